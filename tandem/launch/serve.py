"""`tandem serve MODEL [vLLM's flags]`: `vllm serve`'s command line, run as `tandem up`.

A vLLM user keeps their command: each flag below is mapped onto the cluster flag or the
tier that honours it, and the result is exactly the `tandem up` command that `--dry-run`
prints. A vLLM flag Tandem has no equivalent for is refused with what to use instead (never
a bare "unrecognized arguments"); `tandem up`'s own flags pass through as they are.

    vLLM flag                         goes to
    --host, --port                    tandem up --host, --http-port
    --api-key                         tandem up --api-key
    --served-model-name NAME          tandem up --served-model-name (the router's name)
    --tensor-parallel-size, -tp N     language --tp N
    --max-model-len N                 language --max-model-len N
    --dtype D                         encoder and language --dtype D (auto|float32|...)
    --chat-template T                 encoder and language --chat-template T (a file or
                                      the template itself)
    --gpu-memory-utilization F        language --kv-memory-fraction F
    --max-num-seqs N                  language --max-running-requests N
    --max-num-batched-tokens N        language --max-prefill-tokens N
    --[no-]enable-prefix-caching      language --[no-]prefix-cache
    --limit-mm-per-prompt '{"image": N, "video": M}'
                                      encoder --max-images-per-request N,
                                      --max-videos-per-request M
    --uvicorn-log-level L             tandem up --log-level L
    --seed N                          language --seed N (the seeds of requests that give
                                      none; a request's own `seed` wins)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Mapped:
    """Where a vLLM flag's value goes: the cluster (`up`) or a tier's extra flags."""

    to: str  # "up", "encoder", "language", "tiers" (encoder and language)
    flag: str  # the Tandem flag ("": `convert` returns the Tandem flags and values itself)
    convert: object = str  # value -> the Tandem value (str), or the flags when `flag` is ""


# vLLM's --limit-mm-per-prompt modality -> the encoder's limit
_MM_LIMITS = {"image": "--max-images-per-request", "video": "--max-videos-per-request"}


def _mm_limits(value: str) -> list[str]:
    try:
        limits = json.loads(value)
    except ValueError:  # vLLM's older `image=N,video=M` form
        limits = dict(kv.split("=", 1) for kv in value.split(",") if "=" in kv)
    if not isinstance(limits, dict) or not limits or set(limits) - set(_MM_LIMITS):
        raise ValueError(f"{value!r}: limits for {sorted(_MM_LIMITS)} are served "
                         "('{\"image\": N, \"video\": M}')")
    out = []
    for kind, n in limits.items():
        if isinstance(n, dict):  # vLLM's newer per-modality options: the count alone
            n = n.get("count")
        if not isinstance(n, int | str) or not str(n).isdigit():
            raise ValueError(f"{value!r}: the {kind} limit must be a count")
        out += [_MM_LIMITS[kind], str(int(n))]
    return out


MAPPED: dict[str, Mapped] = {
    "--host": Mapped("up", "--host"),
    "--port": Mapped("up", "--http-port"),
    "--api-key": Mapped("up", "--api-key"),
    "--served-model-name": Mapped("up", "--served-model-name"),
    "--uvicorn-log-level": Mapped("up", "--log-level", lambda v: "debug" if v == "trace" else v),
    "--tensor-parallel-size": Mapped("language", "--tp"),
    "-tp": Mapped("language", "--tp"),
    "--max-model-len": Mapped("language", "--max-model-len"),
    "--dtype": Mapped("tiers", "--dtype"),
    "--chat-template": Mapped("tiers", "--chat-template"),
    "--gpu-memory-utilization": Mapped("language", "--kv-memory-fraction"),
    "--max-num-seqs": Mapped("language", "--max-running-requests"),
    "--max-num-batched-tokens": Mapped("language", "--max-prefill-tokens"),
    "--limit-mm-per-prompt": Mapped("encoder", "", _mm_limits),
    "--seed": Mapped("language", "--seed"),
}
SWITCHES: dict[str, tuple[str, str]] = {  # a flag without a value -> (tier, its flag)
    "--enable-prefix-caching": ("language", "--prefix-cache"),
    "--no-enable-prefix-caching": ("language", "--no-prefix-cache"),
}
# vLLM flags with no Tandem equivalent, and what to do instead.
HINTS: dict[str, str] = {
    "--pipeline-parallel-size": "only tensor parallelism is served "
    "(--tensor-parallel-size)",
    "--quantization": "checkpoints are served in --dtype (float32, bfloat16, float16); "
    "quantized weights are not",
    "--kv-cache-dtype": "the KV cache uses the model's --dtype",
    "--trust-remote-code": "not needed: the supported architectures (Qwen2.5-VL, Qwen3-VL, "
    "Qwen3-VL-MoE) are built in",
    "--enable-chunked-prefill": "prefill is always chunked (--max-num-batched-tokens "
    "bounds a step)",
    "--enforce-eager": "pass --language-args '--cuda-graph-max-bs 0' (and --encoder-args "
    "'--cuda-graph-max 0')",
    "--block-size": "pass --language-args '--kv-page-size N'",
    "--swap-space": "a request that no longer fits is recomputed, never swapped",
    "--tokenizer": "the checkpoint's own tokenizer is used",
    "--revision": "download the revision first (`hf download ID --revision R`) and pass "
    "its directory",
    "--download-dir": "set HF_HOME, or pass a downloaded directory",
    "--enable-auto-tool-choice": "tools are always on (tool_choice auto|required|named)",
    "--tool-call-parser": "tool calls are parsed from the model's <tool_call> blocks",
    "--lora-modules": "LoRA adapters are not served",
    "--enable-lora": "LoRA adapters are not served",
    "--disable-log-requests": "one log line per request, at INFO: --log-level warning "
    "hides it",
    "--max-logprobs": "top_logprobs is bounded at 20",
    "--otlp-traces-endpoint": "set OTEL_EXPORTER_OTLP_TRACES_ENDPOINT in the environment: "
    "every tier reads it (docs/deploy.md, Tracing)",
    "--collect-detailed-traces": "every stage of every tier is traced once tracing is on "
    "(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; docs/deploy.md, Tracing)",
}


def _up_flags() -> set[str]:
    """Every option string `tandem up`'s own parser takes."""
    from tandem.launch.plan import parser

    return {s for a in parser()._actions for s in a.option_strings}


