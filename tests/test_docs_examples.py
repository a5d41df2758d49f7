"""Every Python block in README.md and docs/*.md runs as written against a live cluster.

The conventions a contributor writes examples to (docs/sdk.md, "The examples", says the same):

- A block is a fenced code block whose info string is `python` (or `py`). A fragment that is
  not meant to run on its own is marked by the line `<!-- fragment -->` just above its fence
  (invisible when the Markdown is rendered): it is skipped. Every other block runs.
- Addresses: a block reaches the cluster where `tandem up` serves it by default, HTTP at
  `http://127.0.0.1:8000` (or `localhost:8000`) and gRPC at `127.0.0.1:50051` (or
  `localhost:50051`). The test rewrites exactly these host:port spellings to the live
  cluster's ports and nothing else, so what a reader copies is what ran.
- The model: a block asks the server for it (`client.models.list().data[0].id`) or leaves it
  empty (`model=""`: the served model); no model name is rewritten, so a block that names a
  checkpoint fails here, as it would for a reader serving another one.
- Files: each block runs alone, in a fresh directory holding `cat.png` (a small picture), the
  file the examples name; anything else a block needs (a video clip) it makes itself.
- Imports: a block imports the standard library, `tandem.client` (the client install: grpcio
  and protobuf, no torch) and third-party modules a `pip install` line of its own document
  names (`pip install openai`, `# pip install av numpy`). Checked statically, without a
  cluster: the venv that runs the blocks holds the servers' packages too, so it would not
  catch an example that needs Pillow from a reader who installed the client only.

A block runs in a subprocess of the venv's python; one that exits non-zero fails the test
named by its file and line (`docs/sdk.md:163`), with the line that raised and its stderr.
`test_checker_fails_on_planted_broken_examples` plants broken blocks in a temp copy of
README.md and shows the checker names each, and skips a marked fragment.

One cluster for the module (the tiny Qwen2.5-VL, one encoder and one language instance).
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.launch.cluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"
LANGUAGES = ("python", "py")
# `tandem up`'s default ports, as the docs spell them; rewritten to the live cluster's
HTTP_DEFAULT = re.compile(r"\b(?:127\.0\.0\.1|localhost):8000\b")
GRPC_DEFAULT = re.compile(r"\b(?:127\.0\.0\.1|localhost):50051\b")
# module -> the distribution a `pip install` line names for it
DISTRIBUTIONS = {"PIL": "pillow", "cv2": "opencv-python", "yaml": "pyyaml"}
# the client install's own modules (pyproject.toml's base dependencies)
CLIENT_MODULES = {"grpc", "google"}
# a hang guard only (tests bound no duration): the slowest block decodes a short clip
HANG_GUARD_S = 240

pytestmark = pytest.mark.timeout(600)


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced Python block: `line` is its fence's line in `path` (1-based); the code's
    first line is line + 1."""

    path: Path
    line: int
    code: str
    fragment: bool

    @property
    def name(self) -> str:
        """The document, from the checkout's root (a planted copy outside it: in full)."""
        try:
            return str(self.path.relative_to(ROOT))
        except ValueError:
            return str(self.path)

    @property
    def where(self) -> str:
        return f"{self.name}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of `path` whose info string is python, in order."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*(\S*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        if lang.lower() in LANGUAGES:
            marked = start > 0 and lines[start - 1].strip() == FRAGMENT
            out.append(Block(path, start + 1, "\n".join(body) + "\n", marked))
    return out


def runnable(paths=DOCS) -> list[Block]:
    return [b for p in paths for b in blocks(p) if not b.fragment]


def with_cluster(code: str, http_port: int, grpc_port: int) -> str:
    """The block with `tandem up`'s default addresses moved to the live cluster's."""
    code = HTTP_DEFAULT.sub(f"127.0.0.1:{http_port}", code)
    return GRPC_DEFAULT.sub(f"127.0.0.1:{grpc_port}", code)


def installs(text: str) -> set[str]:
    """The distributions the `pip install` lines of a document name (normalized)."""
    names: set[str] = set()
    for m in re.finditer(r"pip install ([^`\n#)]*)", text):
        for word in m.group(1).split():
            word = word.strip("'\"")
            if word.startswith("-") or "/" in word or word in (".", "./"):
                continue
            names.add(re.split(r"[\[=<>!~;]", word, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def import_problems(block: Block) -> list[str]:
    """Why a reader with the client install and the document's `pip install` lines could not
    import what `block` imports (empty when they can)."""
    stated = installs(block.path.read_text())
    problems = []
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top in CLIENT_MODULES:
                continue
            if top == "tandem":
                if module != "tandem.client" and not module.startswith("tandem.client."):
                    problems.append(f"{block.where}: imports {module}, which needs the "
                                    "servers' install; examples use tandem.client")
                continue
            dist = DISTRIBUTIONS.get(top, top).lower().replace("_", "-")
            if dist not in stated:
                problems.append(f"{block.where}: imports {module}, which the client install "
                                f"lacks and no `pip install` line of the document names "
                                f"({dist})")
    return problems


@dataclasses.dataclass(frozen=True)
class Outcome:
    block: Block
    returncode: int | None  # None: still running at the hang guard
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def report(self) -> str:
        """The failure, named by the document's line that raised where the traceback has it."""
        hits = re.findall(r'File "[^"]*example\.py", line (\d+)', self.stderr)
        where = f"{self.block.name}:{self.block.line + int(hits[-1])}" if hits else ""
        state = ("did not finish" if self.returncode is None
                 else f"exited with status {self.returncode}")
        tail = "\n".join(self.stderr.strip().splitlines()[-25:])
        return (f"{self.block.where}: the example {state}"
                f"{f' (raised at {where})' if where else ''}\n{tail}")


def cat_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (230, 140, 40)).save(buf, format="PNG")
    return buf.getvalue()


def run_block(block: Block, http_port: int, grpc_port: int, workdir: Path) -> Outcome:
    """Run `block` in a subprocess of this venv's python, in `workdir` (given `cat.png`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "cat.png").write_bytes(cat_png())
    script = workdir / "example.py"
    script.write_text(with_cluster(block.code, http_port, grpc_port))
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=workdir, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired as e:
        return Outcome(block, None, _text(e.stdout), _text(e.stderr))
    return Outcome(block, done.returncode, done.stdout, done.stderr)


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def check(paths, http_port: int, grpc_port: int, workdir: Path) -> list[str]:
    """Every problem of the runnable blocks in `paths`: imports, then each run's failure."""
    problems: list[str] = []
    for i, block in enumerate(runnable(paths)):
        problems += import_problems(block)
        outcome = run_block(block, http_port, grpc_port, workdir / f"block{i}")
        if not outcome.ok:
            problems.append(outcome.report())
    return problems


# -- the checker itself, without a cluster ------------------------------------------------


def test_blocks_are_found_with_their_lines_and_fragments_are_marked(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# t\n\n```python\nprint(1)\n```\n\n<!-- fragment -->\n```python\nx.y\n```\n"
                   "```bash\nls\n```\n- item\n\n  ```py\n  print(2)\n  ```\n")
    got = blocks(doc)
    assert [(b.line, b.code, b.fragment) for b in got] == [
        (3, "print(1)\n", False), (8, "x.y\n", True), (16, "print(2)\n", False)]
    assert [b.line for b in runnable([doc])] == [3, 16]


def test_only_the_default_addresses_are_rewritten():
    code = ('OpenAI(base_url="http://127.0.0.1:8000/v1")\nOpenAI(base_url="http://localhost:8000")\n'
            'Client("127.0.0.1:50051")\nClient("localhost:50051")\n"10.0.0.1:8000" "127.0.0.1:80001"')
    assert with_cluster(code, 1234, 5678) == (
        'OpenAI(base_url="http://127.0.0.1:1234/v1")\nOpenAI(base_url="http://127.0.0.1:1234")\n'
        'Client("127.0.0.1:5678")\nClient("127.0.0.1:5678")\n"10.0.0.1:8000" "127.0.0.1:80001"')


def test_an_import_the_client_install_lacks_is_named(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("Install: `pip install openai`, and `pip install 'tandem-vlm[server]'`.\n\n"
                   "```python\nimport json, asyncio\nfrom openai import OpenAI\n"
                   "from tandem.client import Client, image\nfrom PIL import Image\n"
                   "import numpy as np\nfrom tandem.chat import Message\n```\n")
    (block,) = blocks(doc)
    assert import_problems(block) == [
        f"{doc}:3: imports PIL, which the client install lacks and no `pip install` line of "
        "the document names (pillow)",
        f"{doc}:3: imports numpy, which the client install lacks and no `pip install` line of "
        "the document names (numpy)",
        f"{doc}:3: imports tandem.chat, which needs the servers' install; examples use "
        "tandem.client"]
    doc.write_text(doc.read_text().replace("`pip install openai`", "`pip install openai pillow numpy`"))
    assert [p for p in import_problems(blocks(doc)[0]) if "tandem.chat" not in p] == []


@pytest.mark.parametrize("block", [b for p in DOCS for b in blocks(p) if not b.fragment],
                         ids=lambda b: b.where)
def test_example_imports_only_what_its_document_installs(block):
    assert import_problems(block) == []


# -- against a live cluster ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(checkpoint):
    cl = LocalCluster(str(checkpoint("qwen2_5_vl")), encoders=1, languages=1)
    cl.start()
    yield cl
    cl.stop()


@pytest.mark.parametrize("block", runnable(), ids=lambda b: b.where)
def test_example_runs(block, cluster, tmp_path):
    outcome = run_block(block, cluster.http_port, cluster.grpc_port, tmp_path)
    assert outcome.ok, outcome.report()


PLANTED = """
A broken example (the import of `image` forgotten):

```python
from tandem.client import Client

with Client("127.0.0.1:50051", timeout=60) as c:
    print(c.chat("Hello", max_tokens=4).text)
    c.chat([{"role": "user", "content": [image("cat.png"), "What is it?"]}], max_tokens=4)
```

A fragment, marked, that would raise if it ran:

<!-- fragment -->
```python
r = c.chat(messages)
```

An example that fails on the server's answer (an unknown model):

```python
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none", max_retries=0)
client.chat.completions.create(model="no-such-model", max_tokens=4,
                               messages=[{"role": "user", "content": "Hi"}])
```
"""


def test_checker_fails_on_planted_broken_examples(cluster, tmp_path):
    doc = tmp_path / "README.md"
    readme = (ROOT / "README.md").read_text()
    doc.write_text(readme + PLANTED)
    first = len(readme.splitlines()) + 1  # PLANTED's first line in the copy
    planted = [b for b in blocks(doc) if b.line >= first]
    assert [b.fragment for b in planted] == [False, True, False]
    problems = check([doc], cluster.http_port, cluster.grpc_port, tmp_path / "run")
    broken, fragment, unknown = planted
    assert len(problems) == 2, problems  # README's own example passes, the fragment is skipped
    assert problems[0].startswith(f"{doc}:{broken.line}: the example exited with status 1 "
                                  f"(raised at {doc}:{broken.line + 5})"), problems[0]
    assert "NameError: name 'image' is not defined" in problems[0]
    assert problems[1].startswith(f"{doc}:{unknown.line}: the example exited with status 1 "
                                  f"(raised at {doc}:{unknown.line + 4})"), problems[1]
    assert "NotFoundError" in problems[1]
    assert not any(f":{fragment.line}:" in p for p in problems)
