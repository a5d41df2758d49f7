"""The Helm chart: lint, render, strict schema validation, and agreement with the services.

Renders `deploy/k8s/tandem` with the default values and with `deploy/k8s/values-production.yaml`
through the real Helm binary (installed by `deploy/scripts/install-helm.sh`), validates every
object with kubernetes-validate (strict: unknown fields are errors) for the newest Kubernetes
the package knows and for the chart's oldest supported one, and checks that ports, probes,
discovery names and config keys are the ones the services actually read and serve.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from tandem.config import InternalTLSConfig, TransferConfig, parse_settings
from tandem.services.encoder.config import EncoderConfig
from tandem.services.language.config import LanguageConfig
from tandem.services.router.config import RouterConfig
from tandem.v1 import encoder_pb2, language_pb2

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "k8s" / "tandem"
PROD = ROOT / "deploy" / "k8s" / "values-production.yaml"
HELM = ROOT / ".tools" / "helm"
NAMESPACE = "serving"
RELEASE = "tandem"
OLDEST_K8S = "1.27.0"  # Chart.yaml kubeVersion floor
NEWEST_K8S = latest_version()
VARIANTS = {"default": [], "production": ["-f", str(PROD)],
            "plaintext": ["--set", "internalTLS.enabled=false"]}
TIERS = {
    # tier: (config class, proto service full name the readiness probe must ask for)
    "encoder": (EncoderConfig, encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name),
    "language": (LanguageConfig, language_pb2.DESCRIPTOR.services_by_name["Language"].full_name),
}
FAKE_POD_IP = "10.1.2.3"


@pytest.fixture(scope="module")
def helm() -> Path:
    if not HELM.exists():
        r = subprocess.run(
            ["bash", str(ROOT / "deploy/scripts/install-helm.sh"), str(HELM)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0 or not HELM.exists():
            pytest.skip(f"no helm binary and install-helm.sh failed: {r.stderr.strip()[-300:]}")
    return HELM


def helm_run(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def render(helm: Path, *extra: str, kube: str = NEWEST_K8S) -> list[dict]:
    """`helm template` -> objects; raises AssertionError carrying Helm's message on failure."""
    r = helm_run(
        helm,
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        kube,
        *extra,
    )
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict]]:
    return {name: render(helm, *args) for name, args in VARIANTS.items()}


def find(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def container(objs: list[dict], tier: str) -> dict:
    dep = find(objs, "Deployment", f"{RELEASE}-{tier}")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def port_of(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def config_map(objs: list[dict], tier: str) -> dict[str, str]:
    return find(objs, "ConfigMap", f"{RELEASE}-{tier}")["data"]


# ---- Helm itself ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_is_clean(helm, variant):
    r = helm_run(helm, "lint", "--strict", str(CHART), *VARIANTS[variant])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[WARNING]" not in r.stdout and "[ERROR]" not in r.stdout


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates_strictly(helm, rendered, variant):
    """Newest Kubernetes and the chart's oldest supported one; only CRD kinds lack a schema."""
    objs = rendered[variant]
    old = render(helm, *VARIANTS[variant], kube=OLDEST_K8S)
    assert [o["kind"] for o in old] == [o["kind"] for o in objs]
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    for version, docs in ((NEWEST_K8S, objs), (OLDEST_K8S, old)):
        for obj in docs:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except SchemaNotFoundError:
                # The Prometheus Operator's CRD: checked against the Services it selects below.
                assert obj["apiVersion"] == "monitoring.coreos.com/v1", obj["kind"]


def test_strict_validation_rejects_an_unknown_field(rendered):
    """The validator is not vacuous: a misspelt container field fails the same call."""
    dep = find(rendered["default"], "Deployment", f"{RELEASE}-encoder")
    kubernetes_validate.validate(dep, NEWEST_K8S, strict=True)
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, NEWEST_K8S, strict=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set-string", "encoder.replicas=2"], "/encoder/replicas"),
        (["--set-string", "language.port=50071"], "/language/port"),
        (["--set", "router.replicaz=2"], "replicaz"),
        (["--set", "transfer.protocol=udp"], "/transfer/protocol"),
        (["--set", "transfer.minPort=15010", "--set", "transfer.maxPort=15000"], "maxPort"),
        (["--set", "transfer.protocol=rdma"], "deviceName"),
        (["--set", "encoder.config.port=1"], "encoder.config.port"),
        (["--set", "model.source=pvc"], "model.claimName"),
        (["--set", "encoder.config.cache_byte=5"], "additional properties 'cache_byte'"),
        (["--set", "language.config.kv_memory_fraction=2"], "/language/config/kv_memory_fraction"),
        (["--set", "router.config.log_format=xml"], "/router/config/log_format"),
    ],
    ids=[
        "replicas-string",
        "port-string",
        "unknown-key",
        "bad-protocol",
        "port-range",
        "rdma-no-device",
        "managed-key-in-config",
        "pvc-no-claim",
        "misspelt-config-key",
        "config-out-of-range",
        "config-not-a-choice",
    ],
)
def test_broken_values_are_rejected(helm, args, message):
    with pytest.raises(AssertionError) as err:
        render(helm, *args)
    assert message in str(err.value)


