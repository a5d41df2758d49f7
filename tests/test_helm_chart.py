"""The Helm chart: lint, render, strict schema validation, and agreement with the services.

Renders `deploy/k8s/tandem` with the default values and with `deploy/k8s/values-production.yaml`
through the real Helm binary (installed by `deploy/scripts/install-helm.sh`), validates every
object with kubernetes-validate (strict: unknown fields are errors) for the newest Kubernetes
the package knows and for the chart's oldest supported one, and checks that ports, probes,
discovery names and config keys are the ones the services actually read and serve.

Every check reads the rendered objects, resolved as Kubernetes would (a container's
environment from its envFrom sources and env entries, named ports to numbers, the config as
the service itself parses it from its args and environment), and runs what can run here
(the preStop hook, the `helm test` pod's program, the internal-TLS hook Job's `tandem
certs` up to its Kubernetes API calls): never the templates' text, so renaming a
helper, reordering keys or rewording a comment cannot break a test.
"""

from __future__ import annotations

import base64
import copy
import os
import posixpath
import re
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

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
            "plaintext": ["--set", "internalTLS.enabled=false"],
            "cert-manager": ["--set", "internalTLS.certManager=true"]}
# E/P/D (prefill.enabled): prefill pods and decode language pods. The roles run on the CPU
# only (--tp 1), so the language tier has no GPU there.
EPD = ["--set", "prefill.enabled=true", "--set", "language.gpus=0"]
VARIANTS.update({"epd": EPD, "epd-production": ["-f", str(PROD), *EPD]})
CERT_MANAGER = "cert-manager.io/v1"
EXISTING_TLS = [a for role in ("router", "encoder", "language")
                for a in ("--set", f"internalTLS.existingSecrets.{role}=mine-{role}")]
TIERS = {
    # tier: (config class, proto service full name the readiness probe must ask for)
    "encoder": (EncoderConfig, encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name),
    "language": (LanguageConfig, language_pb2.DESCRIPTOR.services_by_name["Language"].full_name),
}
FAKE_POD_IP = "10.1.2.3"
FAKE_POD_NAME = "tandem-pod-0"


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
    return [d for d in yaml.safe_load_all(render_text(helm, *extra, kube=kube)) if d]


def template(helm: Path, *extra: str, kube: str = NEWEST_K8S) -> subprocess.CompletedProcess:
    """`helm template` of the chart with `extra` values, whatever its outcome."""
    return helm_run(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                    "--kube-version", kube, *extra)


def render_text(helm: Path, *extra: str, kube: str = NEWEST_K8S) -> str:
    """`helm template`'s output, as a GitOps tool (Argo CD, Flux) would apply it."""
    r = template(helm, *extra, kube=kube)
    assert r.returncode == 0, r.stderr
    return r.stdout


def assert_refused(helm: Path, bad: list[str], sensible: list[str]) -> None:
    """The chart refuses `bad` (helm's exit status: the schema error's wording is helm's),
    where `sensible`, the same setting with a sensible value, renders: the refusal is about
    that value, not about something else in the command."""
    ok = template(helm, *sensible)
    assert ok.returncode == 0, ok.stderr
    r = template(helm, *bad)
    assert r.returncode != 0, r.stdout[-2000:]


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


def resolve_port(c: dict, ref: int | str) -> int:
    """A port as Kubernetes resolves it against container `c`: a number, or a port's name."""
    return ref if isinstance(ref, int) else port_of(c, ref)


def service_ports_to(svc: dict, c: dict, port: int) -> list[dict]:
    """The Service's ports that forward to container `c`'s `port` (by number or name)."""
    hits = [p for p in svc["spec"]["ports"]
            if resolve_port(c, p.get("targetPort", p["port"])) == port]
    assert hits, f"{svc['metadata']['name']}: no port forwards to {port}: {svc['spec']['ports']}"
    return hits


def pod_spec(objs: list[dict], tier: str) -> dict:
    return find(objs, "Deployment", f"{RELEASE}-{tier}")["spec"]["template"]["spec"]


def pod_labels(objs: list[dict], tier: str) -> dict:
    return find(objs, "Deployment", f"{RELEASE}-{tier}")["spec"]["template"]["metadata"]["labels"]


def _data(objs: list[dict], kind: str, name: str) -> dict[str, str] | None:
    """A ConfigMap's or Secret's data (decoded); None for a Secret the release does not make."""
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    if kind == "Secret" and not hits:
        return None
    (obj,) = hits
    if kind == "Secret":
        data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        return {**data, **(obj.get("stringData") or {})}
    return dict(obj.get("data") or {})


