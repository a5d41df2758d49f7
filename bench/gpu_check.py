"""`make gpu-check`: everything a lent GPU must show, one command, one table.

    .venv/bin/python bench/gpu_check.py [--only a,b] [--out bench/results/gpu.md] [--budget-s 1740]
    .venv/bin/python bench/gpu_check.py --dry-run      # `make gpu-check DRY_RUN=1`: the CPU, tiny

On a CUDA machine every check runs (about 15-25 minutes on one H100 or H200, inside a 30
minute budget) and `bench/results/gpu.md` gets a row per case, the device named in its
header. The dry run runs the same script on the CPU at tiny sizes, in float32: checks that
need CUDA are marked skipped, the rest run their CPU form, so the script itself is known to
work before a GPU comes (tests/test_gpu_check.py runs it in CI). Its table goes to
`.cache/gpu-check/gpu-dry-run.md`, never over the GPU's.

The checks are a list (CHECKS), each independent: it runs in a child process of its own
under its own time limit (a CUDA error, a hang or a crash ends only that check), and gives
one row or more. A check that fails, crashes or runs out of time is recorded with the tail
of its output; the next check runs regardless. Row status (Status):

    pass            ran, and what must hold held (a target missed is said in its figures)
    FAIL            ran, and what must hold did not
    error           crashed, timed out, or its result could not be read (output kept)
    skipped         needs CUDA (dry run), or no time was left in the budget
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
BUDGET_S = 29 * 60  # the whole run, on a GPU: 30 minutes less a margin
TAIL = 4000  # characters of a failed check's output kept in the table's details
BF16_LOGITS_TOL = 0.25  # tests/test_bf16.py's bound, for graph replay against eager


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    ERROR = "error"
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
    "host_syncs": ("tandem.services.language.step_syncs", "decode_step_host_syncs"),
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
                       figures))  # fmt: skip
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
           f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    if ctx.device == "cpu":
        return [Row("device", "cpu", Status.PASS, f"{cpu}, torch {torch.__version__}")]
    p = torch.cuda.get_device_properties(0)
    figures = (f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
               f"{p.multi_processor_count} SMs, torch {torch.__version__}, CUDA "
               f"{torch.version.cuda}, bf16 {torch.cuda.is_bf16_supported()}, "
               f"Python {platform.python_version()}; {cpu}")  # fmt: skip
    return [Row("device", p.name, Status.PASS, figures)]


def _pytest(ctx: Ctx, name: str, args: list[str]) -> tuple[int, ET.Element | None, str]:
    """Run pytest in a process of its own: (exit code, the junit report's root, output)."""
    xml = Path(ctx.work) / f"{name}.xml"
    xml.unlink(missing_ok=True)
    # NOTE: junit_family xunit1 keeps record_property's figures (tests/test_bf16.py's)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
           f"--junitxml={xml}", "-o", "junit_family=xunit1", f"--device={ctx.device}", *args]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
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
               else "skipped" if "skipped" in kinds else "passed")  # fmt: skip
        n[key] += 1
    return n


def _suite_row(check: str, case: str, code: int, root, out: str, want_run: bool) -> Row:
    n = _counts(root)
    figures = ", ".join(f"{v} {k}" for k, v in n.items() if v)
    if code == 0 and not (want_run and n["skipped"]) and n["passed"]:
        return Row(check, case, Status.PASS, figures)
    why = "skipped tests where all must run" if code == 0 and n["passed"] else f"pytest exit {code}"
    return Row(check, case, Status.FAIL, figures or why, f"{why}\n{out[-TAIL:]}")


def check_gpu_tests(ctx: Ctx) -> list[Row]:
    """Every `@pytest.mark.gpu` test, file by file (a file that cannot import fails alone)."""
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in p.read_text())  # fmt: skip
    rows = []
    for f in files:
        code, root, out = _pytest(ctx, f"gpu-{Path(f).stem}", ["-m", "gpu", f])
        rows.append(_suite_row("gpu_tests", f, code, root, out, want_run=True))
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
                       code, root, out, want_run=False)]  # fmt: skip


