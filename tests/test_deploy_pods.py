"""The Helm chart's own pods, run without Kubernetes (`make check-pods`; issue 40).

deploy/harness/pods.py renders the chart (`helm template`, default values plus a CPU
overlay: the tiny model from a hostPath, no GPUs, a KV pool size) and runs each
Deployment replica as a "pod": its own network namespace and address, the container's
command/args/env/envFrom as rendered, its Secrets (made as the chart's hook Job makes
them: `tandem certs`) and volumes mounted at their mountPaths, the Services' names served
by a dnsmasq, probes polled from a kubelet namespace at the pod's address.

- fast (no root): the process and environment the harness derives from the render;
- slow (root, `ip`, dnsmasq): the pods come up ready only through their probes; the
  chart's own `helm test` pod answers a chat through the router's Service name; an image
  chat crosses encoder -> language over the pods' addresses (internal mTLS on); a second
  language replica is found through the headless Service's DNS and used by the router;
- slow: a pod whose servers bind 127.0.0.1 (a fault planted in the rendered ConfigMap)
  answers on its own loopback yet never passes a probe from the kubelet, and never appears
  in DNS: the check can fail.

The slow tests run each pod in the filesystem of its built image where `make image` built
one (the pod's process seen chrooted there), else in this checkout's venv;
TANDEM_PODS_IMAGES=0 runs them in the venv whatever is built.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deploy" / "harness"))
import netpol  # noqa: E402
import pods  # noqa: E402

NS = "tandem"
HANG_S = 600  # hang guard of a pod coming up on a busy two-core machine
IMAGES = os.environ.get("TANDEM_PODS_IMAGES", "1") != "0"


@pytest.fixture(scope="module")
def overlay(tmp_path_factory, checkpoint):
    """The CPU overlay: what a CPU cluster's values would change, nothing else. The model
    is a copy of the test checkpoint readable by the chart's user: transformers' save
    writes model.safetensors owner-only (0600), which a pod running as uid 10001 (in the
    image) cannot open from a hostPath, as on a real node. NOTE: the copy lies outside
    /tmp: in this venv a pod's root is the host's, and its /tmp emptyDir would hide it."""
    model = Path(tempfile.mkdtemp(prefix="pods-model-", dir=ROOT / ".cache"))
    shutil.copytree(checkpoint("qwen2_5_vl"), model, dirs_exist_ok=True)
    model.chmod(0o755)
    for f in model.iterdir():
        f.chmod(0o644)
    f = tmp_path_factory.mktemp("pods") / "cpu.yaml"
    f.write_text(f"image: {{variant: cpu}}\n"
                 f"model: {{source: hostPath, hostPath: {model}}}\n"
                 "encoder: {gpus: 0}\nlanguage: {gpus: 0, kvPages: 256}\n")
    yield f
    shutil.rmtree(model, ignore_errors=True)


def _helm_or_skip() -> None:
    if not netpol.HELM.exists():
        pytest.skip("no .tools/helm (make helm)")


def _pods_or_skip() -> None:
    _helm_or_skip()
    reason = pods.unavailable_reason()
    if reason:
        pytest.skip(reason)


def test_process_and_environment_come_from_the_render(overlay):
    _helm_or_skip()
    objs = netpol.render_chart([overlay], namespace=NS)
    c = pods.Cluster(objs, images=False)
    assert set(c.workloads) == {"router", "encoder", "language"}
    assert pods.image_config("tandem:0.1.0-router").stage == "router"
    for comp in c.workloads:
        argv, env = c.argv_env(c.pod(comp))
        assert argv[1:] == [comp] and Path(argv[0]).name == "tandem"
        assert env["TANDEM_HOST"] == "0.0.0.0"  # envFrom: the rendered ConfigMap
        assert env["TANDEM_INTERNAL_TLS__CERT"] == "/etc/tandem/internal/tls.crt"
        assert env["PATH"].split(":")[0] == str(pods.VENV_BIN)  # the image's /opt/venv/bin
    _, env = c.argv_env(c.pod("encoder"))
    assert env["TANDEM_TRANSFER__HOST"] == c.pod("encoder").address  # fieldRef status.podIP
    _, env = c.argv_env(c.pod("router"))
    assert env["TANDEM_LANGUAGE_DNS"] == f"t-tandem-language-headless.{NS}.svc.cluster.local:50071"
    broken = pods.with_container(objs, "router", lambda ctr, _: ctr["envFrom"].append(
        {"configMapRef": {"name": "nope"}}))
    with pytest.raises(pods.ChartError, match="t-tandem-router: ConfigMap 'nope'"):
        pods.Cluster(broken, images=False).argv_env(pods.Cluster(broken, images=False).pod("router"))


def test_a_built_image_gives_the_pods_its_own_config(overlay):
    """Where `make image` built the chart's images, a pod takes the image's own config
    (buildah's view of it): its entrypoint with tini, its PATH and workdir."""
    _helm_or_skip()
    objs = netpol.render_chart([overlay], namespace=NS)
    c = pods.Cluster(objs)
    built = {comp: pods.built_image(c.container(comp)["image"]) for comp in c.workloads}
    if not all(built.values()):
        pytest.skip(f"not every image is built here (make image): {built}")
    for comp in c.workloads:
        img = c.image_of(c.container(comp))
        assert img.ref == built[comp] and img.workdir == "/home/tandem"
        argv, env = c.argv_env(c.pod(comp))
        assert argv == ["/usr/bin/tini", "--", "tandem", comp]
        assert env["PATH"].split(":")[0] == "/opt/venv/bin" and env["TANDEM_HOST"] == "0.0.0.0"


def _png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 40, 40)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _run_on(c: pods.Cluster, node: str, argv: list[str], env: dict | None = None):
    return subprocess.run(c.net.argv(node, argv), capture_output=True, text=True, timeout=300,
                          env=env)


def _helm_test(c: pods.Cluster, objs: list[dict]) -> subprocess.CompletedProcess:
    """The chart's own `helm test` pod (templates/tests/test-chat.yaml), as rendered, on
    the client node: its command/args/env and user, in its image (python3 is the image's)."""
    test = next(o for o in objs if o.get("kind") == "Pod"
                and o["metadata"].get("annotations", {}).get("helm.sh/hook") == "test")
    return c.run_pod(test, "client")


def _runs_in_its_image(c: pods.Cluster, pod: pods.PodState) -> None:
    """Where the pod's image is built (and IMAGES), its process is chrooted into a
    working container of that image and runs as the chart's user; else in this venv."""
    ref = pods.built_image(c.container(pod.component)["image"]) if IMAGES else None
    if ref is None:
        assert pod.rootfs is None
        return
    assert pod.rootfs is not None and c.image_of(c.container(pod.component)).ref == ref
    root = os.readlink(f"/proc/{pod.proc.pid}/root")
    assert root == str(pod.rootfs.path), (root, pod.rootfs.path)
    status = Path(f"/proc/{pod.proc.pid}/status").read_text()
    uid = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Uid:"))
    assert int(uid) == c.workloads[pod.component]["spec"]["template"]["spec"][
        "securityContext"]["runAsUser"], status


def _image_chat(c: pods.Cluster) -> dict:
    body = {"model": "", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png()}}, {"type": "text", "text": "Colour?"}]}]}
    code = ("import httpx,json,sys\nr=httpx.post('http://t-tandem-router:8000/v1/chat/completions',"
            "json=json.loads(sys.argv[1]),timeout=300)\nprint(r.status_code);print(r.text)")
    r = _run_on(c, "client", [sys.executable, "-c", code, json.dumps(body)])
    status, _, text = r.stdout.partition("\n")
    assert status == "200", r.stdout + r.stderr
    return json.loads(text)


def _wait_ready(c: pods.Cluster, comp: str, index: int = 0) -> None:
    pod = c.pod(comp, index)
    wait_until(lambda: pod.ready, timeout_s=HANG_S, poll_s=0.5,
               what=f"{comp}-{index} ready", state=lambda: c.describe(pod))


@pytest.mark.slow
def test_the_charts_pods_serve_through_services_and_find_a_second_replica(overlay):
    _pods_or_skip()
    pods.netns.sweep_stale()
    objs = netpol.render_chart([overlay], namespace=NS)
    with pods.Cluster(objs, slots={"language": 2}, no_build=("/cache/kernels",),
                      images=IMAGES) as c:
        assert c.resolve("client", "t-tandem-router") == []  # no ready pod: no address
        for comp in ("encoder", "language", "router"):
            c.start(comp)
        for comp in ("encoder", "language", "router"):
            _wait_ready(c, comp)
            # ready only through its readinessProbe at the pod's address
            assert c.pod(comp).probes["readiness"][-1] is True
            _runs_in_its_image(c, c.pod(comp))
        enc, lang0, lang1 = c.pod("encoder"), c.pod("language", 0), c.pod("language", 1)
        assert c.resolve("client", "t-tandem-router") == [c.pod("router").address]
        assert c.resolve("client", f"t-tandem-encoder-headless.{NS}.svc.cluster.local") == [enc.address]
        router_log = c.pod("router").log

        def router_has(line: str) -> bool:
            return line in router_log.read_text()

        wait_until(lambda: router_has(f"language {lang0.address}:50071 added"), timeout_s=HANG_S,
                   what="router found language-0 through DNS", state=lambda: router_log.read_text()[-2000:])
        wait_until(lambda: router_has(f"encoder {enc.address}:50061 added"), timeout_s=HANG_S,
                   what="router found encoder-0 through DNS", state=lambda: router_log.read_text()[-2000:])

        r = _helm_test(c, objs)
        assert r.returncode == 0 and r.stdout.startswith("200 "), r.stdout + r.stderr

        # an image: encoder -> language rows over the pods' own addresses, mTLS between pods
        got = _image_chat(c)
        assert got["tandem"]["encoder"] == f"{enc.address}:50061", got["tandem"]
        assert got["tandem"]["language"] == f"{lang0.address}:50071", got["tandem"]
        assert not got["tandem"]["timings"]["encoder_bypassed"]

        # a second language replica: the headless Service answers both, the router adds it
        c.start("language", 1)
        _wait_ready(c, "language", 1)
        assert c.resolve("client", "t-tandem-language-headless") == sorted([lang0.address, lang1.address])
        wait_until(lambda: router_has(f"language {lang1.address}:50071 added"), timeout_s=HANG_S,
                   what="router found language-1 through DNS", state=lambda: router_log.read_text()[-2000:])
        assert all(p.restarts == 0 for p in c.pods.values()), [c.describe(p) for p in c.pods.values()]
    assert pods.netns.list_ours() == []


@pytest.mark.slow
def test_a_pod_bound_to_loopback_never_passes_a_probe(overlay):
    """The fault the check must catch: TANDEM_HOST=127.0.0.1 in the encoder's rendered
    ConfigMap. The encoder serves (its health answers on its own loopback), the kubelet's
    probes at the pod's address all fail, and DNS never lists it."""
    _pods_or_skip()
    pods.netns.sweep_stale()
    objs = copy.deepcopy(netpol.render_chart([overlay], namespace=NS))
    cm = next(o for o in objs if o.get("kind") == "ConfigMap" and o["metadata"]["name"] == "t-tandem-encoder")
    cm["data"]["TANDEM_HOST"] = "127.0.0.1"
    with pods.Cluster(objs, no_build=("/cache/kernels",), images=IMAGES) as c:
        enc = c.start("encoder")
        probe = {"kind": "grpc", "port": 8090, "timeout": 3.0, "service": "tandem.v1.Encoder",
                 "path": "/"}

        def on_loopback() -> bool:
            code = f"import sys;sys.path.insert(0,{str(pods.HERE)!r});import pods;print(pods._probe_once({ {**probe, 'host': '127.0.0.1'} !r})[0])"
            return _run_on(c, enc.node, [sys.executable, "-c", code]).stdout.strip() == "True"

        wait_until(on_loopback, timeout_s=HANG_S, poll_s=1.0, what="encoder serving on its loopback",
                   state=lambda: c.describe(enc))
        seen = len(enc.probes["startup"])
        # three more probes from the kubelet, every one failed, after the server was up
        wait_until(lambda: len(enc.probes["startup"]) >= seen + 3, timeout_s=HANG_S, poll_s=0.5,
                   what="three kubelet probes", state=lambda: c.describe(enc))
        assert not any(enc.probes["startup"]) and not enc.ready, c.describe(enc)
        assert "UNAVAILABLE" in enc.last_failure or "connect" in enc.last_failure, enc.last_failure
        assert c.resolve("client", "t-tandem-encoder-headless") == []
    assert pods.netns.list_ours() == []
