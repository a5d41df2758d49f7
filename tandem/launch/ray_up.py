"""`tandem up --ray [ADDRESS]`: the tiers as Ray actors, for clusters without Kubernetes.

    tandem up --ray [ADDRESS] [--encoder-gpus 1] [--language-gpus 1]
              [--encoder-cpus 1] [--language-cpus 1] [--ray-num-cpus N]
              [--encoder-resources JSON] [--language-resources JSON]     + `tandem up` flags
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

Placement on named nodes: `--encoder-resources '{"enc_node": 1}'` adds Ray custom resources
to every encoder's bundle, so encoders land only on nodes started with them (`ray start
--resources '{"enc_node": 1}'`).

A lost instance (its node gone, its actor or its service dead) is re-placed, as a
Deployment replaces a pod: the launcher starts a new actor in the same placement-group
bundle; Ray re-places a bundle whose node died once a node with its resources is there
(the placement group is RESCHEDULING until then), and the new service asks for the lost
one's port. Back on the same node (a node that rejoins keeps its IP), it has the same
address, and the router, which ejected that address after its failures, re-admits it on a
successful health probe. On another node, the address is new: the router, whose instance
lists are fixed at its start, is restarted with the new lists (a drain, then a few
seconds in which its ports refuse). Meanwhile the router sends work to the survivors and
retries, elsewhere, the requests the lost instance failed before they produced output.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass, field

from tandem.launch import plan as launch_plan
from tandem.launch.procs import Child, free_port, say, stop_all, stop_event_on_signals, wait_ready


def _listenable(host: str, port: int) -> bool:
    """Whether a server can listen on `port` now. With SO_REUSEADDR, as the services' gRPC
    servers bind: a lost predecessor's connections that linger in TIME_WAIT/FIN_WAIT on
    this node (its peers cut off) do not stand in the way; a listener does."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True


class ServiceHost:
    """A Ray actor (wrapped by `ray.remote` at launch) that runs one `tandem <kind>` child
    process on its node. Sync actor, one call at a time: the child is forked from the
    actor's main thread, so PR_SET_PDEATHSIG fires only when the actor process exits."""

    def __init__(self, name: str, kind: str) -> None:
        self.name, self.kind = name, kind
        self.child: Child | None = None

    def start(self, model: str, extra: list[str], ready_timeout_s: float, nice: int = 0,
              tls_env: dict[str, str] | None = None, probe_pem: dict[str, str] | None = None,
              port: int = 0) -> dict:
        """`tls_env`: the child's certificate as PEM text in TANDEM_INTERNAL_TLS__* (this
        node need not see the driver's files); `probe_pem` (ca, cert, key): the operator's,
        to probe the child's health over mTLS; `port`: the one to take if it is free here
        (a replacement asks for its predecessor's), else a free one."""
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
        port = port if port and _listenable(ip, port) else free_port(ip)
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
                "gpus": env.get("CUDA_VISIBLE_DEVICES", "")}

    def alive(self) -> bool:
        return self.child is not None and self.child.alive

    def stop(self, timeout_s: float) -> int | None:
        """Drain (SIGTERM), then SIGKILL the child's process group; its exit code."""
        if self.child is None or self.child.proc is None:
            return None
        stop_all([[self.child]], timeout_s)
        return self.child.proc.returncode


def _resources(text: str) -> dict[str, float]:
    """`--*-resources`: a JSON object of Ray custom resource names to amounts (> 0)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k and isinstance(v, int | float) and not isinstance(v, bool)
        and v > 0 for k, v in value.items()
    ):
        raise argparse.ArgumentTypeError(
            f'a JSON object of resource names to amounts > 0, e.g. {{"enc_node": 1}}: {text}')
    if {"CPU", "GPU", "memory"} & set(value):
        raise argparse.ArgumentTypeError("CPU/GPU come from --*-cpus/--*-gpus, not here")
    return {k: float(v) for k, v in value.items()}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(Ray options, `tandem up` options): the Ray flags are taken out, the rest goes to
    `tandem up`'s own parser, so both accept exactly the same cluster flags."""
    p = argparse.ArgumentParser(prog="tandem up --ray", add_help=False)
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS")
    p.add_argument("--encoder-gpus", type=float, default=1.0, help="GPUs per encoder actor.")
    p.add_argument("--language-gpus", type=float, default=1.0, help="GPUs per language actor.")
    p.add_argument("--encoder-cpus", type=float, default=1.0, help="CPUs per encoder actor.")
    p.add_argument("--language-cpus", type=float, default=1.0, help="CPUs per language actor.")
    p.add_argument("--encoder-resources", type=_resources, default={}, metavar="JSON",
                   help='Ray custom resources per encoder actor, e.g. \'{"enc_node": 1}\'.')
    p.add_argument("--language-resources", type=_resources, default={}, metavar="JSON",
                   help="Ray custom resources per language actor.")
    p.add_argument("--ray-num-cpus", type=int, default=None,
                   help="CPUs of a local instance started here (default: all).")
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
    args = launch_plan.parse_args(rest)
    if args.prefill:
        p.error("--prefill/--decode (E/P/D) are the local launcher's for now: the Ray "
                "launcher does not place prefill and decode actors yet")
    return ray_args, args


