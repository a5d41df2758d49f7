"""`tandem up` plumbing without the tiers: argument checks, the plan of child commands
(distinct ports and Mooncake ranges), and the supervisor's stop escalation on real
processes (a child that ignores SIGTERM and has a grandchild is killed with its group)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
from waiting import wait_until

from tandem.launch.plan import parse_args, plan, transfer_ranges
from tandem.launch.procs import Child, ChildLaunch, stop_all, wait_ready
from tandem.pki import make_pki


def test_parse_args_rejects_zero_instances(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--encoders", "0"])
    assert "--encoders" in capsys.readouterr().err


def test_tier_args_may_start_with_a_dash():
    # `tandem up --language-args "--no-prefix-cache"`: a value that is itself a flag
    a = parse_args(["--language-args", "--no-prefix-cache --kv-pages 64",
                    "--router-args=--no-encoder-bypass", "--encoder-args", "--max-images 2"])
    assert a.language_args == "--no-prefix-cache --kv-pages 64"
    assert a.router_args == "--no-encoder-bypass" and a.encoder_args == "--max-images 2"


def test_port_flags_in_tier_args_work_or_are_refused_in_one_line(capsys):
    one = parse_args(["--encoder-args", "--metrics-port 9999"])  # one encoder: honoured
    (enc,), _, _ = plan(one, "/m")
    assert enc.argv.count("--metrics-port") == 1 and enc.metrics_url.endswith(":9999/metrics")
    for argv, text in ((["--encoders", "2", "--encoder-args", "--metrics-port 9999"],
                        "--metrics-port with 2 encoders"),
                       (["--language-args", "--port=7000"], "--port is assigned")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert text in capsys.readouterr().err


def test_plan_gives_distinct_ports_and_transfer_ranges(tmp_path):
    args = parse_args(["--model", "/m", "--encoders", "2", "--languages", "3",
                       "--language-args", "--default-reservation-tokens 64", "--api-key", "k"])
    pki = make_pki(tmp_path / "pki")
    encoders, languages, router = plan(args, "/m", pki)
    assert [c.name for c in encoders + languages] == [
        "encoder-0", "encoder-1", "language-0", "language-1", "language-2"]
    ports = {c.grpc_address for c in encoders + languages}
    assert len(ports) == 5

    def flag(c, name):
        return int(c.argv[c.argv.index(name) + 1])

    ranges = sorted((flag(c, "--transfer.min-port"), flag(c, "--transfer.max-port"))
                    for c in encoders + languages)
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert languages[0].argv[-4:-2] == ["--default-reservation-tokens", "64"]
    # tier metrics on, a port of its own per instance, printed with its ready line
    metrics = [flag(c, "--metrics-port") for c in encoders + languages]
    assert len(set(metrics) | {int(a.split(":")[1]) for a in ports}) == 10
    assert all(c.metrics_url == f"http://127.0.0.1:{m}/metrics"
               for c, m in zip(encoders + languages, metrics, strict=True))
    r = router.argv
    assert r[r.index("--encoders") + 1] == ",".join(c.grpc_address for c in encoders)
    assert r[r.index("--languages") + 1] == ",".join(c.grpc_address for c in languages)
    assert "--api-key" not in r and router.env_extra["TANDEM_API_KEY"] == "k"
    # each child gets its own role's certificate, through the environment (not argv), and
    # plaintext is explicitly off whatever the launcher's own environment says
    for c in [router, *encoders, *languages]:
        role = c.name.split("-")[0]
        assert c.env_extra["TANDEM_INTERNAL_TLS__CA"] == str(pki.ca)
        assert c.env_extra["TANDEM_INTERNAL_TLS__CERT"] == str(pki.cert(role))
        assert c.env_extra["TANDEM_INTERNAL_TLS__KEY"] == str(pki.key(role))
        assert c.env_extra["TANDEM_INSECURE_INTERNAL"] == "false"
        assert not any("tls" in a for a in c.argv), c.argv
    encoders, languages, router = plan(args, "/m", None)  # --insecure-internal
    assert all(c.env_extra.get("TANDEM_INSECURE_INTERNAL") == "1" and
               "TANDEM_INTERNAL_TLS__CERT" not in c.env_extra
               for c in [router, *encoders, *languages])
    assert router.health_service == "tandem.v1.Router"
    assert all(lo < hi for lo, hi in transfer_ranges(4))


STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("stubborn up", flush=True)
    time.sleep(600)
""")


