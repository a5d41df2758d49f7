"""`make gpu-check`: everything a lent GPU must show, one command, one table.

    .venv/bin/python bench/gpu_check.py [--only a,b] [--resume] [--out bench/results/gpu.md]
    .venv/bin/python bench/gpu_check.py --plan         # the estimates, and whether they fit
    .venv/bin/python bench/gpu_check.py --dry-run      # `make gpu-check DRY_RUN=1`: the CPU, tiny

The lease it is sized for (bench/README.md): one call of at most 10 minutes on one H200,
with the machine's own Python 3.12 and torch 2.11. The whole run, the wheels' install and
the 7B-shaped checkpoint's build included, must end within BUDGET_S (8.5 minutes) of
`--started-at` (the Makefile passes the moment `make gpu-check` began). The checks run in
the order of what a user most needs proven (CHECKS); each has an estimate of its GPU
machine time derived from what it does (Work: matrix FLOPs, HBM bytes, disk bytes, fresh
processes, ...) and the device's measured figures (H200), and a check whose estimate no
longer fits in what is left is recorded as skipped for lack of time. `--resume` (a second
call) runs only the checks the last table lacks, and keeps its rows. `--plan` prints the
estimates and exits 1 when they add up to more than the budget; the dry run prints them
first and fails the same way, so CI catches a check that grew past the lease.

The dry run runs the same script on the CPU at tiny sizes, in float32: checks that need
CUDA are marked skipped, the rest run their CPU form, so the script itself is known to work
before a GPU comes (tests/test_gpu_check.py runs it in CI). Its table goes to
`.cache/gpu-check/gpu-dry-run.md`, never over the GPU's.

The checks are a list (CHECKS), each independent: it runs in a child process of its own
under its own time limit (a CUDA error, a hang or a crash ends only that check), and gives
one row or more. A check that fails, crashes or runs out of time is recorded with the tail
of its output; the next check runs regardless. Row status (Status):

    pass            ran, and what must hold held (a target missed is said in its figures)
    FAIL            ran, and what must hold did not
    error           crashed, or its result could not be read (output kept)
    stopped         ran past its time limit and was killed: no result (`--resume` runs it
                    again)
    skipped         needs CUDA (dry run), no time was left in the budget, or it needs a
                    package the image lacks and the 64 MiB carried cannot hold (NOT_CARRIED)
    not built yet   the function the row calls (another part's) does not exist yet

A row that reports another part's measurement calls that part's function (PART_FUNCTIONS):
each returns a list of rows (dataclasses or dicts); a boolean field `ok` decides pass or
FAIL where the part gives one, every other field is shown as a figure.

The 7B-shaped checkpoint (`tandem tiny-model --size 7b`, random bfloat16 weights, streamed
to disk) is built on the machine by the `build` check, once: a later run reuses it
(.cache/gpu-check/). Nothing is downloaded or installed by this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "gpu.md"
WORK = ROOT / ".cache" / "gpu-check"
# The whole run on a GPU, from `make gpu-check`'s start (the wheels' install included): a
# lent machine's call may last 10 minutes; 1.5 are left for the machine's start-up within
# the call's limit, the estimates' error and writing the table.
BUDGET_S = 8.5 * 60
TAIL = 4000  # characters of a failed check's output kept in the table's details
# graph replay against eager on one device (tests/test_bf16.py allows 0.375 between two
# systems: transformers' rounding and ours)
BF16_LOGITS_TOL = 0.25


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    ERROR = "error"
    STOPPED = "stopped"
    SKIPPED = "skipped"
    NOT_BUILT = "not built yet"


@dataclass
class Row:
    check: str
    case: str
    status: Status
    figures: str = ""
    detail: str = ""  # a failure's reason or output tail
    seconds: float = 0.0  # the whole check's (the parent fills it in)


@dataclass(frozen=True)
class Ctx:
    """What every check is told (plain data: it crosses into the child as JSON)."""

    dry_run: bool
    device: str  # "cuda" or "cpu" (dry run)
    dtype: str  # "bfloat16" on CUDA, "float32" in the dry run
    work: str  # scratch directory of this run
    model: str  # the big checkpoint's directory (built by the `build` check)
    size: str  # its tiny-model size: "7b", or "tiny" in the dry run

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


class NotBuilt(Exception):
    """The part function a row calls does not exist yet."""


def part_function(module: str, name: str) -> Callable:
    """`module.name`, or NotBuilt when either is missing (another helper's work to come)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise NotBuilt(f"{module} does not exist yet") from e
        raise
    fn = getattr(mod, name, None)
    if fn is None:
        raise NotBuilt(f"{module}.{name} does not exist yet")
    return fn


# The other parts' functions the rows call: (module, function). Their contracts are in the
# check functions below.
PART_FUNCTIONS = {
    "attention_long_context": ("paged_attention", "check_long_context"),  # bench/paged_attention.py
    "vit_graphs": ("vit_graphs", "check_vit_graphs"),  # bench/vit_graphs.py
    "host_syncs": ("step_syncs", "decode_step_host_syncs"),  # bench/step_syncs.py
}


def fields_of(row) -> dict:
    return dataclasses.asdict(row) if dataclasses.is_dataclass(row) else dict(row)


def show(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def part_rows(check: str, case_field: str, rows, ok: Callable[[dict], bool] | None = None):
    """Rows of a part's results: `ok` (or the part's own `ok` field) decides the status."""
    out = []
    for r in rows:
        f = fields_of(r)
        good = ok(f) if ok is not None else bool(f.pop("ok", True))
        figures = ", ".join(f"{k} {show(v)}" for k, v in f.items() if k != case_field)
        out.append(Row(check, str(f.get(case_field, "")), Status.PASS if good else Status.FAIL,
                       figures))
    return out


# -- the checks (each runs in its own child process) -------------------------------------


def check_device(ctx: Ctx) -> list[Row]:
    """The machine, and the CPU kernels built once here: every pytest run's header asks
    for them (tests/conftest.py), so the first would otherwise compile inside its limit."""
    import platform

    import torch

    from tandem.cpu_kernels import cpu_model, isa, kernels

    t0 = time.perf_counter()
    kernels()
    cpu = (f"{cpu_model()}, {os.cpu_count()} cores, CPU kernels {isa() or 'unavailable'} "
           f"({time.perf_counter() - t0:.0f} s)")
    if ctx.device == "cpu":
        return [Row("device", "cpu", Status.PASS, f"{cpu}, torch {torch.__version__}")]
    p = torch.cuda.get_device_properties(0)
    figures = (f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
               f"{p.multi_processor_count} SMs, torch {torch.__version__}, CUDA "
               f"{torch.version.cuda}, bf16 {torch.cuda.is_bf16_supported()}, "
               f"Python {platform.python_version()}; {cpu}")
    return [Row("device", p.name, Status.PASS, figures)]


def _pytest(ctx: Ctx, name: str, args: list[str]) -> tuple[int, ET.Element | None, str]:
    """Run pytest in a process of its own: (exit code, the junit report's root, output)."""
    xml = Path(ctx.work) / f"{name}.xml"
    xml.unlink(missing_ok=True)
    # NOTE: junit_family xunit1 keeps record_property's figures (tests/test_bf16.py's)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
           f"--junitxml={xml}", "-o", "junit_family=xunit1", f"--device={ctx.device}", *args]
    # COLUMNS: the short summary's reasons whole (pytest cuts them to the terminal's width,
    # 80 in a pipe: the first run's table read "- to...")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "400"})
    out = p.stdout + p.stderr
    print(out[-TAIL:], flush=True)
    root = ET.parse(xml).getroot() if xml.exists() else None
    return p.returncode, root, out


def _counts(root: ET.Element | None) -> dict[str, int]:
    cases = [] if root is None else list(root.iter("testcase"))
    n = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for c in cases:
        kinds = {child.tag for child in c}
        key = ("failed" if "failure" in kinds else "errors" if "error" in kinds
               else "skipped" if "skipped" in kinds else "passed")
        n[key] += 1
    return n


# Packages the image lacks that the 64 MiB carried cannot hold: a test or check that needs
# one is recorded as skipped, naming it, not failed. PyAV's wheel is ~35 MB (FFmpeg inside)
# and only the video paths import it (lazily: an import scan of the checks misses it);
# Mooncake's CUDA build is larger still, and only the transfer between tiers needs it.
NOT_CARRIED = {"av": "PyAV", "mooncake": "Mooncake"}


def missing_package(out: str) -> str | None:
    """The NOT_CARRIED package whose absence a check's output reports, if any."""
    for module, name in NOT_CARRIED.items():
        if f"No module named '{module}" in out:
            return f"needs {name} (`{module}`), which the image lacks and the 64 MiB carried cannot hold"
    return None


def _failures(root: ET.Element | None) -> str:
    """Each failed or erred case of a junit report, a line each: its name and the first
    line of its message (what the output's tail may have scrolled away)."""
    lines = []
    for c in [] if root is None else root.iter("testcase"):
        for e in c:
            if e.tag in ("failure", "error"):
                msg = (e.get("message") or e.text or e.tag).strip().splitlines() or [e.tag]
                lines.append(f"{c.get('name')}: {msg[0][:300]}")
    return "\n".join(lines)


def _suite_row(check: str, case: str, code: int, root, out: str, want_run: bool) -> Row:
    n = _counts(root)
    figures = ", ".join(f"{v} {k}" for k, v in n.items() if v)
    if code == 0 and not (want_run and n["skipped"]) and n["passed"]:
        return Row(check, case, Status.PASS, figures)
    if code != 0 and (why := missing_package(out)):
        return Row(check, case, Status.SKIPPED, f"{why}; {figures or 'nothing ran'}", out[-TAIL:])
    why = "skipped tests where all must run" if code == 0 and n["passed"] else f"pytest exit {code}"
    return Row(check, case, Status.FAIL, figures or why,
               f"{why}\n{_failures(root)}\n{out[-TAIL:]}")


def gpu_test_files() -> list[str]:
    """The files with `gpu` tests, less the exactness suites (their checks run them whole)."""
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text() and p.relative_to(ROOT).as_posix()
                  not in FP32_SUITE + BF16_SUITE)


