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
  in DNS: the check can fail;
- slow: the production example (values-production.yaml, the CPU overlay, then
  deploy/harness/values-production-cpu.yaml: what cannot exist here), replicas from its
  HPAs: no declared or Mooncake port on loopback alone, the helm test pod with the API key,
  an image and a video chat whose greedy ids equal transformers', an encoder added at run
  time used and one deleted with chats in flight (none failed), an encoder's link cut then
  its process killed with chats in flight (all answered, retried on another encoder).

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
    is a copy of the test checkpoint readable by the chart's user (transformers' save
    writes model.safetensors owner-only, 0600, which a pod running as uid 10001 cannot
    open from a hostPath; `tandem tiny-model` now writes 0644, a checkpoint from elsewhere
    may not be). NOTE: the copy lies outside
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


def test_the_harness_checks_pass_the_default_and_production_renders(overlay, tmp_path):
    """What the harness checks before it runs a pod (the Services' selectors and
    targetPorts, each variable naming a file finding it in a volume) finds nothing in the
    chart as rendered, default and production; replicas follow the HPAs' minReplicas."""
    _helm_or_skip()
    for files, want in (([overlay], {"encoder": 1, "language": 1, "router": 1}),
                        ([PRODUCTION, overlay, PRODUCTION_CPU],
                         {"encoder": 2, "language": 2, "router": 2})):
        objs = netpol.render_chart(files, namespace=NS)
        if files[0] == PRODUCTION:
            objs += _operator_secrets(tmp_path / "operator")
        c = pods.Cluster(objs, images=False)  # check_services() runs here
        assert c.slots == want
        c.secrets.update({s["metadata"]["name"]: s for s in
                          pods.internal_tls_secrets(objs, tmp_path)})
        for comp, w in c.workloads.items():
            _, env = c.argv_env(c.pod(comp))
            c.check_paths(c.container(comp), w["spec"]["template"]["spec"], w, env, None)


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


# -- the production example (deploy/k8s/values-production.yaml) ------------------------------

PRODUCTION = ROOT / "deploy" / "k8s" / "values-production.yaml"
PRODUCTION_CPU = ROOT / "deploy" / "harness" / "values-production-cpu.yaml"
API_KEY = "pods-harness-key"
MAX_NEW = 10
# a client on the "client" node: every body of a JSON file posted at once to the router's
# Service name, with the API key; one JSON line of [status, answer] per body, in order
CLIENT = """
import httpx, json, sys
from concurrent.futures import ThreadPoolExecutor
bodies = json.load(open(sys.argv[1]))
def post(b):
    try:
        r = httpx.post('http://t-tandem-router:8000/v1/chat/completions', json=b, timeout=300,
                       headers={'Authorization': 'Bearer ' + sys.argv[2]})
        return [r.status_code, r.json() if r.headers.get('content-type', '').startswith(
            'application/json') else r.text]
    except Exception as e:
        return [0, repr(e)]
with ThreadPoolExecutor(len(bodies)) as ex:
    print(json.dumps(list(ex.map(post, bodies))))
"""


def _operator_secrets(tmp: Path) -> list[dict]:
    """What the example's operator creates before installing (`kubectl create secret`):
    the router's API key (router.apiKey.existingSecret) and its TLS pair (router.tls)."""
    subprocess.run([str(pods.VENV_BIN / "tandem"), "certs", str(tmp)], check=True,
                   capture_output=True, timeout=120)
    return [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tandem-api-key", "namespace": NS},
             "stringData": {"api-key": API_KEY}},
            {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
             "metadata": {"name": "tandem-router-tls", "namespace": NS},
             "stringData": {"tls.crt": (tmp / "router.crt").read_text(),
                            "tls.key": (tmp / "router.key").read_text()}}]


def _client(c: pods.Cluster, bodies: list[dict], tmp: Path, background: bool = False):
    f = Path(tempfile.mkstemp(suffix=".json", dir=tmp)[1])
    f.write_text(json.dumps(bodies))
    argv = c.net.argv("client", [sys.executable, "-c", CLIENT, str(f), API_KEY])
    if background:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _answered(results: list, c: pods.Cluster) -> list[dict]:
    bad = [r for r in results if r[0] != 200]
    assert not bad, (bad, [c.describe(p)[-600:] for p in c.pods.values() if p.proc])
    return [r[1] for r in results]


