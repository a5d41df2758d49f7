"""The Helm chart's own pods, run without Kubernetes (issue 40): each pod a network
namespace with its own private address (deploy/harness/netns.py), started from what
`helm template` renders, nothing rewritten by hand.

    objs = netpol.render_chart([overlay])                       # `helm template`
    with Cluster(objs, slots={"language": 2}) as c:              # namespaces, DNS, kubelet
        c.start("router", 0); c.start("encoder", 0); c.start("language", 0)
        c.wait_ready("language", 0)                              # its readinessProbe passed
        c.resolve("client", "t-tandem-language-headless")        # what the pods' DNS answers

Per pod (a Deployment/StatefulSet replica, "<component><i>"):
- the filesystem: the image the container names, where buildah holds it (`make image`:
  tandem:0.1.0-cpu is localhost/tandem:0.1.0-cpu): a working container of it per pod
  (`buildah from`, `buildah mount`), the pod's process chrooted into it, with the image's
  own config (ENTRYPOINT, CMD, ENV, WORKDIR from `buildah inspect`). Where no image is
  built (or Cluster(images=False)), this checkout's venv stands in: the config is read
  from the Dockerfile stage the tag names ("-router" -> stage router, else runtime), the
  image's `tini --` prefix is dropped where tini is not installed, and the program
  resolves on the image's PATH with the venv in place of /opt/venv.
- argv: the container's `command` (else the image's ENTRYPOINT) + `args` (else CMD).
- env: the image's ENV (PATH, PYTHONUNBUFFERED, ...), then envFrom (ConfigMaps, Secrets),
  then env (value; valueFrom fieldRef status.podIP / metadata.name / metadata.namespace,
  configMapKeyRef, secretKeyRef), as the kubelet orders them (later wins).
- files: a private mount namespace (`ip netns exec` gives one): each volumeMount at its
  mountPath (in the image's filesystem, or on this host): Secret and ConfigMap volumes as
  files (items/defaultMode honoured, owned by root:fsGroup), emptyDir as a fresh tmpfs,
  hostPath bound; in the image also /dev, /proc, /sys, the pod's resolv.conf and an
  /etc/hosts naming the pod; then readOnlyRootFilesystem (the root remounted read-only)
  and runAsUser/runAsGroup/fsGroup (setpriv: the image's own, after the chroot) as the
  pod says.
- DNS: /etc/netns/<netns>/resolv.conf (bound over /etc/resolv.conf by `ip netns exec`)
  names a dnsmasq in namespace "dns", with the cluster's search path
  (<ns>.svc.<domain> svc.<domain> <domain>, ndots 5), so short names resolve as in a
  cluster. dnsmasq answers `<svc>.<ns>.svc.<domain>` with every ready pod's address the
  Service's selector matches (headless or not: there is no kube-proxy, so a ClusterIP
  Service answers with its pods' addresses); its hosts file is rewritten and re-read
  (SIGHUP) whenever readiness changes, and TTL is 0.
- probes: a kubelet thread per pod polls startupProbe, then readinessProbe and
  livenessProbe, with the probes' own periodSeconds/failureThreshold/successThreshold/
  initialDelaySeconds/timeoutSeconds, from namespace "kubelet" at the pod's address
  (httpGet, grpc (grpc.health.v1), tcpSocket). A pod is ready only while its readinessProbe
  passes; a failed startup or liveness probe restarts the container (restartPolicy Always).

Secrets the chart leaves to its hook Job (the internal-TLS role Secrets) are made as that
Job makes them: `tandem certs` (here into a directory, the Job through the API), each
role's files as ca.crt / tls.crt / tls.key. Not modelled: resources (no cgroups), the
lifecycle preStop hook, NetworkPolicy (deploy/harness/netpol.py does that), a PID
namespace (the image's tini is not PID 1), and a fresh writable layer per container
restart (a pod keeps its working container until stop() or close()).

Teardown (close(), the context's exit, atexit) always completes: kubelet threads stop,
every process in every namespace is killed and the namespaces deleted (netns.Network),
the pods' working containers removed, the /etc/netns/<netns> directories and the mount
points this run created are removed (sweep_stale_rootfs() removes a killed run's
containers, named tdm<pid>-<pod>).
"""

from __future__ import annotations

import atexit
import copy
import enum
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import netns  # noqa: E402

ROOT = HERE.parents[1]
DOCKERFILE = ROOT / "Dockerfile"
VENV_BIN = Path(sys.executable).parent
IMAGE_VENV = "/opt/venv"  # where the Dockerfile installs the venv; this checkout's stands in
COMPONENT = "app.kubernetes.io/component"
DNS_NODE, KUBELET_NODE = "dns", "kubelet"
WORKLOADS = ("Deployment", "StatefulSet")


def unavailable_reason() -> str:
    """Why the harness cannot run here ("" when it can)."""
    return netns.unavailable_reason() or (
        "" if shutil.which("dnsmasq") else "no dnsmasq (Debian: dnsmasq-base)")


# -- the image, from the Dockerfile ---------------------------------------------------------

@dataclass(frozen=True)
class ImageConfig:
    """What a container inherits from its image: ENTRYPOINT, CMD, ENV and WORKDIR; `ref`,
    the built image whose filesystem the pod runs in (None: this checkout's venv stands in
    for the image, its config read from the Dockerfile stage)."""

    stage: str
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: dict[str, str]
    workdir: str = "/"
    ref: str | None = None