def _connect(ray_args: argparse.Namespace):
    import ray

    address = ray_args.ray or None
    kwargs = {"namespace": ray_args.ray_namespace or f"tandem-{os.getpid()}",
              "include_dashboard": False, "log_to_driver": True}
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
            "(--encoder-gpus 0 --language-gpus 0 runs them on CPU)")
    if need_cpu > have.get("CPU", 0):
        raise RuntimeError(f"the Ray cluster has {have.get('CPU', 0):g} CPUs, the instances "
                           f"need {need_cpu:g} (see --encoder-cpus/--language-cpus)")
    need: dict[str, float] = {}
    for n, res in ((args.encoders, rargs.encoder_resources),
                   (args.languages, rargs.language_resources)):
        for k, v in res.items():
            need[k] = need.get(k, 0.0) + n * v
    for k, v in need.items():
        if v > have.get(k, 0):
            raise RuntimeError(f"the Ray cluster has {have.get(k, 0):g} of resource {k!r}, "
                               f"the instances need {v:g} (`ray start --resources`)")


@dataclass
class Slot:
    """One planned instance and the actor now holding it. `bundle`: its placement-group
    bundle, fixed for its life (a replacement goes into the same one). `info`: the running
    service's start() answer; None while (re)starting, with `pending` its start() call."""

    kind: str
    index: int
    cpus: float
    gpus: float
    resources: dict[str, float]
    extra: str
    bundle: int
    actor: object = None
    pending: object = None  # ObjectRef of start(), while starting
    info: dict | None = None
    address: str = ""  # its service's last address; a replacement asks for the same port
    lost_address: str = ""  # set while a replacement starts: its predecessor's address
    replaced: int = 0
    checks: list = field(default_factory=list)  # the alive() call in flight, at most one

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"


