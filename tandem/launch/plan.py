"""The launch plan `tandem up` and `tandem up --ray` share: the cluster flags, the default
model, the Mooncake port ranges, and the command line of every child.

    args = parse_args(argv)                        # the cluster flags (both launchers)
    model = args.model or str(default_model(args.arch))
    encoders, languages, router = plan(args, model)         # local processes
    instance_argv(kind, model, host, port, (lo, hi), extra)  # one tier instance (Ray too)
    router_child(args, model, encoder_addrs, language_addrs)

Nothing here starts a process; `up.py` and `ray_up.py` run what this plans.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shlex
import sys
import tempfile
from pathlib import Path

from tandem.launch.procs import (
    PORT_RANGE_ENV,
    Child,
    PortRange,
    free_block,
    free_port,
    port_bindable,
    port_window,
    reserve_ports,
    say,
)
from tandem.models.checkpoint import ARCHS
from tandem.pki import PKIPaths, make_pki

ROUTER_HEALTH = "tandem.v1.Router"
PORT_RANGE = 40  # Mooncake RPC ports per instance
# where the instances' Mooncake RPC ranges are drawn: below 32768 (Mooncake ignores a range
# reaching past 32767) and clear of the service-port window (procs.SERVICE_WINDOW)
MOONCAKE_WINDOW = port_window("TANDEM_MOONCAKE_PORTS", (20000, 28000))
# NOTE: the language tier sizes its KV pool from free GPU memory; an instance without a
# GPU needs an explicit page count, so it gets this one unless the caller gave --kv-pages.
CPU_KV_PAGES = 4096
CLI = [sys.executable, "-m", "tandem.cli"]
# Under --port-range: Mooncake ports per engine, i.e. per encoder and per language rank (it
# binds two, its RPC and TCP-transport ports, anywhere free in its range; the rest lets a
# restarted instance bind while the previous one's ports linger), and the private block of
# a tensor-parallel language instance (its rendezvous port, picked by the instance itself
# with free_port).
RANGE_TRANSFER_PORTS = 8
RANGE_TP_PORTS = 2
# Mooncake ignores an RPC range reaching past this port (tandem.config.TransferConfig)
MOONCAKE_TOP = 32767


def cache_dir() -> Path:
    base = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem"
    )
    return Path(base)


def default_model(arch: str) -> Path:
    """The tiny checkpoint in the cache, built on first use (atomically)."""
    out = cache_dir() / f"tiny-{arch}"
    if (out / ".complete").exists():
        return out
    say(f"[up] building the tiny {arch} checkpoint into {out} (once)")
    from tandem.models.tiny import ensure_tiny_model

    return ensure_tiny_model(out, arch=arch, size="tiny", seed=0)


def transfer_ranges(n: int) -> list[tuple[int, int]]:
    """`n` disjoint Mooncake RPC port ranges in a random free-looking window."""
    for _ in range(50):
        base = random.randrange(MOONCAKE_WINDOW[0], MOONCAKE_WINDOW[1] - n * PORT_RANGE)
        ranges = [(base + i * PORT_RANGE, base + (i + 1) * PORT_RANGE - 1) for i in range(n)]
        if all(port_bindable("127.0.0.1", lo) and port_bindable("127.0.0.1", lo + 1)
               for lo, _ in ranges):
            return ranges
    raise RuntimeError("no free port window for the transfer engines")


_TIER_ARGS = ("--encoder-args", "--language-args", "--router-args")


def _glue_tier_args(argv: list[str]) -> list[str]:
    """`--language-args "--tp 2"` -> `--language-args=--tp 2`: argparse would take a value
    that starts with a dash for an option of its own."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _TIER_ARGS and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def parser() -> argparse.ArgumentParser:
    """`tandem up`'s own flags (`--ray` and its sizing flags are ray_up.py's)."""
    p = argparse.ArgumentParser(
        prog="tandem up",
        description="A whole local cluster: N encoders, M language instances, one router.",
        epilog="--ray [ADDRESS]: run the encoder and language instances as Ray actors "
        "instead (a running cluster's GCS address, ray://HOST:10001, or 'local'); with it "
        "--encoder-gpus/--language-gpus/--encoder-cpus/--language-cpus/--ray-num-cpus/"
        "--ray-namespace size them (`tandem up --ray --help`). Ray's token authentication "
        "works as for any Ray client (the token in ~/.ray/auth_token or RAY_AUTH_TOKEN). "
        "--port-range, --metrics-port and the --restart-*/--max-restarts flags are the "
        "local launcher's: --ray refuses them.",
    )
    p.add_argument("--model", default="", help="Local checkpoint dir or Hugging Face id "
                   "(default: a tiny random-weight model built into the cache once).")
    p.add_argument("--arch", default="qwen2_5_vl", choices=list(ARCHS),
                   help="Architecture of the default tiny model.")
    p.add_argument("--encoders", type=int, default=1, help="Encoder instances.")
    p.add_argument("--languages", type=int, default=1, help="Language instances.")
    p.add_argument("--prefill", type=int, default=0,
                   help="E/P/D: prefill instances (language --role prefill), with --decode: "
                   "in place of --languages, prompts run on these and decoding on the "
                   "decode instances (docs/architecture.md, 'Prefill and decode apart').")
    p.add_argument("--decode", type=int, default=0,
                   help="E/P/D: decode instances (language --role decode), with --prefill.")
    p.add_argument("--host", default="127.0.0.1", help="Address everything binds to.")
    p.add_argument("--http-port", type=int, default=8000, help="Router HTTP port.")
    p.add_argument("--grpc-port", type=int, default=50051, help="Router gRPC port.")
    p.add_argument("--api-key", default="", help="Require this Bearer key at the router.")
    p.add_argument("--served-model-name", default="",
                   help="The model's name in the API (/v1/models, `model`): default the "
                   "checkpoint directory's name, or the Hugging Face id as given.")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="Every tier's --log-level.")
    p.add_argument("--demo", action="store_true",
                   help="Send one chat with a generated image once ready (DEMO_ONLY=1: exit after).")
    p.add_argument("--encoder-args", default="", help="Extra flags for every encoder.")
    p.add_argument("--language-args", default="", help="Extra flags for every language instance.")
    p.add_argument("--router-args", default="", help="Extra flags for the router.")
    p.add_argument("--encoder-nice", type=int, default=10, choices=range(0, 20),
                   metavar="0-19",
                   help="Scheduling priority of the encoder processes, below the other "
                   "tiers' (nice). On one host the tiers share its cores: a decode step "
                   "waits for every thread it forks, so the language tier runs first and "
                   "the vision tower fills the idle time (measured in docs/benchmarks.md). "
                   "0 = equal priority.")
    p.add_argument("--insecure-internal", action="store_true",
                   help="Plaintext between the tiers. By default `tandem up` makes a "
                   "throwaway CA and a certificate per tier at start, and the tiers talk "
                   "mTLS (docs/deploy.md, 'Internal TLS').")
    p.add_argument("--pki-dir", default="",
                   help="Write that CA and the certificates here and keep them (default: "
                   "a private temporary directory, removed at exit).")
    p.add_argument("--port-range", type=_port_range, default=None, metavar="LO-HI",
                   help="Every port tandem up assigns (each instance's gRPC and metrics "
                   "ports, its Mooncake transfer ports, the launcher's --metrics-port) comes "
                   "from LO-HI, e.g. 30000-30999; a range too small for the plan is refused "
                   "at start. Mooncake needs its part below 32768. --http-port and "
                   "--grpc-port are yours (they may lie outside). Default: free ports from "
                   f"{SERVICE_WINDOW_TEXT}, Mooncake's from {MOONCAKE_WINDOW[0]}-"
                   f"{MOONCAKE_WINDOW[1] - 1}.")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="The launcher's own Prometheus endpoint: its instances' states and "
                   "restart counts (tandem_up_restarts_total, tandem_up_instance_state). "
                   "Default: a free port (printed at start); 0: off.")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="An instance that exits unexpectedly is restarted, at most this "
                   "many times within --restart-window; past that it stays down (logged, "
                   "and its state 'failed' in the metrics). 0: never restart.")
    p.add_argument("--restart-window", type=float, default=300.0,
                   help="Seconds over which --max-restarts counts an instance's restarts.")
    p.add_argument("--restart-backoff", type=float, default=1.0,
                   help="Seconds before an instance's first restart; doubles with each "
                   "restart still in the window, up to --restart-backoff-max.")
    p.add_argument("--restart-backoff-max", type=float, default=30.0,
                   help="The longest wait before a restart.")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="Seconds to get ready.")
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="Seconds each child gets to drain before it is killed.")
    return p


