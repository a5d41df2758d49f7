"""Output tokens per second of the language engine vs Hugging Face `generate()`.

    .venv/bin/python bench/language.py [--model DIR | --arch qwen2_5_vl --size small]
        [--requests 32] [--concurrency 1 8 32] [--runs 3] [--max-output 128] [--device auto]
        [--dtype auto]
        [--tp N] [--threads N] [--engine-profile] [--out bench/results/language.md]

`--tp N` runs the engine over N tensor-parallel ranks (N processes: gloo on CPU, where the
host's threads are split among them, so on a small CPU host it is a correctness path and
expected slower than `--tp 1`; one GPU per rank on CUDA).

Workload: `--requests` text prompts with lengths drawn from 64-512 tokens (plain ids: none
of the tokenizer's special or vision ids) and output lengths from 16 to `--max-output`
(default 128; fixed seed; EOS ignored so every request produces exactly its length: a
request that ends otherwise is an error, not a faster figure). The engine gets each prompt
as the encoder would send it (token embeddings, text MRoPE positions); transformers gets
the same token ids. The engine runs without its prefix cache (each concurrency serves the
same prompts again: the cache would skip their prefill from the second on, which
transformers' side cannot) and with `max_model_len` the workload's longest (its decode
graphs sized so, not to the model's 128K limit).

- engine @ c: closed loop, at most c requests in flight (a new one is submitted when one
  finishes); tokens/s = all output tokens / wall time from first submit to last finish.
- HF one at a time: `generate()` per request, sequentially.
- HF padded batch @ c: the requests in left-padded batches of c; every batch runs to its
  longest output, only each request's own tokens count.

Each figure is the median of `--runs` runs; ratios use medians from the same process.
Before timing, the engine's greedy tokens are checked against HF one-at-a-time: whole
outputs identical, and identical up to each output's first near tie (a step where HF's
top-2 logit margin is within NEAR_TIE of the dtype: past one, rounding alone may pick the
other token; random-weight logits of a 152K vocabulary often have margins of ~0.2).

`--engine-profile` (off by default; skips the HF runs): where the engine thread's CPU time
goes per step (`time.thread_time`, so other processes' load does not count): schedule(),
the scheduler gauges, metrics, the forward, sample(), scheduler.commit(), the per-token
work (`_on_token`: grammar accept, detokenizer, stop checks, the sink) with its
detokenizer and sink shares, and the engine loop outside `_step` (inbox, deadlines); plus
the process's other threads (the client thread that drains the sinks' queue here; there
is no gRPC in this setup). Use `--threads 1`, so the forward runs on the engine thread
alone. Written to `bench/results/language-profile-<dtype>.md` unless `--out` is given.
"""

from __future__ import annotations

import argparse
import platform
import queue
import statistics
import sys
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tandem.sampling import SamplingParams  # noqa: E402
from tandem.services.language.config import LanguageConfig  # noqa: E402
from tandem.services.language.engine.request import (  # noqa: E402
    Request,
    RequestSpec,
    RequestStatus,
)
from tandem.services.language.main import build_engine  # noqa: E402
from tandem.services.language.metrics import LanguageMetrics  # noqa: E402
from tandem.transfer.payload import PromptPayload  # noqa: E402

_rid = iter(range(1, 1 << 62))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MAX_PROMPT = 512  # prompts are 64-512 tokens
# A greedy step whose top-2 logit margin is within this is a near tie: the bf16 bound of
# the exactness suite (tests/test_bf16.py), float32's rounding for float32.
NEAR_TIE = {torch.bfloat16: 0.375, torch.float16: 0.375, torch.float32: 1e-4}


def workload(n: int, vocab: int, seed: int = 0, max_output: int = 128,
             avoid: frozenset[int] = frozenset()) -> list[tuple[list[int], int]]:
    """`n` (prompt ids, output length) pairs; no prompt id is in `avoid` (the tokenizer's
    special ids and the vision ids: an image pad without an image is an error to HF)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        plen = int(torch.randint(64, MAX_PROMPT + 1, (1,), generator=g))
        olen = int(torch.randint(16, max_output + 1, (1,), generator=g))
        ids = torch.randint(10, vocab - 100, (plen,), generator=g).tolist()  # plain tokens
        for i, t in enumerate(ids):
            while t in avoid:  # drawn again (seed 0's ids stay as they were unless avoided)
                t = int(torch.randint(10, vocab - 100, (1,), generator=g))
            ids[i] = t
        out.append((ids, olen))
    return out


def avoided_ids(tokenizer, spec) -> frozenset[int]:
    """The ids a plain-text prompt must not hold: the tokenizer's special ones and the
    model's vision ids (its ModelSpec's)."""
    return frozenset(tokenizer.all_special_ids) | {
        spec.image_token_id, spec.video_token_id, spec.vision_start_token_id,
        spec.vision_end_token_id}


def payload(hf, ids: list[int]) -> PromptPayload:
    t = torch.tensor(ids)
    with torch.inference_mode():
        emb = hf.get_input_embeddings()(t.to(hf.device)).cpu()
    pos = torch.arange(len(ids), dtype=torch.int32).expand(3, -1).contiguous()
    return PromptPayload(emb, t.to(torch.int32), pos, 0)


def run_engine(engine, work, payloads, concurrency: int, sink_times: dict | None = None
               ) -> tuple[float, list[list[int]]]:
    """Seconds for the whole workload at `concurrency`, and each request's tokens.

    `sink_times`: add each sink call's engine-thread CPU seconds under "sink"."""
    q: queue.Queue = queue.Queue()
    outs: dict[int, list[int]] = {}
    order: list[int] = []
    nxt, inflight, done = 0, 0, 0
    t0 = time.perf_counter()

    def submit(i: int) -> None:
        rid = next(_rid)
        order.append(rid)
        outs[rid] = []
        sp = SamplingParams(max_tokens=work[i][1], ignore_eos=True)
        if sink_times is None:
            sink = lambda d, rid=rid: q.put((rid, d))  # noqa: E731
        else:
            def sink(d, rid=rid):  # the engine thread
                c = time.thread_time()
                q.put((rid, d))
                sink_times["sink"] += time.thread_time() - c
        engine.submit(Request(RequestSpec(rid, sp, payloads[i])), sink)

    reasons: dict[int, RequestStatus] = {}
    while done < len(work):
        while inflight < concurrency and nxt < len(work):
            submit(nxt)
            nxt, inflight = nxt + 1, inflight + 1
        rid, d = q.get()
        outs[rid].extend(d.token_ids)
        if d.finished:
            reasons[rid] = d.finish_reason
            done, inflight = done + 1, inflight - 1
    secs = time.perf_counter() - t0
    # tokens/s counts each request's planned length: one that ended otherwise (an error, a
    # refusal) would make the figure faster, not fail it
    for i, rid in enumerate(order):
        if len(outs[rid]) != work[i][1] or reasons[rid] is not RequestStatus.FINISHED_LENGTH:
            raise RuntimeError(f"request {i} ended {reasons[rid]} after {len(outs[rid])} of "
                               f"its {work[i][1]} tokens")
    return secs, [outs[r] for r in order]


