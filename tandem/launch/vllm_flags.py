"""The fate of every `vllm serve` flag under `tandem serve`: one table, read by serve.py to
translate a command line, by `tandem serve --help`, and rendered into docs/serve.md (a test
keeps that copy equal to `markdown_table()`).

Each row is a `Flag`: vLLM's spellings, how many values it takes, and its `Fate`:

    MAPPED    its value goes to the Tandem flag(s) that honour it (`apply` says which)
    ACCEPTED  it changes nothing here: the launch goes on and prints one notice line (why)
    REFUSED   it cannot be honoured: `tandem serve` exits 2 with the reason

A row's `apply` may also refuse one value of an otherwise accepted or mapped flag
(`--kv-cache-dtype fp8`, `--pipeline-parallel-size 2`, `--tool-call-parser mistral`) by
raising `Refused`. A flag in no row is refused too (serve.py names where to look), so no
vLLM flag is ever dropped without a word.

Value forms follow vLLM's parser: `--dtype half` (its aliases), `--max-model-len 32k`
(`human_int`: k/m/g decimal, K/M/G binary), `--flag.key value` for the JSON-valued flags
(`--limit-mm-per-prompt.image 2`), `--served-model-name a b` (several values).
"""

from __future__ import annotations

import enum
import json
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass


class Fate(enum.Enum):
    MAPPED = "mapped"
    ACCEPTED = "accepted"
    REFUSED = "refused"


class Arity(enum.Enum):
    SWITCH = "switch"  # no value: `--enforce-eager`
    ONE = "one"  # one value: `--dtype half`, `--dtype=half`
    SEVERAL = "several"  # one or more, up to the next flag: `--served-model-name a b`


class To(enum.Enum):
    """Where a Tandem flag goes: `tandem up` itself, or one tier's extra flags."""

    UP = "tandem up"
    ENCODER = "encoder"
    LANGUAGE = "language"
    ROUTER = "router"


@dataclass(frozen=True)
class Put:
    """Tandem flags (with their values) for one destination."""

    to: To
    flags: tuple[str, ...]


@dataclass(frozen=True)
class Effect:
    """What one occurrence of a vLLM flag does: the Tandem flags it sets, and a notice line
    when it does less (or other) than its vLLM meaning and the user should know."""

    puts: tuple[Put, ...] = ()
    notice: str = ""


class Refused(ValueError):
    """A value this flag cannot be honoured with; the message is the reason."""


Apply = Callable[[tuple[str, ...]], Effect]


@dataclass(frozen=True)
class Flag:
    """One row of the table.

    `text` is what the user reads: for MAPPED where the value goes (as `--help` and the
    docs show it), for ACCEPTED the notice printed at launch, for REFUSED the reason.
    `apply` turns the values into an Effect: required for MAPPED, optional for ACCEPTED (a
    check that refuses the values it cannot honour), absent for REFUSED. `dotted`: vLLM's
    `--flag.key value` form is taken for this JSON-valued flag (apply gets the JSON)."""

    names: tuple[str, ...]
    arity: Arity
    fate: Fate
    text: str
    apply: Apply | None = None
    dotted: bool = False
    example: tuple[str, ...] = ()  # values a test launches it with (and the docs show)

    def __post_init__(self) -> None:
        if self.fate is Fate.MAPPED:
            assert self.apply is not None, self.names
        if self.fate is Fate.REFUSED:
            assert self.apply is None, self.names
        # a value for every flag that takes one and may launch (tests run each row with it)
        wants_example = self.arity is not Arity.SWITCH and self.fate is not Fate.REFUSED
        assert wants_example == bool(self.example), self.names


# -- value forms -------------------------------------------------------------------------

_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(value: str) -> int:
    """vLLM's `human_readable_int`: `32k` = 32000, `32K` = 32768 (lower case decimal, upper
    case binary), `25.6k` = 25600; a binary suffix takes no decimals; a bare integer as is."""
    m = _HUMAN.fullmatch(value.strip())
    if not m:
        return _int(value)
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise Refused(f"{value!r}: a binary suffix ({suffix}) takes a whole number "
                      f"(did you mean {number}{suffix.lower()}?)")
    return int(number) * _BINARY[suffix]


def _int(value: str, lo: int | None = None) -> int:
    try:
        n = int(value)
    except ValueError:
        raise Refused(f"{value!r} is not an integer") from None
    if lo is not None and n < lo:
        raise Refused(f"{n} is below {lo}")
    return n


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise Refused(f"{value!r} is not a number") from None


# vLLM's --dtype choices -> the tiers' dtype names
DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
          "float": "float32", "float32": "float32"}


def _json(value: str) -> object:
    try:
        return json.loads(value)
    except ValueError:
        return value


def dotted_json(key: str, value: str) -> str:
    """`--flag.a.b value` as vLLM reads it: `--flag '{"a": {"b": value}}'`, the value JSON
    where it parses as JSON (`2`, `true`) and a string otherwise."""
    out: object = _json(value)
    for part in reversed(key.split(".")):
        out = {part: out}
    return json.dumps(out)


def _object(value: str) -> dict[str, object]:
    obj = _json(value)
    if not isinstance(obj, dict) or not obj:
        raise Refused(f"{value!r} is not a JSON object")
    return obj


# -- effects -----------------------------------------------------------------------------


def to(dest: To, *flags: str, notice: str = "") -> Effect:
    return Effect((Put(dest, flags),), notice)


def tiers(*flags: str) -> Effect:
    """The same flags for both model tiers (the encoder and the language instances)."""
    return Effect((Put(To.ENCODER, flags), Put(To.LANGUAGE, flags)))


def passes(flag: str, dest: To, convert: Callable[[str], object] = str) -> Apply:
    """The one value, converted (a Refused for a bad one), to `flag` at `dest`."""
    return lambda v: to(dest, flag, str(convert(v[0])))


def only(*values: str, why: str) -> Apply:
    """An accepted flag whose other values cannot be honoured."""
    def check(v: tuple[str, ...]) -> Effect:
        if v[0] not in values:
            raise Refused(why)
        return Effect()
    return check


def _dtype(v: tuple[str, ...]) -> Effect:
    if v[0] not in DTYPES:
        raise Refused(f"{v[0]!r}: one of {', '.join(DTYPES)}")
    return tiers("--dtype", DTYPES[v[0]])


def _max_model_len(v: tuple[str, ...]) -> Effect:
    if v[0].strip().lower() in ("auto", "-1"):
        raise Refused("fitting the length to free memory is not done here: leave the flag "
                      "out for the checkpoint's own limit, or give a number")
    n = human_int(v[0])
    if n < 1:
        raise Refused(f"{n} is below 1")
    return to(To.LANGUAGE, "--max-model-len", str(n))


# vLLM's --limit-mm-per-prompt modality -> the encoder's limit
MM_LIMITS = {"image": "--max-images-per-request", "video": "--max-videos-per-request"}


def _mm_limits(v: tuple[str, ...]) -> Effect:
    value = v[0]
    try:
        limits = json.loads(value)
    except ValueError:  # vLLM's older `image=N,video=M` form
        limits = dict(kv.split("=", 1) for kv in value.split(",") if "=" in kv)
    if not isinstance(limits, dict) or not limits or set(limits) - set(MM_LIMITS):
        raise Refused(f"{value!r}: limits for {sorted(MM_LIMITS)} are served "
                      "('{\"image\": N, \"video\": M}' or --limit-mm-per-prompt.image N)")
    flags: list[str] = []
    for kind, n in limits.items():
        if isinstance(n, dict):  # vLLM's newer per-modality options: the count alone
            n = n.get("count")
        if not isinstance(n, int | str) or not str(n).isdigit():
            raise Refused(f"{value!r}: the {kind} limit must be a count")
        flags += [MM_LIMITS[kind], str(int(n))]
    return to(To.ENCODER, *flags)


# Qwen-VL's processor kwargs -> the encoder's resize bounds (the ones it reads; another
# key would change preprocessing in a way the encoder cannot follow)
MM_PROCESSOR_KWARGS = {"min_pixels": "--min-pixels", "max_pixels": "--max-pixels"}


def _mm_processor_kwargs(v: tuple[str, ...]) -> Effect:
    kwargs = _object(v[0])
    unknown = set(kwargs) - set(MM_PROCESSOR_KWARGS)
    if unknown:
        raise Refused(f"{sorted(unknown)}: only {sorted(MM_PROCESSOR_KWARGS)} are read here "
                      "(the encoder's --min-pixels/--max-pixels)")
    flags: list[str] = []
    for key, n in kwargs.items():
        flags += [MM_PROCESSOR_KWARGS[key], str(_int(str(n), 0))]
    return to(To.ENCODER, *flags)


def _served_names(v: tuple[str, ...]) -> Effect:
    """The first name is the model's name in the API; the others are aliases the router
    answers to as well (in `model` and /v1/models), as vLLM's several names are."""
    if any("," in name for name in v):
        raise Refused("a served name cannot hold a comma")
    puts = [Put(To.UP, ("--served-model-name", v[0]))]
    if len(v) > 1:
        puts.append(Put(To.ROUTER, ("--model-aliases", ",".join(v[1:]))))
    return Effect(tuple(puts))


def _api_key(v: tuple[str, ...]) -> Effect:
    if len(v) > 1:
        raise Refused("one key on the command line; several keys: a keys file, "
                      "--router-args '--api-keys-file FILE' (docs/deploy.md)")
    return to(To.UP, "--api-key", v[0])


def _uvicorn_log_level(v: tuple[str, ...]) -> Effect:
    levels = ("critical", "error", "warning", "info", "debug", "trace")
    if v[0] not in levels:
        raise Refused(f"{v[0]!r}: one of {', '.join(levels)}")
    return to(To.UP, "--log-level", "debug" if v[0] == "trace" else v[0])


def _port(v: tuple[str, ...]) -> Effect:
    port = _int(v[0], 1)
    if port > 65535:
        raise Refused(f"{port} is not a port")
    return to(To.UP, "--http-port", str(port))


def _data_parallel(v: tuple[str, ...]) -> Effect:
    n = _int(v[0], 1)
    notice = "" if n == 1 else (
        f"{n} language instances, each on the device --device picks (the first GPU for "
        "'auto'): `tandem up` does not spread them over GPUs; `tandem up --ray` gives "
        "each its own")
    return to(To.UP, "--languages", str(n), notice=notice)


def _pipeline_parallel(v: tuple[str, ...]) -> Effect:
    if _int(v[0], 1) != 1:
        raise Refused("pipeline parallelism is not served; split a model with "
                      "--tensor-parallel-size")
    return Effect()


def _max_logprobs(v: tuple[str, ...]) -> Effect:
    if _int(v[0]) != 20:
        raise Refused("top_logprobs is bounded at 20 here, vLLM's default, and no setting "
                      "changes that bound yet (tandem/sampling.py MAX_TOP_LOGPROBS)")
    return Effect()


def _reasoning_parser(v: tuple[str, ...]) -> Effect:
    if v[0] != "qwen3":
        raise Refused(f"{v[0]!r}: qwen3 only (<think>...</think>, the Qwen3 family's "
                      "markers), services/router/reasoning.py")
    return Effect((Put(To.ROUTER, ("--reasoning-parser", v[0])),))


def _device(v: tuple[str, ...]) -> Effect:
    if v[0] not in ("auto", "cuda", "cpu"):
        raise Refused(f"{v[0]!r}: the tiers run on cuda or cpu ('auto' picks)")
    return tiers("--device", v[0])


def _structured_outputs(v: tuple[str, ...]) -> Effect:
    config = _object(v[0])
    if set(config) != {"backend"} or config["backend"] not in ("auto", "xgrammar"):
        raise Refused("structured output is compiled with xgrammar here; the backend "
                      "(auto|xgrammar) is the one setting taken")
    return Effect()


# -- the table ---------------------------------------------------------------------------

M, A, R = Fate.MAPPED, Fate.ACCEPTED, Fate.REFUSED
SW, ONE, SEV = Arity.SWITCH, Arity.ONE, Arity.SEVERAL
_NOTHING = "changes nothing here"  # the start of most ACCEPTED texts
_LORA = "LoRA adapters are not served"
_DP_MULTI = ("multi-node data parallelism is not served: one `tandem up --ray ADDRESS` "
             "places every instance over a Ray cluster (--data-parallel-size N: N language "
             "instances)")