SERVICE_WINDOW_TEXT = "28000-32767 (below the kernel's ephemeral range)"


def _port_range(text: str) -> PortRange:
    try:
        return PortRange.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Flags only the local launcher honours: `tandem up --ray` refuses them (local_only_in), as
# its actors are placed and replaced by Ray on ports its nodes pick.
LOCAL_ONLY = ("--port-range", "--metrics-port", "--max-restarts", "--restart-window",
              "--restart-backoff", "--restart-backoff-max")


def local_only_in(argv: list[str]) -> list[str]:
    """The local-only flags among `argv` (as given: `--flag V` or `--flag=V`)."""
    return [f for f in LOCAL_ONLY if any(a == f or a.startswith(f + "=") for a in argv)]


def _tp(extra: list[str]) -> int:
    value = _flag_value(extra, "--tp")
    try:
        return int(value) if value is not None else 1
    except ValueError:
        return 1  # the tier's own parser says why, at start or in `tandem serve --dry-run`


def ports_needed(args: argparse.Namespace) -> dict[str, int]:
    """What the plan takes out of --port-range, by use (for the refusal's message)."""
    n = args.encoders + args.languages
    need = {"gRPC": n, f"Mooncake ({RANGE_TRANSFER_PORTS} per encoder and language rank)":
            sum(transfer_widths(args))}
    metrics = sum(count for count, extra in ((args.encoders, args.encoder_args),
                                             (args.languages, args.language_args))
                  if _flag_value(shlex.split(extra), "--metrics-port") is None)
    if metrics:
        need["metrics"] = metrics
    if _tp(shlex.split(args.language_args)) > 1:
        need[f"tensor-parallel rendezvous ({RANGE_TP_PORTS} each)"] = (args.languages
                                                                      * RANGE_TP_PORTS)
    if args.metrics_port is None:
        need["the launcher's metrics"] = 1
    return need


