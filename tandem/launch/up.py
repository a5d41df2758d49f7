"""`tandem up`: a whole local cluster — N encoders, M language instances, one router.

    tandem up [--model M] [--encoders 1] [--languages 1] [--http-port 8000]
              [--grpc-port 50051] [--demo] [--api-key K]
              [--encoder-args "..."] [--language-args "..."] [--router-args "..."]
    tandem up --ray [ADDRESS] ...   the tiers as Ray actors (tandem/launch/ray_up.py; the
                                    `tandem` command picks the launcher)

The plan (flags, ports, child commands) is tandem/launch/plan.py's: instances get free
gRPC ports and disjoint Mooncake port ranges; the router is given their addresses. Each
child is a separate `python -m tandem.cli <kind>` process whose log lines are forwarded
prefixed with its name. Ctrl-C or SIGTERM drains and stops everything; SIGUSR1 prints
every thread's stack (`up`'s own, or a child's: `kill -USR1` its pid).
Without --model, a tiny random-weight checkpoint is built once into the cache directory.
"""

from __future__ import annotations

import os
import shutil
import sys

from tandem.launch.plan import checked_model, internal_pki, parse_args, plan, served_name
from tandem.launch.procs import say, stop_all, stop_event_on_signals, wait_ready
from tandem.models.checkpoint import CheckpointError
from tandem.serving import dump_stacks_on_signal, require_free_ports


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        model = checked_model(args)
    except CheckpointError as e:
        say(f"[up] error: {e}")
        return 2
    # NOTE: before anything starts: the router binds these last, after every tier loaded
    require_free_ports("tandem up", args.host, {"--http-port": args.http_port,
                                                "--grpc-port": args.grpc_port})
    stop = stop_event_on_signals()
    dump_stacks_on_signal()
    pki = internal_pki(args)
    if pki is not None:
        say(f"[up] internal mTLS: a throwaway CA and certificates in {pki.dir}")
    encoders, languages, router = plan(args, model, pki)
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
            f"gRPC {args.host}:{args.grpc_port}   model {served_name(args, model)} ({model})")
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
        if pki is not None and not args.pki_dir:
            shutil.rmtree(pki.dir, ignore_errors=True)
        say("[up] stopped")
    return code
