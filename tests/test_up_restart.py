"""`tandem up` as a process manager, and its ports bounded by one flag.

The supervisor (tandem/launch/supervise.py) on real processes without the tiers: a child
that keeps exiting is restarted with doubling delays, up to the cap, then stays down in
state FAILED, each exit logged and counted; restarts age out of the window. The port plan
under --port-range: every port from the range, a range too small refused at start (and by
`tandem serve --dry-run`); under --ray they are refused. End to end: under `tandem up --port-range`, every listening port
of the cluster lies in the range; SIGKILL of a language and of an encoder instance is
followed by its restart on the same address, the restart counted on the launcher's
metrics, and a chat with an image answering through the router; SIGTERM of `tandem up`
then restarts nothing.

No test here bounds a duration: waits end on the state they wait for (tests/waiting.py).
"""

from __future__ import annotations

import base64
import io
import os
import random
import re
import signal
import sys

import httpx
import psutil
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until

from tandem.launch.plan import RANGE_TRANSFER_PORTS, parse_args, plan
from tandem.launch.procs import (
    PORT_RANGE_ENV,
    Child,
    PortRange,
    PortsExhausted,
    free_block,
    free_port,
    port_bindable,
    stop_all,
)
from tandem.launch.supervise import InstanceState, RestartPolicy, Supervisor

EXITS = [sys.executable, "-c", "raise SystemExit(3)"]


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value
            for m in registry.collect() for s in m.samples if s.name == name}


