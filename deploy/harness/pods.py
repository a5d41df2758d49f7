"""The Helm chart's own pods, run without Kubernetes (issue 40): each pod a network
namespace with its own private address (deploy/harness/netns.py), started from what
`helm template` renders, nothing rewritten by hand.

    objs = netpol.render_chart([overlay])                       # `helm template`
    with Cluster(objs, slots={"language": 2}) as c:              # namespaces, DNS, kubelet
        c.start("router", 0); c.start("encoder", 0); c.start("language", 0)
        c.wait_ready("language", 0)                              # its readinessProbe passed
        c.resolve("client", "t-tandem-language-headless")        # what the pods' DNS answers

Per pod (a Deployment/StatefulSet replica, "<component><i>"):
- argv: the container's `command` (else the image's ENTRYPOINT, from the Dockerfile stage
  the image tag names: "-router" -> stage router, else runtime) + `args` (else CMD); the
  image's `tini --` prefix is dropped where tini is not installed; the program resolves
  on the image's PATH with this checkout's venv in place of /opt/venv.
- env: the image's ENV (PATH, PYTHONUNBUFFERED, ...), then envFrom (ConfigMaps, Secrets),
  then env (value; valueFrom fieldRef status.podIP / metadata.name / metadata.namespace,
  configMapKeyRef, secretKeyRef), as the kubelet orders them (later wins).
- files: a private mount namespace (`ip netns exec` gives one): each volumeMount at its
  mountPath: Secret and ConfigMap volumes as files (items/defaultMode honoured, owned by
  root:fsGroup), emptyDir as a fresh tmpfs, hostPath bound; then readOnlyRootFilesystem
  (/ remounted read-only) and runAsUser/runAsGroup/fsGroup (setpriv) as the pod says.
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
lifecycle preStop hook, NetworkPolicy (deploy/harness/netpol.py does that), and the image's
own filesystem (pods run this checkout's venv until the image is built).

Teardown (close(), the context's exit, atexit) always completes: kubelet threads stop,
every process in every namespace is killed and the namespaces deleted (netns.Network),
the /etc/netns/<netns> directories and the mount points this run created are removed.
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
    """What a container inherits from its image: ENTRYPOINT, CMD and ENV of one stage."""

    stage: str
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: dict[str, str]


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


class Cluster:
    """The rendered chart's workloads as pods. `slots`: replicas to make room for per
    component (default: the Deployment's spec.replicas); start() a replica to run it."""

    def __init__(self, objs: list[dict], slots: dict[str, int] | None = None,
                 subnet: str = "10.231.5.0/24", extra_nodes: tuple[str, ...] = ("client",),
                 no_build: tuple[str, ...] = ()) -> None:
        self.objs = objs
        # NOTE: `no_build`: in-pod directories made empty and read-only after the volumes
        # are mounted. For TANDEM_KERNEL_DIR: the chart's emptyDir /cache makes every pod
        # compile its CPU kernels on first start (minutes on this machine's two shared
        # cores); with the directory unwritable the tiers log "CPU kernels unavailable"
        # and serve with torch's ops (tandem/cpu_kernels.py). Named by the caller.
        self.no_build = tuple(no_build)
        self.workloads = workloads(objs)
        if not self.workloads:
            raise ChartError("the rendered chart has no Deployment or StatefulSet")
        self.slots = {c: (slots or {}).get(c, int(w["spec"].get("replicas", 1)))
                      for c, w in self.workloads.items()}
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

    def argv_env(self, pod: PodState) -> tuple[list[str], dict[str, str]]:
        """The container's process and environment, as the kubelet would make them."""
        c = self.container(pod.component)
        w = self.workloads[pod.component]
        img = image_config(c["image"])
        argv = list(c.get("command") or img.entrypoint) + list(
            c.get("args") if c.get("args") is not None or c.get("command") else img.cmd)
        if argv[:2] == ["/usr/bin/tini", "--"] and not os.path.exists("/usr/bin/tini"):
            argv = argv[2:]
        env = {k: v for k, v in img.env.items()}
        env["PATH"] = _host_path_env(env["PATH"])
        env["HOSTNAME"] = f"{w['metadata']['name']}-{pod.index}"
        ns = self._namespace()
        for src in c.get("envFrom") or []:
            if "configMapRef" in src:
                env.update(self._configmap(src["configMapRef"]["name"], w)["data"])
            elif "secretRef" in src:
                env.update(_secret_data(self._secret(src["secretRef"]["name"], w)))
        fields = {"status.podIP": pod.address, "metadata.name": env["HOSTNAME"],
                  "metadata.namespace": ns}
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = str(e["value"])
            elif "fieldRef" in e.get("valueFrom", {}):
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["configMapKeyRef"]
                env[e["name"]] = self._configmap(ref["name"], w)["data"][ref["key"]]
            elif "secretKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["secretKeyRef"]
                env[e["name"]] = _secret_data(self._secret(ref["name"], w))[ref["key"]]
        prog = shutil.which(argv[0], path=env["PATH"])
        if prog is None:
            raise ChartError(f"{w['metadata']['name']}: {argv[0]!r} is not on the image's PATH")
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

    def _mount_script(self, pod: PodState) -> list[str]:
        """Shell lines run in the pod's private mount namespace before its process."""
        w = self.workloads[pod.component]
        spec = w["spec"]["template"]["spec"]
        c = self.container(pod.component)
        psc = spec.get("securityContext") or {}
        gid = psc.get("fsGroup", psc.get("runAsGroup", 0))
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        lines = []
        for m in c.get("volumeMounts") or []:
            v = vols.get(m["name"])
            if v is None:
                raise ChartError(f"{w['metadata']['name']}: volumeMount {m['name']!r} has no volume")
            target = Path(m["mountPath"])
            if not target.exists():
                missing = [p for p in (target, *target.parents) if not p.exists()]
                target.mkdir(parents=True)
                self._made_dirs.extend(reversed(missing))
            t = shlex.quote(str(target))
            if "secret" in v or "configMap" in v:
                src = self._files(pod, v, gid, w)
                lines.append(f"mount --bind {shlex.quote(str(src))} {t}")
            elif "emptyDir" in v:
                lines.append(f"mount -t tmpfs -o mode=1777 tmpfs {t}")
            elif "hostPath" in v:
                lines.append(f"mount --bind {shlex.quote(v['hostPath']['path'])} {t}")
            else:
                raise ChartError(f"{w['metadata']['name']}: volume {m['name']!r}: kind not modelled")
            if m.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {t}")
        mounted = [m["mountPath"] for m in c.get("volumeMounts") or []]
        for inside in self.no_build:
            if not any(Path(inside).is_relative_to(mp) for mp in mounted):
                continue  # not in a volume of this container
            q = shlex.quote(inside)
            lines += [f"mkdir -p {q}", f"mount -t tmpfs -o ro,size=4k tmpfs {q}"]
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem"):
            lines.append("mount -o remount,bind,ro /")  # last: the mounts above stay writable
        return lines

    def _files(self, pod: PodState, vol: dict, gid: int, w: dict) -> Path:
        """A Secret/ConfigMap volume's files (items, defaultMode), owned root:fsGroup."""
        if "secret" in vol:
            data = _secret_data(self._secret(vol["secret"]["secretName"], w))
            src = vol["secret"]
        else:
            data = dict(self._configmap(vol["configMap"]["name"], w).get("data") or {})
            src = vol["configMap"]
        d = self.workdir / "volumes" / pod.node / vol["name"]
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

    def _launch(self, pod: PodState) -> None:
        argv, env = self.argv_env(pod)
        spec = self.workloads[pod.component]["spec"]["template"]["spec"]
        psc = spec.get("securityContext") or {}
        csc = self.container(pod.component).get("securityContext") or {}
        uid = csc.get("runAsUser", psc.get("runAsUser"))
        gid = csc.get("runAsGroup", psc.get("runAsGroup", uid))
        groups = [g for g in (psc.get("fsGroup"),) if g is not None]
        # NOTE: the user switch needs the venv's interpreter reachable by that user; a venv
        # made from an interpreter under /root (pyenv) is not, and then the pod runs as root
        # (said in describe(): the non-root user is the image's to check, not this venv's).
        if uid is not None and not _reachable_by_all(Path(os.path.realpath(sys.executable))):
            pod.user_note = f"runAsUser {uid} not applied: {os.path.realpath(sys.executable)} " \
                            "is not reachable by other users"
            uid = None
        drop = ["setpriv", f"--reuid={uid}", f"--regid={gid}",
                f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--"] if uid is not None else []
        script = "set -e\n" + "\n".join(self._mount_script(pod)) + "\nexec \"$@\"\n"
        pod.log = self.workdir / f"{pod.node}.log"
        log = open(pod.log, "a")
        pod.proc = self.net.popen(pod.node, ["sh", "-c", script, "sh", "env", "-i",
                                             *[f"{k}={v}" for k, v in env.items()], *drop, *argv],
                                  stdout=log, stderr=subprocess.STDOUT, cwd="/")
        with self._lock:
            pod.phase, pod.ready = Phase.STARTING, False

    def stop(self, component: str, index: int = 0) -> None:
        """Delete the replica (as a scale-down would): its processes killed, DNS updated."""
        pod = self.pod(component, index)
        with self._lock:
            pod.phase, pod.ready = Phase.STOPPED, False
        self._dns_changed()
        self.net.kill_all(pod.node)

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
        return (f"pod {self.workloads[pod.component]['metadata']['name']}-{pod.index} "
                f"({pod.address}): phase={pod.phase.value} ready={pod.ready} "
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
        return False, f"{type(e).__name__}: {str(e)[:200]}"


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