def _documented_keys(lines: list[str]) -> dict[str, bool]:
    """Dotted key path -> whether a comment block starting with `# --` sits right above it."""
    out, stack, comment = {}, [], []
    for ln in lines:
        body = ln.strip()
        if body.startswith("#"):
            comment.append(body)
            continue
        if not body or body.startswith("-") or ":" not in body:
            comment = []
            continue
        indent = (len(ln) - len(ln.lstrip())) // 2
        stack = stack[:indent] + [body.split(":", 1)[0]]
        out[".".join(stack)] = bool(comment) and comment[0].startswith("# --")
        comment = []
    return out


def test_values_are_documented_and_typed():
    """Every value in values.yaml has a `# --` description (on itself or, for a small group
    such as rollingUpdate, on the group) and a schema entry; the schema is closed, so a key
    values.yaml does not have is refused."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    text = (CHART / "values.yaml").read_text()
    docs = _documented_keys(text.splitlines())

    def walk(node: dict, sch: dict, path: str):
        assert sch.get("additionalProperties") is False, f"schema for {path or '/'} is open"
        for key, val in node.items():
            p = f"{path}.{key}" if path else key
            assert key in sch["properties"], f"{p} missing from values.schema.json"
            sub = sch["properties"][key]
            if isinstance(val, dict) and val and sub.get("properties") and not docs[p]:
                walk(val, sub, p)
            else:
                assert docs[p] or docs.get(path), f"{p} has no `# --` description in values.yaml"

    walk(yaml.safe_load(text), schema, "")


# ---- agreement with the services -----------------------------------------------------------


def _field_default(cls, name):
    return cls.model_fields[name].default


def _pod_env(objs: list[dict], tier: str) -> dict[str, str]:
    """The environment the container would see: its ConfigMap plus its own env entries
    (downward-API pod IP faked, Secret values dummied)."""
    env = dict(config_map(objs, tier))
    for e in container(objs, tier).get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = FAKE_POD_IP
        else:
            env[e["name"]] = "secret-from-k8s"
    return env


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tier", ["encoder", "language", "router"])
def test_rendered_config_is_what_the_service_parses(rendered, monkeypatch, variant, tier):
    """Each TANDEM_* key names a real config field, and the service's own parser (CLI args +
    env, exactly as `tandem <tier>` runs it) accepts the rendered values; the parsed ports are
    the container ports."""
    objs = rendered[variant]
    cls = {"encoder": EncoderConfig, "language": LanguageConfig, "router": RouterConfig}[tier]
    env = _pod_env(objs, tier)
    for key in env:
        if not key.startswith("TANDEM_"):
            continue
        field = key.removeprefix("TANDEM_").lower()
        if "__" in field:
            outer, inner = field.split("__", 1)
            nested = {"transfer": TransferConfig, "internal_tls": InternalTLSConfig}
            assert outer in nested and inner in nested[outer].model_fields, key
        else:
            assert field in cls.model_fields, f"{key}: no such field in {cls.__name__}"
    for key in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(key)
    for key, val in env.items():
        monkeypatch.setenv(key, val)
    c = container(objs, tier)
    assert c["args"][0] == tier
    cfg = parse_settings(cls, c["args"][1:], f"tandem {tier}")
    if tier == "router":
        assert cfg.http_port == port_of(c, "http") and cfg.grpc_port == port_of(c, "grpc")
    else:
        assert cfg.port == port_of(c, "grpc") and cfg.metrics_port == port_of(c, "metrics")
        assert cfg.metrics_port > 0, "metrics must be served in the cluster"
        assert cfg.transfer.host == FAKE_POD_IP
        assert cfg.health_port == (port_of(c, "health") if cfg.internal_tls.cert else 0)
    assert cfg.host == "0.0.0.0"
    # mTLS between the tiers unless the variant turns it off (then explicitly plaintext)
    assert bool(cfg.internal_tls.cert) != cfg.insecure_internal


@pytest.mark.parametrize("tier", TIERS)
def test_tier_probes_ports_and_discovery_match_the_service(rendered, tier):
    objs = rendered["default"]
    cls, proto_service = TIERS[tier]
    c = container(objs, tier)
    grpc_port = port_of(c, "grpc")
    assert grpc_port == _field_default(cls, "port")
    # Kubernetes' grpc probe calls grpc.health.v1.Health/Check with `service`: readiness and
    # startup ask for the tier's own proto service, liveness for the whole server.
    # Under internal mTLS (the default) they ask the plaintext health-only port, which the
    # service serves at TANDEM_HEALTH_PORT (a kubelet probe has no client certificate).
    assert health.SERVICE_NAME == "grpc.health.v1.Health"
    probe_port = port_of(c, "health")
    assert _pod_env(objs, tier)["TANDEM_HEALTH_PORT"] == str(probe_port) != str(grpc_port)
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": probe_port, "service": proto_service}
    assert c["livenessProbe"]["grpc"] == {"port": probe_port, "service": health.OVERALL_HEALTH}
    # GPU requested in both requests and limits (extended resources must match).
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The router's discovery name is this tier's headless Service, on the gRPC port.
    host, port = config_map(objs, "router")[f"TANDEM_{tier.upper()}_DNS"].rsplit(":", 1)
    svc_name = f"{RELEASE}-{tier}-headless"
    assert host == f"{svc_name}.{NAMESPACE}.svc.cluster.local"
    svc = find(objs, "Service", svc_name)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is False
    grpc_svc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert int(port) == grpc_svc_port["port"] == grpc_port and grpc_svc_port["targetPort"] == "grpc"
    pod_labels = find(objs, "Deployment", f"{RELEASE}-{tier}")["spec"]["template"]["metadata"][
        "labels"
    ]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tier", ["encoder", "language", "router"])
def test_termination_outlasts_prestop_and_drain(rendered, variant, tier):
    """SIGKILL never cuts a drain short: grace > preStop sleep + the service's drain_timeout_s
    (as the service parses it); a tier pod sleeps until the router has re-resolved DNS."""
    objs = rendered[variant]
    c = container(objs, tier)
    pod = find(objs, "Deployment", f"{RELEASE}-{tier}")["spec"]["template"]["spec"]
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = float(config_map(objs, tier)["TANDEM_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] > sleep + drain
    if tier != "router":
        assert sleep >= float(config_map(objs, "router")["TANDEM_DNS_REFRESH_S"])


def test_router_ports_probes_and_service(rendered):
    objs = rendered["default"]
    c = container(objs, "router")
    assert port_of(c, "http") == _field_default(RouterConfig, "http_port")
    assert port_of(c, "grpc") == _field_default(RouterConfig, "grpc_port")
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    svc = find(objs, "Service", f"{RELEASE}-router")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["http"]["port"] == port_of(c, "http") and ports["http"]["targetPort"] == "http"
    assert ports["grpc"]["port"] == port_of(c, "grpc") and ports["grpc"]["targetPort"] == "grpc"
    # the router runs the CPU-only image (the Dockerfile's `router` target), the tiers the
    # full one
    assert c["image"].endswith("-router") and not container(objs, "encoder")["image"].endswith(
        "-router")


def _selects(peer: dict, objs: list[dict], tier: str) -> bool:
    labels = find(objs, "Deployment", f"{RELEASE}-{tier}")["spec"]["template"]["metadata"]["labels"]
    return peer["podSelector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policy_opens_exactly_the_needed_paths(rendered, variant):
    """gRPC: router -> both tiers, language -> encoder (Attach). Transfer range: encoder ->
    language (Mooncake writes), language -> encoder; nothing else."""
    objs = rendered[variant]
    cm = config_map(objs, "encoder")
    lo, hi = int(cm["TANDEM_TRANSFER__MIN_PORT"]), int(cm["TANDEM_TRANSFER__MAX_PORT"])
    expect = {
        "encoder": {"grpc": {"router", "language"}, "transfer": {"language"}},
        "language": {"grpc": {"router"}, "transfer": {"encoder"}},
    }
    for tier, want in expect.items():
        pol = find(objs, "NetworkPolicy", f"{RELEASE}-{tier}")["spec"]
        grpc_port = port_of(container(objs, tier), "grpc")
        got = {"grpc": set(), "transfer": set()}
        for rule in pol["ingress"]:
            (p,) = rule["ports"]
            if p["port"] == grpc_port:
                kind = "grpc"
            elif (p["port"], p.get("endPort")) == (lo, hi):
                kind = "transfer"
            else:  # metrics, and the health-only port (the kubelet's probes)
                c = container(objs, tier)
                assert p["port"] in {port_of(c, "metrics"), *(
                    [port_of(c, "health")] if any(q["name"] == "health" for q in c["ports"])
                    else [])}
                continue
            for peer in rule["from"]:
                got[kind] |= {
                    t for t in ("router", "encoder", "language") if _selects(peer, objs, t)
                }
        assert got == want, tier


def test_production_gpu_rdma_and_model_volume(rendered):
    objs = rendered["production"]
    for tier in TIERS:
        c = container(objs, tier)
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert config_map(objs, tier)["TANDEM_MODEL"] == "/models/Qwen2.5-VL-72B-Instruct"
        mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert container(objs, "language")["resources"]["limits"]["nvidia.com/gpu"] == 4
    # one language pod = one instance of 4 tensor-parallel ranks, one per GPU (issue 12)
    assert config_map(objs, "language")["TANDEM_TP"] == "4"
    assert config_map(rendered["default"], "language")["TANDEM_TP"] == "1"
    # HPA owns the replica count: the Deployments leave it out.
    for tier in ("encoder", "language", "router"):
        assert "replicas" not in find(objs, "Deployment", f"{RELEASE}-{tier}")["spec"]
        hpa = find(objs, "HorizontalPodAutoscaler", f"{RELEASE}-{tier}")["spec"]
        assert hpa["scaleTargetRef"]["name"] == f"{RELEASE}-{tier}"
    router = container(objs, "router")
    env = {e["name"]: e for e in router["env"]}
    assert env["TANDEM_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "tandem-api-key",
        "key": "api-key",
    }
    assert env["TANDEM_TLS_CERT"]["value"].startswith("/etc/tandem/tls/")


def test_service_monitors_target_existing_ports(rendered):
    objs = rendered["production"]
    monitors = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == 3
    for mon in monitors:
        sel = mon["spec"]["selector"]["matchLabels"]
        svcs = [
            o
            for o in objs
            if o["kind"] == "Service" and sel.items() <= o["metadata"]["labels"].items()
        ]
        assert len(svcs) == 1, mon["metadata"]["name"]
        names = {p["name"] for p in svcs[0]["spec"]["ports"]}
        for ep in mon["spec"]["endpoints"]:
            assert ep["port"] in names and ep["path"] == "/metrics"
    assert not [o for o in rendered["default"] if o["kind"] == "ServiceMonitor"]


def test_generated_internal_certificates_serve_mtls_by_role(rendered, tmp_path):
    """The chart's generated CA and certificates (one Secret per role, the CA's own Secret
    mounted nowhere) are what the services accept: each certificate's common name is its
    role, and a real gRPC server holding the encoder's certificate (RoleGate on) admits the
    router's GetLoad over mTLS and refuses the language's (PERMISSION_DENIED)."""
    import asyncio
    import base64

    import grpc

    from tandem.internal_tls import InternalTLS, RoleGate, sync_channel
    from tandem.pki import common_name
    from tandem.v1 import encoder_pb2_grpc

    objs = rendered["default"]
    pem = {}
    for role in ("router", "encoder", "language"):
        data = find(objs, "Secret", f"{RELEASE}-internal-tls-{role}")["data"]
        assert set(data) == {"ca.crt", "tls.crt", "tls.key"}  # no CA key in a tier's Secret
        pem[role] = {k: base64.b64decode(v) for k, v in data.items()}
        assert common_name(pem[role]["tls.crt"]) == role
        vol = next(v for v in find(objs, "Deployment", f"{RELEASE}-{role}")["spec"]["template"][
            "spec"]["volumes"] if v["name"] == "internal-tls")
        assert vol["secret"]["secretName"] == f"{RELEASE}-internal-tls-{role}"
    assert len({p["ca.crt"] for p in pem.values()}) == 1  # one CA
    tls = {r: InternalTLS(p["ca.crt"], p["tls.crt"], p["tls.key"], r) for r, p in pem.items()}

    class Encoder(encoder_pb2_grpc.EncoderServicer):
        async def GetLoad(self, request, context):  # noqa: N802
            return encoder_pb2.EncoderGetLoadResponse(queued_requests=7)

    async def serve():
        server = grpc.aio.server(interceptors=[RoleGate()])
        encoder_pb2_grpc.add_EncoderServicer_to_server(Encoder(), server)
        port = server.add_secure_port("127.0.0.1:0", tls["encoder"].server_credentials())
        await server.start()
        return server, port

    loop = asyncio.new_event_loop()
    server, port = loop.run_until_complete(serve())
    import threading

    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        req = encoder_pb2.EncoderGetLoadRequest()
        with sync_channel(f"127.0.0.1:{port}", tls["router"]) as ch:
            assert encoder_pb2_grpc.EncoderStub(ch).GetLoad(req, timeout=10).queued_requests == 7
        with sync_channel(f"127.0.0.1:{port}", tls["language"]) as ch:
            with pytest.raises(grpc.RpcError) as e:
                encoder_pb2_grpc.EncoderStub(ch).GetLoad(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_config_schema_is_generated_from_the_services_settings():
    """values.schema.json's `<tier>.config` lists exactly each service's settings fields
    (deploy/k8s/config_schema.py): they cannot drift apart."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("config_schema",
                                                  ROOT / "deploy" / "k8s" / "config_schema.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert json.loads((CHART / "values.schema.json").read_text()) == mod.generated()
    for tier, cls in (("encoder", EncoderConfig), ("language", LanguageConfig),
                      ("router", RouterConfig)):
        props = mod.generated()["properties"][tier]["properties"]["config"]["properties"]
        nested = {"transfer", "internal_tls"}
        assert set(props) == set(cls.model_fields) - nested, tier