def test_restart_delays_double_up_to_the_longest():
    p = RestartPolicy(max_restarts=10, window_s=300, backoff_s=1.0, backoff_max_s=5.0)
    assert [p.delay_s(k) for k in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def _exited(s) -> bool:
    return s.child.proc.poll() is not None


def test_an_instance_that_keeps_exiting_is_restarted_up_to_the_cap_then_stays_down(capsys):
    child = Child("language-0", EXITS, "127.0.0.1:1")
    child.start(None)
    registry = CollectorRegistry()
    sup = Supervisor([child], RestartPolicy(2, 1000.0, 0.0, 0.0), dict(os.environ), registry)
    (s,) = sup.instances
    try:
        wait_until(lambda: (_exited(s) and sup.tick(), s.state)[1] is InstanceState.FAILED,
                   timeout_s=60, what="the instance given up", state=lambda: s)
    finally:
        stop_all([[child]], 1.0)
    assert s.restarts == 2 and sup.failed == ["language-0"]
    out = capsys.readouterr().out
    assert "language-0 exited unexpectedly (exit status 3); restart 1 of 2" in out, out
    assert "restart 2 of 2 within 1000 s in 0 s" in out, out
    assert "ERROR language-0 exited unexpectedly (exit status 3) after 2 restart(s)" in out
    assert "stays DOWN" in out
    assert _samples(registry, "tandem_up_restarts_total") == {(("instance", "language-0"),): 2}
    assert _samples(registry, "tandem_up_unexpected_exits_total") == {
        (("instance", "language-0"),): 3}
    states = _samples(registry, "tandem_up_instance_state")
    assert {dict(k)["state"]: v for k, v in states.items()} == {
        "running": 0, "backoff": 0, "starting": 0, "failed": 1}


def test_restarts_age_out_of_the_window_and_a_signal_is_named(capsys):
    """Restarts older than --restart-window no longer count: an instance that exits once
    in a long while is restarted each time, the delay back at --restart-backoff."""
    now = [0.0]
    child = Child("encoder-0", [sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"],
                  "127.0.0.1:1")
    child.start(None)
    sup = Supervisor([child], RestartPolicy(1, 10.0, 0.5, 8.0), dict(os.environ),
                     clock=lambda: now[0])
    (s,) = sup.instances
    try:
        for t in (0.0, 20.0, 40.0):  # each exit past the window of the one before
            now[0] = t
            wait_until(lambda: _exited(s), timeout_s=60, what="the child's exit")
            sup.tick()
            assert s.state is InstanceState.BACKOFF
            now[0] = t + 0.5  # its delay has passed
            sup.tick()
            assert s.state is InstanceState.STARTING
    finally:
        stop_all([[child]], 1.0)
    assert s.restarts == 3 and not sup.failed
    out = capsys.readouterr().out
    # each exit past the window: restart 1 of 1 again, at the first delay, its signal named.
    # NOTE: SIGKILL each time. Once in CI a restarted child forked by this (gRPC-laden)
    # pytest process aborted in Python's preexec hook before its exec (SIGABRT); children
    # now run no Python between fork and exec (procs.ChildLaunch), so that is a failure
    exits = re.findall(r"encoder-0 exited unexpectedly \(signal (SIG\w+)\); restart 1 of 1 "
                       r"within 10 s in 0\.5 s", out)
    assert exits == ["SIGKILL"] * 3, out


def test_max_restarts_0_never_restarts(capsys):
    child = Child("encoder-0", EXITS, "127.0.0.1:1")
    child.start(None)
    sup = Supervisor([child], RestartPolicy(0, 300.0, 1.0, 30.0), dict(os.environ))
    (s,) = sup.instances
    wait_until(lambda: _exited(s), timeout_s=60, what="the child's exit")
    sup.tick()
    stop_all([[child]], 1.0)
    assert s.state is InstanceState.FAILED and s.restarts == 0


def _flag(c: Child, name: str) -> int:
    return int(c.argv[c.argv.index(name) + 1])


@pytest.fixture
def no_ports_handed_out(monkeypatch):
    """free_port never hands a port out twice in one process; by the time a whole suite
    reaches these tests, earlier tests' random picks can cover every block of a range
    (seen in CI: PortsExhausted). The plan is made as a fresh `tandem up` makes it."""
    from tandem.launch import procs

    monkeypatch.setattr(procs, "_HANDED_OUT", set())


def _bindable_range(width: int) -> PortRange:
    """`width` ports below 32768 (Mooncake's part), every one free now: not a fixed range,
    which another test's cluster (another pytest worker's) may hold a port of."""
    starts = list(range(28000, 32768 - width, width))
    random.shuffle(starts)
    for lo in starts:
        if all(port_bindable("127.0.0.1", p) for p in range(lo, lo + width)):
            return PortRange(lo, lo + width - 1)
    raise PortsExhausted(f"no {width} free ports below 32768")


def test_every_port_of_the_plan_comes_from_the_port_range(no_ports_handed_out):
    r = _bindable_range(80)
    args = parse_args(["--model", "/m", "--encoders", "2", "--languages", "2",
                       "--port-range", str(r), "--http-port", str(r.lo),
                       "--language-args", "--tp 2"])
    encoders, languages, router = plan(args, "/m")
    ports = []
    for c in encoders + languages:
        ports += [int(c.grpc_address.rsplit(":", 1)[1]), _flag(c, "--metrics-port")]
        lo, hi = _flag(c, "--transfer.min-port"), _flag(c, "--transfer.max-port")
        # a Mooncake engine per encoder and per tensor-parallel rank, each with its ports
        assert hi - lo + 1 == RANGE_TRANSFER_PORTS * (2 if c in languages else 1)
        ports += range(lo, hi + 1)
    # a tensor-parallel instance picks its rendezvous port itself: from a block of its own
    for c in languages:
        block = PortRange.parse(c.env_extra[PORT_RANGE_ENV])
        ports += range(block.lo, block.hi + 1)
    assert all(p in r for p in ports) and len(set(ports)) == len(ports)
    assert r.lo not in ports  # the router's --http-port, named by the caller


def test_a_child_picks_its_own_ports_from_its_range(monkeypatch, no_ports_handed_out):
    """A tier given TANDEM_PORT_RANGE (a tensor-parallel language instance under
    --port-range) takes its own ports from it, and its settings still parse (the variable
    is the launcher's, not a setting)."""
    from tandem.config import parse_settings
    from tandem.tiers import TIERS

    r = _bindable_range(4)
    monkeypatch.setenv(PORT_RANGE_ENV, str(r))
    assert {free_port() for _ in range(4)} == set(range(r.lo, r.hi + 1))
    cfg = parse_settings(TIERS["language"].config(), ["--model", "/m", "--insecure-internal"],
                         "tandem language")
    assert cfg.port


@pytest.mark.parametrize("argv,text", [
    (["--port-range", "30000-30010", "--encoders", "2"],
     "--port-range 30000-30010 has 11 ports; this plan needs 31: 3 gRPC, 24 Mooncake (8 per "
     "encoder and language rank), 3 metrics, 1 the launcher's metrics"),
    (["--port-range", "30000-30029", "--language-args", "--tp 2"],
     "this plan needs 31: 2 gRPC, 24 Mooncake (8 per encoder and language rank), 2 metrics, "
     "2 tensor-parallel rendezvous (2 each), 1 the launcher's metrics"),
    (["--port-range", "40000-40999"],
     "--port-range 40000-40999: Mooncake's transfer ports must lie below 32768"),
    (["--port-range", "31000-30000"], "wants LO-HI with 1024 <= LO <= HI <= 65535"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
])
def test_a_port_range_too_small_or_bad_restart_flags_are_refused_at_start(argv, text, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert text in capsys.readouterr().err


def test_serve_dry_run_refuses_a_port_range_too_small(capsys, checkpoint):
    from tandem.launch.serve import main as serve

    model = str(checkpoint("qwen2_5_vl"))
    assert serve([model, "--port-range", "30000-30010", "--dry-run"]) == 2
    assert "--port-range 30000-30010 has 11 ports" in capsys.readouterr().err
    assert serve([model, "--port-range", "30000-30999", "--max-restarts", "2",
                  "--dry-run"]) == 0
    line = capsys.readouterr().out
    assert "--port-range 30000-30999" in line and "--max-restarts 2" in line


def test_the_ray_launcher_refuses_the_local_only_flags(capsys, checkpoint):
    """Under --ray the actors' ports and replacement are Ray's: the local launcher's port
    plan and restart flags would be accepted and ignored there, so they are refused."""
    from tandem.launch import up
    from tandem.launch.serve import main as serve

    assert up(["--ray", "local", "--port-range", "30000-30999", "--max-restarts=2"]) == 2
    assert "--port-range, --max-restarts: only for the local launcher" in capsys.readouterr().err
    model = str(checkpoint("qwen2_5_vl"))
    assert serve([model, "--ray", "local", "--restart-window", "60", "--dry-run"]) == 2
    assert "--restart-window: only for the local launcher" in capsys.readouterr().err


# --- end to end --------------------------------------------------------------------------

def _png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 90)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(cl, model: str) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": _png()}},
               {"type": "text", "text": "Describe the picture."}]
    return httpx.post(f"{cl.http_url}/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 4,
        "messages": [{"role": "user", "content": content}]})


def _launcher_metrics(cl) -> dict[tuple[str, str], float]:
    """{(series name, instance[/state]): value} from the launcher's /metrics."""
    out = {}
    try:
        text = httpx.get(cl.metrics_url, timeout=10).text
    except httpx.HTTPError:
        return out
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.labels.get("instance", "")
            if "state" in s.labels:
                key += "/" + s.labels["state"]
            out[(s.name, key)] = s.value
    return out


def _listening_ports(pid: int) -> set[int]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    out = set()
    for p in procs:
        try:
            out |= {c.laddr.port for c in p.net_connections("tcp") if c.status == "LISTEN"}
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.timeout(300)
def test_a_killed_instance_is_restarted_and_the_cluster_answers_again(checkpoint,
                                                                     no_ports_handed_out):
    from tandem.launch.cluster import LocalCluster

    # 64 ports below 32768 (Mooncake's part), the first two free: the router's
    r = free_block("127.0.0.1", 64, PortRange(28000, 32767))
    cl = LocalCluster(str(checkpoint("qwen2_5_vl")), http_port=r.lo, grpc_port=r.lo + 1,
                      up_args=["--port-range", str(r), "--restart-backoff", "0.2"])
    with cl:
        model = httpx.get(f"{cl.http_url}/v1/models", timeout=30).json()["data"][0]["id"]
        assert _chat(cl, model).status_code == 200
        ports = _listening_ports(cl.proc.pid)
        assert ports and all(p in r for p in ports), (sorted(ports), r)
        for name in ("language-0", "encoder-0"):
            old = cl.instances[name]
            before = (old.address, old.pid)
            os.kill(old.pid, signal.SIGKILL)
            wait_until(lambda name=name: _launcher_metrics(cl), timeout_s=200,
                       what=f"{name} restarted and running",
                       until=lambda m, name=name: (
                           m.get(("tandem_up_restarts_total", name)) == 1
                           and m.get(("tandem_up_instance_state", f"{name}/running")) == 1))
            assert cl.instances[name].address == before[0]  # same ports: the router's list
            assert cl.instances[name].pid != before[1]
            # the router ejected it on its failures and probes it back: a state, not a time
            wait_until(lambda: httpx.get(f"{cl.http_url}/ready", timeout=10), timeout_s=120,
                       what="every tier serving", until=lambda h: h.status_code == 200)
            r2 = _chat(cl, model)
            assert r2.status_code == 200, r2.text
            assert r2.json()["choices"][0]["message"]["content"] is not None
        ports = _listening_ports(cl.proc.pid)
        assert all(p in r for p in ports), (sorted(ports), r)
        log = cl.log_text()
        assert "WARNING language-0 exited unexpectedly (signal SIGKILL); restart 1 of 5" in log
        assert "WARNING encoder-0 exited unexpectedly (signal SIGKILL); restart 1 of 5" in log
        code = cl.stop(signal.SIGTERM)
    assert code == 0, cl.log_text()[-3000:]
    after = cl.log_text().split("SIGTERM: stopping the cluster", 1)[1]
    assert "exited unexpectedly" not in after and "restarted" not in after, after