def usage() -> str:
    return ("usage: tandem serve MODEL [vLLM flags] [tandem up flags] [--dry-run]\n\n"
            + __doc__.split("\n\n", 2)[2].rstrip() + "\n\nAny `tandem up` flag passes "
            "through as it is (`tandem up --help`); --encoders N and --languages N split "
            "the tiers. --dry-run prints the `tandem up` command instead of running it.")


class ServeError(ValueError):
    """A command line that cannot be served as asked; the message says what to do."""


def translate(argv: list[str]) -> list[str]:
    """`tandem serve` arguments -> `tandem up` arguments (ServeError on a refused flag)."""
    if not argv or argv[0].startswith("-"):
        raise ServeError("the model comes first: tandem serve MODEL [flags]")
    up = ["--model", argv[0]]
    tier: dict[str, list[str]] = {"encoder": [], "language": []}
    given: dict[str, list[str]] = {"encoder": [], "language": []}  # --<tier>-args: last wins
    rest = list(argv[1:])
    ray = any(a == "--ray" or a.startswith("--ray=") for a in rest)  # ray_up.py judges its own
    while rest:
        arg = rest.pop(0)
        name, eq, inline = arg.partition("=")
        kind = name.removeprefix("--").removesuffix("-args")
        if kind in given and name.endswith("-args"):
            if not eq and not rest:
                raise ServeError(f"{name} needs a value")
            given[kind] = shlex.split(inline if eq else rest.pop(0))
            continue
        if name in SWITCHES:
            kind, flag = SWITCHES[name]
            tier[kind].append(flag)
            continue
        if name in HINTS:
            raise ServeError(f"{name} (vLLM) has no equivalent here: {HINTS[name]}")
        if name not in MAPPED:
            if name.startswith("-") and name not in _up_flags() and not ray:
                raise ServeError(f"{name} is neither a vLLM flag mapped here nor a `tandem up` "
                                 "flag: `tandem serve --help` lists the vLLM flags, `tandem up "
                                 "--help` the rest; a tier's own flag goes through "
                                 "--encoder-args/--language-args/--router-args")
            up.append(arg)  # a `tandem up` flag, or its value; `tandem up` judges it
            continue
        if not eq and not rest:
            raise ServeError(f"{name} needs a value")
        value = inline if eq else rest.pop(0)
        m = MAPPED[name]
        try:
            value = m.convert(value)
        except ValueError as e:
            raise ServeError(f"{name}: {e}") from None
        flags = value if not m.flag else [m.flag, value]
        if m.to == "up":
            up += flags
        for kind in ("encoder", "language"):
            if m.to in (kind, "tiers"):
                tier[kind] += flags
    for kind, flags in tier.items():
        if flags or given[kind]:  # the caller's own tier flags after the mapped ones
            up.append(f"--{kind}-args={shlex.join(flags + given[kind])}")
    return up


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    dry = "--dry-run" in argv
    try:
        up = translate([a for a in argv if a != "--dry-run"])
    except ServeError as e:
        print(f"tandem serve: {e}", file=sys.stderr)
        return 2
    if dry:
        print(shlex.join(["tandem", "up", *up]))
        return 0
    from tandem.launch import up as launch

    return launch(up)


def parse(argv: list[str]) -> argparse.Namespace:
    """The `tandem up` arguments `tandem serve argv` runs with (for tests and --dry-run)."""
    from tandem.launch.plan import parse_args

    return parse_args(translate(argv))
