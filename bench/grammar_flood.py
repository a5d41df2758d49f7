"""Two clients flood the grammar compiler, a third is served (issue 41: the third client's
fresh schema p99 within 2x of unloaded). `python bench/grammar_flood.py [--flood probe]
[--calm 60] [--rounds 2]`; the table goes to bench/results/grammar-flood.md.

The language tier's compiler alone (`Grammars`, as the engine holds it: default limits,
2 shared slots and the light-only one), on the tiny qwen2_5_vl tokenizer, in this process:
- two flooding clients (a, b) each keep `--inflight` compiles going, each a new spec (no
  cache helps), sent as soon as the last ended:
  `probe`: the probe's enum, 4,000 values of 60 characters (refused at once by
  grammar_max_enum_chars);
  `cpu`: the same enum with the static limits raised, so each reaches a worker (~2 s of
  CPU on this vocabulary) and is refused at grammar_max_compile_cpu_s;
  `inlimit`: 1,500-value enums of 18 characters (under every limit: each is compiled,
  by its worker and again here);
- the calm client (c) compiles `--calm` small object schemas one after another, each new
  (a json_object-like response_format with its own property name), and we time each.
Phases alternate (calm alone, calm under the flood) for `--rounds` rounds; p50/p99 of the
calm client's compile latency per phase and the ratio flooded / unloaded are reported.
`--old PATH` runs against a single-module grammar.py of an earlier commit (the package was
one module up to 5325747; e.g. `git show 5325747~1:services/language/engine/grammar.py >
/tmp/old_grammar.py`): the comparison before a change.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import random
import statistics
import string
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CKPT = ROOT / ".cache" / "test-models"


def enum(seed: int, values: int, chars: int) -> str:
    rng = random.Random(seed)
    return json.dumps({"enum": ["".join(rng.choice(string.ascii_letters) for _ in range(chars))
                                for _ in range(values)]})


def small(i: int) -> str:
    return json.dumps({"type": "object", "properties": {f"name_{i}": {"type": "string"},
                                                        "n": {"type": "integer"}},
                       "required": [f"name_{i}", "n"]})


def load_grammar_module(path: str | None):
    if path is None:
        from tandem.services.language.engine import grammar
        return grammar
    # NOTE: imported by its own name from its folder, so the compile processes (forks of
    # a forkserver, which import a worker's module by name) find it too
    folder, name = os.path.split(os.path.abspath(path))
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")])
    return importlib.import_module(name.removesuffix(".py"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flood", choices=["probe", "cpu", "inlimit"], default="inlimit")
    ap.add_argument("--calm", type=int, default=60, help="calm compiles per phase")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--inflight", type=int, default=2, help="compiles each flooder keeps going")
    ap.add_argument("--old", help="path of an earlier single-module grammar.py to measure instead")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar-flood.md"))
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from tandem.sampling import GrammarKind, GrammarSpec

    gm = load_grammar_module(a.old)
    ckpt = next(p for p in sorted(CKPT.glob("qwen2_5_vl-tiny-*")) if p.is_dir())
    tok = AutoTokenizer.from_pretrained(ckpt)
    fields = {f.name for f in dataclasses.fields(gm.GrammarLimits)}
    roomy = dict(max_enum_values=100_000, max_enum_chars=1 << 20, max_spec_bytes=1 << 20)
    limits = gm.GrammarLimits(**{k: v for k, v in roomy.items() if k in fields}) \
        if a.flood == "cpu" else gm.GrammarLimits()
    g = gm.Grammars(tok, len(tok), (tok.eos_token_id,), limits)
    values, chars = (1500, 18) if a.flood == "inlimit" else (4000, 60)
    serial = iter(range(10**9))  # every flood spec is new
    lock = threading.Lock()
    outcomes = {"compiled": 0, "refused": 0}

    def spec(text: str) -> GrammarSpec:
        return GrammarSpec(GrammarKind.JSON_SCHEMA, text)

    def flood_specs() -> list[GrammarSpec]:
        """The phase's flood, made before it starts (making a 256 KB enum is the bench's
        CPU, not the compiler's): new specs, or for `probe` (refusals are not cached) a few
        sent again and again."""
        n = 8 if a.flood == "probe" else 48
        return [spec(enum(next(serial), values, chars)) for _ in range(n)]

    def flooder(client: str, specs: list[GrammarSpec], stop: threading.Event) -> None:
        i = 0
        while not stop.is_set():
            with lock:
                if a.flood != "probe" and not specs:
                    return
                s = specs[i % len(specs)] if a.flood == "probe" else specs.pop()
                i += 1
            try:
                g.compile(s, client).result(timeout=600)
                outcomes["compiled"] += 1
            except Exception:
                outcomes["refused"] += 1

    calm_serial = iter(range(10**9))

    stalls = {"unloaded": [], "flooded": []}

    def calm_phase(name: str) -> list[float]:
        """The calm client's compiles, timed; beside them a thread that wakes every
        millisecond records its longest wait (how long something held the GIL)."""
        done = threading.Event()

        def ticker():
            last, worst = time.perf_counter(), 0.0
            while not done.is_set():
                time.sleep(0.001)
                now = time.perf_counter()
                worst, last = max(worst, now - last), now
            stalls[name].append(worst * 1000)

        t = threading.Thread(target=ticker, daemon=True)
        t.start()
        took = []
        for _ in range(a.calm):
            s = spec(small(next(calm_serial)))
            t0 = time.perf_counter()
            g.compile(s, "c").result(timeout=600)
            took.append((time.perf_counter() - t0) * 1000)
        done.set()
        t.join()
        return took

    for i in range(5):  # warm-up: the forkserver and each slot's worker started
        g.compile(spec(small(-1 - i)), "c").result(timeout=600)
    phases = {"unloaded": [], "flooded": []}
    for _ in range(a.rounds):
        phases["unloaded"] += calm_phase("unloaded")
        stop = threading.Event()
        specs = {c: flood_specs() for c in ("a", "b")}
        threads = [threading.Thread(target=flooder, args=(c, specs[c], stop), daemon=True)
                   for c in ("a", "b") for _ in range(a.inflight)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the flood under way (its first specs in the workers)
        phases["flooded"] += calm_phase("flooded")
        stop.set()
        for t in threads:
            t.join()
    g.close()

    def q(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

    rows = {k: (q(v, 50), q(v, 99), statistics.mean(v)) for k, v in phases.items()}
    ratio = rows["flooded"][1] / rows["unloaded"][1]
    what = {"probe": "the probe's enum (4,000 x 60 characters; refused by its characters)",
            "cpu": "the probe's enum with the static limits raised (each refused at the CPU "
                   "bound in its worker)",
            "inlimit": "1,500-value enums of 18 characters (each compiled, in its worker "
                       "and here)"}[a.flood]
    code = a.old or "this checkout's grammar package"
    lines = [
        f"## Two clients flood the grammar compiler (bench/grammar_flood.py --flood {a.flood})",
        "",
        f"`Grammars` with {'raised static' if a.flood == 'cpu' else 'default'} limits, tiny "
        f"qwen2_5_vl tokenizer, {code}. Clients a and b each keep {a.inflight} compiles of "
        f"{what} going, new each time; the calm client c compiles {a.calm} new small object "
        f"schemas one after another per phase. {a.rounds} rounds; flood outcomes while c "
        f"ran: {outcomes['compiled']} compiled, {outcomes['refused']} refused. Host: "
        f"{os.cpu_count()} cores.",
        "",
        "| phase | calm compiles | p50 ms | p99 ms | mean ms | longest 1 ms tick ms |",
        "|---|---|---|---|---|---|",
    ]
    for k, (p50, p99, mean) in rows.items():
        lines.append(f"| {k} | {len(phases[k])} | {p50:.1f} | {p99:.1f} | {mean:.1f} | "
                     f"{max(stalls[k]):.1f} |")
    lines += ["", f"Calm client's p99 under the flood / unloaded: **{ratio:.2f}x** "
              f"(p50 {rows['flooded'][0] / rows['unloaded'][0]:.2f}x).", ""]
    text = "\n".join(lines)
    print(text)
    with open(a.out, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
