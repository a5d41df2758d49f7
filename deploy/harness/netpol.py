"""Kubernetes NetworkPolicy objects (as the chart renders them) -> nftables rules per pod,
for pods that are network namespaces (deploy/harness/netns.py).

    objs = render_chart(["deploy/k8s/values-production.yaml"])     # `helm template`
    pods = pods_of(objs, release_namespace, addresses)               # Deployments' pod labels
    plan = translate(policies_of(objs), pods, namespaces)            # NetworkPolicy semantics
    net.exec(pod, "nft", "-f", path_of(plan[pod].nft()))             # one table per pod

Semantics translated (networking.k8s.io/v1, ingress): a pod selected by no policy admits
everything; a pod selected by at least one policy with Ingress in its policyTypes admits a
new connection only when some ingress rule of some such policy admits it; a rule admits a
connection when its `from` (absent or empty: every source) names the source and its `ports`
(absent or empty: every port) name the destination port. Peers: `podSelector` alone (pods
of the policy's namespace), `namespaceSelector` alone (every pod of the matching
namespaces), both (matching pods of matching namespaces), `ipBlock` (cidr less except).
Selectors: matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist); an empty
selector matches all. Ports: number or container port name, with endPort for a range;
protocol TCP (default), UDP or SCTP. Replies of admitted connections (conntrack
established/related) pass; a pod's loopback is never filtered. Refused connections are
dropped, as common CNIs do (the client's connect times out, no RST).

Not translated, and refused with an error rather than ignored: Egress policies (the chart
renders none: egress stays open for model downloads).
"""

from __future__ import annotations

import ipaddress
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "k8s" / "tandem"
HELM = ROOT / ".tools" / "helm"
TABLE = "netpol"  # the nft table each pod gets (inet family)


class Untranslatable(ValueError):
    """A policy uses something this translator does not implement."""


@dataclass(frozen=True)
class Namespace:
    name: str
    labels: dict[str, str]


@dataclass(frozen=True)
class Pod:
    """A pod of the harness: its namespace, labels, address and named container ports."""

    name: str
    namespace: str
    labels: dict[str, str]
    address: str
    ports: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (proto, port)


@dataclass(frozen=True)
class PortRange:
    protocol: str  # "tcp" | "udp" | "sctp" (nft's spelling)
    first: int
    last: int

    def nft(self) -> str:
        span = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        return f"{self.protocol} dport {span}"


@dataclass(frozen=True)
class Allow:
    """One ingress rule of one policy, resolved for one destination pod. `sources`: None
    admits any source; else addresses/CIDRs less `excepts`. `ports`: None admits every
    port (and protocol)."""

    policy: str
    rule: int
    sources: tuple[str, ...] | None
    excepts: tuple[str, ...]
    ports: tuple[PortRange, ...] | None

    def nft_lines(self) -> list[str]:
        tag = f'comment "{self.policy}/ingress[{self.rule}]"'
        if self.sources is not None and not self.sources:
            return []  # names no source that exists: admits nothing
        src = "" if self.sources is None else f"ip saddr {{ {', '.join(self.sources)} }} "
        if self.excepts:
            src += f"ip saddr != {{ {', '.join(self.excepts)} }} "
        if self.ports is None:
            return [f"{src}accept {tag}"]
        return [f"{src}{p.nft()} accept {tag}" for p in self.ports]


@dataclass(frozen=True)
class PodPlan:
    """What one pod admits: `isolated` (some policy selects it for ingress) and the
    rules that admit; not isolated admits everything."""

    pod: Pod
    isolated: bool
    allows: tuple[Allow, ...]

    def nft(self) -> str:
        lines = [f"table inet {TABLE} {{", "  chain ingress {",
                 "    type filter hook input priority filter; policy accept;"]
        if self.isolated:
            lines += ["    ct state established,related accept", '    iifname "lo" accept']
            lines += [f"    {ln}" for a in self.allows for ln in a.nft_lines()]
            lines.append('    counter drop comment "not admitted by any NetworkPolicy"')
        lines += ["  }", "}"]
        return "\n".join(lines) + "\n"


def render_chart(values_files: list[str | Path] = (), release: str = "t",
                 namespace: str = "tandem", helm: Path = HELM,
                 set_values: tuple[str, ...] = ()) -> list[dict]:
    """The chart's objects as `helm template` renders them (`set_values`: `--set` items,
    after the values files)."""
    argv = [str(helm), "template", release, str(CHART), "--namespace", namespace]
    for f in values_files:
        argv += ["-f", str(f)]
    for item in set_values:
        argv += ["--set", item]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"helm template: {r.stderr.strip()}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def policies_of(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o.get("kind") == "NetworkPolicy"]


def pods_of(objs: list[dict], namespace: str, addresses: dict[str, str]) -> list[Pod]:
    """One pod per rendered Deployment/StatefulSet, labelled as its pod template says;
    `addresses`: the workload's component label (router, encoder, ...) -> the address."""
    pods = []
    for o in objs:
        if o.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        tpl = o["spec"]["template"]
        labels = dict(tpl["metadata"].get("labels", {}))
        comp = labels.get("app.kubernetes.io/component", o["metadata"]["name"])
        ports = {p["name"]: (p.get("protocol", "TCP").lower(), int(p["containerPort"]))
                 for c in tpl["spec"]["containers"] for p in c.get("ports", []) if "name" in p}
        pods.append(Pod(comp, namespace, labels, addresses[comp], ports))
    return pods


def selector_matches(selector: dict | None, labels: dict[str, str]) -> bool:
    """A LabelSelector against labels; an empty selector matches everything."""
    selector = selector or {}
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise Untranslatable(f"selector operator {op!r}")
    return True


def _peer(peer: dict, policy_ns: str, pods: list[Pod],
          namespaces: dict[str, Namespace]) -> tuple[list[str], list[str]]:
    """(sources, excepts) one NetworkPolicyPeer names."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ipaddress.ip_network(block["cidr"])  # a clear error on a bad CIDR
        return [block["cidr"]], list(block.get("except") or [])
    if "podSelector" not in peer and "namespaceSelector" not in peer:
        raise Untranslatable(f"a peer with neither selector nor ipBlock: {peer}")
    out = []
    for pod in pods:
        if "namespaceSelector" in peer:
            ns = namespaces[pod.namespace]
            if not selector_matches(peer["namespaceSelector"], ns.labels):
                continue
        elif pod.namespace != policy_ns:
            continue
        if "podSelector" in peer and not selector_matches(peer["podSelector"], pod.labels):
            continue
        out.append(pod.address)
    return out, []


def _ports(ports: list[dict] | None, pod: Pod) -> tuple[PortRange, ...] | None:
    if not ports:
        return None
    out = []
    for p in ports:
        proto = str(p.get("protocol", "TCP")).lower()
        if proto not in ("tcp", "udp", "sctp"):
            raise Untranslatable(f"protocol {p.get('protocol')!r}")
        if "port" not in p:  # a protocol alone: all its ports
            out.append(PortRange(proto, 1, 65535))
            continue
        port = p["port"]
        if isinstance(port, str):
            if port not in pod.ports:  # a named port this pod lacks admits nothing here
                continue
            proto, port = pod.ports[port]
        out.append(PortRange(proto, int(port), int(p.get("endPort", port))))
    return tuple(out)


def translate(policies: list[dict], pods: list[Pod],
              namespaces: list[Namespace]) -> dict[str, PodPlan]:
    """Each pod's plan under the policies (by pod name)."""
    by_name = {n.name: n for n in namespaces}
    plans = {}
    for pod in pods:
        isolated, allows = False, []
        for pol in policies:
            meta, spec = pol["metadata"], pol["spec"]
            policy_ns = meta.get("namespace", pod.namespace)
            types = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec
                                                 else ["Ingress"])
            if "Egress" in types:
                raise Untranslatable(f"{meta['name']}: Egress policies are not translated")
            if policy_ns != pod.namespace or not selector_matches(spec.get("podSelector"),
                                                                  pod.labels):
                continue
            isolated = True
            for i, rule in enumerate(spec.get("ingress") or []):
                peers = rule.get("from")
                if peers:
                    srcs, excepts = [], []
                    for peer in peers:
                        s, e = _peer(peer, policy_ns, pods, by_name)
                        srcs += s
                        excepts += e
                    sources = tuple(dict.fromkeys(srcs))
                else:
                    sources, excepts = None, []
                allows.append(Allow(meta["name"], i, sources, tuple(excepts),
                                    _ports(rule.get("ports"), pod)))
        plans[pod.name] = PodPlan(pod, isolated, tuple(allows))
    return plans


def admits(plan: PodPlan, source: str, protocol: str, port: int) -> bool:
    """Whether the plan admits a new connection (the rules' meaning, for reading plans;
    the harness tests the kernel's verdict, not this)."""
    if not plan.isolated:
        return True
    for a in plan.allows:
        if a.sources is not None and not any(
            ipaddress.ip_address(source) in ipaddress.ip_network(s) for s in a.sources
        ):
            continue
        if any(ipaddress.ip_address(source) in ipaddress.ip_network(e) for e in a.excepts):
            continue
        if a.ports is None or any(p.protocol == protocol and p.first <= port <= p.last
                                  for p in a.ports):
            return True
    return False


def apply(net, plan: PodPlan) -> None:
    """Load the plan into the pod's namespace, replacing an earlier one (netns.Network)."""
    node = plan.pod.name
    tables = net.exec(node, "nft", "list", "tables")
    if f"table inet {TABLE}" in tables:
        net.exec(node, "nft", "delete", "table", "inet", TABLE)
    r = subprocess.run(net.argv(node, ["nft", "-f", "-"]), input=plan.nft(), text=True,
                       capture_output=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"[{node}] nft -f: {r.stderr.strip()}\n{plan.nft()}")