@torch.inference_mode()
def hf_generate(hf, batch: list[tuple[list[int], int]], pad_id: int, margins: list | None = None
                ) -> list[list[int]]:
    """Greedy `generate()` of a left-padded batch, to the longest output of the batch.
    `margins`: each row's top-2 logit margin per step is appended to it (the greedy check)."""
    width = max(len(ids) for ids, _ in batch)
    n_new = max(n for _, n in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, (ids, _) in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    out = hf.generate(
        input_ids=input_ids.to(hf.device), attention_mask=mask.to(hf.device),
        max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, eos_token_id=None,
        pad_token_id=pad_id, output_logits=margins is not None,
        return_dict_in_generate=margins is not None,
    )
    if margins is not None:
        top2 = torch.stack(out.logits, 1).float().topk(2, dim=-1).values  # [rows, steps, 2]
        margins += [(top2[r, :n, 0] - top2[r, :n, 1]).tolist() for r, (_, n) in enumerate(batch)]
        out = out.sequences
    return [out[r, width : width + n].tolist() for r, (_, n) in enumerate(batch)]


def greedy_check(hf, engine, work, payloads, pad: int) -> str:
    """The engine's greedy tokens against HF one at a time on the first 4 requests (also
    warms both up): whole outputs identical, and identical up to each one's first near
    tie (module docstring)."""
    margins: list[list[float]] = []
    ref = [hf_generate(hf, [w], pad, margins)[0] for w in work[:4]]
    _, got = run_engine(engine, work[:4], payloads[:4], 4)
    tie = NEAR_TIE[engine.runner.dtype]
    same = sum(r == g for r, g in zip(ref, got, strict=True))
    clear = [next((i for i, m in enumerate(ms) if m <= tie), len(ms)) for ms in margins]
    upto = sum(r[:k] == g[:k] for r, g, k in zip(ref, got, clear, strict=True))
    return (f"{same}/{len(ref)} requests identical to generate(), {upto}/{len(ref)} up to "
            f"their first near tie (top-2 margin <= {tie:g}; {sum(clear)} of "
            f"{sum(len(r) for r in ref)} tokens before one)")


_DETOK_TIMES: dict[str, float] = {"detok": 0.0}


def _time_detokenizer() -> None:
    """The engine's detokenizers charge their add() to _DETOK_TIMES (engine thread CPU)."""
    from tandem.services.language.engine import core

    class TimedDetokenizer(core.IncrementalDetokenizer):
        def add(self, token_ids):
            c = time.thread_time()
            try:
                return super().add(token_ids)
            finally:
                _DETOK_TIMES["detok"] += time.thread_time() - c

    core.IncrementalDetokenizer = TimedDetokenizer


PARTS = ("schedule", "gauges", "metrics", "forward", "forward_mixed", "sample", "commit",
         "on_token", "detok", "sink")


def engine_profile(a, engine, ckpt, work, payloads, hf, pad, spec) -> int:
    """--engine-profile: per-part engine thread CPU per step, median of the runs."""
    from collections import defaultdict

    greedy = greedy_check(hf, engine, work, payloads, pad)
    print(f"greedy check: {greedy}", flush=True)
    eng_clock = time.pthread_getcpuclockid(engine._thread.ident)
    out_tokens = sum(n for _, n in work)
    rows: dict[int, list[dict]] = {}
    for run in range(a.runs):
        for c in a.concurrency:
            pt = defaultdict(float)
            engine.part_times = pt
            _DETOK_TIMES["detok"] = 0.0
            e0, p0, m0 = time.clock_gettime(eng_clock), time.process_time(), time.thread_time()
            secs, _ = run_engine(engine, work, payloads, c, sink_times=pt)
            e1, p1, m1 = time.clock_gettime(eng_clock), time.process_time(), time.thread_time()
            engine.part_times = None
            pt["detok"] = _DETOK_TIMES["detok"]
            steps = pt["steps_decode"] + pt["steps_mixed"]
            inside = sum(pt[k] for k in PARTS if k not in ("detok", "sink"))
            r = {k: 1e3 * pt[k] / steps for k in PARTS}
            r["forward"] = 1e3 * pt["forward"] / max(pt["steps_decode"], 1)
            r["forward_mixed"] = 1e3 * pt["forward_mixed"] / max(pt["steps_mixed"], 1)
            r["loop"] = 1e3 * ((e1 - e0) - inside) / steps  # inbox, deadlines, idle polls
            r["engine_ms"] = 1e3 * (e1 - e0) / steps
            r["client_ms"] = 1e3 * (m1 - m0) / steps
            r["other_ms"] = 1e3 * ((p1 - p0) - (e1 - e0) - (m1 - m0)) / steps
            r["host_ms"] = r["engine_ms"] - 1e3 * (pt["forward"] + pt["forward_mixed"]) / steps
            r.update(wall_s=secs, tok_s=out_tokens / secs, steps=steps,
                     decode_steps=pt["steps_decode"], mixed_steps=pt["steps_mixed"],
                     engine_s=e1 - e0, tok_per_step=out_tokens / steps)
            rows.setdefault(c, []).append(r)
            print(f"run {run}: c={c}: {r['tok_s']:.1f} tok/s, {steps:.0f} steps, engine "
                  f"{r['engine_ms']:.2f} ms/step (forward {r['forward']:.2f}, host "
                  f"{r['host_ms']:.2f})", flush=True)
    engine.stop()

    def med(c, k):
        return statistics.median(r[k] for r in rows[c])

    host = f"{platform.processor() or platform.machine()}"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                host = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    lines = [
        f"Model `{ckpt.name}` ({a.arch} {a.size}), {engine.runner.dtype}, {host}, "
        f"{torch.get_num_threads()} torch thread(s); {a.requests} requests, prompts 64-512 "
        f"tokens, outputs 16-{a.max_output} ({out_tokens} in all), greedy, sink = a "
        f"queue.Queue put (no gRPC); greedy check {greedy}. Engine thread CPU "
        f"ms (time.thread_time) per step, median of {a.runs} runs; forward: per pure decode "
        "step (prefill/mixed steps apart); the other parts: per step of any kind.",
        "",
        "| c | tok/s | steps (mixed) | tok/step | schedule | gauges | metrics | forward "
        "(decode) | forward (mixed) | sample | commit | on_token | of it detok | of it sink "
        "| loop | engine thread | host (engine - forward) | client thread | other threads |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
        "|---:|---:|",
    ]
    for c in rows:
        lines.append(
            f"| {c} | {med(c, 'tok_s'):.1f} | {med(c, 'steps'):.0f} ({med(c, 'mixed_steps'):.0f})"
            f" | {med(c, 'tok_per_step'):.2f} | "
            + " | ".join(f"{med(c, k):.3f}" for k in (
                "schedule", "gauges", "metrics", "forward", "forward_mixed", "sample", "commit",
                "on_token", "detok", "sink", "loop", "engine_ms", "host_ms", "client_ms",
                "other_ms"))
            + " |")
    lines += ["", "Per run (engine thread ms/step, host ms/step): " + "; ".join(
        f"c={c}: " + ", ".join(f"{r['engine_ms']:.2f}/{r['host_ms']:.3f}" for r in rows[c])
        for c in rows)]
    table = "\n".join(lines)
    print("\n" + table)
    out = a.out or str(ROOT / "bench" / "results" /
                       f"language-profile-{str(engine.runner.dtype).removeprefix('torch.')}.md")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("# Engine thread profile (bench/language.py --engine-profile)\n\n"
                         f"    .venv/bin/python bench/language.py {' '.join(sys.argv[1:])}\n\n"
                         + table + "\n")
    return 0


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    res = fn()
    sync(device)
    return time.perf_counter() - t, res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: build a tiny-model one)")
    ap.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-output", type=int, default=128,
                    help="output lengths are drawn from 16 to this (make gpu-check: 32, so "
                         "transformers' eager baselines fit its budget)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the engine")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--engine-profile", action="store_true",
                    help="engine thread CPU time per part of a step (skips the HF runs)")
    ap.add_argument("--out", default=None,
                    help="default bench/results/language.md (language-profile-<dtype>.md "
                    "with --engine-profile)")
    a = ap.parse_args(argv)
    if a.max_output < 16:
        ap.error(f"--max-output must be at least 16 (outputs are 16 or more), got {a.max_output}")

    from transformers import AutoModelForImageTextToText

    import tandem  # noqa: F401  (registers the tiny processors)

    if a.model:
        ckpt = Path(a.model)
    else:
        from latency import checkpoint  # bench/, the script's own folder

        ckpt = checkpoint(a.arch, a.size)
    cfg = LanguageConfig(
        model=str(ckpt), device=a.device, dtype=a.dtype, kv_pages=4096, kv_page_size=16,
        max_prefill_tokens=a.max_prefill_tokens, max_running_requests=max(a.concurrency),
        cuda_graph_max_bs=max(a.concurrency), tp=a.tp, cpu_threads=a.threads,
        max_model_len=MAX_PROMPT + a.max_output, prefix_cache=False,  # module docstring
    )
    if a.threads:
        torch.set_num_threads(a.threads)  # as `tandem language` does (serving.run_service)
    if a.engine_profile:
        _time_detokenizer()
    engine, spec, tokenizer = build_engine(cfg, LanguageMetrics(CollectorRegistry()))
    device, dtype = engine.runner.device, engine.runner.dtype
    hf = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=dtype).to(device).eval()
    work = workload(a.requests, spec.vocab_size, max_output=a.max_output,
                    avoid=avoided_ids(tokenizer, spec))
    payloads = [payload(hf, ids) for ids, _ in work]
    pad = int(hf.generation_config.pad_token_id or 0)
    engine.start()
    if a.engine_profile:
        return engine_profile(a, engine, ckpt, work, payloads, hf, pad, spec)
    print(
        f"model {ckpt.name} on {device} {dtype}; {a.requests} requests, prompt tokens "
        f"{sum(len(i) for i, _ in work)}, output tokens {sum(n for _, n in work)}",
        flush=True,
    )

    greedy = greedy_check(hf, engine, work, payloads, pad)  # correctness first (warms up)
    print(f"greedy check: {greedy}", flush=True)

    out_tokens = sum(n for _, n in work)
    res: dict[str, list[float]] = {}
    prof: dict[int, dict] = {}

    def engine_runs(run: int) -> None:
        for c in a.concurrency:
            engine.profile = dict.fromkeys(engine.profile, 0.0)
            secs, _ = run_engine(engine, work, payloads, c)
            prof[c] = dict(engine.profile, wall_s=secs)
            res.setdefault(f"engine@{c}", []).append(out_tokens / secs)
            print(f"run {run}: engine @ {c}: {out_tokens / secs:.1f} tok/s", flush=True)

    def hf_runs(run: int) -> None:
        secs, _ = timed(lambda: [hf_generate(hf, [w], pad) for w in work], device)
        res.setdefault("hf_seq", []).append(out_tokens / secs)
        print(f"run {run}: HF one at a time: {out_tokens / secs:.1f} tok/s", flush=True)
        for c in a.concurrency:
            if c == 1:
                continue
            batches = [work[i : i + c] for i in range(0, len(work), c)]
            secs, _ = timed(lambda bs=batches: [hf_generate(hf, b, pad) for b in bs], device)
            res.setdefault(f"hf_pad@{c}", []).append(out_tokens / secs)
            print(f"run {run}: HF padded batch @ {c}: {out_tokens / secs:.1f} tok/s", flush=True)

    # NOTE: the order alternates run by run, so a slow drift of the machine's load
    # (shared hosts) does not always favour the same side; ratios are taken per run.
    for run in range(a.runs):
        for part in (engine_runs, hf_runs) if run % 2 == 0 else (hf_runs, engine_runs):
            part(run)
    engine.stop()
    if engine.runner.tp is not None:
        engine.runner.tp.workers.stop()
    # the compute floor both sides share: one prefill forward per prompt
    with torch.inference_mode():
        prefill_s, _ = timed(
            lambda: [hf(input_ids=torch.tensor([ids], device=device)) for ids, _ in work], device
        )

    med = {k: statistics.median(v) for k, v in res.items()}
    hw = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (
            f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        )
    )
    lines = [
        f"Model `{ckpt.name}` ({a.arch} {a.size}), {dtype}, on {hw}, engine at --tp {a.tp}; "
        f"{a.requests} requests, "
        f"prompts 64-512 tokens, outputs 16-{a.max_output} tokens ({out_tokens} in all); "
        f"median of {a.runs} runs (ratios: median of per-run ratios); greedy check {greedy}.",
        "",
        "| concurrency | engine tok/s | HF one-at-a-time tok/s | HF padded batch tok/s "
        "| engine / one-at-a-time | engine / padded |",
        "|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(num: str, den: str) -> float:  # median of per-run ratios
        return statistics.median(x / y for x, y in zip(res[num], res[den], strict=True))

    for c in a.concurrency:
        e, s = med[f"engine@{c}"], med["hf_seq"]
        pad_key = f"hf_pad@{c}" if c != 1 else "hf_seq"
        p = med[pad_key]
        lines.append(
            f"| {c} | {e:.1f} | {s:.1f} | {p:.1f} | {ratio(f'engine@{c}', 'hf_seq'):.2f}x "
            f"| {ratio(f'engine@{c}', pad_key):.2f}x |"
        )
    lines += ["", "Where the engine's time goes (last run; seconds of forward+sampling per step "
              "kind, host = scheduling, detokenization, streaming):", "",
              "| concurrency | wall s | prefill/mixed steps | their s | decode steps | their s "
              "| host s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for c, p in prof.items():
        lines.append(
            f"| {c} | {p['wall_s']:.1f} | {p['mixed_steps']:.0f} | {p['mixed_s']:.1f} "
            f"| {p['decode_steps']:.0f} | {p['decode_s']:.1f} | {p['host_s']:.1f} |"
        )
    lines += ["", f"HF forward over every prompt once (prefill only, no generation): "
              f"{prefill_s:.1f} s."]
    table = "\n".join(lines)
    print("\n" + table)
    a.out = a.out or str(ROOT / "bench" / "results" / "language.md")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(
            "# Language engine throughput (bench/language.py)\n\n" + table + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
