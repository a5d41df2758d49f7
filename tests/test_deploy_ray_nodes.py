"""`tandem up --ray` on a Ray cluster of three nodes, each in its own network namespace
with its own private address (deploy/harness/netns.py), end to end (`make check-ray-nodes`).

    head 10.231.0.2: GCS, raylet, the launcher, the router (on the head's loopback) and
                     language-0 (resource tandem_language)
    w1   10.231.0.3: encoder-0 or -1 (resource tandem_encoder)
    w2   10.231.0.4: the other encoder
    w3   10.231.0.5: no Ray node at first; where capacity returns for a node lost for good

A chat is answered exactly (transformers' greedy tokens); the worker holding encoder-0 is
frozen, chats are sent (half of them to encoder-0 by the router's affinity), and once all
are in flight it is lost (every process in its namespace SIGKILLed, its link cut): the
ones on it are retried on the other encoder; chats go on through the other encoder with the same answer; the
node comes back (link up, `ray start --address` again), the launcher re-places encoder-0
in its bundle at its old address and the router counts two healthy encoders again; the
other worker is then lost for good and w3 joins: encoder-1 is re-placed there, at a new
address, and the restarted router serves through both; SIGINT stops the launcher and the
harness leaves no namespace and no process. The subnet exists
only inside the namespaces this test makes. Needs root and `ip`; slow (minutes).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deploy" / "harness"))
import netns  # noqa: E402

from tandem.services.router.dispatch.selection import rendezvous_order  # noqa: E402

GCS_PORT = 6379
TEXT, MAX_NEW = "What colour is this?", 8
HTTP_PORT, GRPC_PORT = 8000, 50051


def _image_data_url(seed: int = 0, side: int = 64) -> str:
    """A PNG of seeded noise (seed 0: a plain red one): distinct seeds, distinct images,
    so no encoder's cache answers for another's."""
    import numpy as np
    from PIL import Image

    if seed == 0:
        img = Image.new("RGB", (side, side * 3 // 4), (200, 40, 40))
    else:
        rng = np.random.default_rng(seed)
        img = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Lines:
    """The launcher's output, line by line, pumped on a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.proc = proc
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            self.lines.append(raw.decode(errors="replace").rstrip())

    def tail(self) -> str:
        return "\n".join(self.lines[-80:])

    def wait_for(self, pattern: str, what: str, timeout_s: float = 420) -> re.Match:
        rx = re.compile(pattern)

        def seen():
            assert self.proc.poll() is None, self.tail()
            return next((m for m in map(rx.search, self.lines) if m), None)

        return wait_until(seen, timeout_s=timeout_s, poll_s=0.5, what=what, state=self.tail)


def _image_hash(seed: int) -> str:
    """The router's affinity key of `_chat`'s image (services/router/request.py)."""
    url = _image_data_url(seed, 448 if seed else 64)
    return hashlib.sha256(base64.b64decode(url.split(",", 1)[1])).hexdigest()


def _chat(base: str, model: str, seed: int = 0) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _image_data_url(seed, 448 if seed else 64)}},
            {"type": "text", "text": TEXT},
        ]}],
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "logprobs": True,
        "return_tokens_as_token_ids": True,  # each token spelled `token_id:N`
    }
    r = httpx.post(f"{base}/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _token_ids(resp: dict) -> list[int]:
    return [int(t["token"].split(":", 1)[1]) for t in resp["choices"][0]["logprobs"]["content"]]


def _oracle(model: Path) -> list[int]:
    """transformers' greedy answer to `_chat`'s first chat (seed 0), end-of-text stripped."""
    from language_oracle import generate, load, make_inputs
    from PIL import Image

    hf, processor = load(model)
    url = _image_data_url(0, 64)
    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    tokens, _ = generate(hf, make_inputs(processor, TEXT, [img]), MAX_NEW)
    return _without_eos(tokens, hf.generation_config.eos_token_id)


def _without_eos(tokens: list[int], eos) -> list[int]:
    from test_e2e_cluster import strip_eos

    return strip_eos(tokens, set(eos if isinstance(eos, list | tuple) else [eos]))


def _metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=30).text
    rx = re.compile(rf"^{re.escape(name)}(?:_total)?{re.escape(labels)} ([0-9.e+-]+)$", re.M)
    m = rx.search(text)
    return float(m.group(1)) if m else 0.0