def transfer_widths(args: argparse.Namespace) -> list[int]:
    """Under --port-range, each instance's Mooncake block (encoders, then languages): every
    tensor-parallel rank runs an engine of its own in its instance's block."""
    tp = _tp(shlex.split(args.language_args))
    return ([RANGE_TRANSFER_PORTS] * args.encoders
            + [RANGE_TRANSFER_PORTS * tp] * args.languages)


def check_port_range(args: argparse.Namespace) -> str | None:
    """Why --port-range cannot hold the plan (None: it can). Counts ports, not which are
    free now: a port taken by another process ends the plan later (PortsExhausted)."""
    r: PortRange | None = args.port_range
    if r is None:
        return None
    need = ports_needed(args)
    n = args.encoders + args.languages
    named = [p for p in (args.http_port, args.grpc_port, args.metrics_port) if p in r]
    total, have = sum(need.values()), r.size - len(named)
    if total > have:
        parts = ", ".join(f"{v} {k}" for k, v in need.items())
        mine = (f" ({len(named)} of them named by --http-port/--grpc-port/--metrics-port)"
                if named else "")
        return (f"--port-range {r} has {r.size} ports{mine}; this plan needs {total}: "
                f"{parts} for {args.encoders} encoder(s) and {args.languages} language "
                "instance(s)")
    low = min(r.hi, MOONCAKE_TOP) - r.lo + 1
    if sum(transfer_widths(args)) > low:
        return (f"--port-range {r}: Mooncake's transfer ports must lie below "
                f"{MOONCAKE_TOP + 1} (it ignores a higher range), and {max(low, 0)} ports "
                f"of the range do; {n} instances need {sum(transfer_widths(args))} there")
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The cluster flags; `tandem up --ray` takes its own flags out first, then calls this."""
    p = parser()
    args = p.parse_args(_glue_tier_args(argv))
    if args.prefill or args.decode:  # E/P/D: the language instances are P, then D
        if args.prefill < 1 or args.decode < 1:
            p.error("--prefill and --decode go together, each >= 1")
        if "--languages" in argv or any(a.startswith("--languages=") for a in argv):
            p.error("--languages with --prefill/--decode: give the two counts instead")
        if "--role" in [a.split("=")[0] for a in shlex.split(args.language_args)]:
            p.error("--language-args: --role is assigned per instance by --prefill/--decode")
        args.languages = args.prefill + args.decode
    if args.encoders < 1 or args.languages < 1:
        p.error("--encoders and --languages must be >= 1")
    if args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    if args.restart_window <= 0 or args.restart_backoff < 0:
        p.error("--restart-window must be > 0 and --restart-backoff >= 0")
    if args.restart_backoff_max < args.restart_backoff:
        p.error("--restart-backoff-max must be >= --restart-backoff")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        p.error("--metrics-port must be a port (0: off)")
    if (why := check_port_range(args)) is not None:
        p.error(why)
    for kind, count, extra in (("encoder", args.encoders, args.encoder_args),
                               ("language", args.languages, args.language_args)):
        flags = [a.split("=")[0] for a in shlex.split(extra)]
        if "--port" in flags:
            p.error(f"--{kind}-args: --port is assigned per instance by tandem up")
        if "--metrics-port" in flags and count > 1:
            p.error(f"--{kind}-args: --metrics-port with {count} {kind}s would give them one "
                    "port; tandem up assigns one per instance")
    return args


def _flag_value(extra: list[str], flag: str) -> str | None:
    for i, a in enumerate(extra):
        if a == flag and i + 1 < len(extra):
            return extra[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def cpu_language_args(extra: list[str]) -> list[str]:
    """A language instance's flags on a machine (or Ray bundle) without a GPU."""
    if any(a.startswith("--kv-pages") for a in extra):
        return extra
    return ["--kv-pages", str(CPU_KV_PAGES), *extra]


