"""`tandem up`: a whole local cluster — N encoders, M language instances, one router.

    tandem up [--model M] [--encoders 1] [--languages 1] [--http-port 8000]
              [--grpc-port 50051] [--demo] [--api-key K] [--port-range LO-HI]
              [--metrics-port P] [--max-restarts 5] [--restart-window 300]
              [--restart-backoff 1] [--restart-backoff-max 30]
              [--encoder-args "..."] [--language-args "..."] [--router-args "..."]
    tandem up --ray [ADDRESS] ...   the tiers as Ray actors (tandem/launch/ray_up.py; the
                                    `tandem` command picks the launcher)

The plan (flags, ports, child commands) is tandem/launch/plan.py's: instances get free
gRPC ports and disjoint Mooncake port ranges; the router is given their addresses. Each
child is a separate `python -m tandem.cli <kind>` process whose log lines are forwarded
prefixed with its name. Once the cluster is ready, a tier instance that exits is restarted
on the same ports with backoff, up to a cap (tandem/launch/supervise.py); the router's
exit ends `tandem up` (status 1). The launcher's metrics endpoint (--metrics-port) counts
the restarts. Ctrl-C or SIGTERM drains and stops everything, restarting nothing; SIGUSR1
prints every thread's stack (`up`'s own, or a child's: `kill -USR1` its pid).
Without --model, a tiny random-weight checkpoint is built once into the cache directory.
"""

from __future__ import annotations

import os
import shutil
import sys

from prometheus_client import CollectorRegistry

from tandem.launch.plan import (
    checked_model,
    internal_pki,
    launcher_metrics_port,
    parse_args,
    plan,
    served_name,
)
from tandem.launch.procs import PortsExhausted, say, stop_all, stop_event_on_signals, wait_ready
from tandem.launch.supervise import RestartPolicy, Supervisor
from tandem.metrics import serve_metrics
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
                                                "--grpc-port": args.grpc_port,
                                                "--metrics-port": args.metrics_port or 0})
    stop = stop_event_on_signals()
    dump_stacks_on_signal()
    pki = internal_pki(args)
    if pki is not None:
        say(f"[up] internal mTLS: a throwaway CA and certificates in {pki.dir}")
    try:
        encoders, languages, router = plan(args, model, pki)
        metrics_port = launcher_metrics_port(args)
    except PortsExhausted as e:
        say(f"[up] error: --port-range {args.port_range}: {e}")
        if pki is not None and not args.pki_dir:
            shutil.rmtree(pki.dir, ignore_errors=True)
        return 2
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    groups = [[router], languages + encoders]
    registry = CollectorRegistry()
    supervisor = Supervisor(encoders + languages, RestartPolicy(
        args.max_restarts, args.restart_window, args.restart_backoff, args.restart_backoff_max),
        env, registry)
    code = 0
    try:
        if metrics_port:
            serve_metrics(metrics_port, args.host, registry)
            say(f"[up] launcher metrics http://{args.host}:{metrics_port}/metrics "
                "(instance states and restarts)")
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
            supervisor.tick()
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
    if supervisor.failed:  # a script's `tandem up` ends non-zero after it lost an instance
        say("[up] down past --max-restarts: " + ", ".join(supervisor.failed))
        return code or 1
    return code