def _token_ids(answer: dict) -> list[int]:
    """return_tokens_as_token_ids spells each token `token_id:N`; EOS stripped."""
    from test_e2e_video import without_eos

    return without_eos([int(t["token"].split(":", 1)[1])
                        for t in answer["choices"][0]["logprobs"]["content"]])


def _body(messages: list, **kw) -> dict:
    return {"model": "", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0,
            "logprobs": True, "return_tokens_as_token_ids": True, **kw}


def _image_bodies(seeds, size=(112, 84)) -> list[dict]:
    from video_chats import Image, VideoChat

    return [_body(VideoChat((f"Picture {s}:", Image(s, size), "what is it?")).openai({}))
            for s in seeds]


@pytest.fixture(scope="module")
def exact_chats(tmp_path_factory, checkpoint):
    """An image chat and a video chat (a tiny mp4 made with PyAV), and transformers'
    greedy tokens for each on the tiny checkpoint (tests/video_chats.py's oracle)."""
    from test_e2e_video import without_eos
    from video_chats import Image, Video, VideoChat, oracle_results, write_clips

    raw, files = write_clips(tmp_path_factory.mktemp("clips"))
    chats = {"image": VideoChat(("Describe", Image(1, (56, 56)), "briefly.")),
             "video": VideoChat((Video("small"), "What happens in the clip?"))}
    res = oracle_results({k: ("qwen2_5_vl", v) for k, v in chats.items()}, checkpoint, files,
                         tmp_path_factory.mktemp("oracle"), MAX_NEW)
    return {k: (_body(v.openai(raw)), without_eos(res[k]["tokens"])) for k, v in chats.items()}