def image_config(image: str, dockerfile: Path = DOCKERFILE) -> ImageConfig:
    """The Dockerfile stage an image tag names ("-router" -> router, else runtime)."""
    stage = "router" if image.endswith("-router") else "runtime"
    lines, inside, buf = [], False, ""
    for raw in dockerfile.read_text().splitlines():
        buf += raw.rstrip("\\").strip() + " " if raw.rstrip().endswith("\\") else raw.strip()
        if raw.rstrip().endswith("\\"):
            continue
        line, buf = buf, ""
        m = re.match(r"(?i)^FROM\s+\S+(?:\s+AS\s+(\S+))?", line)
        if m:
            inside = (m.group(1) or "").lower() == stage
        elif inside and line and not line.startswith("#"):
            lines.append(line)
    entry: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: dict[str, str] = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    for line in lines:
        word, _, rest = line.partition(" ")
        if word.upper() == "ENTRYPOINT":
            entry = tuple(json.loads(rest))
        elif word.upper() == "CMD":
            cmd = tuple(json.loads(rest))
        elif word.upper() == "ENV":
            for kv in shlex.split(rest):
                k, _, v = kv.partition("=")
                env[k] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), v)
    if not entry:
        raise ValueError(f"{dockerfile}: stage {stage!r} has no ENTRYPOINT")
    return ImageConfig(stage, entry, cmd, env)


def _reachable_by_all(path: Path) -> bool:
    """Every directory above `path` searchable and `path` executable by any user."""
    return all(os.stat(p).st_mode & 0o001 for p in (path, *path.parents))


def _host_path_env(value: str) -> str:
    """The image's PATH with this checkout's venv where the image has /opt/venv."""
    return ":".join(str(VENV_BIN) if p == f"{IMAGE_VENV}/bin" else p for p in value.split(":"))


# -- the built image (`make image`), where there is one ---------------------------------------

def built_image(image: str) -> str | None:
    """The image buildah holds for a rendered `image:` (`tandem:0.1.0-cpu` is
    localhost/tandem:0.1.0-cpu after `make image`); None when none is built here."""
    if shutil.which("buildah") is None:
        return None
    for ref in (image, f"localhost/{image}"):
        if subprocess.run(["buildah", "inspect", "--type", "image", ref], capture_output=True,
                          timeout=60).returncode == 0:
            return ref
    return None


def built_image_config(ref: str) -> ImageConfig:
    """ENTRYPOINT, CMD, ENV and WORKDIR as the built image's own config states them."""
    out = subprocess.run(["buildah", "inspect", "--type", "image", ref], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    cfg = json.loads(out)["OCIv1"]["config"]
    env = dict(kv.split("=", 1) for kv in cfg.get("Env") or [])
    return ImageConfig(ref, tuple(cfg.get("Entrypoint") or ()), tuple(cfg.get("Cmd") or ()),
                       env, cfg.get("WorkingDir") or "/", ref)


class RootFS:
    """One pod's filesystem: a working container of the built image (`buildah from`),
    mounted on this host (`buildah mount`), its writable layer the pod's own. Named
    tdm<pid>-<key>, so that sweep_stale_rootfs() finds what a killed run left."""

    def __init__(self, ref: str, key: str) -> None:
        name = f"{netns.PREFIX}{os.getpid()}-{key}"
        self.id = subprocess.run(["buildah", "from", "--pull=never", "-q", "--name", name, ref],
                                 check=True, capture_output=True, text=True,
                                 timeout=120).stdout.strip()
        try:
            self.path = Path(subprocess.run(["buildah", "mount", self.id], check=True,
                                            capture_output=True, text=True,
                                            timeout=60).stdout.strip())
        except BaseException:
            subprocess.run(["buildah", "rm", self.id], capture_output=True, timeout=60)
            raise

    def inside(self, path: str | Path) -> Path:
        """Where `path` of the pod's filesystem lies on this host."""
        return self.path / str(path).lstrip("/")

    def close(self) -> None:
        subprocess.run(["buildah", "umount", self.id], capture_output=True, timeout=60)
        subprocess.run(["buildah", "rm", self.id], capture_output=True, timeout=60)


def sweep_stale_rootfs() -> list[str]:
    """Remove the pods' working containers whose creating process is gone; their names."""
    if shutil.which("buildah") is None:
        return []
    out = subprocess.run(["buildah", "containers", "--format", "{{.ContainerName}}"],
                         capture_output=True, text=True, timeout=60).stdout.split()
    gone = [n for n in out if (m := re.match(rf"^{netns.PREFIX}(\d+)-", n))
            and int(m[1]) != os.getpid() and not os.path.exists(f"/proc/{m[1]}")]
    for n in gone:
        subprocess.run(["buildah", "rm", n], capture_output=True, timeout=60)
    return gone


# -- what the chart renders -------------------------------------------------------------------

class ChartError(ValueError):
    """The rendered chart cannot run as written; the message names the object."""


def workloads(objs: list[dict]) -> dict[str, dict]:
    """component label -> its Deployment/StatefulSet."""
    out = {}
    for o in objs:
        if o.get("kind") in WORKLOADS:
            labels = o["spec"]["template"]["metadata"].get("labels", {})
            out[labels.get(COMPONENT, o["metadata"]["name"])] = o
    return out


def replicas(objs: list[dict], w: dict) -> int:
    """The replicas a workload runs as rendered: spec.replicas, else (the chart leaves it
    out when an HPA owns it) the minReplicas of the HPA that targets it, else 1."""
    if "replicas" in w["spec"]:
        return int(w["spec"]["replicas"])
    for o in objs:
        ref = o.get("spec", {}).get("scaleTargetRef", {}) if o.get("kind") == \
            "HorizontalPodAutoscaler" else {}
        if ref.get("kind") == w["kind"] and ref.get("name") == w["metadata"]["name"]:
            return int(o["spec"].get("minReplicas", 1))
    return 1


def check_services(objs: list[dict]) -> None:
    """Every Service's selector matches some workload's pod template, and its targetPorts
    are ports that pod's container declares; ChartError naming the Service otherwise."""
    ws = workloads(objs)
    for svc in (o for o in objs if o.get("kind") == "Service"):
        name, sel = svc["metadata"]["name"], svc["spec"].get("selector") or {}
        if not sel:
            continue  # endpoints managed by hand: not the chart's case
        match = [w for w in ws.values() if all(
            w["spec"]["template"]["metadata"].get("labels", {}).get(k) == v for k, v in sel.items())]
        if not match:
            have = "; ".join(f"{w['metadata']['name']}: " + ", ".join(
                f"{k}={w['spec']['template']['metadata'].get('labels', {}).get(k)}" for k in sel)
                for w in ws.values())
            raise ChartError(f"Service {name}: selector {sel} matches no pod template "
                             f"(the pod templates have {have})")
        for w in match:
            c = w["spec"]["template"]["spec"]["containers"][0]
            declared = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
            for sp in svc["spec"].get("ports") or []:
                t = sp.get("targetPort", sp["port"])
                if t not in declared and t not in declared.values():
                    raise ChartError(f"Service {name}: targetPort {t!r} is no port of "
                                     f"{w['metadata']['name']}'s container ({declared})")


def _by_name(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o.get("kind") == kind}


def internal_tls_secrets(objs: list[dict], workdir: Path) -> list[dict]:
    """The role Secrets the chart's hook Job creates (`tandem certs --kube-secret
    ROLE=NAME ...`), made with `tandem certs DIR` the same way; [] when no such Job."""
    job = next((o for o in objs if o.get("kind") == "Job"
                and "certs" in (o["spec"]["template"]["spec"]["containers"][0].get("args") or [])),
               None)
    if job is None:
        return []
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    roles = dict(a.removeprefix("--kube-secret=").split("=", 1) for a in args
                 if a.startswith("--kube-secret="))
    ns = next(a.split("=", 1)[1] for a in args if a.startswith("--kube-namespace="))
    out = workdir / "certs"
    subprocess.run([str(VENV_BIN / "tandem"), "certs", str(out)], check=True,
                   capture_output=True, timeout=120)
    secrets = []
    for role, name in roles.items():
        data = {"ca.crt": (out / "ca.crt").read_text(), "tls.crt": (out / f"{role}.crt").read_text(),
                "tls.key": (out / f"{role}.key").read_text()}
        secrets.append({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                        "metadata": {"name": name, "namespace": ns}, "stringData": data})
    return secrets


def _secret_data(secret: dict) -> dict[str, str]:
    import base64

    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**data, **(secret.get("stringData") or {})}