def env_of(objs: list[dict], c: dict) -> dict[str, str]:
    """The environment container `c` would see, as the kubelet builds it: its envFrom
    sources in order, then its env entries on top (the downward-API pod IP faked, values
    of Secrets the release does not make dummied)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        kind = "ConfigMap" if "configMapRef" in src else "Secret"
        data = _data(objs, kind, (src.get("configMapRef") or src["secretRef"])["name"])
        env.update({src.get("prefix", "") + k: v for k, v in (data or {}).items()})
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        src = e["valueFrom"]
        if src.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = FAKE_POD_IP
        elif src.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = FAKE_POD_NAME
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            env[e["name"]] = _data(objs, "ConfigMap", ref["name"])[ref["key"]]
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            env[e["name"]] = (_data(objs, "Secret", ref["name"]) or {}).get(
                ref["key"], "secret-from-k8s")
        else:
            raise AssertionError(f"{e['name']}: unmodelled valueFrom {src}")
    return env


CONFIGS = {"encoder": EncoderConfig, "language": LanguageConfig, "router": RouterConfig,
           "prefill": LanguageConfig}
COMMANDS = {"prefill": "language"}  # a Deployment whose `tandem` subcommand is not its name


def service_config(objs: list[dict], tier: str):
    """The tier's config exactly as `tandem <command>` parses it in the pod: the container's
    args after the subcommand, and its environment (no TANDEM_* from this process)."""
    c = container(objs, tier)
    command = COMMANDS.get(tier, tier)
    assert c["args"][0] == command
    host = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    with mock.patch.dict(os.environ, {**host, **_pod_env(objs, tier)}, clear=True):
        return parse_settings(CONFIGS[tier], c["args"][1:], f"tandem {command}")


def has_tier(objs: list[dict], tier: str) -> bool:
    return any(o["kind"] == "Deployment" and o["metadata"]["name"] == f"{RELEASE}-{tier}"
               for o in objs)


def mount_holding(c: dict, pod: dict, path: str) -> tuple[dict, dict]:
    """(volumeMount, volume) that `path` lies in, the innermost mount."""
    mounts = [m for m in c.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on no volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount, vol


# ---- Helm itself ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_is_clean(helm, variant):
    """No warning and no error: `--strict` fails the lint on either (its exit status;
    test_helm_lint_strict_fails_on_a_warning shows it does)."""
    r = helm_run(helm, "lint", "--strict", str(CHART), *VARIANTS[variant])
    assert r.returncode == 0, r.stdout + r.stderr


def test_helm_lint_strict_fails_on_a_warning(helm, tmp_path):
    """The control for the lint above: the chart with one template on an API Kubernetes
    deprecated (a lint warning, not an error) fails `helm lint --strict`."""
    chart = tmp_path / CHART.name
    subprocess.run(["cp", "-r", str(CHART), str(chart)], check=True)
    (chart / "templates" / "zz-deprecated.yaml").write_text(yaml.safe_dump({
        "apiVersion": "policy/v1beta1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "deprecated"}, "spec": {"minAvailable": 1}}))
    r = helm_run(helm, "lint", "--strict", str(chart))
    assert r.returncode != 0, r.stdout + r.stderr


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
                # CRDs: the Prometheus Operator's, checked against the Services it selects
                # below; cert-manager's, checked field by field below.
                assert obj["apiVersion"] in ("monitoring.coreos.com/v1", CERT_MANAGER), obj["kind"]


def test_strict_validation_rejects_an_unknown_field(rendered):
    """The validator is not vacuous: a misspelt container field fails the same call."""
    dep = copy.deepcopy(find(rendered["default"], "Deployment", f"{RELEASE}-encoder"))
    kubernetes_validate.validate(dep, NEWEST_K8S, strict=True)
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, NEWEST_K8S, strict=True)


@pytest.mark.parametrize(
    "bad, sensible",
    [
        (["--set-string", "encoder.replicas=2"], ["--set", "encoder.replicas=2"]),
        (["--set-string", "language.port=50071"], ["--set", "language.port=50071"]),
        (["--set", "router.replicaz=2"], ["--set", "router.replicas=2"]),
        (["--set", "transfer.protocol=udp"], ["--set", "transfer.protocol=tcp"]),
        (["--set", "encoder.config.cache_byte=5"], ["--set", "encoder.config.cache_bytes=5"]),
        # (--set-json: --set makes 0.5 a string; kv_memory_fraction, managed, is never
        # accepted under config, so its range is checked on language.kvMemoryFraction)
        (["--set-json", "language.config.embedding_client_share=2"],
         ["--set-json", "language.config.embedding_client_share=0.5"]),
        (["--set-json", "language.kvMemoryFraction=2"],
         ["--set-json", "language.kvMemoryFraction=0.9"]),
        (["--set", "router.config.log_format=xml"], ["--set", "router.config.log_format=json"]),
        (["--set", "tracing.enabled=true"],
         ["--set", "tracing.enabled=true", "--set", "tracing.endpoint=http://otel:4317"]),
        (["--set", "tracing.sampler=parentbased_always_on", "--set-json", "tracing.samplerArg=0.5"],
         ["--set", "tracing.sampler=parentbased_traceidratio",
          "--set-json", "tracing.samplerArg=0.5"]),
        (["--set", "tracing.sampler=traceidratio"],
         ["--set", "tracing.sampler=traceidratio", "--set-json", "tracing.samplerArg=0.5"]),
    ],
    ids=[
        "replicas-string",
        "port-string",
        "unknown-key",
        "bad-protocol",
        "misspelt-config-key",
        "config-out-of-range",
        "chart-value-out-of-range",
        "config-not-a-choice",
        "tracing-no-endpoint",
        "tracing-ratio-for-another-sampler",
        "tracing-ratio-sampler-without-ratio",
    ],
)
def test_broken_values_are_rejected(helm, bad, sensible):
    """Refused by the values schema (helm's exit status, not its wording), where the same
    setting with a sensible value renders."""
    assert_refused(helm, bad, sensible)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "transfer.minPort=15010", "--set", "transfer.maxPort=15000"], "maxPort"),
        (["--set", "transfer.protocol=rdma"], "deviceName"),
        (["--set", "encoder.config.port=1"], "encoder.config.port"),
        (["--set", "model.source=pvc"], "model.claimName"),
    ],
    ids=[
        "port-range",
        "rdma-no-device",
        "managed-key-in-config",
        "pvc-no-claim",
    ],
)
def test_broken_values_are_rejected_in_the_charts_words(helm, args, message):
    """Refused by the chart's own templates (`fail`/`required`): their message is Tandem's."""
    with pytest.raises(AssertionError) as err:
        render(helm, *args)
    assert message in str(err.value)


def _documented_keys(lines: list[str]) -> dict[str, bool]:
    """Dotted key path -> whether the comment block right above it holds a `# --` line (the
    helm-docs description), whatever the indentation width."""
    out, stack, comment = {}, [], []
    for ln in lines:
        body = ln.strip()
        if body.startswith("#"):
            comment.append(body)
            continue
        if not body or body.startswith("-") or ":" not in body:
            comment = []
            continue
        indent = len(ln) - len(ln.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, body.split(":", 1)[0].strip().strip("'\"")))
        out[".".join(k for _, k in stack)] = any(c.startswith("# --") for c in comment)
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
    return env_of(objs, container(objs, tier))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tier", ["encoder", "language", "router", "prefill"])
def test_rendered_config_is_what_the_service_parses(rendered, variant, tier):
    """Each TANDEM_* key names a real config field, and the service's own parser (CLI args +
    env, exactly as `tandem <tier>` runs it) accepts the rendered values; the parsed ports are
    the container ports. The language pods' role is decode with prefill pods, else both."""
    objs = rendered[variant]
    epd = has_tier(objs, "prefill")
    assert epd == variant.startswith("epd")
    if tier == "prefill" and not epd:
        return
    cls = CONFIGS[tier]
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
    c = container(objs, tier)
    cfg = service_config(objs, tier)
    if tier == "router":
        assert cfg.http_port == port_of(c, "http") and cfg.grpc_port == port_of(c, "grpc")
        assert bool(cfg.prefill_dns) == epd and not cfg.prefills
    else:
        if tier != "encoder":
            assert cfg.role == {"prefill": "prefill", "language": "decode" if epd else "both"}[tier]
            assert cfg.tp == 1 or not epd
        assert cfg.port == port_of(c, "grpc") and cfg.metrics_port == port_of(c, "metrics")
        assert cfg.metrics_port > 0, "metrics must be served in the cluster"
        assert cfg.transfer.host == FAKE_POD_IP
        assert cfg.transfer.protect == "mac"  # the chart's default reaches the tier
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
    for probe, service in (("startupProbe", proto_service), ("readinessProbe", proto_service),
                           ("livenessProbe", health.OVERALL_HEALTH)):
        grpc = c[probe]["grpc"]
        assert resolve_port(c, grpc["port"]) == probe_port, probe
        assert grpc.get("service", "") == service, probe
    # GPU requested in both requests and limits (extended resources must match).
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The router's discovery name is this tier's headless Service, on the gRPC port.
    host, port = getattr(service_config(objs, "router"), f"{tier}_dns").rsplit(":", 1)
    svc_name = f"{RELEASE}-{tier}-headless"
    assert host == f"{svc_name}.{NAMESPACE}.svc.cluster.local"
    svc = find(objs, "Service", svc_name)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"].get("publishNotReadyAddresses", False) is False
    (grpc_svc_port,) = service_ports_to(svc, c, grpc_port)
    assert int(port) == grpc_svc_port["port"] == grpc_port
    assert svc["spec"]["selector"].items() <= pod_labels(objs, tier).items()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tier", ["encoder", "language", "router", "prefill"])