_CORS = "the router sends no CORS headers; answer browsers' preflights in a proxy in front"
_TLS = ("the router's HTTP port speaks plain HTTP: terminate TLS in a proxy in front "
        "(docs/deploy.md)")
_SCHED = f"{_NOTHING}: vLLM's scheduler tuning; the language tier schedules on its own"

TABLE: tuple[Flag, ...] = (
    # -- the API server
    Flag(("--host",), ONE, M, "tandem up --host", passes("--host", To.UP), example=("0.0.0.0",)),
    Flag(("--port",), ONE, M, "tandem up --http-port; the gRPC port moves with it (HTTP port "
         "+ 42051, as 8000 and 50051; past 65535 it wraps to 1024 and up) unless "
         "--grpc-port is given", _port, example=("9001",)),
    Flag(("--api-key",), SEV, M, "tandem up --api-key (one key; several: --router-args "
         "'--api-keys-file FILE')", _api_key, example=("k",)),
    Flag(("--served-model-name",), SEV, M, "tandem up --served-model-name (the first name); "
         "the router answers to the others too (--model-aliases)", _served_names,
         example=("qwen-vl", "qwen")),
    Flag(("--uvicorn-log-level",), ONE, M, "tandem up --log-level (trace: debug)",
         _uvicorn_log_level, example=("warning",)),
    Flag(("--disable-log-requests",), SW, M, "tandem up --log-level warning: the per-request "
         "lines are INFO", lambda v: to(To.UP, "--log-level", "warning", notice=(
             "every tier logs at warning, which hides the per-request lines (INFO) and the "
             "tiers' other INFO lines with them"))),
    Flag(("--enable-log-requests",), SW, A, "one line per request is logged at INFO (the "
         "default --log-level)"),
    Flag(("--disable-log-stats",), SW, A, f"{_NOTHING}: no periodic stats lines are logged; "
         "every tier's /metrics has the numbers"),
    Flag(("--disable-uvicorn-access-log",), SW, A, f"{_NOTHING}: the router keeps no access "
         "log"),
    Flag(("--disable-fastapi-docs",), SW, A, f"{_NOTHING}: the router serves no /docs pages"),
    Flag(("--enable-request-id-headers",), SW, A, f"{_NOTHING}: X-Request-Id is always "
         "answered"),
    Flag(("--disable-frontend-multiprocessing",), SW, A, f"{_NOTHING}: the router is its own "
         "process"),
    Flag(("--max-log-len",), ONE, A, f"{_NOTHING}: prompts and outputs are never logged",
         example=("100",)),
    Flag(("--api-server-count",), ONE, A, "1 only: one router process serves the API",
         only("1", why="one router process serves the API"), example=("1",)),
    Flag(("--response-role",), ONE, A, "assistant only: replies are in that role",
         only("assistant", why="replies are in the role 'assistant'"),
         example=("assistant",)),
    Flag(("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs"), ONE, R,
         _TLS),
    Flag(("--enable-ssl-refresh",), SW, R, _TLS),
    Flag(("--allowed-origins", "--allowed-methods", "--allowed-headers"), ONE, R, _CORS),
    Flag(("--allow-credentials",), SW, R, _CORS),
    Flag(("--root-path",), ONE, R, "the API is served at /; mount it under a prefix in a proxy"),
    Flag(("--middleware",), ONE, R, "the router takes no ASGI middleware"),
    Flag(("--log-config-file",), ONE, R, "logging is configured by --log-level and each "
         "tier's --log-format (text|json)"),
    Flag(("--config",), ONE, R, "a YAML file of flags is not read: put them on the command "
         "line"),
    Flag(("--headless",), SW, R, _DP_MULTI),
    # -- the model and its weights
    Flag(("--trust-remote-code",), SW, A, f"{_NOTHING}: the supported architectures "
         "(Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) are built in; no checkpoint code runs"),
    Flag(("--dtype",), ONE, M, "encoder and language --dtype (half: float16, float: "
         "float32, bfloat16, auto)", _dtype, example=("half",)),
    Flag(("--max-model-len",), ONE, M, "language --max-model-len (32k = 32000, 32K = 32768)",
         _max_model_len, example=("32k",)),
    Flag(("--chat-template",), ONE, M, "encoder and language --chat-template (a file or the "
         "template itself)", lambda v: tiers("--chat-template", v[0]),
         example=("{{ messages[0]['content'] }}",)),
    Flag(("--seed",), ONE, M, "language --seed (the seeds of requests that give none)",
         passes("--seed", To.LANGUAGE, lambda s: _int(s, 0)), example=("7",)),
    Flag(("--device",), ONE, M, "encoder and language --device (auto|cuda|cpu)", _device,
         example=("cpu",)),
    Flag(("--load-format",), ONE, A, "auto, safetensors only: safetensors checkpoints are "
         "loaded",
         only("auto", "safetensors", why="only safetensors checkpoints load; `tandem "
              "tiny-model` writes random weights"), example=("safetensors",)),
    Flag(("--tokenizer-mode",), ONE, A, "auto, hf only: the checkpoint's own (fast) "
         "tokenizer is used",
         only("auto", "hf", why="the checkpoint's own (fast) tokenizer is used"),
         example=("auto",)),
    Flag(("--model-impl",), ONE, A, f"{_NOTHING}: the tiers run their own implementation of "
         "the architecture", example=("auto",)),
    Flag(("--task", "--runner"), ONE, A, "auto, generate only: the model generates text",
         only("auto", "generate", why="only generation is served"), example=("generate",)),
    Flag(("--generation-config",), ONE, A, "vllm only: the checkpoint's "
         "generation_config.json gives its EOS tokens, not the requests' sampling defaults",
         only("vllm", why="the checkpoint's generation_config.json sampling defaults are not "
              "applied here: a request's own values (or OpenAI's defaults) are; "
              "--generation-config vllm is what runs"), example=("vllm",)),
    Flag(("--disable-sliding-window", "--disable-cascade-attn"), SW, A,
         f"{_NOTHING}: the supported models use neither"),
    Flag(("--max-parallel-loading-workers",), ONE, A, f"{_NOTHING}: each tier loads its own "
         "shards", example=("2",)),
    Flag(("--use-tqdm-on-load",), SW, A, f"{_NOTHING}: the tiers log their loading"),
    Flag(("--quantization", "-q"), ONE, R, "checkpoints are served in --dtype (float32, "
         "bfloat16, float16); quantized weights are not"),
    Flag(("--tokenizer",), ONE, R, "the checkpoint's own tokenizer is used (leave the flag "
         "out)"),
    Flag(("--revision", "--code-revision", "--tokenizer-revision"), ONE, R, "download the "
         "revision first (`hf download ID --revision R`) and pass its directory"),
    Flag(("--download-dir",), ONE, R, "set HF_HOME, or pass a downloaded directory"),
    Flag(("--hf-token",), ONE, R, "set HF_TOKEN in the environment, or pass a downloaded "
         "directory"),
    Flag(("--hf-config-path", "--hf-overrides", "--rope-scaling", "--rope-theta"), ONE, R,
         "the checkpoint's config.json is read as it is", dotted=True),
    Flag(("--skip-tokenizer-init",), SW, R, "the tiers tokenize and detokenize themselves"),
    Flag(("--enable-prompt-embeds",), SW, R, "prompts are text, images and video"),
    Flag(("--enable-sleep-mode",), SW, R, "the tiers cannot release their memory while "
         "running"),
    Flag(("--logprobs-mode",), ONE, R, "logprobs are the final distribution's (vLLM's "
         "default); no other mode is served"),
    Flag(("--logits-processors",), SEV, R, "custom logits processors are not loaded"),
    Flag(("--logits-processor-pattern",), ONE, R, "custom logits processors are not loaded"),
    Flag(("--override-generation-config",), ONE, R, "server-side sampling defaults are not "
         "set: requests carry their own", dotted=True),
    # -- parallelism
    Flag(("--tensor-parallel-size", "-tp"), ONE, M, "language --tp",
         passes("--tp", To.LANGUAGE, lambda s: _int(s, 1)), example=("2",)),
    Flag(("--data-parallel-size", "-dp"), ONE, M, "tandem up --languages N (N language "
         "instances behind the router)", _data_parallel, example=("2",)),
    Flag(("--pipeline-parallel-size", "-pp"), ONE, A, "1 only: one pipeline stage",
         _pipeline_parallel, example=("1",)),
    Flag(("--distributed-executor-backend",), ONE, A, f"{_NOTHING}: tensor-parallel ranks "
         "are processes of their language instance (`tandem up --ray` runs the tiers as Ray "
         "actors)", example=("mp",)),
    Flag(("--disable-custom-all-reduce",), SW, A, f"{_NOTHING}: tensor-parallel ranks reduce "
         "with NCCL's own all-reduce"),
    Flag(("--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port",
          "--data-parallel-rank", "--data-parallel-start-rank", "--data-parallel-backend"),
         ONE, R, _DP_MULTI),
    Flag(("--enable-expert-parallel", "--enable-eplb"), SW, R, "expert parallelism is not "
         "served: --tensor-parallel-size splits the experts"),
    # -- the KV cache and the scheduler
    Flag(("--gpu-memory-utilization",), ONE, M, "language --kv-memory-fraction (the share of "
         "the memory free after the weights, for the KV pool)",
         passes("--kv-memory-fraction", To.LANGUAGE, _float), example=("0.8",)),
    Flag(("--block-size",), ONE, M, "language --kv-page-size",
         passes("--kv-page-size", To.LANGUAGE, lambda s: _int(s, 1)), example=("32",)),
    Flag(("--num-gpu-blocks-override",), ONE, M, "language --kv-pages",
         passes("--kv-pages", To.LANGUAGE, lambda s: _int(s, 1)), example=("512",)),
    Flag(("--max-num-seqs",), ONE, M, "language --max-running-requests",
         passes("--max-running-requests", To.LANGUAGE, lambda s: _int(s, 1)),
         example=("48",)),
    Flag(("--max-num-batched-tokens",), ONE, M, "language --max-prefill-tokens (8k = 8000)",
         passes("--max-prefill-tokens", To.LANGUAGE, human_int), example=("2k",)),
    Flag(("--enable-prefix-caching",), SW, M, "language --prefix-cache",
         lambda v: to(To.LANGUAGE, "--prefix-cache")),
    Flag(("--no-enable-prefix-caching",), SW, M, "language --no-prefix-cache",
         lambda v: to(To.LANGUAGE, "--no-prefix-cache")),
    Flag(("--enforce-eager",), SW, M, "language --cuda-graph-max-bs 0 --compile-step off, "
         "encoder --cuda-graph-max-patches 0 (no CUDA graphs, no compiled CPU step; flex "
         "attention stays compiled)",
         lambda v: Effect((Put(To.LANGUAGE, ("--cuda-graph-max-bs", "0",
                                                  "--compile-step", "off")),
                           Put(To.ENCODER, ("--cuda-graph-max-patches", "0"))))),
    Flag(("--scheduling-policy",), ONE, M, "language --schedule-policy (fcfs|priority)",
         passes("--schedule-policy", To.LANGUAGE), example=("priority",)),
    Flag(("--enable-chunked-prefill", "--no-enable-chunked-prefill"), SW, A,
         f"{_NOTHING}: prefill is always chunked, at --max-num-batched-tokens per step "
         "(outputs do not depend on it)"),
    Flag(("--kv-cache-dtype",), ONE, A, "auto only: the KV cache is in the model's --dtype",
         only("auto", why="the KV cache is in the model's --dtype; fp8 KV is not served"),
         example=("auto",)),
    Flag(("--calculate-kv-scales",), SW, A, f"{_NOTHING}: KV scales are for fp8 KV caches, "
         "which are not served"),
    Flag(("--swap-space",), ONE, A, f"{_NOTHING}: a request that no longer fits is "
         "recomputed, never swapped", example=("4",)),
    Flag(("--prefix-caching-hash-algo",), ONE, A, f"{_NOTHING}: prefix pages are keyed by "
         "Tandem's own hash of token ids and image hashes", example=("sha256",)),
    Flag(("--max-seq-len-to-capture",), ONE, A, f"{_NOTHING}: decode graphs are captured "
         "by batch size (language --cuda-graph-max-bs)", example=("8192",)),
    Flag(("--max-num-partial-prefills", "--max-long-partial-prefills",
          "--long-prefill-token-threshold", "--num-lookahead-slots", "--scheduler-delay-factor",
          "--num-scheduler-steps", "--preemption-mode"), ONE, A, _SCHED, example=("1",)),
    Flag(("--async-scheduling", "--multi-step-stream-outputs"), SW, A, _SCHED),
    Flag(("--compilation-config", "-O"), ONE, A, f"{_NOTHING}: the tiers choose their own "
         "kernels and graphs (--enforce-eager turns CUDA graphs and the compiled CPU step "
         "off; language --compile-step decode or all turns the latter on)", dotted=True,
         example=("3",)),
    Flag(("--cpu-offload-gb",), ONE, R, "weights stay on the device; offloading is not "
         "served"),
    Flag(("--kv-cache-memory-bytes",), ONE, R, "the KV pool is sized by "
         "--gpu-memory-utilization or --num-gpu-blocks-override"),
    Flag(("--speculative-config",), ONE, R, "speculative decoding is not served",
         dotted=True),
    Flag(("--kv-transfer-config", "--kv-events-config"), ONE, R, "vLLM's KV connectors are "
         "not served: Tandem moves KV pages with its own transfer (`tandem up --prefill N "
         "--decode M` splits prefill and decode; `tandem serve` does not yet)", dotted=True),
    # -- multimodal input
    Flag(("--limit-mm-per-prompt",), ONE, M, "encoder --max-images-per-request, "
         "--max-videos-per-request ('{\"image\": N, \"video\": M}', image=N,video=M or "
         "--limit-mm-per-prompt.image N)", _mm_limits, dotted=True,
         example=('{"image": 3, "video": 2}',)),
    Flag(("--mm-processor-kwargs",), ONE, M, "encoder --min-pixels, --max-pixels (the keys "
         "min_pixels, max_pixels)", _mm_processor_kwargs, dotted=True,
         example=('{"max_pixels": 1003520}',)),
    Flag(("--allowed-media-domains",), SEV, M, "encoder --allowed-url-hosts (without it no "
         "media URL is fetched)", lambda v: to(To.ENCODER, "--allowed-url-hosts", ",".join(v)),
         example=("example.com", "images.example.org")),
    Flag(("--mm-processor-cache-gb",), ONE, A, f"{_NOTHING}: the encoder caches embeddings "
         "(encoder --cache-bytes)", example=("4",)),
    Flag(("--disable-mm-preprocessor-cache",), SW, A, f"{_NOTHING}: the encoder caches "
         "embeddings (encoder --cache-bytes 0 turns that off)"),
    Flag(("--mm-encoder-tp-mode",), ONE, A, f"{_NOTHING}: each encoder runs a whole vision "
         "tower (encoder --devices spreads batches over several)", example=("data",)),
    Flag(("--skip-mm-profiling", "--interleave-mm-strings"), SW, A, f"{_NOTHING}: vLLM's "
         "multimodal profiling and string prompts"),
    Flag(("--allowed-local-media-path",), ONE, M, "encoder --allowed-local-media-path "
         "(file:// images and videos under that directory, symlinks resolved)",
         passes("--allowed-local-media-path", To.ENCODER), example=("/tmp",)),
    Flag(("--media-io-kwargs",), ONE, R, "media loading options are the encoder's own "
         "(video: docs/video.md)", dotted=True),
    # -- tools, reasoning, structured output
    Flag(("--max-logprobs",), ONE, A, "20 only (vLLM's default): top_logprobs is bounded "
         "at 20", _max_logprobs, example=("20",)),
    Flag(("--enable-auto-tool-choice",), SW, A, f"{_NOTHING}: tools are always on "
         "(tool_choice auto|required|named)"),
    Flag(("--tool-call-parser",), ONE, A, "hermes only: tool calls are parsed from the "
         "model's <tool_call> JSON blocks, hermes's format",
         only("hermes", why="tool calls are parsed from <tool_call> JSON blocks (hermes's "
              "format) only"), example=("hermes",)),
    Flag(("--exclude-tools-when-tool-choice-none",), SW, A, f"{_NOTHING}: tool_choice none "
         "never renders the tools"),
    Flag(("--tool-parser-plugin",), ONE, R, "tool parser plugins are not loaded"),
    Flag(("--reasoning-parser",), ONE, M, "qwen3 only: the router's --reasoning-parser "
         "(the thinking in reasoning_content and delta.reasoning_content)",
         _reasoning_parser, example=("qwen3",)),
    Flag(("--enable-reasoning",), SW, A, f"{_NOTHING}: the split is on whenever "
         "--reasoning-parser is given (as in vLLM, which dropped this flag)"),
    Flag(("--guided-decoding-backend",), ONE, A, "auto, xgrammar only: structured output "
         "is compiled with xgrammar", only("auto", "xgrammar", why="structured output is compiled with "
                          "xgrammar here"), example=("xgrammar",)),
    Flag(("--structured-outputs-config",), ONE, A, "backend auto or xgrammar only: "
         "structured output is compiled with xgrammar", _structured_outputs, dotted=True, example=('{"backend": "xgrammar"}',)),
    Flag(("--return-tokens-as-token-ids",), SW, R, "not as a server default: a request sends "
         "return_tokens_as_token_ids itself"),
    Flag(("--enable-force-include-usage",), SW, R, "not as a server default: a streamed "
         "request asks for usage with stream_options.include_usage"),
    Flag(("--enable-prompt-tokens-details",), SW, R, "usage carries no prompt_tokens_details "
         "yet"),
    Flag(("--enable-log-outputs",), SW, R, "outputs are never logged"),
    Flag(("--chat-template-content-format",), ONE, A, "auto only: content parts are given "
         "to the template as it expects them",
         only("auto", why="content parts are given to the template as it expects them "
              "(auto); no other format is served"), example=("auto",)),
    # -- LoRA
    Flag(("--enable-lora", "--fully-sharded-loras", "--enable-lora-bias"), SW, R, _LORA),
    Flag(("--lora-modules",), SEV, R, _LORA),
    Flag(("--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-dtype",
          "--lora-extra-vocab-size", "--default-mm-loras"), ONE, R, _LORA),
    # -- observability
    Flag(("--otlp-traces-endpoint",), ONE, M, "--tracing.endpoint of every tier (router, "
         "encoder, language)", lambda v: Effect(tuple(
             Put(t, ("--tracing.endpoint", v[0])) for t in (To.ROUTER, To.ENCODER, To.LANGUAGE))),
         example=("http://collector:4317",)),
    Flag(("--collect-detailed-traces",), ONE, A, f"{_NOTHING}: every stage of every tier is "
         "traced once tracing is on", example=("all",)),
    Flag(("--show-hidden-metrics-for-version",), ONE, A, f"{_NOTHING}: Tandem hides no "
         "metrics", example=("0.10",)),
)