def _exported_metric_names() -> set[str]:
    """Every series name the services export (each tier's metric set built in a registry of
    its own): counters' _total, histograms' _bucket/_sum/_count, gauges."""
    from prometheus_client import CollectorRegistry

    from tandem.metrics import metric_set
    from tandem.services.encoder.metrics import EncoderMetrics
    from tandem.services.language.metrics import LanguageMetrics
    from tandem.services.router.metrics import RouterMetrics
    from tandem.transfer.metrics import transfer_metrics

    names: set[str] = set()
    for make in (lambda r: metric_set(EncoderMetrics, r), lambda r: metric_set(LanguageMetrics, r),
                 lambda r: metric_set(RouterMetrics, r),
                 lambda r: transfer_metrics(r).blocks(0, 1)):  # blocks: where a pool exists
        reg = CollectorRegistry()
        make(reg)
        for fam in reg.collect():
            names.add(fam.name)
            names |= {f"{fam.name}{s}" for s in ("_total", "_bucket", "_sum", "_count")}
    return names


def test_alerts_and_dashboard_use_real_metrics_and_pass_promtool(helm, tmp_path):
    """The PrometheusRule's rules pass `promtool check rules`; every metric its alerts and
    the Grafana dashboard query is one the services export; the dashboard JSON parses."""
    import json
    import re
    import shutil

    objs = render(helm, "--set", "prometheusRule.enabled=true",
                  "--set", "grafanaDashboard.enabled=true")
    rule = find(objs, "PrometheusRule", RELEASE)
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"TandemErrorRatioHigh", "TandemTTFTHigh", "TandemTransferFaults",
            "TandemKVCacheFull", "TandemTierDown"} <= alerts
    dash = json.loads(find(objs, "ConfigMap", f"{RELEASE}-dashboard")["data"]["tandem.json"])
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"tandem_[a-z_]+", e)}
    assert used and used <= _exported_metric_names(), used - _exported_metric_names()
    promtool = shutil.which("promtool") or str(ROOT / ".tools" / "promtool")
    if not Path(promtool).exists():
        pytest.skip("promtool not installed (`make test` fetches it)")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    r = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_helm_test_hook_sends_one_chat_to_the_router(helm):
    """`helm test`: a hook pod that posts one chat to the router's Service (with the API key
    from its Secret when one is configured) and fails unless it gets a 200 with a choice."""
    objs = render(helm, "--set", "router.apiKey.value=k3y")
    pod = find(objs, "Pod", f"{RELEASE}-test-chat")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    svc = find(objs, "Service", f"{RELEASE}-router")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    assert env["ROUTER_URL"]["value"] == f"http://{RELEASE}-router:{port}"
    assert env["API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-router-api-key"
    assert "/v1/chat/completions" in c["args"][0]
    kubernetes_validate.validate(pod, NEWEST_K8S, strict=True)