def instance_argv(
    kind: str, model: str, host: str, port: int, ports: tuple[int, int], extra: list[str]
) -> list[str]:
    """The command of one tier instance: its gRPC port and its own Mooncake port range."""
    lo, hi = ports
    return [*CLI, kind, "--model", model, "--host", host, "--port", str(port),
            "--transfer.host", host, "--transfer.min-port", str(lo),
            "--transfer.max-port", str(hi), *extra]


def served_name(args: argparse.Namespace, model: str) -> str:
    """The model's name in the API: --served-model-name, else the checkpoint directory's
    name, or a Hugging Face id as given (as vLLM names it)."""
    if args.served_model_name:
        return args.served_model_name
    return Path(model).name if Path(model).expanduser().is_dir() else model


def checked_model(args: argparse.Namespace) -> str:
    """The checkpoint the tiers will load, checked before anything starts: a missing
    directory, an unsupported architecture or an unreadable config ends the launch here
    (CheckpointError), not after certificates were made and every tier started."""
    from tandem.models.checkpoint import read_spec, resolve_model_path

    model = args.model or str(default_model(args.arch))
    read_spec(resolve_model_path(model))
    return model


def language_roles(args: argparse.Namespace) -> list[str]:
    """Each language instance's role, in order: `both`, or (--prefill P --decode D) P
    prefill instances, then D decode instances."""
    if getattr(args, "prefill", 0):
        return ["prefill"] * args.prefill + ["decode"] * args.decode
    return ["both"] * args.languages


def router_child(
    args: argparse.Namespace, model: str, encoders: list[str], languages: list[str],
    prefills: list[str] = (),
) -> Child:
    """The router, local to the launcher, given every instance's address (E/P/D:
    `languages` are the decode instances, `prefills` the prefill ones)."""
    argv = [*CLI, "router", "--model", served_name(args, model), "--host", args.host,
            "--log-level", args.log_level,
            "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
            "--encoders", ",".join(encoders), "--languages", ",".join(languages),
            *(["--prefills", ",".join(prefills)] if prefills else []),
            *shlex.split(args.router_args)]
    router = Child("router", argv, f"{args.host}:{args.grpc_port}", ROUTER_HEALTH)
    if args.api_key:  # NOTE: through the environment, not argv (which `ps` shows to all)
        router.env_extra["TANDEM_API_KEY"] = args.api_key
    return router


def _cpu_only() -> bool:
    """No GPU for the language tier here. A CPU build of torch says so in its
    torch/version.py (no CUDA, no HIP), read without importing torch: the import costs
    ~2 s of CPU before the launcher starts any instance. Only a GPU build is imported and
    asked whether a device is there."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return True
    probe = importlib.util.spec_from_file_location(
        "_tandem_torch_version", Path(spec.origin).parent / "version.py")
    if probe is not None and probe.loader is not None:
        build = importlib.util.module_from_spec(probe)
        try:
            probe.loader.exec_module(build)
        except OSError:
            build = None
        if build is not None and getattr(build, "cuda", "") is None and getattr(
                build, "hip", "") is None:
            return True
    import torch

    return not torch.cuda.is_available()


def internal_pki(args: argparse.Namespace) -> PKIPaths | None:
    """The cluster's CA and certificates (None under --insecure-internal)."""
    if args.insecure_internal:
        say("[up] WARNING: --insecure-internal: the tiers talk plaintext")
        return None
    out = Path(args.pki_dir) if args.pki_dir else Path(tempfile.mkdtemp(prefix="tandem-pki-"))
    return make_pki(out)


def tls_env(pki: PKIPaths | None, role: str, inline: bool = False) -> dict[str, str]:
    """The environment that gives a `role` process its certificate (file paths; the PEM
    text itself with `inline`, for processes on other machines: Ray actors)."""
    if pki is None:
        return {"TANDEM_INSECURE_INTERNAL": "1"}
    val = (lambda p: p.read_text()) if inline else str  # noqa: E731
    # NOTE: "false" explicitly: the launcher decides, whatever its own environment says
    return {"TANDEM_INTERNAL_TLS__CA": val(pki.ca), "TANDEM_INTERNAL_TLS__CERT": val(pki.cert(role)),
            "TANDEM_INTERNAL_TLS__KEY": val(pki.key(role)), "TANDEM_INSECURE_INTERNAL": "false"}


def operator_tls(pki: PKIPaths | None):
    """The launcher's own credentials to probe the tiers (None: plaintext)."""
    if pki is None:
        return None
    from tandem.internal_tls import from_files

    return from_files(pki.ca, pki.cert("operator"), pki.key("operator"), "operator")


def launcher_metrics_port(args: argparse.Namespace) -> int:
    """The launcher's own metrics port: --metrics-port, else a free one (in --port-range)."""
    if args.metrics_port is not None:
        return args.metrics_port
    return free_port(args.host, args.port_range)


def plan(args: argparse.Namespace, model: str, pki: PKIPaths | None = None
         ) -> tuple[list[Child], list[Child], Child]:
    """(encoders, languages, router) as local processes on `args.host`, free ports each;
    each child gets its role's certificate from `pki` (plaintext when None). Under
    --port-range every port comes from it (PortsExhausted when it is too crowded)."""
    # NOTE: the router's ports are free until it binds them, after the instances are up: an
    # instance must not be handed one (seen in CI: language-0 on the router's --grpc-port)
    reserve_ports(args.http_port, args.grpc_port, args.metrics_port)
    within: PortRange | None = args.port_range
    n = args.encoders + args.languages
    if within is None:
        ranges = iter(transfer_ranges(n))
    else:  # Mooncake's blocks first, widest first: they need the part below 32768
        low = PortRange(within.lo, min(within.hi, MOONCAKE_TOP))
        widths = transfer_widths(args)
        blocks = {i: free_block(args.host, w, low)
                  for i, w in sorted(enumerate(widths), key=lambda iw: -iw[1])}
        ranges = iter((blocks[i].lo, blocks[i].hi) for i in range(n))
    language_extra = shlex.split(args.language_args)
    if _cpu_only():
        language_extra = cpu_language_args(language_extra)
    tp_blocks = ([free_block(args.host, RANGE_TP_PORTS, within) for _ in range(args.languages)]
                 if within is not None and _tp(language_extra) > 1 else [])
    encoders, languages = [], []
    roles = language_roles(args)
    for kind, count, extra, out in (
        ("encoder", args.encoders, shlex.split(args.encoder_args), encoders),
        ("language", args.languages, language_extra, languages),
    ):
        for i in range(count):
            role = roles[i] if kind == "language" else "both"
            name = f"{kind}-{i}" if role == "both" else f"{role}-{i - roles.index(role)}"
            extra_i = [*extra, "--role", role] if role != "both" else extra
            port = free_port(args.host, within)
            # tier metrics on, one port per instance (unless the caller named one)
            metrics = _flag_value(extra, "--metrics-port")
            own = ([] if metrics else
                   ["--metrics-port", metrics := str(free_port(args.host, within))])
            argv = instance_argv(kind, model, args.host, port, next(ranges),
                                 ["--log-level", args.log_level, *extra_i, *own])
            child = Child(name, argv, f"{args.host}:{port}",
                          nice=args.encoder_nice if kind == "encoder" else 0,
                          log_level=args.log_level)
            child.metrics_url = f"http://{args.host}:{metrics}/metrics"
            child.env_extra.update(tls_env(pki, kind))
            if kind == "language" and tp_blocks:  # its own picks (free_port) from its block
                child.env_extra[PORT_RANGE_ENV] = str(tp_blocks[i])
            child.probe_tls = operator_tls(pki)
            out.append(child)
    router = router_child(
        args, model, [c.grpc_address for c in encoders],
        [c.grpc_address for c, r in zip(languages, roles, strict=True) if r != "prefill"],
        [c.grpc_address for c, r in zip(languages, roles, strict=True) if r == "prefill"])
    router.env_extra.update(tls_env(pki, "router"))
    return encoders, languages, router