BY_NAME: dict[str, Flag] = {}
for _row in TABLE:
    for _name in _row.names:
        assert _name not in BY_NAME, f"{_name} has two rows"
        BY_NAME[_name] = _row


def markdown_table() -> str:
    """The table as docs/serve.md shows it (a test keeps that copy equal to this)."""
    lines = ["| vLLM flag | fate | here |", "|---|---|---|"]
    for row in TABLE:
        names = ", ".join(f"`{n}`" for n in row.names)
        text = row.text.replace("|", "\\|")
        lines.append(f"| {names} | {row.fate.value} | {text} |")
    return "\n".join(lines)


def help_table(width: int = 34, columns: int = 100) -> str:
    """The table as `tandem serve --help` prints it: one block per fate, each row's text
    wrapped beside its names (below them when they are wider than `width`)."""
    out = []
    indent = " " * (width + 4)
    for fate, title in ((M, "mapped: the value goes to"), (A, "accepted, with this notice"),
                        (R, "refused, and why")):
        out.append(f"{title}:")
        for row in TABLE:
            if row.fate is not fate:
                continue
            names = "  " + ", ".join(row.names)
            text = textwrap.wrap(row.text, columns - len(indent), break_on_hyphens=False)
            if len(names) + 2 > len(indent):
                out.append(names)
                names = ""
            out.append(names.ljust(len(indent)) + text[0])
            out += [indent + line for line in text[1:]]
    return "\n".join(out)
