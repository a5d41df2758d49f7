"""`make gpu-check DRY_RUN=1`: the GPU check script runs on the CPU and writes its table.

The dry run is the whole script (bench/gpu_check.py): every check in a child process of its
own, CUDA-only checks marked skipped, the rest in their tiny CPU form. What must hold: the
table lists every check; the checks whose CPU form is this project's own pass (device, the
exactness suites' plumbing, the streamed build, decode graph replay against eager, the 7B
row's bench/language.py run); the rows that call other parts report pass, FAIL or "not
built yet", never an error; and a check that crashes or hangs is recorded as an error
while the next one still runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402  (bench/)

pytestmark = pytest.mark.timeout(900)
OURS = {"device", "exactness_fp32", "exactness_bf16", "build", "decode_graphs", "e2e"}


def rows_of(table: str) -> list[dict]:
    out = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in {c.name for c in gpu_check.CHECKS}:
            out.append(dict(zip(("check", "case", "status", "figures", "s"), cells, strict=True)))
    return out


def test_dry_run_writes_a_row_for_every_check(tmp_path):
    out = tmp_path / "gpu.md"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    table = out.read_text()
    assert table.startswith("# GPU check") and "DRY RUN on the CPU" in table
    rows = rows_of(table)
    assert {r["check"] for r in rows} == {c.name for c in gpu_check.CHECKS}, table
    for r in rows:
        check = next(c for c in gpu_check.CHECKS if c.name == r["check"])
        if check.cuda_only:
            assert r["status"] == "skipped" and r["figures"] == "needs CUDA", r
        elif r["check"] in OURS:
            assert r["status"] == "pass", (r, table)
        else:
            assert r["status"] in ("pass", "FAIL", "not built yet"), (r, table)
    decode = [r for r in rows if r["check"] == "decode_graphs"]
    assert [r["case"] for r in decode] == [f"batch {b}" for b in (1, 5, 8, 17, 32)]
    assert [r["case"] for r in rows if r["check"] == "e2e"] == ["concurrency 1", "concurrency 2"]
    bf16 = [r for r in rows if r["check"] == "exactness_bf16"]
    assert any("rows within the bound" in r["figures"] for r in bf16), bf16


def test_a_hang_and_a_crash_are_rows_and_the_next_check_runs(tmp_path, monkeypatch):
    """The parent with stand-in children (a shell script in place of the child process):
    `device` hangs past its limit (killed with its process group), `build` exits without a
    result, `decode_graphs` writes one; all three rows reach the table."""
    script = tmp_path / "child.sh"  # $2: the check's name, $6: where its result goes
    script.write_text(textwrap.dedent("""\
        echo "output of $2"
        case "$2" in
          device) sleep 600 ;;
          build) exit 3 ;;
          *) echo '[{"check": "decode_graphs", "case": "batch 1", "status": "pass"}]' > "$6" ;;
        esac
    """))
    monkeypatch.setattr(sys, "executable", "/bin/sh")
    monkeypatch.setattr(gpu_check, "__file__", str(script))
    monkeypatch.setattr(gpu_check, "DRY_LIMIT_S", 3)
    monkeypatch.setattr(gpu_check, "WORK", tmp_path / "work")
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--dry-run", "--only", "device,build,decode_graphs", "--out", str(out)]) == 0
    table = out.read_text()
    rows = {r["check"]: r for r in rows_of(table)}
    assert rows["device"]["status"] == "error" and "timed out after 3 s" in rows["device"]["figures"]
    assert rows["build"]["status"] == "error" and "exited 3 with no result" in rows["build"]["figures"]
    assert rows["decode_graphs"]["status"] == "pass"
    assert "output of build" in table and "output of device" in table  # the details


def test_a_check_that_raises_is_an_error_row(tmp_path, monkeypatch):
    def boom(ctx):
        raise RuntimeError("a CUDA error, say")

    monkeypatch.setattr(gpu_check, "CHECKS", [gpu_check.Check("build", boom, 60)])
    result = tmp_path / "r.json"
    ctx = gpu_check.Ctx(True, "cpu", "float32", str(tmp_path), str(tmp_path / "m"), "tiny")
    gpu_check.run_child("build", ctx, result)
    (row,) = json.loads(result.read_text())
    assert row["status"] == "error" and "RuntimeError: a CUDA error, say" in row["detail"]


def test_part_functions_missing_are_not_built_yet(tmp_path):
    with pytest.raises(gpu_check.NotBuilt, match="does_not_exist_yet"):
        gpu_check.part_function("does_not_exist_yet", "check")
    with pytest.raises(gpu_check.NotBuilt, match="gpu_check.no_such_function"):
        gpu_check.part_function("gpu_check", "no_such_function")
    result = tmp_path / "r.json"
    ctx = gpu_check.Ctx(True, "cpu", "float32", str(tmp_path), str(tmp_path / "m"), "tiny")
    saved = dict(gpu_check.PART_FUNCTIONS)
    try:
        gpu_check.PART_FUNCTIONS["vit_graphs"] = ("does_not_exist_yet", "check_vit_graphs")
        gpu_check.run_child("vit_graphs", ctx, result)
    finally:
        gpu_check.PART_FUNCTIONS.update(saved)
    (row,) = json.loads(result.read_text())
    assert row["status"] == "not built yet" and "does_not_exist_yet" in row["figures"]
