"""`tandem up`: a whole local cluster — N encoders, M language instances, one router.

    tandem up [--model M] [--encoders 1] [--languages 1] [--http-port 8000]
              [--grpc-port 50051] [--demo] [--api-key K]
              [--encoder-args "..."] [--language-args "..."] [--router-args "..."]
    tandem up --ray [ADDRESS] ...   the tiers as Ray actors (see tandem/launch/ray_up.py)

Instances get free gRPC ports and disjoint Mooncake port ranges; the router is given their
addresses. Each child is a separate `python -m tandem.cli <kind>` process whose log lines
are forwarded prefixed with its name. Ctrl-C or SIGTERM drains and stops everything.
Without --model, a tiny random-weight checkpoint is built once into the cache directory.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import socket
import sys
from pathlib import Path

from tandem.launch.procs import (
    Child,
    free_port,
    say,
    stop_all,
    stop_event_on_signals,
    wait_ready,
)

ROUTER_HEALTH = "tandem.v1.Router"
PORT_RANGE = 40  # Mooncake RPC ports per instance
CPU_KV_PAGES = 4096  # KV pages per language instance on a machine without CUDA


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
    from tandem.models.tiny import build_tiny_model

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    build_tiny_model(tmp, arch=arch, size="tiny", seed=0)
    (tmp / ".complete").touch()
    try:
        tmp.rename(out)
    except OSError:  # built concurrently by another process
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def transfer_ranges(n: int) -> list[tuple[int, int]]:
    """`n` disjoint Mooncake RPC port ranges in a random free-looking window."""
    for _ in range(50):
        base = random.randrange(20000, 32000 - n * PORT_RANGE)
        ranges = [(base + i * PORT_RANGE, base + (i + 1) * PORT_RANGE - 1) for i in range(n)]
        if all(_port_free(lo) and _port_free(lo + 1) for lo, _ in ranges):
            return ranges
    raise RuntimeError("no free port window for the transfer engines")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem up", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="Local checkpoint dir or Hugging Face id "
                   "(default: a tiny random-weight model built into the cache once).")
    p.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl"],
                   help="Architecture of the default tiny model.")
    p.add_argument("--encoders", type=int, default=1, help="Encoder instances.")
    p.add_argument("--languages", type=int, default=1, help="Language instances.")
    p.add_argument("--host", default="127.0.0.1", help="Address everything binds to.")
    p.add_argument("--http-port", type=int, default=8000, help="Router HTTP port.")
    p.add_argument("--grpc-port", type=int, default=50051, help="Router gRPC port.")
    p.add_argument("--api-key", default="", help="Require this Bearer key at the router.")
    p.add_argument("--demo", action="store_true",
                   help="Send one chat with a generated image once ready (DEMO_ONLY=1: exit after).")
    p.add_argument("--encoder-args", default="", help="Extra flags for every encoder.")
    p.add_argument("--language-args", default="", help="Extra flags for every language instance.")
    p.add_argument("--router-args", default="", help="Extra flags for the router.")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="Seconds to get ready.")
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="Seconds each child gets to drain before it is killed.")
    args = p.parse_args(argv)
    if args.encoders < 1 or args.languages < 1:
        p.error("--encoders and --languages must be >= 1")
    return args


def _cpu_only() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def language_defaults(extra: str) -> str:
    """NOTE: the language tier sizes its KV pool from free GPU memory; without CUDA it
    needs an explicit page count, so give it one unless the caller did."""
    if "--kv-pages" not in extra and _cpu_only():
        return f"--kv-pages {CPU_KV_PAGES} {extra}".strip()
    return extra


def plan(args: argparse.Namespace, model: str) -> tuple[list[Child], list[Child], Child]:
    py = [sys.executable, "-m", "tandem.cli"]
    ranges = transfer_ranges(args.encoders + args.languages)
    encoders, languages = [], []
    for kind, count, extra, out in (
        ("encoder", args.encoders, args.encoder_args, encoders),
        ("language", args.languages, language_defaults(args.language_args), languages),
    ):
        for i in range(count):
            port = free_port(args.host)
            lo, hi = ranges.pop()
            argv = py + [kind, "--model", model, "--host", args.host, "--port", str(port),
                         "--transfer.host", args.host, "--transfer.min-port", str(lo),
                         "--transfer.max-port", str(hi), *shlex.split(extra)]
            out.append(Child(f"{kind}-{i}", argv, f"{args.host}:{port}"))
    router_argv = py + [
        "router", "--model", model, "--host", args.host,
        "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
        "--encoders", ",".join(c.grpc_address for c in encoders),
        "--languages", ",".join(c.grpc_address for c in languages),
        *shlex.split(args.router_args),
    ]
    router = Child("router", router_argv, f"{args.host}:{args.grpc_port}", ROUTER_HEALTH)
    if args.api_key:  # NOTE: through the environment, not argv (which `ps` shows to all)
        router.env_extra["TANDEM_API_KEY"] = args.api_key
    return encoders, languages, router


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--ray" or a.startswith("--ray=") for a in argv):
        # The tiers as Ray actors instead of local processes (tandem/launch/ray_up.py).
        from tandem.launch.ray_up import main as ray_main

        return ray_main(argv)
    args = parse_args(argv)
    stop = stop_event_on_signals()

    model = args.model or str(default_model(args.arch))
    encoders, languages, router = plan(args, model)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    groups = [[router], languages + encoders]
    code = 0
    try:
        for c in encoders + languages:
            say(f"[up] {c.name:<11} starting {c.grpc_address}")
            c.start(env)
        wait_ready(encoders + languages, args.ready_timeout, stop)
        say(f"[up] router      starting http://{args.host}:{args.http_port}")
        router.start(env)
        wait_ready([router], args.ready_timeout, stop)
        say(f"[up] ready: OpenAI API http://{args.host}:{args.http_port}/v1   "
            f"gRPC {args.host}:{args.grpc_port}   model {model}")
        say("[up] pids: " + " ".join(f"{c.name}={c.proc.pid}" for c in encoders + languages
                                       + [router]))
        if args.demo:
            from tandem.launch.demo import run_demo

            code = run_demo(args.host, args.http_port, args.api_key)
            if os.environ.get("DEMO_ONLY") == "1":
                return code
        while not stop.is_set():
            if not router.alive:
                say(f"[up] router exited with code {router.proc.returncode}")
                code = 1
                break
            for c in encoders + languages:
                if c.proc.returncode is None and c.proc.poll() is not None:
                    say(f"[up] {c.name} exited with code {c.proc.returncode}")
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        say(f"[up] error: {e}")
        code = 1
    finally:
        stop_all(groups, args.stop_timeout)
        say("[up] stopped")
    return code