@pytest.mark.slow
def test_the_production_example_serves_exactly_scales_and_survives_a_killed_pod(
        overlay, exact_chats, tmp_path):
    """deploy/k8s/values-production.yaml with the CPU overlay and
    deploy/harness/values-production-cpu.yaml (what cannot exist here, each with its
    reason): its HPAs' minReplicas as replicas (encoder 2, language 2, router 2), its API
    key and router TLS Secrets made as an operator would. Shows, through the router
    Service's name: the pods ready through their probes, every declared port and the
    Mooncake ports listened on at the pod's address (never loopback alone); the chart's
    helm test pod; an image and a video chat whose greedy token ids equal transformers';
    a third encoder added at run time found through DNS and used; one encoder deleted
    (out of DNS, process stopped) while chats are in flight, none failing, and never used
    after; then an encoder's link cut and its process killed with chats in flight: every
    chat answered."""
    _pods_or_skip()
    pods.netns.sweep_stale()
    objs = netpol.render_chart([PRODUCTION, overlay, PRODUCTION_CPU], namespace=NS)
    objs += _operator_secrets(tmp_path / "operator")
    assert {comp: pods.replicas(objs, w) for comp, w in pods.workloads(objs).items()} == {
        "encoder": 2, "language": 2, "router": 2}
    with pods.Cluster(objs, slots={"encoder": 3}, no_build=("/cache/kernels",),
                      images=IMAGES, subnet="10.231.6.0/24") as c:
        up = [(comp, i) for comp in ("encoder", "language", "router") for i in range(2)]
        for comp, i in up:
            c.start(comp, i)
        for comp, i in up:
            c.wait_ready(comp, i, timeout_s=HANG_S)
            _runs_in_its_image(c, c.pod(comp, i))
        for comp, i in up:  # no loopback for what other pods need
            got = c.check_listeners(c.pod(comp, i))
            assert ("127.0.0.1", 50061) not in got and ("127.0.0.1", 50071) not in got, got
        enc = [c.pod("encoder", i) for i in range(3)]
        routers = [c.pod("router", i) for i in range(2)]
        langs = {f"{c.pod('language', i).address}:50071" for i in range(2)}
        assert c.resolve("client", "t-tandem-router") == sorted(c.pod("router", i).address
                                                                  for i in range(2))
        for p in (*enc[:2], c.pod("language", 0), c.pod("language", 1)):
            port = 50061 if p.component == "encoder" else 50071
            line = f"{p.component} {p.address}:{port} added"
            wait_until(lambda line=line: all(_router_has_all(c, line)),
                       timeout_s=HANG_S, what=f"both routers found {p.node} through DNS")

        r = _helm_test(c, objs)  # with the API key from the operator's Secret
        assert r.returncode == 0 and r.stdout.startswith("200 "), r.stdout + r.stderr

        # exactness through the Service: greedy ids equal transformers' generate()
        names = list(exact_chats)
        got = _answered(_client(c, [exact_chats[n][0] for n in names], tmp_path), c)
        for n, answer in zip(names, got, strict=True):
            assert _token_ids(answer) == exact_chats[n][1], (n, answer)
            t = answer["tandem"]
            assert t["encoder"] in {f"{e.address}:50061" for e in enc[:2]}, t
            assert t["language"] in langs and not t["timings"]["encoder_bypassed"], t

        # scale up, as an HPA would: a third encoder, found through DNS and used
        c.start("encoder", 2)
        c.wait_ready("encoder", 2, timeout_s=HANG_S)
        c.check_listeners(enc[2])
        assert c.resolve("client", "t-tandem-encoder-headless") == sorted(e.address for e in enc)
        wait_until(lambda: all(_router_has_all(c, f"encoder {enc[2].address}:50061 added")),
                   timeout_s=HANG_S, what="both routers found encoder-2 through DNS")
        seen = set()
        for batch in range(8):
            answers = _answered(_client(c, _image_bodies(range(10 * batch, 10 * batch + 6)),
                                        tmp_path), c)
            seen |= {a["tandem"]["encoder"] for a in answers}
            if f"{enc[2].address}:50061" in seen:
                break
        assert f"{enc[2].address}:50061" in seen, seen

        # scale down: encoder-0 deleted (out of DNS, its process stopped) with chats in flight
        inflight = _client(c, _image_bodies(range(100, 108)), tmp_path, background=True)
        c.stop("encoder", 0)
        out, err = inflight.communicate(timeout=600)
        assert inflight.returncode == 0, err
        _answered(json.loads(out), c)
        assert c.resolve("client", "t-tandem-encoder-headless") == sorted(
            e.address for e in enc[1:])
        assert enc[0].proc.poll() is not None and c.net.pids(enc[0].node) == []
        wait_until(lambda: all(_router_has_all(c, f"encoder {enc[0].address}:50061 removed")),
                   timeout_s=HANG_S, what="both routers dropped encoder-0")
        answers = _answered(_client(c, _image_bodies(range(200, 206)), tmp_path), c)
        assert {a["tandem"]["encoder"] for a in answers} <= {f"{e.address}:50061" for e in enc[1:]}

        # a pod killed mid-request: encoder-1's link cut with chats on their way to it, then
        # its process killed, none having produced output (an answer comes whole)
        c.net.isolate(enc[1].node)
        inflight = _client(c, _image_bodies(range(300, 308)), tmp_path, background=True)
        wait_until(lambda: sum(_metric(c, r, "tandem_router_inflight", 8000) for r in routers) > 0,
                   timeout_s=HANG_S, poll_s=0.1, what="chats in flight")
        c.net.kill_all(enc[1].node)
        out, err = inflight.communicate(timeout=600)
        assert inflight.returncode == 0, err
        answers = _answered(json.loads(out), c)
        assert all(_token_ids(a) for a in answers)
        # the chats sent to encoder-1 were retried on encoder-2 (the Encode call of the
        # attempt repeated), before any output
        assert {a["tandem"]["encoder"] for a in answers} == {f"{enc[2].address}:50061"}, answers
        assert any(a["tandem"]["encoder_attempts"] > 1 for a in answers), [a["tandem"] for a in answers]
    assert pods.netns.list_ours() == []


def _router_has_all(c: pods.Cluster, line: str) -> list[bool]:
    return [line in p.log.read_text() for (comp, _), p in sorted(c.pods.items())
            if comp == "router" and p.log and p.log.exists()]


def _metric(c: pods.Cluster, pod: pods.PodState, name: str, port: int = 9090) -> float:
    """A counter or gauge of the pod's /metrics (its metrics port), from the client node;
    summed over labels; -1 when the pod does not answer."""
    code = ("import httpx,sys\ntry:\n r=httpx.get(sys.argv[1],timeout=5)\n"
            " print(r.text if r.status_code == 200 else '')\n"
            "except Exception: print('')")
    text = _run_on(c, "client", [sys.executable, "-c", code,
                                 f"http://{pod.address}:{port}/metrics"]).stdout
    vals = [float(ln.split()[-1]) for ln in text.splitlines()
            if ln.startswith(name) and not ln.startswith("#")]
    return sum(vals) if text else -1.0