def check_exactness_bf16(ctx: Ctx) -> list[Row]:
    sel = ["-k", DRY_SELECT["bf16"]] if ctx.dry_run else []
    code, root, out = _pytest(ctx, "exactness-bf16", [*sel, *BF16_SUITE])
    rows = [_suite_row("exactness_bf16", "bfloat16 within 0.25, " + " ".join(BF16_SUITE),
                       code, root, out, want_run=False)]  # fmt: skip
    for case in [] if root is None else root.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if "bf16_case" not in props:
            continue
        failed = any(child.tag in ("failure", "error") for child in case)
        rows.append(Row("exactness_bf16", props["bf16_case"], Status.FAIL if failed else Status.PASS,
                        f"{props['bf16_compared']}/{props['bf16_rows']} rows within the bound, "
                        f"max abs diff {float(props['bf16_max_diff']):.4f}, greedy ids compared "
                        f"{props['bf16_greedy_compared']}, near ties {props['bf16_near_ties']}, "
                        f"router near ties {props['bf16_routing_ties']}"))  # fmt: skip
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
                   f" from values made on {ctx.device}"))]  # fmt: skip


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
    (float32: 1e-4; bfloat16: tests/test_bf16.py's 0.25) and the same greedy ids wherever
    the top-2 margin exceeds it, at batch sizes 1, 8, 32 and two padded ones (5, 17);
    eager / replay step time."""
    import torch

    from tandem.models.split import load_text_weights
    from tandem.services.language.engine.kv_pages import KVPagePool
    from tandem.services.language.runner.forward_batch import (
        ForwardBatch,
        SeqChunk,
        decode_positions,
    )
    from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings
    from tandem.units import ceil_div

    path, device, dtype = _need_model(ctx), torch.device(ctx.device), ctx.torch_dtype
    context, page, sizes = (24, 4, (1, 5, 8, 17, 32)) if ctx.dry_run else (512, 16, (1, 5, 8, 17, 32))
    per_seq = ceil_div(context + 1, page)
    max_bs = max(sizes)
    runner = ModelRunner(
        load_text_weights(path, dtype=dtype, device=device),
        RunnerSettings(page_size=page, cuda_graph_max_bs=max_bs, max_seq_len=context + page),
        num_pages=max_bs * per_seq + 1, device=device, dtype=dtype,
    )  # fmt: skip
    gr = runner.graph_runner
    captured = len(gr.graphs) if gr is not None else 0
    if device.type == "cuda" and not captured:
        return [Row("decode_graphs", "capture", Status.FAIL, "no decode graph was captured")]
    pool = KVPagePool(runner.num_pages, page)
    g = torch.Generator().manual_seed(0)
    chunks = []
    with torch.inference_mode():
        for i in range(max_bs):
            ids = torch.randint(0, runner.vocab_size, (context,), generator=g)
            pages = pool.alloc(per_seq)
            pos = torch.arange(context).expand(3, context)
            runner.forward_eager(ForwardBatch([SeqChunk(i, 0, pos, pages, token_ids=ids)]))
            chunks.append(SeqChunk(i, context, decode_positions(context, 0), pages,
                                   token_ids=torch.tensor([int(ids[-1])])))  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else BF16_LOGITS_TOL
    steps = 3 if ctx.dry_run else 20
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
                            f"speed-up {te / tg:.2f}x{target}, graphs {captured}"))  # fmt: skip
    return rows


def check_attention_long_context(ctx: Ctx) -> list[Row]:
    """No attention call on the math backend, and the peak memory of a 4096-token chunk over
    a 16K and a 32K context at 7B attention sizes (bench/paged_attention.py)."""
    import torch

    fn = part_function(*PART_FUNCTIONS["attention_long_context"])
    if ctx.dry_run:  # the part's own dry-run sizes
        rows = fn("cpu", torch.float32, contexts=(512,), chunk=160, heads=4, kv_heads=2,
                  head_dim=32, runs=1, backend="flex")  # fmt: skip
    else:
        rows = fn(ctx.device, ctx.torch_dtype, contexts=(16384, 32768), chunk=4096)

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
    conc = ["1", "2"] if ctx.dry_run else ["1", "8", "32"]
    n = "2" if ctx.dry_run else "32"
    cmd = [sys.executable, str(ROOT / "bench" / "language.py"), "--model", str(path),
           "--device", ctx.device, "--dtype", ctx.dtype, "--requests", n, "--concurrency",
           *conc, "--runs", "1", "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    text = p.stdout + p.stderr
    print(text[-TAIL:], flush=True)
    if p.returncode != 0 or not out.exists():
        return [Row("e2e", "bench/language.py", Status.ERROR, f"exit {p.returncode}", text[-TAIL:])]
    greedy = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                   if ln.startswith("greedy check:")), "?")  # fmt: skip
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
                        f"{r_one} / {r_pad} of them{target}; greedy check {greedy}"))  # fmt: skip
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
                )  # fmt: skip
                last = fn(runner, batch_size=8, shaped=shaped, steps=2)[-1]
            else:  # on the CPU nothing is a device sync: count on a fake CUDA device, with
                # the gather attention (compiled flex cannot lower for a device that is not)
                from tandem.host_syncs import fake_cuda
                from tandem.services.language.step_syncs import fake_cuda_runner

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
                            traceback.format_exc()[-TAIL:]))  # fmt: skip
            continue
        ok = not last.captured and len(last.outside) <= 1 and last.complete
        rows.append(Row("host_syncs", case, Status.PASS if ok else Status.FAIL,
                        f"in the graph body {len(last.captured)} (must be 0), outside "
                        f"{len(last.outside)} (at most 1)" + ("" if last.complete else
                        f", stopped early: {last.stopped}"), last.describe()[-TAIL:]))  # fmt: skip
        del runner
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
    return rows


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Ctx], list[Row]]
    limit_s: int  # its time limit on a GPU (the dry run: DRY_LIMIT_S)
    cuda_only: bool = False  # skipped in the dry run


CHECKS = [
    Check("device", check_device, 420),
    Check("gpu_tests", check_gpu_tests, 420, cuda_only=True),
    Check("exactness_fp32", check_exactness_fp32, 420),
    Check("exactness_bf16", check_exactness_bf16, 300),
    Check("build", check_build, 420),
    Check("decode_graphs", check_decode_graphs, 300),
    Check("attention_long_context", check_attention_long_context, 240),
    Check("vit_graphs", check_vit_graphs, 300),
    Check("e2e", check_e2e, 480),
    Check("host_syncs", check_host_syncs, 240),
]
DRY_LIMIT_S = 480  # a cap on each check in the dry run (a hang never holds CI long)


# -- what a bare CUDA image needs besides its own packages (`make gpu-wheels`) ------------

# Modules the checks import (their children, the suites they run, the scripts they call).
CHECK_MODULES = [
    "tandem.services.language.main", "tandem.services.encoder.pipeline", "tandem.models.tiny",
    "tandem.models.random_weights", "tandem.host_syncs", "conftest", "language_oracle",
    "test_language_model", "test_language_engine", "test_bf16", "test_graph_runner",
    "test_encoder_units", "test_vit_graphs", "language",
    "xgrammar",  # imported inside a function: an engine warms its grammar masks at start
    *(module for module, _ in PART_FUNCTIONS.values()),
]  # fmt: skip
# What a CUDA PyTorch image already holds (torch and its CUDA stack, triton, the scientific
# basics, pytest, gRPC, transformers' small dependencies): not carried. `av` (PyAV, ~35 MB)
# is not carried either: the video `gpu` test fails to import without it.
IMAGE_HAS = {
    "torch", "triton", "numpy", "sympy", "mpmath", "networkx", "pillow", "jinja2", "markupsafe",
    "filelock", "fsspec", "typing-extensions", "setuptools", "packaging", "pyyaml", "regex",
    "requests", "tqdm", "safetensors", "grpcio", "prometheus-client", "pytest", "pluggy",
    "iniconfig", "pygments", "anyio", "h11", "idna", "sniffio", "certifi", "av", "tandem-vlm",
}  # fmt: skip


def wheel_specs() -> list[str]:
    """`name==version` (this environment's) of every distribution the checks import that
    IMAGE_HAS lacks."""
    import importlib.metadata as md

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench"), str(ROOT)]
    before = set(sys.modules)
    for m in CHECK_MODULES:
        try:
            importlib.import_module(m)
        except ImportError as e:  # a part not built yet: its row will say so
            print(f"gpu-check: {m} not imported ({e}); its needs are not counted", file=sys.stderr)
    tops = {m.split(".")[0] for m in set(sys.modules) - before}
    by_module = md.packages_distributions()
    dists = {d for t in tops for d in by_module.get(t, [])}
    if "protobuf" in dists:  # `google` is a namespace: only protobuf is imported under it
        dists = {d for d in dists if not d.startswith(("google-", "googleapis"))}
    norm = {d: d.lower().replace("_", "-") for d in dists}
    return sorted(f"{d}=={md.version(d)}" for d in dists if norm[d] not in IMAGE_HAS)


# -- the parent: one child per check, the table ----------------------------------------


def run_child(name: str, ctx: Ctx, result: Path) -> int:
    """In the child process: run one check, write its rows as JSON."""
    check = next(c for c in CHECKS if c.name == name)
    try:
        rows = check.run(ctx)
    except NotBuilt as e:
        rows = [Row(name, "", Status.NOT_BUILT, str(e))]
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
           json.dumps(dataclasses.asdict(ctx)), "--result", str(result)]  # fmt: skip
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
        rows = [Row(check.name, "", Status.ERROR, f"timed out after {limit_s:.0f} s", tail)]
    elif not result.exists():
        rows = [Row(check.name, "", Status.ERROR, f"the child exited {code} with no result", tail)]
    else:
        rows = [Row(**dict(r, status=Status(r["status"]))) for r in json.loads(result.read_text())]
    for r in rows:
        r.seconds = secs
    return rows


def markdown(rows: list[Row], ctx: Ctx, started: str, total_s: float) -> str:
    device = next((r for r in rows if r.check == "device" and r.status is Status.PASS), None)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"  # fmt: skip
    mode = "DRY RUN on the CPU (tiny sizes, float32)" if ctx.dry_run else "CUDA"
    counts = {s: sum(r.status is s for r in rows) for s in Status}
    lines = [
        "# GPU check (`make gpu-check`, bench/gpu_check.py)",
        "",
        f"{mode}; {started}; commit {commit}; "
        f"device {device.figures if device else 'unknown'}; {total_s / 60:.1f} min in all; "
        f"model {Path(ctx.model).name} ({ctx.dtype}).",
        "",
        "Rows: " + ", ".join(f"{n} {s.value}" for s, n in counts.items() if n) + ".",
        "",
        "| check | case | status | figures | s |",
        "|---|---|---|---|---:|",
    ]
    for r in rows:
        fig = r.figures.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.check} | {r.case} | {r.status.value} | {fig} | {r.seconds:.0f} |")
    details = [r for r in rows if r.detail and r.status in (Status.FAIL, Status.ERROR)]
    if details:
        lines += ["", "## Failures and errors", ""]
        for r in details:
            lines += [f"### {r.check}: {r.case or r.status.value}", "", "```",
                      r.detail.rstrip(), "```", ""]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="the CPU, tiny sizes, float32; CUDA-only checks skipped")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--out", help="the table (default bench/results/gpu.md; dry run: "
                    ".cache/gpu-check/gpu-dry-run.md)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's limit")
    ap.add_argument("--wheel-specs", action="store_true",
                    help="print what a bare CUDA image lacks, as name==version (make gpu-wheels)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.wheel_specs:
        print(" ".join(wheel_specs()))
        return 0
    if a.child:
        sys.path.insert(0, str(ROOT))
        return run_child(a.child, Ctx(**json.loads(a.ctx)), Path(a.result))

    names = [c.name for c in CHECKS]
    only = [n for n in a.only.split(",") if n]
    if unknown := sorted(set(only) - set(names)):
        ap.error(f"unknown checks {unknown}; known: {', '.join(names)}")
    if not a.dry_run:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA device here: `make gpu-check DRY_RUN=1` runs the dry run")
    work = WORK / ("dry-run" if a.dry_run else "cuda")
    work.mkdir(parents=True, exist_ok=True)
    size = "tiny" if a.dry_run else "7b"
    ctx = Ctx(dry_run=a.dry_run, device="cpu" if a.dry_run else "cuda",
              dtype="float32" if a.dry_run else "bfloat16", work=str(work),
              model=str(work / f"model-{size}"), size=size)  # fmt: skip
    out = Path(a.out) if a.out else (work.parent / "gpu-dry-run.md" if a.dry_run else RESULTS)
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    t0 = time.monotonic()
    rows: list[Row] = []
    for check in CHECKS:
        if only and check.name not in only:
            continue
        left = a.budget_s - (time.monotonic() - t0)
        if a.dry_run and check.cuda_only:
            rows.append(Row(check.name, "", Status.SKIPPED, "needs CUDA"))
        elif left < 30:
            rows.append(Row(check.name, "", Status.SKIPPED, f"no time left in the {a.budget_s:.0f} s budget"))
        else:
            limit = min(DRY_LIMIT_S if a.dry_run else check.limit_s, left)
            print(f"gpu-check: {check.name} (limit {limit:.0f} s)", flush=True)
            try:
                rows += run_check(check, ctx, limit)
            except Exception:  # the parent's own trouble with one check stops no other
                rows.append(Row(check.name, "", Status.ERROR, "the parent failed to run it",
                                traceback.format_exc()[-TAIL:]))  # fmt: skip
        for r in rows[-1:]:
            print(f"gpu-check: {r.check}: {r.status.value} {r.figures}"[:300], flush=True)
    table = markdown(rows, ctx, started, time.monotonic() - t0)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    print("\n" + table + f"\nwritten to {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