def check_gpu_tests(ctx: Ctx) -> list[Row]:
    """Every other `@pytest.mark.gpu` test, in one pytest process (one start, one compile
    cache), a row per file: a file that cannot import fails (or is skipped, for a package
    NOT_CARRIED) alone. `multi_gpu` tests are deselected on a machine of one GPU (every
    test that is selected must run: a skip is a finding)."""
    import torch

    files = gpu_test_files()
    marks = "gpu" if torch.cuda.device_count() >= 2 else "gpu and not multi_gpu"
    code, root, out = _pytest(ctx, "gpu-tests", ["-m", marks, "--continue-on-collection-errors", *files])
    if root is None:
        return [Row("gpu_tests", " ".join(files), Status.ERROR, f"pytest exit {code}, no report", out[-TAIL:])]
    rows = []
    for f in files:
        mine = ET.Element("testsuite")
        dotted = f.removesuffix(".py").replace("/", ".")
        mine.extend(c for c in root.iter("testcase")
                    if c.get("file") == f or (c.get("classname") or c.get("name") or "").startswith(dotted))
        text = "\n".join(e.text or e.get("message", "") for c in mine for e in c
                         if e.tag in ("failure", "error"))
        bad = _counts(mine)["failed"] + _counts(mine)["errors"]
        rows.append(_suite_row("gpu_tests", f, 1 if bad or not len(mine) else 0, mine, text or out, want_run=True))
    return rows


# The exactness suite: the runner on the device against transformers on the CPU.
FP32_SUITE = ["tests/test_language_model.py", "tests/test_language_engine.py"]
BF16_SUITE = ["tests/test_bf16.py"]
DRY_SELECT = {  # the dry run's one case of each (the plumbing, not the suite again)
    "fp32": "test_prompt_logits_match_transformers and qwen2_5_vl",
    "bf16": "test_bf16_runner_within_bound_of_transformers and qwen2_5_vl and auto",
}


def check_exactness_fp32(ctx: Ctx) -> list[Row]:
    sel = ["-k", DRY_SELECT["fp32"]] if ctx.dry_run else []
    code, root, out = _pytest(ctx, "exactness-fp32", [*sel, *FP32_SUITE])
    return [_suite_row("exactness_fp32", "float32 exact (1e-4), " + " ".join(FP32_SUITE),
                       code, root, out, want_run=False)]


def check_exactness_bf16(ctx: Ctx) -> list[Row]:
    sel = ["-k", DRY_SELECT["bf16"]] if ctx.dry_run else []
    code, root, out = _pytest(ctx, "exactness-bf16", [*sel, *BF16_SUITE])
    rows = [_suite_row("exactness_bf16", "bfloat16 within 0.375, " + " ".join(BF16_SUITE),
                       code, root, out, want_run=False)]
    for case in [] if root is None else root.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if "bf16_case" not in props:
            continue
        failed = any(child.tag in ("failure", "error") for child in case)
        rows.append(Row("exactness_bf16", props["bf16_case"], Status.FAIL if failed else Status.PASS,
                        f"{props['bf16_compared']}/{props['bf16_rows']} rows within the bound, "
                        f"max abs diff {float(props['bf16_max_diff']):.4f}, greedy ids compared "
                        f"{props['bf16_greedy_compared']}, near ties {props['bf16_near_ties']}, "
                        f"router near ties {props['bf16_routing_ties']}"))
    return rows


def check_build(ctx: Ctx) -> list[Row]:
    """The big checkpoint, streamed (reused when a complete one is there)."""
    import shutil

    from tandem.models.tiny import build_tiny_model, plan_tiny_model

    out = Path(ctx.model)
    plan = plan_tiny_model(None, ctx.size)
    t0 = time.perf_counter()
    reused = (out / ".complete").exists()
    if not reused:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        build_tiny_model(tmp, size=ctx.size, stream=True, device=ctx.device)
        (tmp / ".complete").touch()
        tmp.rename(out)
    secs = time.perf_counter() - t0
    on_disk = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    ok = on_disk >= plan.total_bytes
    return [Row("build", f"tiny-model --size {ctx.size}", Status.PASS if ok else Status.FAIL,
                f"{plan.num_parameters:,} parameters, {on_disk / 1e9:.3f} GB on disk, "
                + ("reused" if reused else f"written in {secs:.0f} s ({on_disk / 1e9 / secs:.2f} GB/s)"
                   f" from values made on {ctx.device}"))]


def _need_model(ctx: Ctx) -> Path:
    path = Path(ctx.model)
    if not (path / ".complete").exists():
        raise RuntimeError(f"{path} is not built (the `build` check failed or did not run)")
    return path