# -- pods ---------------------------------------------------------------------------------------

class Phase(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"  # running, startupProbe not passed yet
    RUNNING = "running"  # started; ready or not per readinessProbe


@dataclass
class PodState:
    component: str
    index: int
    node: str
    address: str
    phase: Phase = Phase.STOPPED
    ready: bool = False
    restarts: int = 0
    probes: dict[str, list[bool]] = field(default_factory=lambda: {
        "startup": [], "readiness": [], "liveness": []})  # every result, in order
    last_failure: str = ""
    user_note: str = ""
    proc: subprocess.Popen | None = None
    log: Path | None = None
    rootfs: RootFS | None = None  # the built image's filesystem it runs in (None: the venv)


class Cluster:
    """The rendered chart's workloads as pods. `slots`: replicas to make room for per
    component (default: the Deployment's spec.replicas); start() a replica to run it.
    `images`: run each pod in the filesystem of the image its container names where
    buildah holds one (`make image`), else in this checkout's venv; False: the venv always."""

    def __init__(self, objs: list[dict], slots: dict[str, int] | None = None,
                 subnet: str = "10.231.5.0/24", extra_nodes: tuple[str, ...] = ("client",),
                 no_build: tuple[str, ...] = (), images: bool = True) -> None:
        self.objs = objs
        self.images = images
        self._image_configs: dict[str, ImageConfig] = {}
        # NOTE: `no_build`: in-pod directories made empty and read-only after the volumes
        # are mounted. For TANDEM_KERNEL_DIR: the chart's emptyDir /cache makes every pod
        # compile its CPU kernels on first start (minutes on this machine's two shared
        # cores); with the directory unwritable the tiers log "CPU kernels unavailable"
        # and serve with torch's ops (tandem/cpu_kernels.py). Named by the caller.
        self.no_build = tuple(no_build)
        self.workloads = workloads(objs)
        if not self.workloads:
            raise ChartError("the rendered chart has no Deployment or StatefulSet")
        check_services(objs)
        self.slots = {c: (slots or {}).get(c, replicas(objs, w)) for c, w in self.workloads.items()}
        names = [f"{c[:8]}{i}" for c, n in self.slots.items() for i in range(n)]
        self.net = netns.Network([DNS_NODE, KUBELET_NODE, *extra_nodes, *names], subnet=subnet)
        self.pods = {(c, i): PodState(c, i, f"{c[:8]}{i}", self.net.nodes[f"{c[:8]}{i}"].address)
                     for c, n in self.slots.items() for i in range(n)}
        self.workdir = ROOT / ".cache" / "pods-unbuilt"  # made by build()
        self.configmaps = _by_name(objs, "ConfigMap")
        self.secrets = _by_name(objs, "Secret")
        self.domain = "cluster.local"
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._made_dirs: list[Path] = []
        self._dnsmasq: subprocess.Popen | None = None
        self._prober: subprocess.Popen | None = None
        self._prober_lock = threading.Lock()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        return self.build()

    def __exit__(self, *exc) -> None:
        self.close()

    def build(self) -> Cluster:
        atexit.register(self.close)
        (ROOT / ".cache").mkdir(exist_ok=True)
        self.workdir = Path(tempfile.mkdtemp(prefix="tandem-pods-", dir=ROOT / ".cache"))
        try:
            if self.images:
                sweep_stale_rootfs()
            self.net.build()
            for s in internal_tls_secrets(self.objs, self.workdir):
                self.secrets.setdefault(s["metadata"]["name"], s)
            for node in self.net.nodes.values():
                if node.name != DNS_NODE:
                    self._resolv_conf(node.netns)
            self._start_dnsmasq()
            self._prober = self.net.popen(KUBELET_NODE, [sys.executable, __file__, "--prober"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        errors = []
        try:
            self.net.close()  # kills dnsmasq, the prober and every pod's processes
        except Exception as e:  # noqa: BLE001  NOTE: go on removing files
            errors.append(str(e))
        for pod in self.pods.values():
            if pod.rootfs is not None:
                pod.rootfs.close()
                pod.rootfs = None
        for node in self.net.nodes.values():
            shutil.rmtree(f"/etc/netns/{node.netns}", ignore_errors=True)
        for d in reversed(self._made_dirs):
            try:
                d.rmdir()
            except OSError as e:
                errors.append(f"rmdir {d}: {e}")
        shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.close)
        if errors:
            raise RuntimeError("teardown: " + "; ".join(errors))

    # -- DNS -----------------------------------------------------------------------------------

    def _namespace(self) -> str:
        return next(iter(self.workloads.values()))["metadata"].get("namespace") or self._release_ns()

    def _release_ns(self) -> str:
        for o in self.objs:
            for a in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])[0].get("args") or []:
                if str(a).startswith("--kube-namespace="):
                    return str(a).split("=", 1)[1]
        return "default"

    def _resolv_conf(self, netns_name: str) -> None:
        ns, d = self._namespace(), self.domain
        path = Path("/etc/netns") / netns_name / "resolv.conf"
        if not path.parent.parent.exists():
            path.parent.parent.mkdir()
            self._made_dirs.append(path.parent.parent)  # removed at close, when empty
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"nameserver {self.net.nodes[DNS_NODE].address}\n"
                        f"search {ns}.svc.{d} svc.{d} {d}\noptions ndots:5\n")

    def records(self) -> dict[str, list[str]]:
        """Service FQDN -> the addresses of the ready pods its selector matches."""
        ns, out = self._namespace(), {}
        with self._lock:
            for svc in (o for o in self.objs if o.get("kind") == "Service"):
                sel = svc["spec"].get("selector") or {}
                addrs = [p.address for (c, _), p in sorted(self.pods.items()) if p.ready and sel
                         and all(self._labels(c).get(k) == v for k, v in sel.items())]
                out[f"{svc['metadata']['name']}.{ns}.svc.{self.domain}"] = addrs
        return out

    def _labels(self, component: str) -> dict[str, str]:
        return self.workloads[component]["spec"]["template"]["metadata"].get("labels", {})

    def _write_hosts(self) -> None:
        lines = [f"{a} {name}" for name, addrs in self.records().items() for a in addrs]
        hosts = self.workdir / "hosts"
        tmp = hosts.with_suffix(".new")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.chmod(0o644)
        tmp.replace(hosts)

    def _start_dnsmasq(self) -> None:
        self._write_hosts()
        addr = self.net.nodes[DNS_NODE].address
        argv = ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
                "--no-hosts", f"--addn-hosts={self.workdir / 'hosts'}", f"--listen-address={addr}",
                "--bind-interfaces", "--local-ttl=0", "--no-negcache", "--user=root",
                f"--local=/{self.domain}/", "--pid-file=", "--log-facility=-"]
        self._dnsmasq = self.net.popen(DNS_NODE, argv, stdout=subprocess.DEVNULL,
                                       stderr=open(self.workdir / "dnsmasq.log", "w"))
        self._wait(lambda: self.resolve(KUBELET_NODE, "nonexistent") == [] and
                   self._dnsmasq.poll() is None, "dnsmasq answering")

    def _dns_changed(self) -> None:
        if self._closed:  # a kubelet thread late at teardown: the files are gone
            return
        self._write_hosts()
        if self._dnsmasq and self._dnsmasq.poll() is None:
            self._dnsmasq.send_signal(signal.SIGHUP)  # re-reads --addn-hosts

    def resolve(self, node: str, name: str) -> list[str]:
        """The addresses `name` resolves to on `node`, through the node's resolv.conf (a
        process in its namespace, as a pod's getaddrinfo sees them); sorted."""
        code = ("import socket,sys\ntry: print(' '.join(sorted({a[4][0] for a in "
                "socket.getaddrinfo(sys.argv[1], 1, socket.AF_INET, socket.SOCK_STREAM)})))\n"
                "except socket.gaierror: print('')")
        r = subprocess.run(self.net.argv(node, [sys.executable, "-c", code, name]),
                           capture_output=True, text=True, timeout=60)
        return r.stdout.split()

    # -- pods ----------------------------------------------------------------------------------

    def pod(self, component: str, index: int = 0) -> PodState:
        return self.pods[(component, index)]

    def start(self, component: str, index: int = 0) -> PodState:
        """Run the replica, and its kubelet (probes, restarts)."""
        pod = self.pod(component, index)
        self._launch(pod)
        t = threading.Thread(target=self._kubelet, args=(pod,), daemon=True,
                             name=f"kubelet-{pod.node}")
        t.start()
        self._threads.append(t)
        return pod

    def container(self, component: str) -> dict:
        return self.workloads[component]["spec"]["template"]["spec"]["containers"][0]

    def image_of(self, c: dict) -> ImageConfig:
        """The config of the image container `c` names: the built image's own where there
        is one (and `images`), else the Dockerfile stage's."""
        name = c["image"]
        if name not in self._image_configs:
            ref = built_image(name) if self.images else None
            self._image_configs[name] = built_image_config(ref) if ref else image_config(name)
        return self._image_configs[name]

    def argv_env(self, pod: PodState) -> tuple[list[str], dict[str, str]]:
        """The container's process and environment, as the kubelet would make them."""
        w = self.workloads[pod.component]
        return self._process(self.container(pod.component), w, pod.address,
                             f"{w['metadata']['name']}-{pod.index}")

    def _process(self, c: dict, owner: dict, address: str,
                 hostname: str) -> tuple[list[str], dict[str, str]]:
        img = self.image_of(c)
        argv = list(c.get("command") or img.entrypoint) + list(
            c.get("args") if c.get("args") is not None or c.get("command") else img.cmd)
        env = {k: v for k, v in img.env.items()}
        if img.ref is None:  # this venv in place of the image's
            if argv[:2] == ["/usr/bin/tini", "--"] and not os.path.exists("/usr/bin/tini"):
                argv = argv[2:]
            env["PATH"] = _host_path_env(env["PATH"])
        env["HOSTNAME"] = hostname
        ns = self._namespace()
        for src in c.get("envFrom") or []:
            if "configMapRef" in src:
                env.update(self._configmap(src["configMapRef"]["name"], owner)["data"])
            elif "secretRef" in src:
                env.update(_secret_data(self._secret(src["secretRef"]["name"], owner)))
        fields = {"status.podIP": address, "metadata.name": hostname, "metadata.namespace": ns}
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = str(e["value"])
            elif "fieldRef" in e.get("valueFrom", {}):
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["configMapKeyRef"]
                env[e["name"]] = self._configmap(ref["name"], owner)["data"][ref["key"]]
            elif "secretKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["secretKeyRef"]
                env[e["name"]] = _secret_data(self._secret(ref["name"], owner))[ref["key"]]
        if img.ref is not None:
            return argv, env  # `env` finds the program on the image's PATH, inside the image
        prog = shutil.which(argv[0], path=env["PATH"])
        if prog is None:
            raise ChartError(f"{owner['metadata']['name']}: {argv[0]!r} is not on the image's PATH")
        return [prog, *argv[1:]], env

    def _configmap(self, name: str, w: dict) -> dict:
        if name not in self.configmaps:
            raise ChartError(f"{w['metadata']['name']}: ConfigMap {name!r} is not rendered")
        return self.configmaps[name]

    def _secret(self, name: str, w: dict) -> dict:
        if name not in self.secrets:
            raise ChartError(f"{w['metadata']['name']}: Secret {name!r} neither rendered "
                             "nor made by the chart's hook Job")
        return self.secrets[name]

    def _mount_script(self, c: dict, spec: dict, owner: dict, key: str, address: str,
                      hostname: str, root: RootFS | None) -> list[str]:
        """Shell lines run in the pod's private mount namespace before its process: its
        volumes, at their mountPaths in the image's filesystem (`root`) or this host's."""
        psc = spec.get("securityContext") or {}
        gid = psc.get("fsGroup", psc.get("runAsGroup", 0))
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        name = owner["metadata"]["name"]

        def at(path: str | Path) -> Path:
            return root.inside(path) if root else Path(path)

        lines = []
        if root:  # the devices first: an emptyDir at /dev/shm goes over them
            lines.append(f"mount --rbind /dev {shlex.quote(str(at('/dev')))}")
        for m in c.get("volumeMounts") or []:
            v = vols.get(m["name"])
            if v is None:
                raise ChartError(f"{name}: volumeMount {m['name']!r} has no volume")
            target = at(m["mountPath"])
            if not target.exists():
                missing = [p for p in (target, *target.parents) if not p.exists()]
                target.mkdir(parents=True)
                if not root:  # the image's own are gone with its container
                    self._made_dirs.extend(reversed(missing))
            t = shlex.quote(str(target))
            if "secret" in v or "configMap" in v:
                src = self._files(key, v, gid, owner)
                lines.append(f"mount --bind {shlex.quote(str(src))} {t}")
            elif "emptyDir" in v:
                lines.append(f"mount -t tmpfs -o mode=1777 tmpfs {t}")
            elif "hostPath" in v:
                lines.append(f"mount --bind {shlex.quote(v['hostPath']['path'])} {t}")
            else:
                raise ChartError(f"{name}: volume {m['name']!r}: kind not modelled")
            if m.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {t}")
        mounted = [m["mountPath"] for m in c.get("volumeMounts") or []]
        for inside in self.no_build:
            if not any(Path(inside).is_relative_to(mp) for mp in mounted):
                continue  # not in a volume of this container
            q = shlex.quote(str(at(inside)))
            lines += [f"mkdir -p {q}", f"mount -t tmpfs -o ro,size=4k tmpfs {q}"]
        if root:  # what a runtime gives every container: /proc, /sys, DNS, /etc/hosts
            hosts = self.workdir / f"hosts-{key}"
            hosts.write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{address}\t{hostname}\n")
            hosts.chmod(0o644)
            for f in ("/etc/resolv.conf", "/etc/hosts"):
                at(f).touch()  # a mount point, in the container's own layer
            lines += [f"mount -t proc proc {shlex.quote(str(at('/proc')))}",
                      f"mount --rbind /sys {shlex.quote(str(at('/sys')))}",
                      f"mount --bind /etc/resolv.conf {shlex.quote(str(at('/etc/resolv.conf')))}",
                      f"mount --bind {shlex.quote(str(hosts))} {shlex.quote(str(at('/etc/hosts')))}"]
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem"):
            # last: the mounts above stay writable
            lines.append(f"mount -o remount,bind,ro {shlex.quote(str(at('/')))}")
        return lines

    def _files(self, key: str, vol: dict, gid: int, w: dict) -> Path:
        """A Secret/ConfigMap volume's files (items, defaultMode), owned root:fsGroup."""
        if "secret" in vol:
            data = _secret_data(self._secret(vol["secret"]["secretName"], w))
            src = vol["secret"]
        else:
            data = dict(self._configmap(vol["configMap"]["name"], w).get("data") or {})
            src = vol["configMap"]
        d = self.workdir / "volumes" / key / vol["name"]
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)
        items = src.get("items") or [{"key": k, "path": k} for k in data]
        for it in items:
            if it["key"] not in data:
                raise ChartError(f"{w['metadata']['name']}: volume {vol['name']!r}: key "
                                 f"{it['key']!r} not in its object")
            f = d / it["path"]
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(data[it["key"]])
            os.chown(f, 0, gid)
            f.chmod(it.get("mode", src.get("defaultMode", 0o644)))
        return d

    def _command(self, c: dict, spec: dict, owner: dict, key: str, address: str,
                 hostname: str, root: RootFS | None) -> tuple[list[str], str]:
        """The command (run in the pod's network namespace) that mounts the pod's volumes in
        its private mount namespace, then runs its process as the pod's user: chrooted into
        the image's filesystem, or in this venv; and a note on what was not applied."""
        argv, env = self._process(c, owner, address, hostname)
        self.check_paths(c, spec, owner, env, root)
        psc = spec.get("securityContext") or {}
        csc = c.get("securityContext") or {}
        uid = csc.get("runAsUser", psc.get("runAsUser"))
        gid = csc.get("runAsGroup", psc.get("runAsGroup", uid))
        groups = [g for g in (psc.get("fsGroup"),) if g is not None]
        note = ""
        # NOTE: in this venv the user switch needs its interpreter reachable by that user; a
        # venv made from an interpreter under /root (pyenv) is not, and then the pod runs as
        # root (said in describe()). In the image the user is the image's to serve.
        if uid is not None and root is None and not _reachable_by_all(
                Path(os.path.realpath(sys.executable))):
            note = f"runAsUser {uid} not applied: {os.path.realpath(sys.executable)} " \
                   "is not reachable by other users"
            uid = None
        drop = ["setpriv", f"--reuid={uid}", f"--regid={gid}",
                f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--"] if uid is not None else []
        script = "set -e\n" + "\n".join(
            self._mount_script(c, spec, owner, key, address, hostname, root)) + "\nexec \"$@\"\n"
        variables = [f"{k}={v}" for k, v in env.items()]
        if root is None:
            run = ["env", "-i", *variables, *drop, *argv]
        else:  # env and setpriv are the image's (util-linux and coreutils: any Debian base)
            img = self.image_of(c)
            run = ["chroot", str(root.path), "env", "-i", f"--chdir={img.workdir}", *variables,
                   *drop, *argv]
        return ["sh", "-c", script, "sh", *run], note

    def check_paths(self, c: dict, spec: dict, owner: dict, env: dict[str, str],
                    root: RootFS | None) -> None:
        """Each variable that names a file (an absolute path) finds it where the pod will
        have it: in a Secret/ConfigMap volume mounted above it (the file one of its keys or
        items), a hostPath holding it, an emptyDir, or the image itself. ChartError naming
        the workload, the variable and what is mounted where otherwise (a Secret mounted
        where the tier does not look)."""
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        mounts = sorted(c.get("volumeMounts") or [], key=lambda m: -len(m["mountPath"]))
        name = owner["metadata"]["name"]
        where = ", ".join(f"{m['name']} at {m['mountPath']}" for m in c.get("volumeMounts") or [])
        for var, value in sorted(env.items()):
            if not value.startswith("/") or len(value) < 2 or any(ch in value for ch in ": ,;"):
                continue
            path = Path(value)
            m = next((m for m in mounts if path == Path(m["mountPath"])
                      or path.is_relative_to(m["mountPath"])), None)
            if m is None:
                # in the image: the file itself; in this venv (the host's files, not the
                # image's), at least its directory
                there = root.inside(path) if root else path
                if not there.exists() and (root is not None or not there.parent.exists()):
                    raise ChartError(f"{name}: env {var}={value}: no volume is mounted there "
                                     f"and the image has no such path (mounted: {where})")
                continue
            v, rel = vols.get(m["name"], {}), str(path.relative_to(m["mountPath"]))
            if rel == ".":
                continue
            src = v.get("secret") or v.get("configMap")
            if src is not None:
                obj = (_secret_data(self._secret(src["secretName"], owner)) if "secret" in v
                       else self._configmap(src["name"], owner).get("data") or {})
                files = [it["path"] for it in src["items"]] if src.get("items") else list(obj)
                if rel not in files:
                    kind = "Secret" if "secret" in v else "ConfigMap"
                    raise ChartError(f"{name}: env {var}={value}: {kind} "
                                     f"{src.get('secretName', src.get('name'))!r} mounted at "
                                     f"{m['mountPath']} has no file {rel!r} (it has {sorted(files)})")
            elif "hostPath" in v and not (Path(v["hostPath"]["path"]) / rel).exists():
                raise ChartError(f"{name}: env {var}={value}: hostPath volume {m['name']!r} "
                                 f"({v['hostPath']['path']}) has no {rel!r}")

    def listeners(self, pod: PodState) -> list[tuple[str, int]]:
        """The pod's listening TCP sockets (address, port), as `ss` sees them in its
        network namespace."""
        out = self.net.exec(pod.node, "ss", "-ltnH")
        got = []
        for line in out.splitlines():
            local = line.split()[3]
            addr, _, port = local.rpartition(":")
            got.append((addr.strip("[]").split("%")[0], int(port)))
        return sorted(set(got))

    def check_listeners(self, pod: PodState) -> list[tuple[str, int]]:
        """Every port the pod's container declares, and every port of its Mooncake transfer
        range in use, is listened on at the pod's address or any address (never loopback
        alone); ChartError naming the pod and the port otherwise. The listeners."""
        c = self.container(pod.component)
        name = f"{self.workloads[pod.component]['metadata']['name']}-{pod.index}"
        got = self.listeners(pod)
        reach = {pod.address, "0.0.0.0", "*", "::"}
        _, env = self.argv_env(pod)
        lo, hi = int(env.get("TANDEM_TRANSFER__MIN_PORT", 0)), int(env.get("TANDEM_TRANSFER__MAX_PORT", -1))
        for p in c.get("ports") or []:
            on = [a for a, port in got if port == p["containerPort"]]
            if not on:
                raise ChartError(f"{name}: containerPort {p['containerPort']} "
                                 f"({p.get('name', '')}) has no listener; the process listens on "
                                 f"{[f'{a}:{q}' for a, q in got]}")
            if not reach & set(on):
                raise ChartError(f"{name}: containerPort {p['containerPort']} "
                                 f"({p.get('name', '')}) is listened on at {on} only, not at the "
                                 f"pod's address {pod.address}")
        for a, port in got:
            if lo <= port <= hi and a not in reach:
                raise ChartError(f"{name}: transfer port {port} is listened on at {a}, not at "
                                 f"the pod's address {pod.address}")
        return got

    def wait_ready(self, component: str, index: int = 0, timeout_s: float = 600) -> PodState:
        """Until the replica's readinessProbe passes; past `timeout_s` (a hang guard),
        ChartError naming the pod, its last probe failure and what its container declares
        against what it listens on."""
        pod = self.pod(component, index)
        try:
            self._wait(lambda: pod.ready, f"{component}-{index} ready", timeout_s)
        except TimeoutError:
            name = f"{self.workloads[component]['metadata']['name']}-{index}"
            why = ""
            if pod.proc is not None and pod.proc.poll() is None:
                try:
                    self.check_listeners(pod)
                except ChartError as e:
                    why = f"; {e}"
            rp = self.container(component).get("readinessProbe") or {}
            kind = next((k for k in ("httpGet", "grpc", "tcpSocket") if k in rp), None)
            why = (f"; readinessProbe {kind} {json.dumps(rp[kind], sort_keys=True)}" if kind
                   else "") + why
            raise ChartError(f"{name}: never ready in {timeout_s:g} s (restarts "
                             f"{pod.restarts}; last failure {pod.last_failure}){why}\n"
                             f"{self.describe(pod)}") from None
        return pod

    def _rootfs_for(self, c: dict, key: str) -> RootFS | None:
        ref = self.image_of(c).ref
        return RootFS(ref, key) if ref else None

    def _launch(self, pod: PodState) -> None:
        w = self.workloads[pod.component]
        c = self.container(pod.component)
        if pod.rootfs is None:
            pod.rootfs = self._rootfs_for(c, pod.node)  # kept through restarts; stop() removes it
        argv, pod.user_note = self._command(
            c, w["spec"]["template"]["spec"], w, pod.node, pod.address,
            f"{w['metadata']['name']}-{pod.index}", pod.rootfs)
        pod.log = self.workdir / f"{pod.node}.log"
        log = open(pod.log, "a")
        pod.proc = self.net.popen(pod.node, argv, stdout=log, stderr=subprocess.STDOUT, cwd="/")
        with self._lock:
            pod.phase, pod.ready = Phase.STARTING, False

    def run_pod(self, obj: dict, node: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        """A rendered bare Pod (the chart's `helm test` pod) run to completion on `node`:
        its container's command/args/env, volumes and user as rendered, in its image's
        filesystem where one is built (else this venv)."""
        spec = obj["spec"]
        c = spec["containers"][0]
        key = f"pod-{obj['metadata']['name']}"
        root = self._rootfs_for(c, key)
        try:
            argv, _ = self._command(c, spec, obj, key,
                                    self.net.nodes[node].address, obj["metadata"]["name"], root)
            return subprocess.run(self.net.argv(node, argv), capture_output=True, text=True,
                                  timeout=timeout_s, cwd="/")
        finally:
            if root:
                root.close()

    def stop(self, component: str, index: int = 0) -> None:
        """Delete the replica (as a scale-down would): its processes killed, DNS updated."""
        pod = self.pod(component, index)
        with self._lock:
            pod.phase, pod.ready = Phase.STOPPED, False
        self._dns_changed()
        self.net.kill_all(pod.node)
        if pod.rootfs is not None:  # a pod started again later is a new pod
            pod.rootfs.close()
            pod.rootfs = None

    # -- the kubelet ---------------------------------------------------------------------------

    def probe(self, pod: PodState, spec: dict) -> tuple[bool, str]:
        """One probe of the container at the pod's address, from the kubelet's namespace."""
        ports = {p["name"]: p["containerPort"] for p in self.container(pod.component).get("ports", [])}
        kind = next(k for k in ("httpGet", "grpc", "tcpSocket") if k in spec)
        port = spec[kind]["port"]
        req = {"kind": kind, "host": pod.address, "port": ports.get(port, port),
               "timeout": float(spec.get("timeoutSeconds", 1)),
               "path": spec[kind].get("path", "/"), "service": spec[kind].get("service", "")}
        with self._prober_lock:
            self._prober.stdin.write(json.dumps(req) + "\n")
            self._prober.stdin.flush()
            got = json.loads(self._prober.stdout.readline())
        return got["ok"], got["detail"]

    def _kubelet(self, pod: PodState) -> None:
        c = self.container(pod.component)
        started_at = time.monotonic()
        due: dict[str, float] = {}
        fails: dict[str, int] = {"startup": 0, "readiness": 0, "liveness": 0}
        oks: dict[str, int] = {"readiness": 0}
        while not self._stop.wait(0.2):
            with self._lock:
                if pod.phase is Phase.STOPPED:
                    return
            now = time.monotonic()
            if pod.proc.poll() is not None:
                self._restart(pod, f"exited with {pod.proc.returncode}")
                started_at, due, fails = time.monotonic(), {}, dict.fromkeys(fails, 0)
                continue
            kinds = ["startup"] if pod.phase is Phase.STARTING and "startupProbe" in c else (
                ["readiness", "liveness"])
            if pod.phase is Phase.STARTING and "startupProbe" not in c:
                pod.phase = Phase.RUNNING
            for kind in kinds:
                spec = c.get(f"{kind}Probe")
                if spec is None:
                    if kind == "readiness" and not pod.ready:
                        self._set_ready(pod, True)
                    continue
                if now - started_at < spec.get("initialDelaySeconds", 0) or now < due.get(kind, 0):
                    continue
                due[kind] = now + spec.get("periodSeconds", 10)
                ok, detail = self.probe(pod, spec)
                pod.probes[kind].append(ok)
                if not ok:
                    pod.last_failure = f"{kind}: {detail}"
                fails[kind] = 0 if ok else fails[kind] + 1
                if kind == "startup" and ok:
                    pod.phase = Phase.RUNNING
                elif kind in ("startup", "liveness") and fails[kind] >= spec.get("failureThreshold", 3):
                    self._restart(pod, f"{kind} probe failed {fails[kind]} times: {detail}")
                    started_at, due, fails = time.monotonic(), {}, dict.fromkeys(fails, 0)
                    break
                elif kind == "readiness":
                    oks["readiness"] = oks["readiness"] + 1 if ok else 0
                    if ok and oks["readiness"] >= spec.get("successThreshold", 1) and not pod.ready:
                        self._set_ready(pod, True)
                    elif not ok and fails[kind] >= spec.get("failureThreshold", 3) and pod.ready:
                        self._set_ready(pod, False)

    def _set_ready(self, pod: PodState, ready: bool) -> None:
        with self._lock:
            pod.ready = ready
        self._dns_changed()

    def _restart(self, pod: PodState, why: str) -> None:
        """Kill and relaunch, after the kubelet's back-off (10 s doubling to 300 s)."""
        with self._lock:
            if pod.phase is Phase.STOPPED:
                return
            pod.restarts += 1
            pod.last_failure = why
            pod.ready = False
        self._dns_changed()
        self.net.kill_all(pod.node)
        if self._stop.wait(min(300.0, 10.0 * 2 ** (pod.restarts - 1))):
            return
        with self._lock:
            if pod.phase is Phase.STOPPED:  # deleted during the back-off
                return
        self._launch(pod)

    # -- waiting -------------------------------------------------------------------------------

    def _wait(self, pred, what: str, timeout_s: float = 120) -> None:
        end = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > end:
                raise TimeoutError(f"{what} not reached within {timeout_s} s")
            time.sleep(0.2)

    def describe(self, pod: PodState) -> str:
        tail = pod.log.read_text()[-1500:] if pod.log and pod.log.exists() else ""
        where = f"image {self.image_of(self.container(pod.component)).ref}" if pod.rootfs \
            else "this venv"
        return (f"pod {self.workloads[pod.component]['metadata']['name']}-{pod.index} "
                f"({pod.address}, in {where}): phase={pod.phase.value} ready={pod.ready} "
                f"restarts={pod.restarts} last failure: {pod.last_failure} {pod.user_note}\n{tail}")


# -- the prober (runs in the kubelet's namespace) -------------------------------------------------

def _probe_once(req: dict) -> tuple[bool, str]:
    import socket

    host, port, timeout = req["host"], int(req["port"]), req["timeout"]
    try:
        if req["kind"] == "tcpSocket":
            socket.create_connection((host, port), timeout=timeout).close()
            return True, "connected"
        if req["kind"] == "httpGet":
            import httpx

            r = httpx.get(f"http://{host}:{port}{req['path']}", timeout=timeout)
            return 200 <= r.status_code < 400, f"HTTP {r.status_code}"
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"{host}:{port}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=req["service"]), timeout=timeout)
            ok = r.status == health_pb2.HealthCheckResponse.SERVING
            return ok, health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    except Exception as e:  # noqa: BLE001  NOTE: any failure is a failed probe, reported
        return False, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _prober_main() -> None:
    for line in sys.stdin:
        ok, detail = _probe_once(json.loads(line))
        print(json.dumps({"ok": ok, "detail": detail}), flush=True)


def with_container(objs: list[dict], component: str, edit) -> list[dict]:
    """A copy of the rendered objects with `edit(container, objs)` applied to one
    workload's container: how a test plants a fault in what the chart says."""
    objs = copy.deepcopy(objs)
    edit(workloads(objs)[component]["spec"]["template"]["spec"]["containers"][0], objs)
    return objs


if __name__ == "__main__" and sys.argv[1:] == ["--prober"]:
    _prober_main()