def test_stop_all_kills_stubborn_child_and_grandchild():
    c = Child("stubborn-0", [sys.executable, "-c", STUBBORN], "127.0.0.1:1")
    c.start(env=None)
    for _ in range(100):
        kids = psutil.Process(c.proc.pid).children(recursive=True)
        if kids and any("stubborn up" in line for line in c.tail):
            break
        threading.Event().wait(0.05)
    tree = [psutil.Process(c.proc.pid)] + kids
    assert len(tree) == 2
    stop_all([[c]], timeout_s=0.5)
    _, alive = psutil.wait_procs(tree, timeout=5)
    assert alive == []


def test_wait_ready_reports_a_dead_child():
    c = Child("broken-0", [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"],
              "127.0.0.1:1")
    c.start(env=None)
    c.proc.wait(30)
    with pytest.raises(RuntimeError, match="broken-0 exited with code 3"):
        wait_ready([c], timeout_s=10, stop=threading.Event())
    stop_all([[c]], timeout_s=1)


PARENT = textwrap.dedent("""
    import sys, time
    from tandem.launch.procs import Child
    c = Child("sleeper-0", [sys.executable, "-c", "import time; time.sleep(600)"], "127.0.0.1:1")
    c.start(env=None)
    print(c.proc.pid, flush=True)
    time.sleep(600)
""")


def test_children_die_with_a_killed_launcher():
    """kill -9 of the launcher itself: PR_SET_PDEATHSIG takes the children down too."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    child = psutil.Process(child_pid)
    parent.kill()
    parent.wait()
    _, alive = psutil.wait_procs([child], timeout=10)
    assert alive == []


def test_free_port_never_hands_out_a_port_twice():
    from tandem.launch.procs import free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_free_ports_stay_out_of_the_ephemeral_mooncake_and_ray_ranges():
    """A port in the kernel's ephemeral range can be taken by any outgoing connection before
    the child binds it (a CI failure); Mooncake's windows and Ray's worker ports 10002-19999
    must not be shared either."""
    from tandem.launch.plan import MOONCAKE_WINDOW, transfer_ranges
    from tandem.launch.procs import SERVICE_WINDOW, _ephemeral_low, free_port

    eph_low = _ephemeral_low()
    if min(SERVICE_WINDOW[1], eph_low) - SERVICE_WINDOW[0] < 1000:
        pytest.skip(f"this host's ephemeral range starts at {eph_low}: kernel ports are used")
    for port in (free_port() for _ in range(100)):
        assert SERVICE_WINDOW[0] <= port < min(SERVICE_WINDOW[1], eph_low)
        assert not MOONCAKE_WINDOW[0] <= port < MOONCAKE_WINDOW[1]
        assert not 10002 <= port <= 19999
    for lo, hi in transfer_ranges(4):
        assert MOONCAKE_WINDOW[0] <= lo <= hi < MOONCAKE_WINDOW[1] <= SERVICE_WINDOW[0]


def test_grpc_servers_refuse_a_taken_port():
    """With gRPC's default SO_REUSEPORT a second server binds a taken port and silently
    shares its connections; every service's server (grpc_server) makes it a bind error."""
    import asyncio

    from tandem.serving import bind, grpc_server

    async def main() -> None:
        first = grpc_server()
        port = bind(first, "127.0.0.1:0", "first")
        second = grpc_server(max_send_message_length=1 << 20)
        try:
            with pytest.raises(SystemExit, match="cannot bind"):
                bind(second, f"127.0.0.1:{port}", "second")
        finally:
            await first.stop(None)
            await second.stop(None)

    asyncio.run(main())


def test_encoders_run_at_a_lower_priority_than_the_other_tiers():
    """`tandem up` starts encoders at `--encoder-nice` (default 10) and every other tier at
    the launcher's own priority; the child really runs at that niceness (read back from
    the process), and 0 turns it off."""
    encs, langs, router = plan(parse_args(["--encoders", "2"]), "/m")
    assert [c.nice for c in encs] == [10, 10]
    assert [c.nice for c in langs] == [0] and router.nice == 0
    (enc,), _, _ = plan(parse_args(["--encoder-nice", "0"]), "/m")
    assert enc.nice == 0
    with pytest.raises(SystemExit):
        parse_args(["--encoder-nice", "25"])

    base = psutil.Process().nice()
    child = Child("c", [sys.executable, "-c", "import time; time.sleep(30)"], "", nice=7)
    child.start(None)
    try:
        proc = psutil.Process(child.proc.pid)
        # the pid execs setpriv, then nice, then the command (ChildLaunch): read it there
        wait_until(lambda: proc.cmdline()[:1] == [sys.executable], timeout_s=30,
                   what="the exec of the command", state=proc.cmdline)
        assert proc.nice() == min(base + 7, 19)
    finally:
        child.kill_group()


def test_children_are_started_with_no_python_between_fork_and_exec():
    """Where util-linux's setpriv exists (Debian's images: always), the death signal and
    niceness are set by programs exec'd in front of the command, so subprocess runs no
    Python hook in the forked child (a child forked from a process with gRPC's threads
    aborted in such a hook once); elsewhere the hook does it."""
    launch = ChildLaunch.of(["prog", "arg"], death=signal.SIGKILL, nice=3)
    if shutil.which("setpriv") is None:
        assert launch.argv == ["prog", "arg"] and launch.preexec is not None
        return
    assert launch.preexec is None
    assert launch.argv[1:3] == ["--pdeathsig=KILL", "--"] and launch.argv[-2:] == ["prog", "arg"]
    assert launch.argv[-5:-2] == [shutil.which("nice"), "-n", "3"]
    assert ChildLaunch.of(["prog"]).argv[1:3] == ["--pdeathsig=TERM", "--"]


def test_a_child_whose_launcher_is_gone_before_its_death_signal_is_set_does_not_run():
    """The death signal only covers a launcher that dies after it is set; one killed
    between fork and the prctl (a CI failure) re-parents the child first. The child then
    sees a parent other than its launcher and exits instead of running orphaned: here the
    launch is started by a shell in between, as a re-parented child would be."""
    launch = ChildLaunch.of([sys.executable, "-c", "print('ran')"])
    if launch.preexec is not None:
        pytest.skip("no setpriv here: the hook's check runs only under subprocess")
    r = subprocess.run(["sh", "-c", '"$@"; exit $?', "sh", *launch.argv], capture_output=True,
                       text=True, timeout=60)
    assert r.stdout == "" and r.returncode == 128 + signal.SIGTERM
    r = subprocess.run(launch.argv, capture_output=True, text=True, timeout=60)
    assert r.stdout == "ran\n" and r.returncode == 0


def test_up_help_names_the_ray_launcher():
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "up", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--ray [ADDRESS]" in r.stdout and "RAY_AUTH_TOKEN" in r.stdout
    assert "--insecure-internal" in r.stdout and "--pki-dir" in r.stdout


@pytest.mark.parametrize("kind", ["encoder", "language", "router", "up"])
def test_a_taken_port_stops_each_server_in_one_line(kind, checkpoint):
    """A second server on a port already in use exits non-zero with one line naming the
    port and no traceback: each tier (it checks the port before its model loads) and
    `tandem up` (before any tier starts; its router would bind last). How long that takes
    is not asserted; the run's timeout is only a hang guard."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flag = {"encoder": "--port", "language": "--port", "router": "--http-port",
                "up": "--http-port"}[kind]
        argv = [sys.executable, "-m", "tandem.cli", kind, "--model",
                str(checkpoint("qwen2_5_vl")), flag, str(port)]
        if kind != "up":
            argv.append("--insecure-internal")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if "cannot listen" in ln]
    assert len(errors) == 1 and f"127.0.0.1:{port} ({flag})" in errors[0], r.stderr
    assert "Traceback" not in r.stderr, r.stderr



def test_mooncakes_benign_start_up_lines_show_only_at_debug():
    """Mooncake logs through glog at warning and error level on every healthy TCP start;
    the launcher shows those lines at --log-level debug only, and any other glog line in
    the launcher's shape, with its level."""
    from tandem.launch.procs import native_line

    benign = ["WARNING: Logging before InitGoogleLogging() is written to STDERR",
              "W1125 17:33:10.823345 28818 topology.cpp:201] No RDMA devices found, check "
              "your device installation",
              "E1125 17:33:10.823823 28818 transfer_metadata.cpp:1098] Local segment "
              "descriptor not found"]
    assert [native_line(ln, "info") for ln in benign] == [None] * 3
    assert all(native_line(ln, "debug").startswith("mooncake DEBUG") for ln in benign)
    other = "E1125 17:33:11.000001 28818 transfer_engine.cpp:77] connection refused by peer"
    assert native_line(other, "info") == ("mooncake ERROR transfer_engine.cpp:77 connection "
                                          "refused by peer")
    assert native_line("2026-11-25 17:33:11,000 INFO tandem.language ready", "info") == (
        "2026-11-25 17:33:11,000 INFO tandem.language ready")


@pytest.mark.parametrize("kind,fmt", [("encoder", "text"), ("language", "json")])
def test_a_tier_on_its_own_logs_as_under_tandem_up(kind, fmt, checkpoint, tmp_path):
    """A tier started on its own (a pod's `tandem encoder ...`) runs under the launcher's
    log filter: Mooncake's glog lines become records of logger `mooncake` in the tier's
    --log-format, its benign start-up lines at DEBUG, so a healthy start prints no
    WARNING or ERROR line; SIGTERM reaches the tier, which drains and exits 0, and nothing
    is left running. Under `tandem up` the tier runs directly (its launcher filters)."""
    import json
    import signal

    from waiting import wait_until

    from tandem.launch.procs import FILTERED_ENV, free_port

    pki = make_pki(tmp_path / "pki")
    err = tmp_path / "stderr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    argv = [sys.executable, "-m", "tandem.cli", kind, "--model", str(checkpoint("qwen2_5_vl")),
            "--port", str(free_port()), "--internal-tls.ca", str(pki.ca),
            "--internal-tls.cert", str(pki.cert(kind)), "--internal-tls.key", str(pki.key(kind))]
    if kind == "language":
        argv += ["--kv-pages", "64"]
    if fmt == "json":
        argv += ["--log-format", "json", "--log-level", "debug"]
    with err.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=sink, env=env)
    try:
        wait_until(lambda: f"{kind} ready on" in err.read_text() or proc.poll() is not None,
                   timeout_s=120,
                   what=f"the {kind}'s ready line", state=err.read_text)
        assert proc.poll() is None, err.read_text()
        tier = psutil.Process(proc.pid).children()
        assert len(tier) == 1 and tier[0].environ().get(FILTERED_ENV) == "1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert not tier[0].is_running()
    text = err.read_text()
    assert f"{kind} stopped" in text, text
    if fmt == "text":
        loud = [ln for ln in text.splitlines() if " WARNING " in ln or " ERROR " in ln
                or ln[:1] in ("W", "E")]
        assert loud == [], text
        return
    records = [json.loads(ln) for ln in text.splitlines()]  # every line a JSON record
    assert not [r for r in records if r["level"] in ("WARNING", "ERROR", "CRITICAL")], text
    benign = [r["msg"] for r in records if r["logger"] == "mooncake" and r["level"] == "DEBUG"]
    assert any("Local segment descriptor not found" in m for m in benign), text


