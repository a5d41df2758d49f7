"""`tandem up`'s supervisor: a tier instance that exits unexpectedly is restarted, as a
process manager would.

    sup = Supervisor(encoders + languages, RestartPolicy(...), env, metrics_registry)
    while not stop.is_set():
        sup.tick()                       # exits seen, restarts due, readiness of restarts

Rules (`tandem up --max-restarts N --restart-window S --restart-backoff B
--restart-backoff-max M`):
- Only an instance that exits while `tandem up` runs is restarted: the main loop stops
  calling `tick` once Ctrl-C / SIGTERM set its stop event, before anything is stopped, so
  an intentional shutdown restarts nothing. An instance that dies before the cluster was
  first ready ends the launch instead (a bad flag would only die again).
- The restart that would be the N+1-th within the last S seconds is not made: the
  instance stays down, in state FAILED, said at ERROR level; the router keeps serving with
  the other instances (its /health shows the tier's healthy count drop).
- Before restart k (k-th within the window) the supervisor waits B * 2**(k-1) seconds,
  at most M. Restarts age out of the window, so a long-stable instance starts over at B.
- A restarted instance runs the same command line: the same gRPC, metrics and Mooncake
  ports, so the router's static address list stays true; the router probes an ejected
  instance back by itself.
- Each exit and restart is one log line (instance, exit status or signal, restart k of
  N, the delay), and counted: `tandem_up_restarts_total{instance}` and
  `tandem_up_instance_state{instance,state}` on the launcher's metrics endpoint.
"""

from __future__ import annotations

import collections
import enum
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem.launch.procs import Child, probe, say


class InstanceState(enum.Enum):
    RUNNING = "running"  # serving (ready once, and not seen exiting since)
    BACKOFF = "backoff"  # exited; restarts when its delay has passed
    STARTING = "starting"  # restarted, not yet SERVING
    FAILED = "failed"  # exited past --max-restarts within --restart-window: stays down


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int  # within window_s; 0: never restart
    window_s: float
    backoff_s: float
    backoff_max_s: float

    def delay_s(self, attempt: int) -> float:
        """The wait before restart `attempt` (1-based, counted within the window)."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))


def describe_exit(returncode: int) -> str:
    """`exit status 3` or `signal SIGKILL` (Popen's negative return code)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


@dataclass
class Supervised:
    """One instance under supervision."""

    child: Child
    state: InstanceState = InstanceState.RUNNING
    restarts: int = 0  # made since `tandem up` started
    recent: collections.deque = field(default_factory=collections.deque)  # their times
    restart_at: float = 0.0  # in BACKOFF: when the restart is due


class SupervisorMetrics:
    """The launcher's own series (its --metrics-port)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.restarts = Counter(
            "tandem_up_restarts", "Restarts tandem up made of an instance that exited "
            "unexpectedly.", ["instance"], registry=registry)
        self.exits = Counter(
            "tandem_up_unexpected_exits", "Exits of an instance that tandem up did not ask for.",
            ["instance"], registry=registry)
        self.state = Gauge(
            "tandem_up_instance_state", "1 for the instance's current state (running, "
            "backoff, starting, failed), 0 for the others.", ["instance", "state"],
            registry=registry)


class Supervisor:
    """Watches running instances; restarts the ones that exit (module docstring)."""

    def __init__(self, children: list[Child], policy: RestartPolicy, env: dict[str, str],
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.env = env
        self.clock = clock
        self.instances = [Supervised(c) for c in children]
        self.metrics = SupervisorMetrics(registry or CollectorRegistry())
        for s in self.instances:
            self.metrics.restarts.labels(s.child.name)  # each series exists from the start
            self.metrics.exits.labels(s.child.name)
            self._set_state(s, InstanceState.RUNNING)

    def _set_state(self, s: Supervised, state: InstanceState) -> None:
        s.state = state
        for st in InstanceState:
            self.metrics.state.labels(s.child.name, st.value).set(1 if st is state else 0)

    @property
    def failed(self) -> list[str]:
        return [s.child.name for s in self.instances if s.state is InstanceState.FAILED]

    def tick(self) -> None:
        """One pass: note exits, make the restarts that are due, see restarts get ready."""
        for s in self.instances:
            if s.state in (InstanceState.RUNNING, InstanceState.STARTING) and not s.child.alive:
                self._exited(s)
            elif s.state is InstanceState.BACKOFF and self.clock() >= s.restart_at:
                self._restart(s)
            elif s.state is InstanceState.STARTING and probe(s.child, timeout=0.5):
                self._set_state(s, InstanceState.RUNNING)
                say(f"[up] {s.child.name:<11} ready   {s.child.grpc_address:<21} again after "
                    f"restart {s.restarts}")

    def _exited(self, s: Supervised) -> None:
        c = s.child
        how = describe_exit(c.proc.returncode)
        # NOTE: its process group too, before anything else: a grandchild (a tensor-parallel
        # rank) must not outlive it and hold its ports against the restart
        c.kill_group()
        c.join_logs()
        self.metrics.exits.labels(c.name).inc()
        now = self.clock()
        while s.recent and now - s.recent[0] > self.policy.window_s:
            s.recent.popleft()
        p = self.policy
        if len(s.recent) >= p.max_restarts:
            self._set_state(s, InstanceState.FAILED)
            say(f"[up] ERROR {c.name} exited unexpectedly ({how}) after {len(s.recent)} "
                f"restart(s) within {p.window_s:g} s (--max-restarts {p.max_restarts}, "
                f"--restart-window {p.window_s:g}): it stays DOWN until tandem up is "
                "restarted; the cluster serves with its other instances. Its last lines:")
            for line in list(c.tail)[-15:]:
                say(f"[up]   {line}")
            return
        s.recent.append(now)
        attempt = len(s.recent)
        delay = p.delay_s(attempt)
        s.restart_at = now + delay
        self._set_state(s, InstanceState.BACKOFF)
        say(f"[up] WARNING {c.name} exited unexpectedly ({how}); restart {attempt} of "
            f"{p.max_restarts} within {p.window_s:g} s in {delay:g} s")

    def _restart(self, s: Supervised) -> None:
        c = s.child
        c.start(self.env)
        s.restarts += 1
        self.metrics.restarts.labels(c.name).inc()
        self._set_state(s, InstanceState.STARTING)
        say(f"[up] {c.name:<11} restarted {c.grpc_address} pid={c.proc.pid} "
            f"(restart {s.restarts} since start)")
