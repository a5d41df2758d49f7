"""docs/architecture.md's file map ("Layout: one line per file") names every module.

The map is the code block under "## Layout": a line at column 0 names a folder
(`tandem/`, `services/encoder/`), each line indented two spaces starts with the files it
describes, relative to that folder (`main.py, server.py`; a second name without a folder
shares the first's: `models/processor.py, hook.py` is models/hook.py). Lines indented
deeper continue a description. Every .py file under tandem/ and services/ must be named,
except __init__.py and the generated stubs (tandem/v1/), and every name must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("tandem", "services")
SKIP = ("tandem/v1/",)  # generated stubs (`make proto`)
# the names that open an entry line: `a.py`, `dir/b.py`, `dir/`, joined by ", "
_NAME = r"[\w./-]+(?:\.py|/)"
_NAMES = re.compile(rf"{_NAME}(?:, {_NAME})*")


def map_entries(text: str) -> set[str]:
    """The paths (from the repository root) the layout block names."""
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    out: set[str] = set()
    folder = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            folder = line.split()[0]
            continue
        if line.startswith("   "):  # a description continued
            continue
        m = _NAMES.match(line.strip())
        assert m, f"docs/architecture.md: a map line without a file name: {line!r}"
        sub = ""
        for name in m.group(0).split(", "):
            if "/" in name.rstrip("/"):
                sub = name.rstrip("/").rpartition("/")[0] + "/"
                out.add(folder + name)
            else:
                out.add(folder + sub + name)
    return out


def project_modules() -> set[str]:
    out = set()
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            rel = p.relative_to(ROOT).as_posix()
            if p.name != "__init__.py" and not rel.startswith(SKIP):
                out.add(rel)
    return out


def test_the_parser_reads_shared_folders_and_continuations():
    text = "## Layout\n```\npkg/\n  a.py, b.py       one\n  sub/c.py, d.py   two\n" \
           "                   more of two\n  csrc/            folder\nother/\n  e.py x\n```\n"
    assert map_entries(text) == {"pkg/a.py", "pkg/b.py", "pkg/sub/c.py", "pkg/sub/d.py",
                                 "pkg/csrc/", "other/e.py"}


def test_every_module_is_in_the_architecture_map():
    entries = map_entries(DOC.read_text())
    modules = project_modules()
    assert len(modules) > 50  # the walk sees the project
    missing = sorted(modules - entries)
    assert missing == [], f"add to docs/architecture.md's file map: {missing}"


def test_every_name_in_the_map_exists():
    stale = sorted(e for e in map_entries(DOC.read_text())
                   if e.startswith(PACKAGES) and not e.startswith(SKIP) and not (ROOT / e).exists())
    assert stale == [], f"docs/architecture.md's file map names what is not there: {stale}"