def test_a_cpu_language_tier_without_kv_pages_stops_with_one_line(checkpoint):
    """kv_pages 0 sizes the pool from free GPU memory: on CPU that is one clear line before
    the weights load, not a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "language", "--model",
                        str(checkpoint("qwen2_5_vl")), "--insecure-internal"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1
    assert "--kv-pages is needed on cpu" in r.stderr.splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_no_instance_gets_the_routers_ports(monkeypatch):
    """The router's --http-port and --grpc-port are free until the router binds them (after
    the instances are up): an instance handed one of them left the router unable to listen
    (seen in CI). Every random pick lands on the router's ports first here."""
    import random

    from tandem.launch import procs

    args = parse_args(["--model", "/m", "--http-port", "24101", "--grpc-port", "24102"])
    picks = iter([24102, 24101] * 8 + list(range(24200, 24300)))
    monkeypatch.setattr(random, "randrange", lambda lo, hi: next(picks))
    monkeypatch.setattr(procs, "_ephemeral_low", lambda: 60000)
    encoders, languages, router = plan(args, "/m")
    taken = {int(c.grpc_address.rsplit(":", 1)[1]) for c in encoders + languages}
    taken |= {int(c.metrics_url.split(":")[-1].split("/")[0]) for c in encoders + languages}
    assert not taken & {24101, 24102}, taken
