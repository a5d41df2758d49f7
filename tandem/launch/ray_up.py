"""`tandem up --ray [ADDRESS]`: the tiers as Ray actors, for clusters without Kubernetes.

    tandem up --ray [ADDRESS] [--encoder-gpus 1] [--language-gpus 1]
              [--encoder-cpus 1] [--language-cpus 1] [--ray-num-cpus N]  + `tandem up` flags
    python -m tandem.launch.ray_up --ray ...                              (same thing)

ADDRESS: a running cluster ("HOST:PORT" of its GCS, or "ray://HOST:10001"); "local" starts
a fresh local instance; omitted, Ray's own rule applies (RAY_ADDRESS, else a cluster started
by `ray start` on this machine, else a fresh local instance).

    this process (driver) ── router (local child, `--host`/--http-port/--grpc-port)
        │                        └─ --encoders/--languages = the actors' addresses
        └─ placement group, one bundle per instance, strategy SPREAD (across nodes)
             ├─ ServiceHost actor (num_gpus=--encoder-gpus)  ── `tandem encoder` child
             └─ ServiceHost actor (num_gpus=--language-gpus) ── `tandem language` child

Each actor runs its service as a child process on its node (Ray's CUDA_VISIBLE_DEVICES
passes through), bound to the node's IP with free ports, and owns it: stop() drains it with
SIGTERM and kills its process group after --stop-timeout; the child also dies with the actor
(PR_SET_PDEATHSIG), and the actors die with this driver (Ray owner semantics).
Teardown on exit, Ctrl-C or SIGTERM, in order: router, instances (drained in parallel),
actors killed, placement group removed, Ray disconnected (a local instance stops with it).
The model (`--model`) must resolve on every node: a shared path or a Hugging Face id.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading

from tandem.launch import plan as launch_plan
from tandem.launch.procs import Child, free_port, say, stop_all, stop_event_on_signals, wait_ready


class ServiceHost:
    """A Ray actor (wrapped by `ray.remote` at launch) that runs one `tandem <kind>` child
    process on its node. Sync actor, one call at a time: the child is forked from the
    actor's main thread, so PR_SET_PDEATHSIG fires only when the actor process exits."""

    def __init__(self, name: str, kind: str) -> None:
        self.name, self.kind = name, kind
        self.child: Child | None = None

    def start(self, model: str, extra: list[str], ready_timeout_s: float, nice: int = 0,
              tls_env: dict[str, str] | None = None, probe_pem: dict[str, str] | None = None
              ) -> dict:
        """`tls_env`: the child's certificate as PEM text in TANDEM_INTERNAL_TLS__* (this
        node need not see the driver's files); `probe_pem` (ca, cert, key): the operator's,
        to probe the child's health over mTLS."""
        import ray

        from tandem.internal_tls import InternalTLS

        ip = ray.util.get_node_ip_address()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not ray.get_gpu_ids():
            # NOTE: no GPU was granted: hide the node's GPUs from the child; a language
            # instance then needs a KV page count (see plan.CPU_KV_PAGES).
            env["CUDA_VISIBLE_DEVICES"] = ""
            if self.kind == "language":
                extra = launch_plan.cpu_language_args(extra)
        port = free_port(ip)
        (ports,) = launch_plan.transfer_ranges(1)
        argv = launch_plan.instance_argv(self.kind, model, ip, port, ports, extra)
        self.child = Child(self.name, argv, f"{ip}:{port}", nice=nice)
        self.child.env_extra.update(tls_env or {})
        if probe_pem:
            self.child.probe_tls = InternalTLS(*(probe_pem[k].encode() for k in
                                                 ("ca", "cert", "key")), "operator")
        self.child.start(env)
        try:
            wait_ready([self.child], ready_timeout_s, threading.Event())
        except (RuntimeError, KeyboardInterrupt):
            stop_all([[self.child]], 5.0)
            raise
        return {"name": self.name, "address": self.child.grpc_address,
                "pid": self.child.proc.pid, "node_ip": ip,
                "gpus": env.get("CUDA_VISIBLE_DEVICES", "")}  # fmt: skip

    def alive(self) -> bool:
        return self.child is not None and self.child.alive

    def stop(self, timeout_s: float) -> int | None:
        """Drain (SIGTERM), then SIGKILL the child's process group; its exit code."""
        if self.child is None or self.child.proc is None:
            return None
        stop_all([[self.child]], timeout_s)
        return self.child.proc.returncode


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(Ray options, `tandem up` options): the Ray flags are taken out, the rest goes to
    `tandem up`'s own parser, so both accept exactly the same cluster flags."""
    p = argparse.ArgumentParser(prog="tandem up --ray", add_help=False)
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS")
    p.add_argument("--encoder-gpus", type=float, default=1.0, help="GPUs per encoder actor.")
    p.add_argument("--language-gpus", type=float, default=1.0, help="GPUs per language actor.")
    p.add_argument("--encoder-cpus", type=float, default=1.0, help="CPUs per encoder actor.")
    p.add_argument("--language-cpus", type=float, default=1.0, help="CPUs per language actor.")
    p.add_argument("--ray-num-cpus", type=int, default=None,
                   help="CPUs of a local instance started here (default: all).")  # fmt: skip
    p.add_argument("--ray-namespace", default="", help="Ray namespace (default: tandem-<pid>).")
    if "-h" in argv or "--help" in argv:
        p.print_help()
        launch_plan.parse_args(["--help"])
    ray_args, rest = p.parse_known_args(argv)
    if ray_args.ray is None:
        p.error("--ray is required")
    for flag in ("encoder_gpus", "language_gpus", "encoder_cpus", "language_cpus"):
        if getattr(ray_args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0")
    return ray_args, launch_plan.parse_args(rest)


def _connect(ray_args: argparse.Namespace):
    import ray

    address = ray_args.ray or None
    kwargs = {"namespace": ray_args.ray_namespace or f"tandem-{os.getpid()}",
              "include_dashboard": False, "log_to_driver": True}  # fmt: skip
    if address == "local" and ray_args.ray_num_cpus is not None:
        kwargs["num_cpus"] = ray_args.ray_num_cpus
    ray.init(address=address, **kwargs)
    return ray


def _check_resources(ray, rargs: argparse.Namespace, args: argparse.Namespace) -> None:
    have = ray.cluster_resources()
    need_gpu = args.encoders * rargs.encoder_gpus + args.languages * rargs.language_gpus
    need_cpu = args.encoders * rargs.encoder_cpus + args.languages * rargs.language_cpus
    if need_gpu > have.get("GPU", 0):
        raise RuntimeError(
            f"the Ray cluster has {have.get('GPU', 0):g} GPUs, the instances need {need_gpu:g} "
            "(--encoder-gpus 0 --language-gpus 0 runs them on CPU)")  # fmt: skip
    if need_cpu > have.get("CPU", 0):
        raise RuntimeError(f"the Ray cluster has {have.get('CPU', 0):g} CPUs, the instances "
                           f"need {need_cpu:g} (see --encoder-cpus/--language-cpus)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    rargs, args = parse_args(list(sys.argv[1:] if argv is None else argv))
    stop = stop_event_on_signals()

    ray = _connect(rargs)
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    Host = ray.remote(ServiceHost)
    plan = [("encoder", i, rargs.encoder_cpus, rargs.encoder_gpus, args.encoder_args)
            for i in range(args.encoders)] + [
            ("language", i, rargs.language_cpus, rargs.language_gpus, args.language_args)
            for i in range(args.languages)]  # fmt: skip
    actors, pg, router, code, pki = [], None, None, 0, None
    try:
        _check_resources(ray, rargs, args)
        model = args.model or str(launch_plan.default_model(args.arch))
        pki = launch_plan.internal_pki(args)
        if pki is not None:
            say(f"[up] internal mTLS: a throwaway CA and certificates in {pki.dir} (each actor "
                f"gets its own as PEM text in its environment)")
        probe_pem = None if pki is None else {
            "ca": pki.ca.read_text(), "cert": pki.cert("operator").read_text(),
            "key": pki.key("operator").read_text()}
        # SPREAD: bundles go to different nodes where possible (soft, unlike STRICT_SPREAD).
        pg = placement_group([{"CPU": c, "GPU": g} if g else {"CPU": c} for _, _, c, g, _ in plan],
                             strategy="SPREAD", name=f"tandem-{os.getpid()}")  # fmt: skip
        ray.get(pg.ready(), timeout=args.ready_timeout)
        for k, (kind, i, cpus, gpus, _) in enumerate(plan):
            actors.append(Host.options(
                name=f"tandem-{kind}-{i}", num_cpus=cpus, num_gpus=gpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k),
            ).remote(f"{kind}-{i}", kind))  # fmt: skip
        import shlex

        pending = [a.start.remote(model, ["--log-level", args.log_level, *shlex.split(extra)],
                                  args.ready_timeout,
                                  args.encoder_nice if kind == "encoder" else 0,
                                  launch_plan.tls_env(pki, kind, inline=True), probe_pem)
                   for a, (kind, _, _, _, extra) in zip(actors, plan, strict=True)]  # fmt: skip
        infos = []
        for ref in pending:  # NOTE: in order, but every start runs in parallel on its actor
            while not stop.is_set():
                done, _ = ray.wait([ref], timeout=0.5)
                if done:
                    infos.append(ray.get(ref))
                    break
            if stop.is_set():
                raise KeyboardInterrupt
            info = infos[-1]
            say(f"[up] {info['name']:<11} ready   {info['address']:<21} "
                f"(node {info['node_ip']}, gpus [{info['gpus']}])")  # fmt: skip
        addresses = {kind: [f["address"] for f in infos if f["name"].startswith(kind)]
                     for kind in ("encoder", "language")}  # fmt: skip
        router = launch_plan.router_child(args, model, addresses["encoder"],
                                          addresses["language"])  # fmt: skip
        router.env_extra.update(launch_plan.tls_env(pki, "router"))
        say(f"[up] router      starting http://{args.host}:{args.http_port}")
        router.start(dict(os.environ, PYTHONUNBUFFERED="1"))
        wait_ready([router], args.ready_timeout, stop)
        say(f"[up] ready: OpenAI API http://{args.host}:{args.http_port}/v1   "
            f"gRPC {args.host}:{args.grpc_port}   model {model}   (Ray)")  # fmt: skip
        say("[up] pids: " + " ".join(f"{f['name']}={f['pid']}" for f in infos)
            + f" router={router.proc.pid}")  # fmt: skip
        if args.demo:
            from tandem.launch.demo import run_demo

            code = run_demo(args.host, args.http_port, args.api_key)
            if os.environ.get("DEMO_ONLY") == "1":
                return code
        while not stop.wait(2.0):
            if not router.alive:
                say(f"[up] router exited with code {router.proc.returncode}")
                return 1
            for info, alive in zip(infos, ray.get([a.alive.remote() for a in actors]),
                                   strict=True):  # fmt: skip
                if not alive:
                    say(f"[up] {info['name']} exited")
    except KeyboardInterrupt:
        pass
    except (RuntimeError, ray.exceptions.RayError, TimeoutError) as e:
        say(f"[up] error: {e}")
        code = 1
    finally:
        _teardown(ray, router, actors, pg, args.stop_timeout, remove_placement_group)
        if pki is not None and not args.pki_dir:
            shutil.rmtree(pki.dir, ignore_errors=True)
        say("[up] stopped")
    return code


def _teardown(ray, router, actors, pg, stop_timeout_s, remove_placement_group) -> None:
    """Router first (no new work), then every instance drains in parallel, then the actors
    and the placement group go. Each step runs even when an earlier one failed."""
    if router is not None and router.proc is not None:
        stop_all([[router]], stop_timeout_s)
    refs = [a.stop.remote(stop_timeout_s) for a in actors]
    try:
        ray.get(refs, timeout=stop_timeout_s + 15)
    except Exception as e:  # a dead actor: its child already got PR_SET_PDEATHSIG
        say(f"[up] stopping instances: {type(e).__name__}: {e}")
    for a in actors:
        ray.kill(a, no_restart=True)
    if pg is not None:
        remove_placement_group(pg)
    ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