def _timed(fn, device, n: int) -> float:
    """Median seconds of `fn` over n calls after 2 warm-ups."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    times = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def check_decode_graphs(ctx: Ctx) -> list[Row]:
    """Decode graph replay against eager on the big model: equal within the dtype's bound
    (float32: 1e-4; bfloat16: 0.25, under tests/test_bf16.py's 0.375 between systems) and
    the same greedy ids wherever the top-2 margin exceeds it, at batch sizes 1, 8, 32 and
    two padded ones (5, 17);
    eager / replay step time."""
    import torch
    from language_runner import decode_batch  # (bench/, this script's directory, is on the path)

    from tandem.models.split import load_text_weights
    from tandem.services.language.engine.kv_pages import KVPagePool
    from tandem.services.language.runner.forward_batch import ForwardBatch
    from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings
    from tandem.units import ceil_div

    path, device, dtype = _need_model(ctx), torch.device(ctx.device), ctx.torch_dtype
    context, page, sizes = (24, 4, DECODE_SIZES) if ctx.dry_run else (DECODE_CONTEXT, DECODE_PAGE, DECODE_SIZES)
    per_seq = ceil_div(context + 1, page)
    max_bs = max(sizes)
    runner = ModelRunner(
        load_text_weights(path, dtype=dtype, device=device),
        RunnerSettings(page_size=page, cuda_graph_max_bs=max_bs, max_seq_len=context + page),
        num_pages=max_bs * per_seq + 1, device=device, dtype=dtype,
    )
    gr = runner.graph_runner
    captured = len(gr.graphs) if gr is not None else 0
    if device.type == "cuda" and not captured:
        return [Row("decode_graphs", "capture", Status.FAIL, "no decode graph was captured")]
    pool = KVPagePool(runner.num_pages, page)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        chunks = decode_batch(runner, pool, max_bs, context, per_seq, g).chunks
    tol = 1e-4 if dtype == torch.float32 else BF16_LOGITS_TOL
    steps = 3 if ctx.dry_run else DECODE_STEPS
    rows = []
    with torch.inference_mode():
        for bs in sizes:
            batch = ForwardBatch(chunks[:bs])
            eager = runner.forward_eager(batch).last_logits.float()
            graph = gr.run(batch).last_logits.float()
            diff = (eager - graph).abs().max().item()
            top2 = eager.topk(2, dim=-1).values
            clear = top2[:, 0] - top2[:, 1] > tol  # rows whose greedy id the bound decides
            same = int((eager.argmax(-1) == graph.argmax(-1))[clear].sum())
            n_clear = int(clear.sum())
            te = _timed(lambda b=batch: runner.forward_eager(b), device, steps)
            tg = _timed(lambda b=batch: gr.run(b), device, steps)
            target = ""
            if bs == 1 and device.type == "cuda":
                target = f", target >= 2x {'met' if te / tg >= 2 else 'MISSED'}"
            ok = diff <= tol and same == n_clear
            rows.append(Row("decode_graphs", f"batch {bs}", Status.PASS if ok else Status.FAIL,
                            f"max abs diff {diff:.3g} (bound {tol}), greedy ids equal {same}/"
                            f"{n_clear} (rows with a top-2 margin over the bound), "
                            f"eager {te * 1e3:.2f} ms, replay {tg * 1e3:.2f} ms, "
                            f"speed-up {te / tg:.2f}x{target}, graphs {captured}"))
    return rows


def check_attention_long_context(ctx: Ctx) -> list[Row]:
    """No attention call on the math backend, and the peak memory of a 4096-token chunk over
    a 16K and a 32K context at 7B attention sizes (bench/paged_attention.py)."""
    import torch

    fn = part_function(*PART_FUNCTIONS["attention_long_context"])
    if ctx.dry_run:  # the part's own dry-run sizes, on the CPU's own path: the plumbing of
        # the row (flex on the CPU, compiled, costs CI ~45 s; tests/test_paged_attention.py
        # checks that path against the reference)
        rows = fn("cpu", torch.float32, contexts=(512,), chunk=160, heads=4, kv_heads=2,
                  head_dim=32, runs=1, backend="auto")
    else:
        rows = fn(ctx.device, ctx.torch_dtype, contexts=LONG_CONTEXTS, chunk=LONG_CHUNK,
                  heads=LONG_HEADS, head_dim=LONG_HEAD_DIM, runs=LONG_RUNS)

    def ok(f: dict) -> bool:
        peak = f.get("peak_extra_bytes")
        return not f["math_fallback"] and (peak is None or peak <= f["bound_bytes"])

    return part_rows("attention_long_context", "context", rows, ok)


def check_vit_graphs(ctx: Ctx) -> list[Row]:
    """ViT CUDA graphs over a mix of image sizes: captures counted, replay equal to eager,
    speed-up. Contract: `check_vit_graphs(model: Path, device: str, dtype: torch.dtype,
    dry_run: bool) -> list[row]`, each row with `ok` and a `case` field."""
    fn = part_function(*PART_FUNCTIONS["vit_graphs"])
    rows = fn(_need_model(ctx), ctx.device, ctx.torch_dtype, ctx.dry_run)
    return part_rows("vit_graphs", "case", rows)


def check_e2e(ctx: Ctx) -> list[Row]:
    """The big model through the language engine at concurrency 1/8/32 against transformers'
    generate() (one at a time and padded batches), bench/language.py; target at c=32:
    >= 3x the padded generate()."""
    path = _need_model(ctx)
    out = Path(ctx.work) / "language.md"
    out.unlink(missing_ok=True)
    conc = ["1", "2"] if ctx.dry_run else [str(c) for c in E2E_CONCURRENCY]
    n = "2" if ctx.dry_run else str(E2E_REQUESTS)
    cmd = [sys.executable, str(ROOT / "bench" / "language.py"), "--model", str(path),
           "--device", ctx.device, "--dtype", ctx.dtype, "--requests", n, "--concurrency",
           *conc, "--runs", "1", "--max-output", str(E2E_MAX_OUTPUT), "--out", str(out)]
    # NOTE: its lines go to this check's log as they come (a timeout kills the process
    # group, and output held back until the script's end was lost: the first run's e2e row
    # said only "timed out")
    lines = []
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as p:
        for line in p.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    text = "".join(lines)
    if p.returncode != 0 or not out.exists():
        return [Row("e2e", "bench/language.py", Status.ERROR, f"exit {p.returncode}", text[-TAIL:])]
    greedy = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                   if ln.startswith("greedy check:")), "?")
    rows = []
    for line in out.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 6 or not cells[0].isdigit():
            continue
        c, eng, one, pad, r_one, r_pad = cells
        target = ""
        if c == "32" and not ctx.dry_run:
            target = f", target >= 3x padded {'met' if float(r_pad.rstrip('x')) >= 3 else 'MISSED'}"
        rows.append(Row("e2e", f"concurrency {c}", Status.PASS,
                        f"engine {eng} tok/s, HF one at a time {one}, HF padded {pad}, "
                        f"{r_one} / {r_pad} of them{target}; greedy check {greedy}"))
    if not rows:
        return [Row("e2e", "bench/language.py", Status.ERROR, "no table rows", out.read_text())]
    return rows


def check_host_syncs(ctx: Ctx) -> list[Row]:
    """Host syncs per decode step (tandem/host_syncs.py) for the sampler (plain rows, and
    rows with penalties and a bias) and a MoE model: none inside the captured graph body,
    at most one outside. Contract: `decode_step_host_syncs(runner, batch_size, shaped,
    steps) -> [StepSyncs(captured, outside, stopped)]`, the last step the steady state."""
    import torch

    from tandem.models.split import load_text_weights
    from tandem.models.tiny import cached_tiny_model
    from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings

    fn = part_function(*PART_FUNCTIONS["host_syncs"])
    size = "tiny" if ctx.dry_run else "small"
    rows = []
    for arch, shaped in (("qwen2_5_vl", False), ("qwen2_5_vl", True), ("qwen3_vl_moe", False)):
        case = f"{arch} {size}, batch 8, {'penalties + bias' if shaped else 'plain sampling'}"
        try:
            ckpt = cached_tiny_model(ROOT / ".cache" / "test-models", arch, size)
            settings = RunnerSettings(page_size=16, cuda_graph_max_bs=8, max_seq_len=64)
            if ctx.device == "cuda":
                runner = ModelRunner(
                    load_text_weights(ckpt, dtype=ctx.torch_dtype, device=ctx.device),
                    settings, num_pages=64, device=ctx.device, dtype=ctx.torch_dtype,
                )
                last = fn(runner, batch_size=8, shaped=shaped, steps=2)[-1]
            else:  # on the CPU nothing is a device sync: count on a fake CUDA device, with
                # the gather attention (compiled flex cannot lower for a device that is not)
                from step_syncs import fake_cuda_runner  # bench/ (on the path: part_function)

                from tandem.host_syncs import fake_cuda

                weights = load_text_weights(ckpt, dtype=ctx.torch_dtype, device="cpu")
                with fake_cuda():
                    runner = fake_cuda_runner(
                        weights, dataclasses.replace(settings, attention_backend="gather"),
                        ctx.torch_dtype)
                    last = fn(runner, batch_size=8, shaped=shaped, steps=2)[-1]
        except NotBuilt:
            raise
        except Exception as e:  # this case only: the others still run
            rows.append(Row("host_syncs", case, Status.FAIL, f"{type(e).__name__}: {e}"[:300],
                            traceback.format_exc()[-TAIL:]))
            continue
        ok = not last.captured and len(last.outside) <= 1 and last.complete
        rows.append(Row("host_syncs", case, Status.PASS if ok else Status.FAIL,
                        f"in the graph body {len(last.captured)} (must be 0), outside "
                        f"{len(last.outside)} (at most 1)" + ("" if last.complete else
                        f", stopped early: {last.stopped}"), last.describe()[-TAIL:]))
        del runner
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
    return rows


# -- what each check costs on the lent GPU (estimates) -------------------------------------


@dataclass(frozen=True)
class Machine:
    """A lent machine's figures. The first two were measured there (the device notes,
    KINDS.md: an 8192^3 bf16 matrix product at 769-798 TFLOP/s, a device-to-device copy
    at 4.3 TB/s counting bytes read and written); three more by the first `make gpu-check`
    there (bench/results/gpu.md, 2026-11-29: see H200); the rest are assumptions, named so
    the estimates say what they rest on, and checked by each run's table (its seconds
    beside each estimate)."""

    name: str
    bf16_flops: float  # dense bf16 matrix work, per second
    hbm_bytes_s: float  # device memory traffic, per second
    process_s: float  # a fresh Python: torch, transformers and the CUDA context (assumed)
    compile_s: float  # flex attention compiled for one KV cache geometry (a runner's warm-up)
    kernel_build_s: float  # the CPU kernels' compile on the machine's cores (measured)
    disk_bytes_s: float  # a checkpoint written or read (measured: written)
    h2d_bytes_s: float  # host to device copies, pinned or not (assumed; PCIe 5 x16 ~ 50)
    launch_s: float  # one kernel launched eagerly from Python (measured: an eager step)
    pytest_case_s: float  # one exactness test case: the CPU oracle's side


EFFICIENCY = 0.5  # the share of the peak figures real kernels reach (decode GEMVs, small GEMMs)


@dataclass(frozen=True)
class Work:
    """What a check does on the GPU machine, in the units the machine's figures price."""

    flops: float = 0.0  # bf16 matrix FLOPs
    hbm_bytes: float = 0.0  # device memory read and written
    disk_bytes: float = 0.0  # checkpoint bytes written or read
    h2d_bytes: float = 0.0  # host to device
    processes: int = 1  # fresh Python processes
    # KV cache geometries (pages, page size, heads, head size, dtype) a check's processes
    # compile flex attention for: each is its own set of kernels (attention.py
    # `_compiled_flex`); a runner of a geometry compiled before in its process compiles none
    compiles: int = 0
    kernel_builds: int = 0  # builds of the CPU kernels (the `device` check's, once)
    launches: int = 0  # eager kernel launches
    pytest_cases: int = 0  # exactness test cases

    def seconds(self, m: Machine) -> float:
        # launches are asynchronous: the host's launching and the device's kernels overlap,
        # so the slower of the two counts (a decode step is one or the other bound)
        device = self.flops / (m.bf16_flops * EFFICIENCY) + self.hbm_bytes / (m.hbm_bytes_s * EFFICIENCY)
        return (max(device, self.launches * m.launch_s) + self.disk_bytes / m.disk_bytes_s
                + self.h2d_bytes / m.h2d_bytes_s + self.processes * m.process_s
                + self.compiles * m.compile_s + self.kernel_builds * m.kernel_build_s
                + self.pytest_cases * m.pytest_case_s)


