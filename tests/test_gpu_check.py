"""`make gpu-check DRY_RUN=1`: the GPU check script runs on the CPU and writes its table.

The dry run is the whole script (bench/gpu_check.py): the plan of estimates first (it must
fit the lease), then every check in a child process of its own, CUDA-only checks marked
skipped, the rest in their tiny CPU form. What must hold: the plan fits, and a check that
grows past the budget fails the dry run before anything runs; the table lists every check
in the order of value; the checks whose CPU form is this project's own pass (device, the
exactness suites' plumbing, the streamed build, decode graph replay against eager, the 7B
row's bench/language.py run); the rows that call other parts report pass, FAIL or "not
built yet", never an error; a check that crashes or hangs is recorded as an error while
the next one still runs; one that does not fit the time left is skipped, saying so;
`--resume` runs only what the last table lacks; a package not carried (PyAV, Mooncake) is
a skip naming it; `make gpu-wheels`' size check names what to drop.
"""

from __future__ import annotations

import dataclasses
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
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "the first call: " in p.stdout and "fits" in p.stdout, p.stdout[:3000]
    table = out.read_text()
    assert table.startswith("# GPU check") and "DRY RUN on the CPU" in table
    assert "Estimated seconds on the NVIDIA H200" in table
    rows = rows_of(table)
    order = [c.name for c in gpu_check.CHECKS]
    assert list(dict.fromkeys(r["check"] for r in rows)) == order, table
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
    result, `decode_graphs` writes one; all three rows reach the table, which is written
    after each check (a call the lease ends keeps what it ran)."""
    out = tmp_path / "gpu.md"
    script = tmp_path / "child.sh"  # $2: the check's name, $6: where its result goes
    script.write_text(textwrap.dedent(f"""\
        echo "output of $2"
        case "$2" in
          device) sleep 600 ;;
          build) cp {out} {tmp_path}/as-build-started.md; exit 3 ;;
          *) echo '[{{"check": "decode_graphs", "case": "batch 1", "status": "pass"}}]' > "$6" ;;
        esac
    """))
    monkeypatch.setattr(sys, "executable", "/bin/sh")
    monkeypatch.setattr(gpu_check, "__file__", str(script))
    monkeypatch.setattr(gpu_check, "DRY_LIMIT_S", 3)
    monkeypatch.setattr(gpu_check, "WORK", tmp_path / "work")
    assert gpu_check.main(["--dry-run", "--only", "device,build,decode_graphs", "--out", str(out)]) == 0
    assert [r["check"] for r in rows_of((tmp_path / "as-build-started.md").read_text())] == ["device"]
    table = out.read_text()
    rows = {r["check"]: r for r in rows_of(table)}
    assert rows["device"]["status"] == "stopped" and "timed out after 3 s" in rows["device"]["figures"]
    assert rows["build"]["status"] == "error" and "exited 3 with no result" in rows["build"]["figures"]
    assert rows["decode_graphs"]["status"] == "pass"
    assert "output of build" in table and "output of device" in table  # the details

    # --resume: only what the table lacks runs (the stand-in child now names its check): a
    # check its limit stopped runs again, one with a result (a crash's error included)
    # keeps its row and details
    script.write_text('echo \'[{"check": "\'$2\'", "case": "again", "status": "pass"}]\' > "$6"\n')
    model = tmp_path / "work" / "dry-run" / "model-tiny"
    model.mkdir(parents=True)
    (model / ".complete").touch()
    resume = ["--dry-run", "--only", "device,build,decode_graphs,vit_graphs", "--resume",
              "--out", str(out)]
    assert gpu_check.main(resume) == 0
    table = out.read_text()
    assert [(r["check"], r["case"]) for r in rows_of(table)] == [
        ("device", "again"), ("build", ""), ("decode_graphs", "batch 1"), ("vit_graphs", "again")]
    assert "output of build" in table
    # on a fresh machine (no model there) `device` and `build` run again: the checks after
    # them need the CPU kernels and the model
    (model / ".complete").unlink()
    assert gpu_check.main(resume) == 0
    assert [(r["check"], r["case"]) for r in rows_of(out.read_text())] == [
        ("device", "again"), ("build", "again"), ("decode_graphs", "batch 1"),
        ("vit_graphs", "again")]


def test_a_check_stopped_at_its_limit_is_not_done():
    """--resume runs again a check whose row says its limit stopped it (no result), and
    keeps one that failed or passed."""
    Row, S = gpu_check.Row, gpu_check.Status
    rows = [Row("e2e", "", S.STOPPED, "timed out after 194 s"),
            Row("vit_graphs", "", S.ERROR, "the child exited 1 with no result"),
            Row("host_syncs", "a", S.FAIL, "x"), Row("gpu_tests", "", S.SKIPPED, "no time left"),
            Row("decode_graphs", "batch 1", S.PASS, "")]
    assert gpu_check.done_checks(rows) == {"vit_graphs", "host_syncs", "decode_graphs"}


def test_the_plan_fits_the_lease_and_a_grown_check_fails_the_dry_run(tmp_path, monkeypatch, capsys):
    plan = gpu_check.Plan.of(gpu_check.BUDGET_S)
    assert plan.fits, plan.describe()
    assert plan.total_s <= 8.5 * 60 and set(plan.estimates) == {c.name for c in gpu_check.CHECKS}
    # derived from the model's shape: the 7B checkpoint is ~16.5 GB, written at the assumed disk rate
    assert 15e9 < gpu_check.Shape.of("7b").checkpoint_bytes < 18e9
    grown = [dataclasses.replace(c, estimate=lambda shape: gpu_check.Work(processes=100))
             if c.name == "e2e" else c for c in gpu_check.CHECKS]
    monkeypatch.setattr(gpu_check, "CHECKS", grown)
    monkeypatch.setattr(gpu_check, "WORK", tmp_path / "work")
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path / "gpu.md")]) == 1
    assert "OVER by" in capsys.readouterr().out and not (tmp_path / "gpu.md").exists()


def test_a_check_that_does_not_fit_the_time_left_is_skipped(tmp_path, monkeypatch):
    """On CUDA (faked), with the budget nearly spent at the start: every check is a skip row
    naming its estimate and --resume; nothing runs."""
    import types

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_available=lambda: True)))
    monkeypatch.setattr(gpu_check, "WORK", tmp_path / "work")
    monkeypatch.setattr(gpu_check, "run_check", lambda *a: pytest.fail("nothing may run"))
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--budget-s", "5", "--out", str(out)]) == 0
    rows = rows_of(out.read_text())
    assert [r["check"] for r in rows] == [c.name for c in gpu_check.CHECKS]
    first = {c.name for c in gpu_check.CHECKS if c.first_call}
    assert all(r["status"] == "skipped" and "--resume runs it" in r["figures"] for r in rows)
    assert all(("no time left: estimated" if r["check"] in first else "planned for the "
                "second call") in r["figures"] for r in rows), rows
    # --resume's own budget is what a second call has of the lease, not the first call's
    # (started at the epoch's first second: all of it spent)
    assert gpu_check.main(["--resume", "--started-at", "1", "--out", str(out)]) == 0
    rows = rows_of(out.read_text())
    assert all(f"of the {gpu_check.RESUME_BUDGET_S:.0f} s budget left" in r["figures"]
               for r in rows), rows


def test_a_package_not_carried_is_a_skip_naming_it():
    out = "E   ModuleNotFoundError: No module named 'av'\n"
    row = gpu_check._suite_row("gpu_tests", "tests/test_video_payload.py", 2, None, out, want_run=True)
    assert row.status is gpu_check.Status.SKIPPED and "needs PyAV (`av`)" in row.figures
    assert gpu_check.missing_package("No module named 'mooncake.engine'").startswith("needs Mooncake")
    assert gpu_check.missing_package("No module named 'numpy'") is None
    # in a fresh interpreter, as make gpu-wheels runs it: in this process every module an
    # earlier test imported would not count as the checks' (the full suite imports them all)
    listed = subprocess.run([sys.executable, str(gpu_check.ROOT / "bench" / "gpu_check.py"),
                             "--wheel-specs"], capture_output=True, text=True, check=True)
    specs = {s.split("==")[0].lower() for s in listed.stdout.split()}
    assert not specs & {"av", "mooncake-transfer-engine-non-cuda", "grpcio-tools", "tandem-vlm", "torch"}
    assert {"transformers", "grpcio", "protobuf"} <= specs, specs


def test_the_carry_check_names_the_wheels_to_drop(tmp_path, monkeypatch, capsys):
    for name, mib in (("big-1.0-py3-none-any.whl", 3), ("small-1.0-py3-none-any.whl", 1)):
        (tmp_path / name).write_bytes(b"\0" * (mib << 20))
    monkeypatch.setattr(gpu_check, "CARRY_LIMIT_BYTES", 64 << 20)
    assert gpu_check.check_carry(tmp_path) == 0
    monkeypatch.setattr(gpu_check, "CARRY_LIMIT_BYTES", 5 << 20)  # the tree alone is ~3.5 MiB
    assert gpu_check.check_carry(tmp_path) == 1
    said = capsys.readouterr().out
    assert "drop" in said and "big-1.0-py3-none-any.whl (3.0 MiB)" in said, said


def test_a_check_that_raises_is_an_error_row(tmp_path, monkeypatch):
    def boom(ctx):
        raise RuntimeError("a CUDA error, say")

    monkeypatch.setattr(gpu_check, "CHECKS", [gpu_check.Check("build", boom, gpu_check.estimate_build)])
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