def _ray_start(net, node: str, temp: Path, env: dict, head: bool) -> None:
    ray_bin = str(Path(sys.executable).parent / "ray")
    resources = {"tandem_language": 1} if head else {"tandem_encoder": 1}
    argv = [ray_bin, "start", f"--node-ip-address={net.nodes[node].address}",
            "--num-gpus=0", f"--resources={json.dumps(resources)}",
            "--disable-usage-stats", f"--temp-dir={temp / node}"]
    if head:
        argv += ["--head", f"--port={GCS_PORT}", "--num-cpus=2", "--include-dashboard=false"]
    else:
        argv += [f"--address={net.nodes['head'].address}:{GCS_PORT}", "--num-cpus=1"]
    r = subprocess.run(net.argv(node, argv), env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, f"[{node}] ray start: {r.stdout[-2000:]}{r.stderr[-2000:]}"


def test_resources_flags_are_checked():
    from tandem.launch import ray_up

    rargs, _ = ray_up.parse_args(["--ray", "local", "--encoder-resources", '{"enc": 1}'])
    assert rargs.encoder_resources == {"enc": 1.0} and rargs.language_resources == {}
    for bad in ("[1]", '{"enc": 0}', '{"enc": true}', '{"CPU": 1}', "{nope"):
        with pytest.raises(SystemExit):
            ray_up.parse_args(["--ray", "local", "--language-resources", bad])

    class FakeRay:
        @staticmethod
        def cluster_resources():
            return {"CPU": 4.0, "enc": 1.0}

    rargs, args = ray_up.parse_args(["--ray", "local", "--encoders", "2", "--encoder-gpus", "0",
                                     "--language-gpus", "0", "--encoder-resources", '{"enc": 1}'])
    with pytest.raises(RuntimeError, match="1 of resource 'enc', the instances need 2"):
        ray_up._check_resources(FakeRay, rargs, args)


class _RayError(Exception):
    pass


class _Ref:
    def __init__(self, value=None, error: Exception | None = None, done: bool = True) -> None:
        self.value, self.error, self.done = value, error, done


class _FakeRay:
    """What _watch uses of Ray: wait (done or not), get (value or error), kill."""

    class exceptions:  # noqa: N801  NOTE: ray.exceptions' shape
        RayError = _RayError

    def __init__(self) -> None:
        self.killed: list[object] = []

    def wait(self, refs, timeout):
        return [r for r in refs if r.done], [r for r in refs if not r.done]

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, actor, no_restart):
        self.killed.append(actor)


class _Actor:
    def __init__(self, alive: _Ref) -> None:
        self.alive = type("M", (), {"remote": staticmethod(lambda: alive)})