@dataclass(frozen=True)
class Shape:
    """The 7B-shaped model's sizes that the estimates need (tandem.models.tiny's `7b`)."""

    layers: int
    text_params: int
    vision_params: int
    kv_bytes_per_token: int  # bf16 keys and values of all layers

    @classmethod
    def of(cls, size: str = "7b") -> Shape:
        from tandem.models.tiny import _REAL  # the released config's numbers, no torch

        t, v = _REAL[size]["text"], _REAL[size]["vision"]
        h, i, n = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
        hd = h // t["num_attention_heads"]
        kv = t["num_key_value_heads"] * hd
        layer = 2 * h * h + 2 * h * kv + 3 * h * i  # q, o, k, v, gate/up/down (biases aside)
        d = v["hidden_size"]
        block = 4 * d * d + 3 * d * v["intermediate_size"]
        return cls(n, n * layer + 2 * t["vocab_size"] * h, v["depth"] * block, 2 * 2 * n * kv)

    @property
    def text_bytes(self) -> int:
        return 2 * self.text_params

    @property
    def checkpoint_bytes(self) -> int:
        return 2 * (self.text_params + self.vision_params)


# The sizes of the checks on CUDA: the checks read them, and so do their estimates.
DECODE_CONTEXT, DECODE_PAGE, DECODE_SIZES, DECODE_STEPS = 512, 16, (1, 5, 8, 17, 32), 20
LONG_CONTEXTS, LONG_CHUNK, LONG_HEADS, LONG_HEAD_DIM, LONG_RUNS = (16384, 32768), 4096, 28, 128, 3
E2E_CONCURRENCY, E2E_REQUESTS = (1, 8, 32), 32
# bench/language.py's workload at `--max-output E2E_MAX_OUTPUT` (outputs drawn from 16 up:
# transformers' eager baselines, one token step at a time from Python, are most of the check)
E2E_MEAN_PROMPT, E2E_MAX_PROMPT, E2E_MAX_OUTPUT = 288, 512, 32
E2E_MEAN_OUTPUT = (16 + E2E_MAX_OUTPUT) // 2
E2E_CHECKED = 4  # the greedy check's requests (bench/language.py: work[:4])
HF_LAUNCHES_PER_LAYER = 30  # transformers' eager decoder layer, kernels per token step
ENGINE_LAUNCHES_PER_LAYER = 20  # the runner's eager decoder layer, kernels per step
# (Both assumed; only their ratio matters, since launch_s comes from the runner's measured
# eager step. Ops counted by a dispatch mode, 2026-11-30: transformers 5.24's greedy decode
# step 42 a layer + 40 outside them on the CPU, the runner's step on a fake CUDA device
# ~37 a layer (gather attention): a ratio of ~1.2, against the 1.5 assumed here, so the
# HF side of the e2e estimate errs long.)
VIT_PATCHES = 6000  # bench/vit_graphs.py's MIX at patch 14, all batches
VIT_CAPTURES = 24  # ViT graph keys captured (buckets x bounds)

# The first run's figures: the CPU kernels built in 36 s on the 16 cores (the `device` row);
# 16.58 GB written in 23 s (the `build` row); the runner's eager decode step of the 7B
# shape at batch 1 in 40.49 ms, over its layers of ENGINE_LAUNCHES_PER_LAYER launches
# (the `decode_graphs` row): 72 us a launch, Python's dispatch and not the GPU (the same
# step replayed from a graph took 7.03 ms). Before it the estimates had assumed 1.0 GB/s
# and 10 us and left the kernels' build out, and the e2e check overran its share.
# Two more from the same table: the decode_graphs row took 59 s, of which the estimate's
# other terms are ~42 s, so one geometry's flex compile ~17 s (30 had been assumed); the
# exactness rows ran their oracles' side and failed at the runner's construction, 35
# cases in 77 s and 15 in 51 s, a process start each: (77 + 51 - 2 * 8) / 50 ~ 2.2 s a
# case, 2.5 with a margin (3.0 had been assumed).
H200 = Machine("NVIDIA H200", bf16_flops=790e12, hbm_bytes_s=4.3e12, process_s=8.0,
               compile_s=17.0, kernel_build_s=36.0, disk_bytes_s=16.58e9 / 23,
               h2d_bytes_s=20e9,
               launch_s=40.49e-3 / (Shape.of("7b").layers * ENGINE_LAUNCHES_PER_LAYER),
               pytest_case_s=2.5)


def _decode_step(shape: Shape, bs: int, context: int) -> Work:
    """One decode step of `bs` rows: the weights read once, each row's KV, its GEMMs."""
    return Work(flops=2 * shape.text_params * bs, processes=0,
                hbm_bytes=shape.text_bytes + bs * context * shape.kv_bytes_per_token)


def _sum(works: list[Work]) -> Work:
    return Work(**{f.name: sum(getattr(w, f.name) for w in works) for f in dataclasses.fields(Work)})


def _scaled(w: Work, n: int) -> Work:
    return Work(**{f.name: getattr(w, f.name) * n for f in dataclasses.fields(Work)})


def _pytest_cases(files: list[str], gpu_only: bool = False) -> int:
    """Test cases in these files, read statically: each test function (marked `gpu` and not
    `multi_gpu`, with gpu_only: the lent machine has one GPU) times the length of each of
    its literal `parametrize` lists and of the `params` of each fixture of its file it
    takes, directly or through another (a list is a literal or a module-level name of
    one; 2 where it is neither)."""
    return sum(_file_cases(ROOT / f, gpu_only) for f in files)


def _file_cases(path: Path, gpu_only: bool) -> int:
    import ast

    tree = ast.parse(path.read_text())
    lists = {t.id: len(s.value.elts) for s in tree.body if isinstance(s, ast.Assign)
             and isinstance(s.value, ast.List | ast.Tuple)
             for t in s.targets if isinstance(t, ast.Name)}

    def length(vals) -> int:
        if isinstance(vals, ast.List | ast.Tuple):
            return len(vals.elts)
        return lists.get(vals.id, 2) if isinstance(vals, ast.Name) else 2

    funcs = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
    fixtures: dict[str, tuple[int, list[str]]] = {}  # name -> (its params, its fixtures)
    for node in funcs:
        for d in node.decorator_list:
            call = d if isinstance(d, ast.Call) else None
            if "fixture" in ast.unparse(call.func if call else d):
                params = [k.value for k in (call.keywords if call else []) if k.arg == "params"]
                fixtures[node.name] = (length(params[0]) if params else 1,
                                       [a.arg for a in node.args.args])

    def fanout(args: list[str], seen: frozenset = frozenset()) -> int:
        out = 1
        for a in args:
            if a in fixtures and a not in seen:
                own, deeper = fixtures[a]
                out *= own * fanout(deeper, seen | {a})
        return out

    n = 0
    for node in funcs:
        if node.name.startswith("test_"):
            marks = "".join(ast.unparse(d) for d in node.decorator_list)
            if gpu_only and ("mark.gpu" not in marks or "mark.multi_gpu" in marks):
                continue
            cases = fanout([a.arg for a in node.args.args])
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "parametrize":
                    cases *= length(d.args[1] if len(d.args) > 1 else None)
            n += cases
    return n


def estimate_device(shape: Shape) -> Work:
    return Work(kernel_builds=1)


def estimate_build(shape: Shape) -> Work:
    # values made on the GPU (written once, read once), copied to the host, written to disk
    b = shape.checkpoint_bytes
    return Work(hbm_bytes=2 * b, h2d_bytes=b, disk_bytes=b)


def _load_text(shape: Shape) -> Work:
    return Work(disk_bytes=shape.text_bytes, h2d_bytes=shape.text_bytes, processes=0)


def estimate_decode_graphs(shape: Shape) -> Work:
    rows = max(DECODE_SIZES)
    prefill = Work(flops=2 * shape.text_params * rows * DECODE_CONTEXT, processes=0,
                   launches=rows * shape.layers * ENGINE_LAUNCHES_PER_LAYER)
    # a capture per graph batch size (1, 2, 4, 8, 16, 24, 32: at most 2 x log2 + 1): a warm-up
    # step and the recorded one, each with its eager launches
    captures = 2 * (2 * rows.bit_length() + 1)
    eager = Work(launches=shape.layers * ENGINE_LAUNCHES_PER_LAYER, processes=0)
    steps = [_scaled(_sum([_decode_step(shape, bs, DECODE_CONTEXT), eager]), 2 * (DECODE_STEPS + 3))
             for bs in DECODE_SIZES]  # eager and replay, 2 warm-ups and the comparison each
    return _sum([Work(compiles=1), _load_text(shape), prefill, _scaled(eager, captures), *steps])


def estimate_attention(shape: Shape) -> Work:
    works = []
    for ctx in LONG_CONTEXTS:  # QK^T and PV over the context, and the float32 reference
        f = 4 * LONG_CHUNK * ctx * LONG_HEADS * LONG_HEAD_DIM
        works.append(Work(flops=f * (LONG_RUNS + 1 + 4), processes=0))
    return _sum([Work(compiles=1), *works])


# The suites' cache geometries on CUDA: every test cache there has at least
# tests/language_oracle.CUDA_MIN_PAGES pages, so the tiny models (one attention shape
# across the three architectures) share one geometry and the `small` ones another, per
# dtype (before that floor, a cache size per test: ~11 geometries in the float32 suite).
SUITE_GEOMETRIES = 2


def estimate_exactness_bf16(shape: Shape) -> Work:
    return Work(pytest_cases=_pytest_cases(BF16_SUITE), compiles=SUITE_GEOMETRIES)


def estimate_exactness_fp32(shape: Shape) -> Work:
    return Work(pytest_cases=_pytest_cases(FP32_SUITE), compiles=SUITE_GEOMETRIES)