def test_termination_outlasts_prestop_and_drain(rendered, tmp_path, variant, tier):
    """SIGKILL never cuts a drain short: grace > preStop sleep (what the hook waits when
    run) + the service's drain_timeout_s (as the service parses it); a tier pod sleeps
    until the router has re-resolved DNS."""
    objs = rendered[variant]
    if not has_tier(objs, tier):
        return
    sleep = prestop_seconds(container(objs, tier), tmp_path)
    drain = service_config(objs, tier).drain_timeout_s
    assert pod_spec(objs, tier)["terminationGracePeriodSeconds"] > sleep + drain
    if tier != "router":
        assert sleep >= service_config(objs, "router").dns_refresh_s


def prestop_seconds(c: dict, tmp: Path) -> float:
    """How long the container's preStop hook waits: its `sleep` action, or its exec command
    run here with a `sleep` on PATH that records its arguments instead of sleeping."""
    pre = c["lifecycle"]["preStop"]
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    fake, log = tmp / "bin", tmp / "slept"
    fake.mkdir(exist_ok=True)
    (fake / "sleep").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >>{shlex.quote(str(log))}\n')
    (fake / "sleep").chmod(0o755)
    log.write_text("")
    argv = list(pre["exec"]["command"])
    if posixpath.basename(argv[0]) == "sleep":
        argv[0] = str(fake / "sleep")
    r = subprocess.run(argv, env={"PATH": f"{fake}:/usr/bin:/bin"}, capture_output=True,
                       text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    words = log.read_text().split()
    assert words, f"preStop {argv} never sleeps"
    return sum(float(w[:-1]) * units[w[-1]] if w[-1] in units else float(w) for w in words)


def test_router_ports_probes_and_service(rendered):
    objs = rendered["default"]
    c = container(objs, "router")
    assert port_of(c, "http") == _field_default(RouterConfig, "http_port")
    assert port_of(c, "grpc") == _field_default(RouterConfig, "grpc_port")
    probe = c["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and resolve_port(c, probe["port"]) == port_of(c, "http")
    svc = find(objs, "Service", f"{RELEASE}-router")
    for name in ("http", "grpc"):
        (p,) = service_ports_to(svc, c, port_of(c, name))
        assert p["port"] == port_of(c, name), name
    # the router runs the CPU-only image (the Dockerfile's `router` target), the tiers the
    # full one
    assert c["image"].endswith("-router") and not container(objs, "encoder")["image"].endswith(
        "-router")


def _selects(peer: dict, objs: list[dict], tier: str) -> bool:
    """Whether a NetworkPolicy `from` peer admits the tier's pods (a peer without a pod
    selector admits every pod it reaches)."""
    sel = peer.get("podSelector")
    if sel is None:
        return True
    assert not sel.get("matchExpressions"), "matchExpressions: not modelled here"
    return (sel.get("matchLabels") or {}).items() <= pod_labels(objs, tier).items()


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policy_opens_exactly_the_needed_paths(rendered, variant):
    """gRPC: router -> both tiers, language -> encoder (Attach). Transfer range: encoder ->
    language (Mooncake writes), language -> encoder; nothing else.

    E/P/D (prefill pods; the language pods decode): the prefill pods take the language
    side of the encoder paths (Attach, the embedding writes), the decode pods keep only
    the router's gRPC and gain the prefill pods' KV writes; the prefill pods are reached by
    the router (Reattach, GetLoad) and the decode pods (Prefill) on gRPC and by the
    encoders on the transfer range. Nothing else."""
    objs = rendered[variant]
    if has_tier(objs, "prefill"):
        expect = {
            "encoder": {"grpc": {"router", "prefill"}, "transfer": {"prefill"}},
            "language": {"grpc": {"router"}, "transfer": {"prefill"}},
            "prefill": {"grpc": {"router", "language"}, "transfer": {"encoder"}},
        }
    else:
        expect = {
            "encoder": {"grpc": {"router", "language"}, "transfer": {"language"}},
            "language": {"grpc": {"router"}, "transfer": {"encoder"}},
        }
    policies = {o["metadata"]["name"] for o in objs if o["kind"] == "NetworkPolicy"}
    assert policies == {f"{RELEASE}-{t}" for t in (*expect, "router")}
    for tier, want in expect.items():
        pol = find(objs, "NetworkPolicy", f"{RELEASE}-{tier}")["spec"]
        assert [t for t in (*expect, "router") if _selects(pol, objs, t)] == [tier]
        c = container(objs, tier)
        transfer = service_config(objs, tier).transfer
        lo, hi = transfer.min_port, transfer.max_port
        grpc_port = port_of(c, "grpc")
        # metrics, and the health-only port (the kubelet's probes): open to any source
        others = {p["containerPort"] for p in c["ports"] if p["name"] in ("metrics", "health")}
        got = {"grpc": set(), "transfer": set()}
        for rule in pol["ingress"]:
            # no `from`: every source; a peer without a pod selector: every pod it reaches
            peers = {"*"} if not rule.get("from") else {
                t for peer in rule["from"] for t in ("router", "encoder", "language", "prefill")
                if has_tier(objs, t) and _selects(peer, objs, t)}
            for p in rule.get("ports") or [{}]:  # no ports: all of them
                port = resolve_port(c, p["port"]) if "port" in p else None
                if port == grpc_port and not p.get("endPort"):
                    got["grpc"] |= peers
                elif (port, p.get("endPort")) == (lo, hi):
                    got["transfer"] |= peers
                else:
                    assert port in others and not p.get("endPort"), f"{tier} opens {p}"
        assert got == want, tier


@pytest.mark.parametrize("values", ["default", "production"])
def test_network_policy_without_prefill_is_unchanged(helm, values):
    """With prefill off (the default) the rendered NetworkPolicy is byte for byte the one
    the chart rendered before E/P/D (tests/golden/, rendered then), whatever prefill.*
    holds. A deliberate change of the policy rewrites the golden file in the same commit."""
    args = ["-f", str(PROD)] if values == "production" else []
    golden = (ROOT / "tests" / "golden" / f"networkpolicy-{values}.yaml").read_text()
    for extra in ([], ["--set", "prefill.replicas=3", "--set", "prefill.config.max_prefill_tokens=512",
                       "--set", "language.gpus=0"]):
        text = render_text(helm, *args, *extra, "--show-only", "templates/networkpolicy.yaml")
        assert text == golden, extra


@pytest.mark.parametrize("variant", ["epd", "epd-production"])
def test_epd_prefill_pods_are_found_probed_and_trusted(rendered, variant):
    """The prefill Deployment: the language image as `tandem language --role=prefill`, the
    language tier's health service on the probes, found by the router through its own
    headless Service (which selects no decode pod, as the language Service selects no
    prefill pod), mounting the language role's certificate: the role internal_tls.POLICY
    lets call Prefill (what a decode pod presents) and Attach (what P opens on an encoder);
    fixed replicas (no HPA), the language tier's PDB."""
    from tandem import internal_tls

    objs = rendered[variant]
    c, lang = container(objs, "prefill"), container(objs, "language")
    assert c["image"] == lang["image"] and c["args"][:2] == ["language", "--role=prefill"]
    assert lang["args"][:2] == ["language", "--role=decode"]
    cfg = service_config(objs, "prefill")
    grpc_port = port_of(c, "grpc")
    assert grpc_port == cfg.port == _field_default(LanguageConfig, "port")
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"]["service"] == TIERS["language"][1]
        assert resolve_port(c, c[probe]["grpc"]["port"]) == port_of(c, "health")
    host, port = service_config(objs, "router").prefill_dns.rsplit(":", 1)
    svc_name = f"{RELEASE}-prefill-headless"
    assert host == f"{svc_name}.{NAMESPACE}.svc.cluster.local"
    svc = find(objs, "Service", svc_name)
    assert svc["spec"]["clusterIP"] == "None"
    (grpc_svc_port,) = service_ports_to(svc, c, grpc_port)
    assert int(port) == grpc_svc_port["port"] == grpc_port
    lang_svc = find(objs, "Service", f"{RELEASE}-language-headless")
    for s_, tier, other in ((svc, "prefill", "language"), (lang_svc, "language", "prefill")):
        assert s_["spec"]["selector"].items() <= pod_labels(objs, tier).items()
        assert not s_["spec"]["selector"].items() <= pod_labels(objs, other).items()
    # internal TLS: the prefill pod's certificate is the language role's
    vols = {v["name"]: v for v in pod_spec(objs, "prefill")["volumes"]}
    assert vols["internal-tls"]["secret"]["secretName"] == f"{RELEASE}-internal-tls-language"
    assert internal_tls.allowed_roles("/tandem.v1.Language/Prefill") == {"language"}
    assert "language" in internal_tls.allowed_roles("/tandem.v1.Encoder/Attach")
    for method in ("Reattach", "GetLoad"):
        assert "router" in internal_tls.allowed_roles(f"/tandem.v1.Language/{method}")
    # scaling: fixed replicas even where the language tier autoscales; language's PDB
    dep = find(objs, "Deployment", f"{RELEASE}-prefill")
    assert dep["spec"]["replicas"] == 1
    assert not [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"
                and o["metadata"]["name"] == f"{RELEASE}-prefill"]
    pdb = find(objs, "PodDisruptionBudget", f"{RELEASE}-prefill")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(objs, "prefill").items()


def test_epd_values_merge_over_the_language_tiers(helm):
    """prefill.* keys are merged over language.*: a map key by key, a list replaced; an
    existing language Secret is the prefill pods' too; prefill.config reaches only them."""
    objs = render(helm, *EPD, "--set", "prefill.replicas=2",
                  "--set", "prefill.resources.limits.memory=8Gi",
                  "--set", "language.config.max_running_requests=7",
                  "--set", "prefill.config.max_prefill_tokens=512",
                  "--set", "prefill.extraArgs={--log-level=debug}",
                  "--set", "internalTLS.existingSecrets.language=mine-language")
    c, lang = container(objs, "prefill"), container(objs, "language")
    assert find(objs, "Deployment", f"{RELEASE}-prefill")["spec"]["replicas"] == 2
    assert c["resources"]["limits"]["memory"] == "8Gi"
    assert c["resources"]["requests"] == lang["resources"]["requests"]
    assert c["args"] == ["language", "--role=prefill", "--log-level=debug"]
    pre, dec = service_config(objs, "prefill"), service_config(objs, "language")
    assert pre.max_prefill_tokens == 512 != dec.max_prefill_tokens
    assert pre.max_running_requests == dec.max_running_requests == 7
    vols = {v["name"]: v for v in pod_spec(objs, "prefill")["volumes"]}
    assert vols["internal-tls"]["secret"]["secretName"] == "mine-language"


def test_epd_refuses_gpu_pods_and_a_role_in_config(helm):
    """The prefill and decode roles run on the CPU only (--tp 1): the chart refuses a GPU
    language tier with prefill on rather than deploy pods that exit at start; `role` is the
    chart's (prefill.enabled), not a config key."""
    r = template(helm, "--set", "prefill.enabled=true")
    assert r.returncode != 0 and "CPU only" in r.stderr
    r = template(helm, "--set", "language.config.role=decode")
    assert r.returncode != 0 and "dedicated chart value" in r.stderr
    r = template(helm, *EPD, "--set", "router.config.prefill_dns=elsewhere:1")
    assert r.returncode != 0 and "dedicated chart value" in r.stderr


def test_production_gpu_rdma_and_model_volume(rendered):
    objs = rendered["production"]
    prod = yaml.safe_load(PROD.read_text())["model"]
    for tier in TIERS:
        c = container(objs, tier)
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        # the model the service loads is the checkpoint directory on the read-only claim
        model = str(service_config(objs, tier).model)
        mount, vol = mount_holding(c, pod_spec(objs, tier), model)
        assert mount.get("readOnly") is True
        assert vol["persistentVolumeClaim"]["claimName"] == prod["claimName"]
        assert posixpath.relpath(model, mount["mountPath"]) == prod["path"]
    # one language pod = one instance of 4 tensor-parallel ranks, one per GPU (issue 12)
    gpus = container(objs, "language")["resources"]["limits"]["nvidia.com/gpu"]
    assert service_config(objs, "language").tp == gpus == 4
    assert service_config(rendered["default"], "language").tp == 1
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
    # the router's TLS certificate and key are files of a mounted Secret
    cfg = service_config(objs, "router")
    for path in (cfg.tls_cert, cfg.tls_key):
        _, vol = mount_holding(router, pod_spec(objs, "router"), str(path))
        assert "secret" in vol, path


@pytest.mark.parametrize("variant", ["production", "epd-production"])
def test_service_monitors_target_existing_ports(rendered, variant):
    objs = rendered[variant]
    monitors = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == (4 if variant == "epd-production" else 3)
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


def test_hook_job_secrets_serve_mtls_by_role(rendered, tmp_path):
    """The Secrets the default values' hook Job creates (its own `tandem certs` arguments,
    parsed by the CLI, planned by tandem/pki.py for a namespace that has none yet) are the
    ones each role's pods mount, each strictly valid, the CA's mounted by no pod; each
    certificate's common name is its role, and a real gRPC server holding the encoder's
    certificate (RoleGate on) admits the router's GetLoad over mTLS and refuses the
    language's (PERMISSION_DENIED). Only the API calls that store them do not run here."""
    import asyncio

    import grpc

    from tandem.internal_tls import InternalTLS, RoleGate, sync_channel
    from tandem.pki import common_name
    from tandem.v1 import encoder_pb2_grpc

    objs = rendered["default"]
    spec, created = _hook_job_secrets(objs)
    ca_name = spec["ca_secret"]
    assert [o["metadata"]["name"] for o in created] == [ca_name, *spec["secrets"].values()]
    by_name = {o["metadata"]["name"]: o for o in created}
    for obj in created:
        kubernetes_validate.validate(obj, NEWEST_K8S, strict=True)
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    pem = {}
    for role in ("router", "encoder", "language"):
        name, keys = _internal_tls_files(objs, role)
        assert name == spec["secrets"][role] == f"{RELEASE}-internal-tls-{role}"
        data = by_name[name]["data"]
        assert set(data) == set(keys.values()) == {"ca.crt", "tls.crt", "tls.key"}  # no CA key
        pem[role] = {k: base64.b64decode(data[v]) for k, v in keys.items()}
        assert common_name(pem[role]["cert"]) == role
    ca_pem = base64.b64decode(by_name[ca_name]["data"]["tls.crt"])
    assert {p["ca"] for p in pem.values()} == {ca_pem}  # one CA, the stored one
    volumes = [v for o in objs if o["kind"] in ("Deployment", "Pod", "Job")
               for v in (o["spec"].get("template", o)["spec"].get("volumes") or [])]
    assert ca_name not in {v.get("secret", {}).get("secretName") for v in volumes}
    tls = {r: InternalTLS(p["ca"], p["cert"], p["key"], r) for r, p in pem.items()}

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


HOOK = "helm.sh/hook"


@pytest.mark.parametrize("variant", ["default", "production"])
def test_hook_job_runs_first_with_rights_to_exactly_its_secrets(rendered, variant):
    """Without cert-manager the Secrets come from a pre-install/pre-upgrade hook Job: its
    ServiceAccount, Role and RoleBinding are hooks of a lower weight (created before it),
    all are deleted once they succeed; the Role may get the CA's and the roles' Secrets and
    nothing else, and create Secrets (RBAC cannot name what a create makes); the Job runs
    the router's image as its own ServiceAccount, the only pod with an API token."""
    objs = rendered[variant]
    spec, _ = _hook_job_secrets(objs)
    assert spec["namespace"] == NAMESPACE
    assert spec["days"] == 3650  # internalTLS.generatedValidityDays
    job = _hook_job(objs)
    name = job["metadata"]["name"]
    hooks = {(o["kind"], o["metadata"]["name"]): o["metadata"]["annotations"]
             for o in objs if HOOK in o["metadata"].get("annotations", {})}
    rbac = {("ServiceAccount", name), ("Role", name), ("RoleBinding", name)}
    # the helm test pod is a hook too (`helm test`), not one of these
    assert set(hooks) - {("Pod", f"{RELEASE}-test-chat")} == rbac | {("Job", name)}
    for key in rbac | {("Job", name)}:
        ann = hooks[key]
        assert set(ann[HOOK].split(",")) == {"pre-install", "pre-upgrade"}, key
        # the right to create Secrets goes when the hook fails too; the Job stays for logs
        assert set(ann["helm.sh/hook-delete-policy"].split(",")) == {
            "before-hook-creation", "hook-succeeded"} | (
            {"hook-failed"} if key in rbac else set()), key
    weight = {k: int(hooks[k].get("helm.sh/hook-weight", "0")) for k in rbac | {("Job", name)}}
    assert max(weight[k] for k in rbac) < weight[("Job", name)]

    role = find(objs, "Role", name)
    gets = [r for r in role["rules"] if "get" in r["verbs"]]
    creates = [r for r in role["rules"] if "create" in r["verbs"]]
    assert len(role["rules"]) == 2 and len(gets) == len(creates) == 1
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""] and rule["resources"] == ["secrets"]
        assert len(rule["verbs"]) == 1
    assert set(gets[0]["resourceNames"]) == {spec["ca_secret"], *spec["secrets"].values()}
    binding = find(objs, "RoleBinding", name)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name,
                                    "namespace": NAMESPACE}]
    find(objs, "ServiceAccount", name)

    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name and pod["automountServiceAccountToken"] is True
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] >= 1
    (c,) = pod["containers"]
    assert c["image"] == container(objs, "router")["image"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True  # the plan is in memory
    for tier in ("router", "encoder", "language"):  # the tiers never call the API
        assert pod_spec(objs, tier)["automountServiceAccountToken"] is False
    # no tier's NetworkPolicy selects the Job's pod (egress is open: it reaches the API)
    labels = job["spec"]["template"]["metadata"]["labels"]
    for np in (o for o in objs if o["kind"] == "NetworkPolicy"):
        sel = np["spec"]["podSelector"]["matchLabels"]
        assert not sel.items() <= labels.items(), np["metadata"]["name"]


def test_hook_job_makes_only_the_roles_without_an_existing_secret(helm):
    """A role named in existingSecrets is left to its Secret: the Job neither creates nor
    may read it; with all three named there is no Job and no RBAC at all."""
    objs = render(helm, "--set", "internalTLS.existingSecrets.encoder=mine-encoder")
    spec, created = _hook_job_secrets(objs)
    assert spec["secrets"] == {r: f"{RELEASE}-internal-tls-{r}" for r in ("router", "language")}
    assert "mine-encoder" not in {o["metadata"]["name"] for o in created}
    name = _hook_job(objs)["metadata"]["name"]
    (get,) = [r for r in find(objs, "Role", name)["rules"] if "get" in r["verbs"]]
    assert "mine-encoder" not in get["resourceNames"]
    assert _internal_tls_files(objs, "encoder")[0] == "mine-encoder"
    objs = render(helm, *EXISTING_TLS)
    assert not [o for o in objs if o["kind"] in ("Job", "Role", "RoleBinding")]


def _stored(obj: dict) -> dict:
    """A planned Secret as the API server would return it (what the next run reads)."""
    return {**obj, "metadata": {**obj["metadata"], "uid": "x", "resourceVersion": "1"}}


def test_hook_job_creates_what_is_missing_and_changes_nothing_that_exists(rendered):
    """The Job's decisions (tandem/pki.py plan_kube_secrets), for the states a namespace can
    be in: nothing there (the CA first, then every role); everything there (nothing, so a
    rerun on every upgrade or Argo CD sync rotates nothing); one role's Secret deleted (only
    it, signed by the stored CA, so the other tiers keep trusting it); the CA's Secret gone
    but some roles' left (refused with the command that resolves it)."""
    from cryptography import x509

    from tandem.pki import KubeSecretsError, plan_kube_secrets

    objs = rendered["default"]
    spec, first = _hook_job_secrets(objs)
    ca_name, secrets = spec["ca_secret"], spec["secrets"]
    assert first[0]["metadata"]["name"] == ca_name and first[0]["type"] == "kubernetes.io/tls"
    stored = {o["metadata"]["name"]: _stored(o) for o in first}

    def plan(present: dict) -> list[dict]:
        state = {n: present.get(n) for n in [ca_name, *secrets.values()]}
        return plan_kube_secrets(state, ca_name, secrets, spec["labels"], spec["days"])

    assert plan(stored) == []
    lost = {n: o for n, o in stored.items() if n != secrets["encoder"]}
    (again,) = plan(lost)
    assert again["metadata"]["name"] == secrets["encoder"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(stored[ca_name]["data"]["tls.crt"]))
    new = x509.load_pem_x509_certificate(base64.b64decode(again["data"]["tls.crt"]))
    new.verify_directly_issued_by(ca)
    assert again["data"]["ca.crt"] == stored[secrets["router"]]["data"]["ca.crt"]
    assert new.not_valid_after_utc <= ca.not_valid_after_utc
    no_ca = {n: o for n, o in lost.items() if n != ca_name}
    with pytest.raises(KubeSecretsError, match=f"kubectl delete secret .*{secrets['router']}"):
        plan(no_ca)


def test_hook_job_signs_with_the_ca_an_earlier_genca_release_left(rendered):
    """Releases of this chart before the hook Job generated the Secrets with Helm's genCA
    (an RSA CA in a kubernetes.io/tls Secret of the same name, kept on upgrade by
    helm.sh/resource-policy: keep). Upgrading runs the Job against them: nothing is created
    while all are there, and a missing role is signed by that same RSA CA."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    from tandem.pki import plan_kube_secrets

    spec, _ = _hook_job_secrets(rendered["default"])
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem internal CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
          .public_key(key.public_key()).serial_number(1).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(key, hashes.SHA256()))
    pem = ca.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    old_ca = {"type": "kubernetes.io/tls", "data": {
        "tls.crt": base64.b64encode(pem).decode(), "tls.key": base64.b64encode(key_pem).decode()}}
    state = {spec["ca_secret"]: old_ca, **{n: None for n in spec["secrets"].values()}}
    state[spec["secrets"]["router"]] = {"data": {}}  # still there: not touched
    made = plan_kube_secrets(state, spec["ca_secret"], spec["secrets"], {}, spec["days"])
    assert [o["metadata"]["name"] for o in made] == [spec["secrets"][r]
                                                    for r in ("encoder", "language")]
    for obj in made:
        cert = x509.load_pem_x509_certificate(base64.b64decode(obj["data"]["tls.crt"]))
        cert.verify_directly_issued_by(ca)
        assert cert.not_valid_after_utc <= ca.not_valid_after_utc  # capped at the CA's
        assert base64.b64decode(obj["data"]["ca.crt"]) == pem


def test_hook_job_refuses_to_sign_with_an_expired_ca(rendered):
    """A stored CA past its end signs nothing (its certificates would be void at once): the
    Job says so and names the Secrets to delete, not cryptography's date-order error."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from tandem.pki import KubeSecretsError, plan_kube_secrets

    spec, _ = _hook_job_secrets(rendered["default"])
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem internal CA")])
    ended = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1)
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
          .public_key(key.public_key()).serial_number(1)
          .not_valid_before(ended - datetime.timedelta(days=365)).not_valid_after(ended)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    stored = {"type": "kubernetes.io/tls", "data": {
        "tls.crt": base64.b64encode(ca.public_bytes(serialization.Encoding.PEM)).decode(),
        "tls.key": base64.b64encode(key_pem).decode()}}
    state = {spec["ca_secret"]: stored, **{n: None for n in spec["secrets"].values()}}
    with pytest.raises(KubeSecretsError, match=f"expired .*kubectl delete secret {spec['ca_secret']}"):
        plan_kube_secrets(state, spec["ca_secret"], spec["secrets"], {}, spec["days"])