def main(argv: list[str] | None = None) -> int:
    rargs, args = parse_args(list(sys.argv[1:] if argv is None else argv))
    stop = stop_event_on_signals()

    ray = _connect(rargs)
    import shlex

    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    Host = ray.remote(ServiceHost)
    slots = [Slot("encoder", i, rargs.encoder_cpus, rargs.encoder_gpus, rargs.encoder_resources,
                  args.encoder_args, i) for i in range(args.encoders)]
    slots += [Slot("language", i, rargs.language_cpus, rargs.language_gpus,
                   rargs.language_resources, args.language_args, args.encoders + i)
              for i in range(args.languages)]
    pg, router, code, pki, model, probe_pem = None, None, 0, None, "", None

    def launch(slot: Slot) -> None:
        """A fresh actor in the slot's bundle, its service's start() in flight."""
        slot.actor = Host.options(
            name=f"tandem-{slot.name}", num_cpus=slot.cpus, num_gpus=slot.gpus,
            resources=slot.resources, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=slot.bundle),
        ).remote(slot.name, slot.kind)
        slot.info, slot.checks = None, []
        port = int(slot.address.rsplit(":", 1)[1]) if slot.address else 0
        slot.pending = slot.actor.start.remote(
            model, ["--log-level", args.log_level, *shlex.split(slot.extra)], args.ready_timeout,
            args.encoder_nice if slot.kind == "encoder" else 0,
            launch_plan.tls_env(pki, slot.kind, inline=True), probe_pem, port)

    def addresses(kind: str) -> list[str]:
        return [s.address for s in slots if s.kind == kind]

    def start_router():
        r = launch_plan.router_child(args, model, addresses("encoder"), addresses("language"))
        r.env_extra.update(launch_plan.tls_env(pki, "router"))
        say(f"[up] router      starting http://{args.host}:{args.http_port}")
        r.start(dict(os.environ, PYTHONUNBUFFERED="1"))
        wait_ready([r], args.ready_timeout, stop)
        return r

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
        # SPREAD: bundles go to different nodes where possible (soft, unlike STRICT_SPREAD);
        # a bundle's custom resources confine it to the nodes that have them.
        pg = placement_group([{"CPU": s.cpus, **({"GPU": s.gpus} if s.gpus else {}),
                               **s.resources} for s in slots],
                             strategy="SPREAD", name=f"tandem-{os.getpid()}")
        ray.get(pg.ready(), timeout=args.ready_timeout)
        for slot in slots:  # every start runs in parallel, each on its actor
            launch(slot)
        for slot in slots:  # NOTE: reported in order
            while not stop.is_set() and not _started(ray, slot):
                stop.wait(0.5)
            if stop.is_set():
                raise KeyboardInterrupt
            info = slot.info
            say(f"[up] {slot.name:<11} ready   {info['address']:<21} "
                f"(node {info['node_ip']}, gpus [{info['gpus']}])")
        router = start_router()
        say(f"[up] ready: OpenAI API http://{args.host}:{args.http_port}/v1   "
            f"gRPC {args.host}:{args.grpc_port}   model {model}   (Ray)")
        say("[up] pids: " + " ".join(f"{s.name}={s.info['pid']}" for s in slots)
            + f" router={router.proc.pid}")
        if args.demo:
            from tandem.launch.demo import run_demo

            code = run_demo(args.host, args.http_port, args.api_key)
            if os.environ.get("DEMO_ONLY") == "1":
                return code
        while not stop.wait(2.0):
            if not router.alive:
                say(f"[up] router exited with code {router.proc.returncode}")
                return 1
            if _watch(ray, slots, launch):
                now = addresses("encoder") + addresses("language")
                say(f"[up] an instance came back at a new address: restarting the router "
                    f"with {now}")
                stop_all([[router]], args.stop_timeout)
                router = start_router()
                say(f"[up] router      ready again (pid {router.proc.pid})")
    except KeyboardInterrupt:
        pass
    except (RuntimeError, ray.exceptions.RayError, TimeoutError) as e:
        say(f"[up] error: {e}")
        code = 1
    finally:
        _teardown(ray, router, [s.actor for s in slots if s.actor is not None], pg,
                  args.stop_timeout, remove_placement_group)
        if pki is not None and not args.pki_dir:
            shutil.rmtree(pki.dir, ignore_errors=True)
        say("[up] stopped")
    return code


def _started(ray, slot: Slot) -> bool:
    """Whether the slot's start() finished; if so its service is recorded (or its error
    raised)."""
    done, _ = ray.wait([slot.pending], timeout=0)
    if not done:
        return False
    slot.info, slot.pending = ray.get(slot.pending), None
    slot.address = slot.info["address"]
    return True


def _watch(ray, slots: list[Slot], launch) -> bool:
    """One pass over the instances: a lost one (its actor dead, its node gone, or its
    service exited) is re-placed in its bundle; a replacement that became ready is
    reported. True when a replacement is serving at another address than its
    predecessor (the router must learn it)."""
    moved = False
    for slot in slots:
        if slot.pending is not None:  # (re)starting: Ray places it once its bundle can be
            try:
                if not _started(ray, slot):
                    continue
            except ray.exceptions.RayError as e:  # lost again before it served
                say(f"[up] {slot.name} failed to start ({type(e).__name__}): re-placing")
                _kill(ray, slot.actor)
                launch(slot)
                continue
            say(f"[up] {slot.name:<11} re-placed {slot.info['address']:<21} "
                f"(node {slot.info['node_ip']}, replacement {slot.replaced})")
            moved |= slot.lost_address != slot.address
            slot.lost_address = ""
            continue
        if not slot.checks:
            slot.checks.append(slot.actor.alive.remote())
        done, _ = ray.wait(slot.checks, timeout=0)
        if not done:  # NOTE: a check unanswered is not a loss: Ray says when the node died
            continue
        try:
            alive = ray.get(slot.checks.pop())
            why = "its service exited"
        except ray.exceptions.RayError as e:
            alive, why = False, f"{type(e).__name__}: its actor or node is gone"
        if alive:
            continue
        lost = slot.info
        say(f"[up] {slot.name} lost at {lost['address']} (node {lost['node_ip']}): {why}; "
            "re-placing it in its bundle (Ray moves the bundle once a node can hold it)")
        _kill(ray, slot.actor)  # frees its bundle; a dead one (the usual case) stays dead
        slot.replaced += 1
        slot.lost_address = lost["address"]
        launch(slot)
    return moved


def _kill(ray, actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except ray.exceptions.RayError as e:  # NOTE: gone already: nothing left to free
        say(f"[up] kill: {type(e).__name__}")


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