def estimate_e2e(shape: Shape) -> Work:
    """bench/language.py at --runs 1, as it runs: the engine (graphs captured up to the
    largest concurrency) and transformers (eager) loaded once each; the greedy check (HF
    one at a time and the engine, E2E_CHECKED requests); HF one at a time over every
    request (the c=1 baseline) and in padded batches at each larger concurrency, each
    batch to its longest output; the engine at each concurrency."""
    tokens = E2E_REQUESTS * E2E_MEAN_OUTPUT
    hf_launches = Work(launches=shape.layers * HF_LAUNCHES_PER_LAYER, processes=0)
    hf_token = _sum([_decode_step(shape, 1, E2E_MEAN_PROMPT), hf_launches])
    hf_one = _scaled(hf_token, tokens + E2E_CHECKED * E2E_MEAN_OUTPUT)
    hf_padded = [_scaled(_sum([_decode_step(shape, c, E2E_MEAN_PROMPT), hf_launches]),
                         E2E_MAX_OUTPUT * -(-E2E_REQUESTS // c)) for c in E2E_CONCURRENCY if c > 1]
    engine = [_scaled(_decode_step(shape, c, E2E_MEAN_PROMPT), -(-tokens // c))
              for c in (E2E_CHECKED, *E2E_CONCURRENCY)]
    # graph captures, eagerly: two warm-up steps and the recorded one per graph, a graph
    # per batch bucket and table width (bench/language.py's max_model_len: the workload's)
    from tandem.services.language.runner.graph_runner import batch_buckets, width_buckets
    from tandem.units import ceil_div

    eager = Work(launches=shape.layers * ENGINE_LAUNCHES_PER_LAYER, processes=0)
    widths = width_buckets(ceil_div(E2E_MAX_PROMPT + E2E_MAX_OUTPUT, DECODE_PAGE))
    captures = _scaled(eager, 3 * len(batch_buckets(max(E2E_CONCURRENCY))) * len(widths))
    prefill = Work(flops=2 * shape.text_params * E2E_REQUESTS * E2E_MEAN_PROMPT * (1 + 2), processes=0)
    return _sum([Work(compiles=1), _load_text(shape), _load_text(shape), hf_one, *hf_padded,
                 *engine, captures, prefill])


def estimate_vit_graphs(shape: Shape) -> Work:
    vit = Work(flops=2 * shape.vision_params * VIT_PATCHES, processes=0)
    return _sum([Work(disk_bytes=2 * shape.vision_params), _scaled(vit, 2 * 5 + 2 + VIT_CAPTURES)])


def estimate_host_syncs(shape: Shape) -> Work:
    return Work(compiles=1)  # three `small` models: seconds of GPU work beside the start


# The `gpu` tests' geometries: the graph runner's (640 pages), the tiny float32 runners'
# (upload staging, paged attention: the suites' floor), the sized pool's (bfloat16), and
# the paged-attention steps' own (two dtypes) and long chunks'.
GPU_TEST_GEOMETRIES = 5


def estimate_gpu_tests(shape: Shape) -> Work:
    files = gpu_test_files()  # one process; of their cases only the `gpu` ones run
    return Work(compiles=GPU_TEST_GEOMETRIES,
                pytest_cases=sum(_pytest_cases([f], gpu_only=True) for f in files))


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Ctx], list[Row]]
    estimate: Callable[[Shape], Work]  # its work on the lent GPU, at the sizes above
    cuda_only: bool = False  # skipped in the dry run
    first_call: bool = True  # planned within BUDGET_S; else within RESUME_BUDGET_S (--resume)


# Most valuable first (issue 43): decode graphs equal to eager and faster; no SDPA math
# fallback on the paged attention path; bf16 and fp32 exactness; the 7B-shaped model through
# the engine at c=1/8/32; ViT graphs; host syncs; then the `gpu` tests. `device` is the table's
# header and `build` makes the model the next checks load. A call runs its checks in this
# order, each that fits the time left. The first call runs all but the engine's and the
# `gpu` tests (first_call=False: it skips them, naming the second call, even with time
# left: a check started on what is left could be stopped at the budget's end, its time and
# the checks after it lost); a second call right after it (`--resume`, on the still-warm
# machine) runs those two, in what is left of the 15-minute lease. (The first run's
# figures priced e2e, and the geometry count the suites' compiles: bench/results/gpu.md.)
CHECKS = [
    Check("device", check_device, estimate_device),
    Check("build", check_build, estimate_build),
    Check("decode_graphs", check_decode_graphs, estimate_decode_graphs),
    Check("attention_long_context", check_attention_long_context, estimate_attention),
    Check("exactness_bf16", check_exactness_bf16, estimate_exactness_bf16),
    Check("exactness_fp32", check_exactness_fp32, estimate_exactness_fp32),
    Check("e2e", check_e2e, estimate_e2e, first_call=False),
    Check("vit_graphs", check_vit_graphs, estimate_vit_graphs),
    Check("host_syncs", check_host_syncs, estimate_host_syncs),
    Check("gpu_tests", check_gpu_tests, estimate_gpu_tests, cuda_only=True, first_call=False),
]
INSTALL = Work(processes=2)  # `make gpu-check` before the script: pip installs .whl/ offline
# A second call: the 15-minute lease (900 s) less the first call (BUDGET_S, and 38 s of the
# machine's start, transfers and hand-back: the first lease had 352 s left after its 510 s
# call), less a margin of ~50 s (the second call must follow within the machine's idle
# release, 30 s, or it starts a fresh machine). Read `status`' budget_left_s before it: with
# less than this + 30 s left, pass --budget-s (that less 30).
RESUME_BUDGET_S = 5 * 60
LIMIT_FACTOR = 2.5  # a check may run this many times its estimate before it is stopped
LIMIT_FLOOR_S = 60  # and at least this long: the estimates' host terms are assumptions
DRY_LIMIT_S = 480  # a cap on each check in the dry run (a hang never holds CI long)


@dataclass(frozen=True)
class Plan:
    """The estimates of the checks on a machine, and whether each call's fit its budget."""

    machine: Machine
    budget_s: float
    install_s: float
    estimates: dict[str, float]  # check name -> seconds
    resume: frozenset[str]  # the checks planned for a second call

    @classmethod
    def of(cls, budget_s: float, m: Machine = H200) -> Plan:
        shape = Shape.of("7b")
        return cls(m, budget_s, INSTALL.seconds(m),
                   {c.name: c.estimate(shape).seconds(m) for c in CHECKS},
                   frozenset(c.name for c in CHECKS if not c.first_call))

    @property
    def total_s(self) -> float:
        """The first call's: the install and the checks it plans."""
        return self.install_s + sum(s for n, s in self.estimates.items() if n not in self.resume)

    @property
    def resume_s(self) -> float:
        return self.install_s + sum(s for n, s in self.estimates.items() if n in self.resume)

    @property
    def fits(self) -> bool:
        return self.total_s <= self.budget_s and self.resume_s <= RESUME_BUDGET_S

    def describe(self) -> str:
        def verdict(total: float, budget: float) -> str:
            return f"{total:.0f} s of {budget:.0f}: " + ("fits" if total <= budget else
                                                         f"OVER by {total - budget:.0f} s")

        lines = [f"gpu-check plan on the {self.machine.name} ({self.machine.bf16_flops / 1e12:.0f} "
                 f"bf16 TFLOP/s, {self.machine.hbm_bytes_s / 1e12:.1f} TB/s), estimated seconds:",
                 f"  {'install (make gpu-check)':<26} {self.install_s:5.0f}"]
        lines += [f"  {n:<26} {s:5.0f}" for n, s in self.estimates.items() if n not in self.resume]
        lines.append(f"  the first call: {verdict(self.total_s, self.budget_s)}")
        lines += [f"  {n:<26} {s:5.0f}  (the second call: --resume)"
                  for n, s in self.estimates.items() if n in self.resume]
        lines.append(f"  a second call (--resume): {verdict(self.resume_s, RESUME_BUDGET_S)}")
        return "\n".join(lines)


# -- what a bare CUDA image needs besides its own packages (`make gpu-wheels`) ------------

def check_modules() -> list[str]:
    """Modules the checks import: their children's, the suites and `gpu` test files they
    run (with conftest and the oracle), the scripts and part functions they call."""
    tests = {Path(f).stem for f in [*FP32_SUITE, *BF16_SUITE, *gpu_test_files()]}
    return [
        "tandem.services.language.main", "tandem.services.encoder.pipeline", "tandem.models.tiny",
        "tandem.models.random_weights", "tandem.host_syncs", "conftest", "language_oracle",
        *sorted(tests), "language",
        "xgrammar",  # imported inside a function: an engine warms its grammar masks at start
        *(module for module, _ in PART_FUNCTIONS.values()),
    ]


# The Python packages of the lent H200's image ('cuda'), as the device notes list them
# (/work/.library/device/KINDS.md, read on a machine on 2026-11-17): not carried.
IMAGE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp
""".split())
# Carried although the image has them, for their version. transformers, tokenizers and
# huggingface-hub: the exactness oracle and the tokenizer files are this project's versions
# (the image: 5.17.0, 0.23.2, 1.33.0). grpcio and protobuf: the generated stubs refuse a
# runtime older than the grpcio-tools and protoc that made them.
CARRIED_ANYWAY = frozenset({"transformers", "tokenizers", "huggingface-hub", "grpcio", "protobuf"})
# Never carried: the tree itself travels, and the stubs travel generated (`make gpu-wheels`
# makes them; the image has no grpcio-tools to).
NOT_WHEELS = frozenset({"tandem-vlm", "grpcio-tools"})
CARRY_LIMIT_BYTES = 64 * 2**20  # what a call carries: the working tree and .whl/ together


def _norm(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


def wheel_specs() -> list[str]:
    """`name==version` (this environment's) of every distribution the checks import that
    the image lacks (or must be carried at this version), less NOT_CARRIED's."""
    import importlib.metadata as md

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench"), str(ROOT)]
    before = set(sys.modules)
    for m in check_modules():
        try:
            importlib.import_module(m)
        except ImportError as e:  # a part not built yet: its row will say so
            print(f"gpu-check: {m} not imported ({e}); its needs are not counted", file=sys.stderr)
    tops = {m.split(".")[0] for m in set(sys.modules) - before} - set(NOT_CARRIED)
    by_module = md.packages_distributions()
    dists = {d for t in tops for d in by_module.get(t, [])}
    if "protobuf" in dists:  # `google` is a namespace: only protobuf is imported under it
        dists = {d for d in dists if not d.startswith(("google-", "googleapis"))}
    carried = {d for d in dists if _norm(d) not in NOT_WHEELS
               and (_norm(d) not in IMAGE_HAS or _norm(d) in CARRIED_ANYWAY)}
    return sorted(f"{d}=={md.version(d)}" for d in carried)


def check_carry(wheels: Path) -> int:
    """`make gpu-wheels`' last step: the wheels and the tree that travels (tracked and
    untracked-not-ignored files, the stubs) within CARRY_LIMIT_BYTES, else exit 1 naming the
    largest wheels to drop."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    tree = sum((ROOT / f).stat().st_size for f in listed.split("\0") if f and (ROOT / f).is_file())
    stubs = sum(f.stat().st_size for f in (ROOT / "tandem" / "v1").glob("*") if f.is_file())
    whl = sorted(((f.stat().st_size, f.name) for f in wheels.glob("*.whl")), reverse=True)
    total = tree + stubs + sum(n for n, _ in whl)
    mib = 2**20
    print(f"gpu-wheels: {len(whl)} wheels {sum(n for n, _ in whl) / mib:.1f} MiB + tree "
          f"{tree / mib:.1f} MiB + stubs {stubs / mib:.2f} MiB = {total / mib:.1f} MiB of "
          f"{CARRY_LIMIT_BYTES / mib:.0f} MiB")
    if total <= CARRY_LIMIT_BYTES:
        return 0
    over, drop = total - CARRY_LIMIT_BYTES, []
    for n, name in whl:
        if over <= 0:
            break
        drop.append(f"{name} ({n / mib:.1f} MiB)")
        over -= n
    print(f"gpu-wheels: over the {CARRY_LIMIT_BYTES / mib:.0f} MiB a call carries by "
          f"{(total - CARRY_LIMIT_BYTES) / mib:.1f} MiB; drop (add to NOT_CARRIED in "
          f"bench/gpu_check.py, naming the checks that need it): {', '.join(drop)}")
    return 1


# Import names that differ from the image's distribution names (check_install).
IMPORT_NAMES = {"yaml": "pyyaml", "PIL": "pillow", "google": "protobuf", "dateutil": "python-dateutil",
                "typing_extensions": "typing-extensions", "prometheus_client": "prometheus-client"}


def check_install(site: Path, python: str) -> int:
    """`make gpu-wheels`' proof that the set is complete: .whl/ was installed into `site`
    (a clean target, for Python 3.12, no dependencies); `python` (a 3.12 here) imports each
    carried top-level module from it alone. A module may fail only for want of a package
    the image holds (IMAGE_HAS; torch and the rest cannot be installed here); any other
    missing module is one the set lacks: exit 1 naming it."""
    tops = sorted({p.name.split(".")[0] for p in site.iterdir() if not p.name.endswith(
        (".dist-info", ".libs", ".data")) and not p.name.startswith(("_", "bin"))})
    lacking = []
    for top in tops:
        p = subprocess.run([python, "-c", f"import {top}"], env={**os.environ, "PYTHONPATH": str(site)},
                           capture_output=True, text=True)
        err = p.stderr.strip().splitlines()[-1:] or [""]
        missing = err[0].split("No module named ")[-1].strip("'").split(".")[0] if "No module named" in err[0] else ""
        if p.returncode == 0:
            print(f"gpu-wheels: import {top}: ok")
        elif missing and _norm(IMPORT_NAMES.get(missing, missing)) in IMAGE_HAS:
            print(f"gpu-wheels: import {top}: needs {missing}, which the image holds")
        else:
            print(f"gpu-wheels: import {top}: FAILED: {err[0]}")
            lacking.append(f"{top} ({err[0]})")
    if lacking:
        print(f"gpu-wheels: the set is incomplete: {'; '.join(lacking)}")
    return 1 if lacking else 0


# -- the parent: one child per check, the table ----------------------------------------


def run_child(name: str, ctx: Ctx, result: Path) -> int:
    """In the child process: run one check, write its rows as JSON."""
    check = next(c for c in CHECKS if c.name == name)
    try:
        rows = check.run(ctx)
    except NotBuilt as e:
        rows = [Row(name, "", Status.NOT_BUILT, str(e))]
    except ModuleNotFoundError as e:
        why = missing_package(str(e))
        if why is None:
            raise
        rows = [Row(name, "", Status.SKIPPED, why)]
    except Exception:
        rows = [Row(name, "", Status.ERROR, "the check raised", traceback.format_exc()[-TAIL:])]
    result.write_text(json.dumps([dict(dataclasses.asdict(r), status=r.status.value) for r in rows]))
    return 0


def run_check(check: Check, ctx: Ctx, limit_s: float) -> list[Row]:
    """In the parent: the check in a child process of its own (its own session, so a
    timeout ends its whole tree), its rows, or an error row with the output's tail."""
    result = Path(ctx.work) / f"{check.name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", check.name, "--ctx",
           json.dumps(dataclasses.asdict(ctx)), "--result", str(result)]
    log = Path(ctx.work) / f"{check.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = p.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code = None
    secs = time.perf_counter() - t0
    tail = log.read_text(errors="replace")[-TAIL:]
    if code is None:
        rows = [Row(check.name, "", Status.STOPPED, f"timed out after {limit_s:.0f} s", tail)]
    elif not result.exists() and (why := missing_package(tail)):
        rows = [Row(check.name, "", Status.SKIPPED, why, tail)]
    elif not result.exists():
        rows = [Row(check.name, "", Status.ERROR, f"the child exited {code} with no result", tail)]
    else:
        rows = [Row(**dict(r, status=Status(r["status"]))) for r in json.loads(result.read_text())]
    for r in rows:
        r.seconds = secs
    return rows


def tree_commit() -> str:
    """The commit of the tree that ran: the one `make gpu-wheels` wrote beside the wheels
    where they were carried (the device's copy of the tree reported a stale HEAD: the
    first table named 302c52e for bcbc0a0), else git's."""
    stamp = ROOT / ".whl" / "COMMIT"
    if stamp.exists():
        return f"{stamp.read_text().strip()} (as make gpu-wheels found it)"
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip() or "?"


def markdown(rows: list[Row], ctx: Ctx, started: str, total_s: float, plan: Plan) -> str:
    device = next((r for r in rows if r.check == "device" and r.status is Status.PASS), None)
    commit = tree_commit()
    mode = "DRY RUN on the CPU (tiny sizes, float32)" if ctx.dry_run else "CUDA"
    counts = {s: sum(r.status is s for r in rows) for s in Status}
    lines = [
        "# GPU check (`make gpu-check`, bench/gpu_check.py)",
        "",
        f"{mode}; {started}; commit {commit}; "
        f"device {device.figures if device else 'unknown'}; {total_s / 60:.1f} min in all; "
        f"model {Path(ctx.model).name} ({ctx.dtype}).",
        "",
        f"Estimated seconds on the {plan.machine.name} (bench/gpu_check.py Plan; install "
        f"{plan.install_s:.0f}): " + ", ".join(f"{n} {s:.0f}" for n, s in plan.estimates.items())
        + f"; {plan.total_s:.0f} of the {plan.budget_s:.0f} s budget.",
        "",
        "Rows: " + ", ".join(f"{n} {s.value}" for s, n in counts.items() if n) + ".",
        "",
        "| check | case | status | figures | s |",
        "|---|---|---|---|---:|",
    ]
    for r in rows:
        fig = r.figures.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.check} | {r.case} | {r.status.value} | {fig} | {r.seconds:.0f} |")
    details = [r for r in rows if r.detail and r.status in (Status.FAIL, Status.ERROR, Status.STOPPED)]
    if details:
        lines += ["", "## Failures and errors", ""]
        for r in details:
            lines += [f"### {r.check}: {r.case or r.status.value}", "", "```",
                      r.detail.rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


def read_table(path: Path) -> list[Row]:
    """The rows of a table `markdown` wrote, their failures' details included (--resume)."""
    rows: list[Row] = []
    text = path.read_text() if path.exists() else ""
    body, _, failures = text.partition("\n## Failures and errors\n")
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in {c.name for c in CHECKS}:
            rows.append(Row(cells[0], cells[1], Status(cells[2]), cells[3], "", float(cells[4] or 0)))
    for section in failures.split("\n### ")[1:]:
        head, _, rest = section.partition("\n")
        detail = rest.strip().removeprefix("```").removesuffix("```").strip("\n")
        for r in rows:
            if f"{r.check}: {r.case or r.status.value}" == head.strip():
                r.detail = detail
    return rows


def done_checks(rows: list[Row]) -> set[str]:
    """Checks a table holds a result of: any row of theirs neither skipped nor stopped (a
    check stopped at its limit left no result: a second call runs it again)."""
    return {r.check for r in rows if r.status not in (Status.SKIPPED, Status.STOPPED)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="the CPU, tiny sizes, float32; CUDA-only checks skipped")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--resume", action="store_true",
                    help="run only the checks the last table (--out) lacks, and keep its rows")
    ap.add_argument("--out", help="the table (default bench/results/gpu.md; dry run: "
                    ".cache/gpu-check/gpu-dry-run.md)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"this call's limit (default {BUDGET_S:.0f}; with --resume "
                         f"{RESUME_BUDGET_S:.0f}, what a second call has of the lease)")
    ap.add_argument("--started-at", type=float, default=None,
                    help="epoch seconds the budget counts from (make gpu-check's start)")
    ap.add_argument("--plan", action="store_true",
                    help="print each check's estimate on the GPU; exit 1 when they exceed the budget")
    ap.add_argument("--wheel-specs", action="store_true",
                    help="print what a bare CUDA image lacks, as name==version (make gpu-wheels)")
    ap.add_argument("--check-carry", metavar="WHEELS",
                    help="exit 1 when WHEELS/*.whl and the tree exceed what a call carries")
    ap.add_argument("--check-install", nargs=2, metavar=("SITE", "PYTHON"),
                    help="import each carried module from SITE with PYTHON (make gpu-wheels)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.wheel_specs:
        print(" ".join(wheel_specs()))
        return 0
    if a.check_carry:
        return check_carry(Path(a.check_carry))
    if a.check_install:
        return check_install(Path(a.check_install[0]), a.check_install[1])
    if a.child:
        sys.path.insert(0, str(ROOT))
        return run_child(a.child, Ctx(**json.loads(a.ctx)), Path(a.result))

    names = [c.name for c in CHECKS]
    only = [n for n in a.only.split(",") if n]
    if unknown := sorted(set(only) - set(names)):
        ap.error(f"unknown checks {unknown}; known: {', '.join(names)}")
    out_default = WORK / "gpu-dry-run.md" if a.dry_run else RESULTS
    out = Path(a.out) if a.out else out_default
    # the whole plan must fit, whatever this call runs: a check that grew fails CI here
    plan = Plan.of(a.budget_s if a.budget_s is not None and not a.resume else BUDGET_S)
    budget_s = a.budget_s if a.budget_s is not None else (
        RESUME_BUDGET_S if a.resume else BUDGET_S)
    print(plan.describe(), flush=True)
    if a.plan or (a.dry_run and not plan.fits):
        return 0 if plan.fits else 1
    if not a.dry_run:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA device here: `make gpu-check DRY_RUN=1` runs the dry run")
    work = WORK / ("dry-run" if a.dry_run else "cuda")
    work.mkdir(parents=True, exist_ok=True)
    size = "tiny" if a.dry_run else "7b"
    ctx = Ctx(dry_run=a.dry_run, device="cpu" if a.dry_run else "cuda",
              dtype="float32" if a.dry_run else "bfloat16", work=str(work),
              model=str(work / f"model-{size}"), size=size)
    kept = read_table(out) if a.resume else []
    skip = done_checks(kept)
    if not (Path(ctx.model) / ".complete").exists():  # a fresh machine: what the checks
        skip -= {"device", "build"}  # after them need (the CPU kernels, the model) again
    kept = [r for r in kept if r.check in skip]
    to_run = [c for c in CHECKS if (not only or c.name in only) and c.name not in skip]
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    # the budget counts from make's start (the wheels' install spent part of it)
    t0 = time.monotonic() - (time.time() - a.started_at if a.started_at else 0.0)
    order = {c.name: i for i, c in enumerate(CHECKS)}

    def write(rows: list[Row]) -> str:
        """The table as it stands (after each check: a call the lease ends keeps its rows)."""
        done = sorted(kept + rows, key=lambda r: order[r.check])  # stable: rows stay in order
        table = markdown(done, ctx, started, time.monotonic() - t0, plan)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)
        return table

    rows: list[Row] = []
    for check in to_run:
        left = budget_s - (time.monotonic() - t0)
        est = plan.estimates[check.name]
        if a.dry_run and check.cuda_only:
            rows.append(Row(check.name, "", Status.SKIPPED, "needs CUDA"))
        elif not a.dry_run and not a.resume and not check.first_call and not only:
            rows.append(Row(check.name, "", Status.SKIPPED,
                            f"planned for the second call (estimated {est:.0f} s; --resume "
                            "runs it)"))
        elif not a.dry_run and est > left:
            rows.append(Row(check.name, "", Status.SKIPPED,
                            f"no time left: estimated {est:.0f} s, {max(left, 0):.0f} s of the "
                            f"{budget_s:.0f} s budget left (--resume runs it)"))
        else:
            limit = DRY_LIMIT_S if a.dry_run else min(left, max(LIMIT_FACTOR * est, LIMIT_FLOOR_S))
            print(f"gpu-check: {check.name} (estimated {est:.0f} s on the GPU, limit {limit:.0f} s)",
                  flush=True)
            try:
                rows += run_check(check, ctx, limit)
            except Exception:  # the parent's own trouble with one check stops no other
                rows.append(Row(check.name, "", Status.ERROR, "the parent failed to run it",
                                traceback.format_exc()[-TAIL:]))
        for r in rows[-1:]:
            print(f"gpu-check: {r.check}: {r.status.value} {r.figures}"[:300], flush=True)
        write(rows)
    print("\n" + write(rows) + f"\nwritten to {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