def test_watch_replaces_a_lost_instance_and_says_when_the_router_must_learn_it():
    """The launcher's loop, without Ray: a dead actor is killed and re-launched in its
    bundle, asking for its old port; its replacement, once started, is reported; only a
    new address asks for the router's restart."""
    from tandem.launch import ray_up

    fake = _FakeRay()
    slot = ray_up.Slot("encoder", 0, 1.0, 0.0, {"enc": 1.0}, "", 0)
    first = _Actor(_Ref(error=_RayError("node died")))
    slot.actor, slot.address = first, "10.0.0.3:29000"
    slot.info = {"address": slot.address, "node_ip": "10.0.0.3", "pid": 1, "gpus": ""}
    launched: list[ray_up.Slot] = []

    def launch(s):  # as main's: a fresh actor, its start() in flight
        launched.append(s)
        s.actor, s.info, s.checks = _Actor(_Ref(True)), None, []
        s.pending = _Ref(done=False)

    assert ray_up._watch(fake, [slot], launch) is False
    assert fake.killed == [first] and launched == [slot] and slot.replaced == 1
    assert slot.lost_address == "10.0.0.3:29000"
    assert ray_up._watch(fake, [slot], launch) is False  # not placed yet: nothing
    slot.pending = _Ref({"address": "10.0.0.3:29000", "node_ip": "10.0.0.3", "pid": 2,
                         "gpus": ""})  # back on its node, at its old port
    assert ray_up._watch(fake, [slot], launch) is False
    assert slot.info["pid"] == 2 and slot.pending is None and slot.lost_address == ""
    assert ray_up._watch(fake, [slot], launch) is False  # alive: nothing to do

    slot.checks = [_Ref(False)]  # its service exited, the actor lives
    assert ray_up._watch(fake, [slot], launch) is False and slot.replaced == 2
    slot.pending = _Ref({"address": "10.0.0.4:31000", "node_ip": "10.0.0.4", "pid": 3,
                         "gpus": ""})  # elsewhere: the router must be told
    assert ray_up._watch(fake, [slot], launch) is True
    assert slot.address == "10.0.0.4:31000"

    slot.checks = [_Ref(error=_RayError("gone"))]
    ray_up._watch(fake, [slot], launch)
    slot.pending = _Ref(error=_RayError("lost again before it served"))
    before = len(launched)
    assert ray_up._watch(fake, [slot], launch) is False and len(launched) == before + 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_node_ray_cluster_serves_survives_a_worker_loss_and_leaves_nothing(checkpoint):
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("no ray in this venv")
    netns.sweep_stale()
    model = checkpoint("qwen2_5_vl")
    temp = Path(tempfile.mkdtemp(prefix="tdmr", dir="/tmp"))  # Ray's socket paths stay short
    kernels = os.environ.get("TANDEM_KERNEL_DIR") or os.path.expanduser("~/.cache/tandem/kernels")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # a dead node is declared after ~3 missed health checks a second apart (Ray's default
    # is 5 of 3 s); the rest is Ray's behaviour unchanged
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_health_check_period_ms="1000",
               RAY_health_check_timeout_ms="1000", RAY_health_check_failure_threshold="3",
               PYTHONUNBUFFERED="1", TANDEM_KERNEL_DIR=kernels, OMP_NUM_THREADS="1",
               # token authentication on, as an operator runs a cluster: every node and the
               # launcher read the token from $HOME/.ray (this run's own HOME)
               HOME=str(temp / "home"), RAY_AUTH_MODE="token")
    gen = subprocess.run([str(Path(sys.executable).parent / "ray"), "get-auth-token",
                          "--generate"], env=env, capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    net = netns.Network(["head", "w1", "w2", "w3"])  # w3: no Ray node until capacity returns
    launcher = None
    try:
        net.build()
        ips = {n: node.address for n, node in net.nodes.items()}
        for node in ("head", "w1", "w2"):
            _ray_start(net, node, temp, env, head=node == "head")
        argv = [sys.executable, "-m", "tandem.cli", "up", "--ray", f"{ips['head']}:{GCS_PORT}",
                "--encoders", "2", "--languages", "1",
                "--encoder-gpus", "0", "--language-gpus", "0",
                "--encoder-resources", '{"tandem_encoder": 1}',
                "--language-resources", '{"tandem_language": 1}',
                "--model", str(model), "--host", "127.0.0.1",
                "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT),
                "--ready-timeout", "400", "--stop-timeout", "20"]
        launcher = net.popen("head", argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        out = Lines(launcher)
        out.wait_for(r"^\[up\] pids:", "the launcher serving")
        placed = {m.group(1): (m.group(2), m.group(3)) for m in (
            re.match(r"^\[up\] ((?:encoder|language)-\d+) +ready +(\S+) +\(node (\S+),", ln)
            for ln in out.lines) if m}
        # the tiers on the nodes their resources name, each service on its node's address
        assert placed["language-0"][1] == ips["head"], placed
        assert {placed["encoder-0"][1], placed["encoder-1"][1]} == {ips["w1"], ips["w2"]}, placed
        assert all(addr.startswith(ip + ":") for addr, ip in placed.values()), placed

        base = f"http://127.0.0.1:{HTTP_PORT}/v1"
        served = net.call_in("head", lambda: httpx.get(f"{base}/models", timeout=30).json())
        name = served["data"][0]["id"]
        first = net.call_in("head", _chat, base, name)
        answer = first["choices"][0]["message"]["content"]
        assert answer and first["usage"]["prompt_tokens"] > 8, first
        # exact: the tokens transformers' greedy generate() gives for the same chat
        eos = json.loads((Path(model) / "generation_config.json").read_text())["eos_token_id"]
        assert _without_eos(_token_ids(first), eos) == _oracle(model), first

        # the worker holding encoder-0 is lost (its processes killed, its link cut) while
        # chats with large, distinct images are in flight through the router. Half of them
        # are chats whose images the router's affinity sends to encoder-0 first; the node
        # is frozen (SIGSTOP) before they are sent, so they are still on it when it dies,
        # however fast an encode is here
        lost = next(n for n in ("w1", "w2") if ips[n] == placed["encoder-0"][1])
        encoders = [placed["encoder-0"][0], placed["encoder-1"][0]]
        first = {k: rendezvous_order(_image_hash(k), encoders)[0] for k in range(1, 64)}
        seeds = ([k for k, a in first.items() if a == encoders[0]][:4]
                 + [k for k, a in first.items() if a == encoders[1]][:4])
        frozen = net.pids(lost)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        with ThreadPoolExecutor(len(seeds)) as pool:
            during = [pool.submit(net.call_in, "head", _chat, base, name, k) for k in seeds]
            wait_until(lambda: net.call_in("head", _metric, base, "tandem_router_inflight")
                       >= len(seeds) or any(f.done() for f in during),
                       timeout_s=120, poll_s=0.2, what="the chats in flight")
            assert net.kill_all(lost) > 0
            net.isolate(lost)
            during = [f.result() for f in during]  # each answered: 200 (else _chat fails)
        retries = {m: net.call_in("head", _metric, base, f"tandem_router_{m}")
                   for m in ("encoder_retries", "request_retries")}
        print(f"chats in flight at the loss: {len(seeds)} ({len(frozen)} processes frozen on "
              f"{lost}); router retries: {retries}")
        # the chats sent to the frozen encoder-0 were retried on the other one
        assert retries["encoder_retries"] + retries["request_retries"] >= 1, retries

        def chats(n: int) -> list[dict]:
            with ThreadPoolExecutor(n) as pool:
                return list(pool.map(lambda _: _chat(base, name), range(n)))

        after = net.call_in("head", chats, 4)
        # every chat answered, exactly as before: the surviving encoder served them
        assert [a["choices"][0]["message"]["content"] for a in after] == [answer] * 4
        out.wait_for(r"^\[up\] encoder-0 lost at", "the launcher seeing encoder-0 lost")
        wait_until(lambda: net.call_in("head", _metric, base, "tandem_router_healthy_instances",
                                       '{tier="encoder"}') == 1,
                   timeout_s=120, poll_s=1, what="the router down to one healthy encoder")

        # capacity returns: the node rejoins with the same address and resources
        net.reconnect(lost)
        _ray_start(net, lost, temp, env, head=False)
        m = out.wait_for(r"^\[up\] encoder-0 +re-placed +(\S+) +\(node (\S+),",
                         "encoder-0 re-placed on the returning node")
        assert (m.group(1), m.group(2)) == placed["encoder-0"], (m.groups(), placed, out.tail())
        wait_until(lambda: net.call_in("head", _metric, base, "tandem_router_healthy_instances",
                                       '{tier="encoder"}') == 2,
                   timeout_s=120, poll_s=1, what="the router re-admitting encoder-0")
        again = net.call_in("head", chats, 2)
        assert [a["choices"][0]["message"]["content"] for a in again] == [answer] * 2
        # the chats that lived through the loss answer as the same images do undisturbed
        # (now on the re-placed encoder-0 or encoder-1, whose caches are cold for them
        # only if the lost encoder held them)
        undisturbed = [net.call_in("head", _chat, base, name, k) for k in seeds]
        assert [c["choices"][0]["message"]["content"] for c in during] == [
            c["choices"][0]["message"]["content"] for c in undisturbed]
        assert not any("restarting the router" in ln for ln in out.lines), out.tail()

        # the other worker (encoder-1) is lost for good; capacity returns on a fourth node,
        # w3, at another address: encoder-1 is re-placed there and the router, restarted
        # with the new address, serves through both encoders again
        other = "w2" if lost == "w1" else "w1"
        assert net.kill_all(other) > 0
        net.isolate(other)
        out.wait_for(r"^\[up\] encoder-1 lost at", "the launcher seeing encoder-1 lost")
        _ray_start(net, "w3", temp, env, head=False)
        m = out.wait_for(r"^\[up\] encoder-1 +re-placed +(\S+) +\(node (\S+),",
                         "encoder-1 re-placed on w3")
        assert m.group(2) == ips["w3"], out.tail()
        out.wait_for(r"^\[up\] router +ready again", "the router restarted")
        wait_until(lambda: net.call_in("head", _metric, base, "tandem_router_healthy_instances",
                                       '{tier="encoder"}') == 2,
                   timeout_s=120, poll_s=1, what="the new router with both encoders")
        moved = net.call_in("head", chats, 2)
        assert [a["choices"][0]["message"]["content"] for a in moved] == [answer] * 2

        os.killpg(launcher.pid, signal.SIGINT)
        assert launcher.wait(180) == 0, out.tail()
        assert out.lines[-1] == "[up] stopped", out.tail()
        print("\n".join(ln for ln in out.lines if ln.startswith("[up]")))
    finally:
        if launcher is not None and launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        deleted = net.close()
        shutil.rmtree(temp, ignore_errors=True)
    # nothing left: no namespace of this run, no process that ran in one
    assert len(deleted) == 5 and netns.list_ours() == []
    leftover = subprocess.run(["pgrep", "-f", str(temp)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout
