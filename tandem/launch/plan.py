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
import os
import random
import shlex
import sys
import tempfile
from pathlib import Path

from tandem.launch.procs import Child, free_port, port_bindable, reserve_ports, say
from tandem.models.checkpoint import ARCHS
from tandem.pki import PKIPaths, make_pki

ROUTER_HEALTH = "tandem.v1.Router"
PORT_RANGE = 40  # Mooncake RPC ports per instance
# where the instances' Mooncake RPC ranges are drawn: below 32768 (Mooncake ignores a range
# reaching past 32767) and clear of the service-port window (procs.SERVICE_WINDOW)
MOONCAKE_WINDOW = (20000, 28000)
# NOTE: the language tier sizes its KV pool from free GPU memory; an instance without a
# GPU needs an explicit page count, so it gets this one unless the caller gave --kv-pages.
CPU_KV_PAGES = 4096
CLI = [sys.executable, "-m", "tandem.cli"]


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
        "works as for any Ray client (the token in ~/.ray/auth_token or RAY_AUTH_TOKEN).",
    )
    p.add_argument("--model", default="", help="Local checkpoint dir or Hugging Face id "
                   "(default: a tiny random-weight model built into the cache once).")
    p.add_argument("--arch", default="qwen2_5_vl", choices=list(ARCHS),
                   help="Architecture of the default tiny model.")
    p.add_argument("--encoders", type=int, default=1, help="Encoder instances.")
    p.add_argument("--languages", type=int, default=1, help="Language instances.")
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
    p.add_argument("--ready-timeout", type=float, default=300.0, help="Seconds to get ready.")
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="Seconds each child gets to drain before it is killed.")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The cluster flags; `tandem up --ray` takes its own flags out first, then calls this."""
    p = parser()
    args = p.parse_args(_glue_tier_args(argv))
    if args.encoders < 1 or args.languages < 1:
        p.error("--encoders and --languages must be >= 1")
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
            "--transfer.max-port", str(hi), *extra]  # fmt: skip


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


def router_child(
    args: argparse.Namespace, model: str, encoders: list[str], languages: list[str]
) -> Child:
    """The router, local to the launcher, given every instance's address."""
    argv = [*CLI, "router", "--model", served_name(args, model), "--host", args.host,
            "--log-level", args.log_level,
            "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
            "--encoders", ",".join(encoders), "--languages", ",".join(languages),
            *shlex.split(args.router_args)]  # fmt: skip
    router = Child("router", argv, f"{args.host}:{args.grpc_port}", ROUTER_HEALTH)
    if args.api_key:  # NOTE: through the environment, not argv (which `ps` shows to all)
        router.env_extra["TANDEM_API_KEY"] = args.api_key
    return router


def _cpu_only() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


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


def plan(args: argparse.Namespace, model: str, pki: PKIPaths | None = None
         ) -> tuple[list[Child], list[Child], Child]:
    """(encoders, languages, router) as local processes on `args.host`, free ports each;
    each child gets its role's certificate from `pki` (plaintext when None)."""
    ranges = transfer_ranges(args.encoders + args.languages)
    # NOTE: the router's ports are free until it binds them, after the instances are up: an
    # instance must not be handed one (seen in CI: language-0 on the router's --grpc-port)
    reserve_ports(args.http_port, args.grpc_port)
    language_extra = shlex.split(args.language_args)
    if _cpu_only():
        language_extra = cpu_language_args(language_extra)
    encoders, languages = [], []
    for kind, count, extra, out in (
        ("encoder", args.encoders, shlex.split(args.encoder_args), encoders),
        ("language", args.languages, language_extra, languages),
    ):
        for i in range(count):
            port = free_port(args.host)
            # tier metrics on, one port per instance (unless the caller named one)
            metrics = _flag_value(extra, "--metrics-port")
            own = [] if metrics else ["--metrics-port", metrics := str(free_port(args.host))]
            argv = instance_argv(kind, model, args.host, port, ranges.pop(),
                                 ["--log-level", args.log_level, *extra, *own])
            child = Child(f"{kind}-{i}", argv, f"{args.host}:{port}",
                          nice=args.encoder_nice if kind == "encoder" else 0,
                          log_level=args.log_level)
            child.metrics_url = f"http://{args.host}:{metrics}/metrics"
            child.env_extra.update(tls_env(pki, kind))
            child.probe_tls = operator_tls(pki)
            out.append(child)
    router = router_child(args, model, [c.grpc_address for c in encoders],
                          [c.grpc_address for c in languages])  # fmt: skip
    router.env_extra.update(tls_env(pki, "router"))
    return encoders, languages, router