@pytest.mark.parametrize(
    "argv, message",
    [([], "give DIR"),
     (["out", "--kube-namespace", "ns"], "exclusive"),
     (["out", "--kube-label", "a=b"], "give DIR"),
     (["--kube-namespace", "ns", "--kube-secret", "router=r"], "--kube-ca-secret"),
     (["--kube-namespace", "ns", "--kube-ca-secret", "ca", "--kube-secret", "vit=r"],
      "unknown role"),
     (["--kube-namespace", "ns", "--kube-ca-secret", "ca", "--kube-secret", "router=ca"],
      "different Secrets"),
     (["--kube-namespace", "ns", "--kube-ca-secret", "ca", "--kube-secret", "router"],
      "KEY=VALUE"),
     (["out", "--days", "0"], "--days")],
    ids=["nothing", "dir-and-namespace", "label-without-namespace", "no-ca-secret",
         "unknown-role", "ca-is-a-role-secret", "no-name", "zero-days"])
def test_tandem_certs_refuses_flags_it_would_ignore(capsys, argv, message):
    from tandem.cli import _certs_spec

    with pytest.raises(SystemExit) as e:
        _certs_spec(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


# cert-manager.io/v1 spec fields the chart may set, and their closed choices (from
# cert-manager's CRDs): kubernetes-validate has no schema for CRDs, so a misspelt key would
# pass it and be dropped by the API server.
CM_SPEC = {
    "Issuer": {"selfSigned": {"crlDistributionPoints"},
               "ca": {"secretName", "crlDistributionPoints", "issuingCertificateURLs",
                      "ocspServers"}},
    "Certificate": {"secretName": None, "secretTemplate": {"labels", "annotations"},
                    "commonName": None, "dnsNames": None, "ipAddresses": None,
                    "usages": None, "duration": None, "isCA": None,
                    "privateKey": {"algorithm", "size", "encoding", "rotationPolicy"},
                    "issuerRef": {"name", "kind", "group"}},
}
CM_USAGES = {"signing", "digital signature", "content commitment", "key encipherment",
             "key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
             "decipher only", "any", "server auth", "client auth", "code signing",
             "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user",
             "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"}
CM_KEY = {"algorithm": {"RSA", "ECDSA", "Ed25519"}, "encoding": {"PKCS1", "PKCS8"},
          "rotationPolicy": {"Never", "Always"}}


def _check_cert_manager_shape(obj: dict) -> None:
    kind, spec = obj["kind"], obj["spec"]
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, obj["metadata"]["name"]
    assert kind in CM_SPEC and set(spec) <= set(CM_SPEC[kind]), (kind, set(spec))
    for key, sub in CM_SPEC[kind].items():
        if sub is not None and key in spec:
            assert isinstance(spec[key], dict) and set(spec[key]) <= sub, (kind, key)
    if kind == "Issuer":
        assert len(spec) == 1, "an Issuer has exactly one kind of issuer"
        return
    assert isinstance(spec["secretName"], str) and spec["secretName"]
    assert isinstance(spec["issuerRef"]["name"], str)
    for key in ("dnsNames", "ipAddresses", "usages"):
        assert all(isinstance(v, str) for v in spec.get(key, [])), key
    assert set(spec.get("usages", [])) <= CM_USAGES, spec["usages"]
    for key, choices in CM_KEY.items():
        assert spec.get("privateKey", {}).get(key, next(iter(choices))) in choices, key
    assert isinstance(spec.get("privateKey", {}).get("size", 256), int)
    # a Go duration cert-manager accepts (at least an hour)
    hours = spec.get("duration", "2160h")
    assert hours.endswith("h") and int(hours[:-1]) >= 1, hours
    for labels in spec.get("secretTemplate", {}).values():
        assert all(isinstance(v, str) for v in labels.values())


def _key_material(objs: list[dict]) -> list[str]:
    """The rendered Secrets holding a private key (a `*.key` entry or PEM key text)."""
    out = []
    for o in objs:
        if o["kind"] == "Secret":
            data = _data(objs, "Secret", o["metadata"]["name"])
            if any(k.endswith(".key") or "PRIVATE KEY" in v for k, v in data.items()):
                out.append(o["metadata"]["name"])
    return out


def _hook_job(objs: list[dict]) -> dict:
    (job,) = [o for o in objs if o["kind"] == "Job"]
    return job


def _hook_job_secrets(objs: list[dict], present: dict[str, dict] | None = None
                      ) -> tuple[dict, list[dict]]:
    """The hook Job's command as `tandem certs` parses it ({namespace, ca_secret, secrets
    (role -> name), labels, days}), and the Secrets it would create where `present` (name
    -> object) are the only ones there: tandem/pki.py's plan, run for real (new keys)."""
    from tandem.cli import _certs_spec
    from tandem.pki import plan_kube_secrets

    job = _hook_job(objs)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert "command" not in c and c["args"][0] == "certs"  # the image's `tandem` entrypoint
    args, secrets, labels = _certs_spec(c["args"][1:])
    spec = {"namespace": args.kube_namespace, "ca_secret": args.kube_ca_secret,
            "secrets": secrets, "labels": labels, "days": args.days}
    present = present or {}
    state = {n: present.get(n) for n in [args.kube_ca_secret, *secrets.values()]}
    return spec, plan_kube_secrets(state, args.kube_ca_secret, secrets, labels, args.days)


def _internal_tls_files(objs: list[dict], tier: str) -> tuple[str, dict[str, str]]:
    """(Secret name, {config field: Secret key}) the tier's internal TLS settings read: each
    of the paths the service parses (ca, cert, key), resolved through the pod's mounts to
    the Secret volume and the item it projects."""
    c, pod = container(objs, tier), pod_spec(objs, tier)
    cfg = service_config(objs, tier).internal_tls
    names, keys = set(), {}
    for field in ("ca", "cert", "key"):
        path = getattr(cfg, field)
        mount, vol = mount_holding(c, pod, path)
        rel = posixpath.relpath(path, mount["mountPath"])
        items = vol["secret"].get("items") or []
        (key,) = [i["key"] for i in items if i["path"] == rel] or [rel]
        names.add(vol["secret"]["secretName"])
        keys[field] = key
    (name,) = names
    return name, keys


def test_cert_manager_issues_exactly_the_secrets_the_pods_mount(rendered):
    """internalTLS.certManager: a self-signed Issuer -> the CA Certificate -> a CA Issuer
    holding it -> one Certificate per role, whose Secret (the keys cert-manager writes:
    ca.crt, tls.crt, tls.key) is the one that role's pods read their CA, certificate and key
    from; common name = the role, and the same DNS/IP names and usages as the chart's own
    generated certificates. The chart renders no key material itself."""
    from cryptography import x509

    from tandem.pki import INTERNAL_NAME

    objs = rendered["cert-manager"]
    cm = [o for o in objs if o["apiVersion"] == CERT_MANAGER]
    for o in cm:
        _check_cert_manager_shape(o)
    issuers = {o["metadata"]["name"]: o["spec"] for o in cm if o["kind"] == "Issuer"}
    certs = [o["spec"] for o in cm if o["kind"] == "Certificate"]

    def issuer_of(cert: dict) -> dict:
        ref = cert["issuerRef"]
        assert ref.get("group", "cert-manager.io") == "cert-manager.io"
        assert ref.get("kind", "Issuer") == "Issuer"  # namespaced: no cluster-wide issuer
        return issuers[ref["name"]]

    (ca,) = [c for c in certs if c.get("isCA")]
    assert issuer_of(ca) == {"selfSigned": {}}
    leaves = {c["secretName"]: c for c in certs if not c.get("isCA")}
    for leaf in leaves.values():
        assert issuer_of(leaf) == {"ca": {"secretName": ca["secretName"]}}
        assert "cert sign" not in leaf.get("usages", [])

    default = rendered["default"]
    spec, created = _hook_job_secrets(default)
    made = {o["metadata"]["name"]: o["data"] for o in created}
    mounted = set()
    for role in ("router", "encoder", "language"):
        name, keys = _internal_tls_files(objs, role)
        assert keys == {"ca": "ca.crt", "cert": "tls.crt", "key": "tls.key"}, role
        mounted.add(name)
        leaf = leaves[name]
        assert leaf["commonName"] == role
        assert INTERNAL_NAME in leaf["dnsNames"]  # what clients check servers against
        assert {"digital signature", "server auth", "client auth"} <= set(leaf["usages"])
        # the same Secret and names as the certificate the hook Job makes without it
        gen_secret, _ = _internal_tls_files(default, role)
        assert gen_secret == name == spec["secrets"][role]
        gen = x509.load_pem_x509_certificate(base64.b64decode(made[name]["tls.crt"]))
        san = gen.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sorted(leaf["dnsNames"]) == sorted(san.get_values_for_type(x509.DNSName))
        assert sorted(leaf["ipAddresses"]) == sorted(
            str(ip) for ip in san.get_values_for_type(x509.IPAddress))
    assert mounted == set(leaves)  # one Certificate per role, each mounted by its role
    # the CA's Secret (its key) is mounted by no pod
    volumes = [v for o in objs if o["kind"] in ("Deployment", "Pod")
               for v in (o["spec"].get("template", o)["spec"].get("volumes") or [])]
    assert ca["secretName"] not in {v.get("secret", {}).get("secretName") for v in volumes}
    assert not [o for o in objs if o["kind"] in ("Secret", "Job")]


@pytest.mark.parametrize(
    "args",
    [[], ["-f", str(PROD)], ["--api-versions", CERT_MANAGER, "--set",
                             "internalTLS.certManager=false"],
     ["--api-versions", CERT_MANAGER], ["-f", str(PROD), "--api-versions", CERT_MANAGER],
     EXISTING_TLS, ["--api-versions", CERT_MANAGER, *EXISTING_TLS]],
    ids=["default", "production", "hook-job-beside-cert-manager", "cert-manager-detected",
         "production-cert-manager", "existing-secrets", "existing-secrets-with-cert-manager"],
)
def test_gitops_renders_are_identical_and_hold_no_keys(helm, args):
    """What Argo CD or Flux apply (`helm template` on every sync): two renders are byte for
    byte the same and hold no private key, so a sync rotates nothing. Each role's pods mount
    a Secret that something creates: cert-manager (picked up from the cluster's API
    versions by "auto"), the hook Job (without cert-manager, or certManager: false), or
    the user (existingSecrets, only referenced)."""
    first = render_text(helm, *args)
    assert render_text(helm, *args) == first
    objs = [d for d in yaml.safe_load_all(first) if d]
    assert not _key_material(objs)
    existing = any("existingSecrets" in a for a in args)
    certs = {o["spec"]["secretName"] for o in objs if o["kind"] == "Certificate"}
    jobs = [o for o in objs if o["kind"] == "Job"]
    job = _hook_job_secrets(objs)[0]["secrets"].values() if jobs else set()
    assert not (certs and jobs), "one source of certificates"
    for role in ("router", "encoder", "language"):
        name, _ = _internal_tls_files(objs, role)
        assert name == f"mine-{role}" if existing else name in certs | set(job), role
    if existing:  # all three given: nothing to issue
        assert not [o for o in objs if o["apiVersion"] == CERT_MANAGER] and not jobs


def test_production_turns_on_alerts_and_dashboard(rendered):
    """The production example ships the PrometheusRule, selected by the same Prometheus that
    selects its ServiceMonitors, and the Grafana dashboard for the sidecar."""
    import json

    objs = rendered["production"]
    rule = find(objs, "PrometheusRule", RELEASE)
    assert rule["spec"]["groups"] and all(g["rules"] for g in rule["spec"]["groups"])
    for mon in (o for o in objs if o["kind"] == "ServiceMonitor"):
        selected_by = yaml.safe_load(PROD.read_text())["serviceMonitor"]["labels"]
        assert selected_by.items() <= mon["metadata"]["labels"].items()
        assert selected_by.items() <= rule["metadata"]["labels"].items()
    dash = find(objs, "ConfigMap", f"{RELEASE}-dashboard")
    sidecar = yaml.safe_load((CHART / "values.yaml").read_text())["grafanaDashboard"]["labels"]
    assert sidecar.items() <= dash["metadata"]["labels"].items()
    assert json.loads(dash["data"]["tandem.json"])["panels"]


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
        nested = {"transfer", "internal_tls", "tracing"}
        assert set(props) == set(cls.model_fields) - nested, tier


def test_helm_test_hook_sends_one_chat_to_the_router(helm, tmp_path):
    """`helm test`: a hook pod, running the router's image, whose program (run here against
    a stand-in router) posts one chat to the router's Service URL with the router's own API
    key, and exits 0 only on a 200 that carries a choice."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlsplit

    objs = render(helm, "--set", "router.apiKey.value=k3y")
    pod = find(objs, "Pod", f"{RELEASE}-test-chat")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    kubernetes_validate.validate(pod, NEWEST_K8S, strict=True)
    (c,) = pod["spec"]["containers"]
    assert c["image"] == container(objs, "router")["image"]
    env = env_of(objs, c)
    url = urlsplit(env["ROUTER_URL"])
    svc = find(objs, "Service", f"{RELEASE}-router")
    router = container(objs, "router")
    ((port, _),) = [(p["port"], p) for p in service_ports_to(svc, router, port_of(router, "http"))]
    assert url.hostname.split(".")[0] == svc["metadata"]["name"] and url.port == port
    key = _pod_env(objs, "router")["TANDEM_API_KEY"]
    assert key == "k3y"

    seen, answer = [], {}

    class Router(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization"), body))
            self.send_response(answer["status"])
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(answer["body"]).encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    argv = [*c.get("command", []), *c.get("args", [])]
    if posixpath.basename(argv[0]).startswith("python"):
        argv[0] = sys.executable  # the image's python: httpx is in both
    local = f"http://127.0.0.1:{server.server_address[1]}{url.path}"
    run_env = {**env, "ROUTER_URL": local, "PATH": os.environ["PATH"]}
    try:
        for status, body, ok in ((200, {"choices": [{"index": 0}]}, True),
                                 (200, {"choices": []}, False),
                                 (503, {"error": "no tier"}, False)):
            answer.update(status=status, body=body)
            r = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=60)
            assert (r.returncode == 0) is ok, (status, body, r.stdout + r.stderr)
    finally:
        server.shutdown()
    assert len(seen) == 3
    path, auth, body = seen[0]
    assert path == "/v1/chat/completions" and auth == f"Bearer {key}"
    assert body["messages"] and body["max_tokens"] > 0


# ---- autoscaling on each tier's own signal ---------------------------------------------------

ADAPTER_RULES = ROOT / "deploy" / "k8s" / "prometheus-adapter-rules.yaml"


def exported_metric_names() -> set[str]:
    """Every series name the three tiers export (tests/exported_series.py)."""
    from exported_series import exported_series

    return set(exported_series())


def hpa_pod_metrics(objs: list[dict], tier: str) -> dict[str, str]:
    spec = find(objs, "HorizontalPodAutoscaler", f"{RELEASE}-{tier}")["spec"]
    assert {m["type"] for m in spec["metrics"]} == {"Pods"}, spec["metrics"]
    return {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"]
            for m in spec["metrics"]}


def test_each_tier_scales_on_its_own_signal_served_by_the_adapter_rules(helm, rendered):
    """`signal: load` (the default): the encoder on patches waiting for or in the ViT, the
    language tier on KV use, waiting requests and embedding blocks, the router on requests
    in flight. Every metric an HPA names has a prometheus-adapter rule, and every rule
    reads series the tiers export (so no HPA waits on a metric that never exists)."""
    prod = rendered["production"]
    assert hpa_pod_metrics(prod, "encoder") == {"tandem_encoder_pending_patches": "32768"}
    assert set(hpa_pod_metrics(prod, "language")) == {
        "tandem_language_kv_cache_usage_ratio", "tandem_language_waiting_requests",
        "tandem_language_embedding_blocks_used"}
    assert set(hpa_pod_metrics(prod, "router")) == {"tandem_router_inflight"}
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]["custom"]
    served = {r["name"]["as"] for r in rules}
    named = set()
    for tier in ("encoder", "language", "router"):
        named |= set(hpa_pod_metrics(prod, tier))
    on = [a for t in ("encoder", "language", "router")
          for a in ("--set", f"{t}.autoscaling.enabled=true")]
    default_on = render(helm, *on)
    for tier in ("encoder", "language", "router"):
        named |= set(hpa_pod_metrics(default_on, tier))
    assert named <= served, named - served
    exported = exported_metric_names()
    for r in rules:
        read = set(re.findall(r"\b(tandem_[a-z_]+)\b", r["seriesQuery"] + r["metricsQuery"]))
        assert read and read <= exported, (r["name"]["as"], read - exported)


def test_cpu_is_the_fallback_signal_and_a_wrong_one_is_refused(helm):
    objs = render(helm, "--set", "encoder.autoscaling.enabled=true",
                  "--set", "encoder.autoscaling.signal=cpu")
    spec = find(objs, "HorizontalPodAutoscaler", f"{RELEASE}-encoder")["spec"]
    assert spec["metrics"] == [{"type": "Resource", "resource": {
        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}]
    on = ["--set", "encoder.autoscaling.enabled=true"]
    assert_refused(helm, [*on, "--set", "encoder.autoscaling.signal=gpu"],
                   [*on, "--set", "encoder.autoscaling.signal=cpu"])


def test_transfer_protection_reaches_both_tiers_and_a_bad_mode_is_refused(helm):
    objs = render(helm, "--set", "transfer.protect=encrypt")
    for tier in ("encoder", "language"):
        assert service_config(objs, tier).transfer.protect == "encrypt"
    assert_refused(helm, ["--set", "transfer.protect=rot13"],
                   ["--set", "transfer.protect=encrypt"])


def test_a_tenants_secret_reaches_the_router_as_its_keys_file(helm):
    objs = render(helm, "--set", "router.tenants.existingSecret=tandem-tenants")
    cfg = service_config(objs, "router")
    mount, vol = mount_holding(container(objs, "router"), pod_spec(objs, "router"),
                               cfg.api_keys_file)
    assert vol["secret"]["secretName"] == "tandem-tenants" and mount["readOnly"]
    assert cfg.api_keys_file.endswith("/tenants.yaml")
    assert service_config(render(helm), "router").api_keys_file == ""


@pytest.mark.parametrize("variant", VARIANTS)
def test_tracing_values_reach_every_tier_as_the_standard_variables(rendered, variant):
    """`tracing` (on in the production values) becomes the OTEL_* variables each tier
    reads, and the tier's own resolution of them (tandem/tracing.py, with its parsed
    config) exports to the collector with the chart's sampler under its own service name;
    off (the default) sets none, so tracing stays off."""
    from tandem.tracing import resolve

    objs = rendered[variant]
    for tier in ("encoder", "language", "router", "prefill"):
        if not has_tier(objs, tier):
            continue
        env = _pod_env(objs, tier)
        # the service names itself after its command (a prefill pod: tandem-language); the
        # tandem.tier attribute tells prefill pods from decode pods
        service = f"tandem-{COMMANDS.get(tier, tier)}"
        got = resolve(service_config(objs, tier).tracing, service, env)
        if variant not in ("production", "epd-production"):
            assert not [k for k in env if k.startswith("OTEL_")] and got is None
            continue
        assert (got.endpoint, got.service_name, got.sampler, got.sampler_arg) == (
            "http://otel-collector.observability:4317", service,
            "parentbased_traceidratio", 0.05)
        names = [e["name"] for e in container(objs, tier)["env"]]
        # $(OTEL_POD_NAME) expands only from a variable defined before it
        assert names.index("OTEL_POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
        attrs = dict(kv.split("=", 1) for kv in env["OTEL_RESOURCE_ATTRIBUTES"].split(","))
        assert attrs == {"k8s.pod.name": "$(OTEL_POD_NAME)", "k8s.namespace.name": NAMESPACE,
                         "tandem.tier": tier}
