"""The chart's NetworkPolicy, enforced (`make check-netpol`).

deploy/harness/netpol.py translates the NetworkPolicy objects that `helm template` renders
into nftables rules for pods that are network namespaces (deploy/harness/netns.py). Here:

- per rendered rule (fast, no root): what it admits, resolved against the pods the chart
  renders, matches the chart's stated intent (deploy/k8s/tandem/templates/networkpolicy.yaml)
  for the default values and for values-production.yaml;
- the translator's own semantics (selectors, empty peers/ports, ipBlock, Egress refused);
- enforced (slow; root, `ip`, `nft`): one namespace per pod (router, encoder, language of
  the release namespace, and prefill with prefill.enabled (E/P/D); a pod of `default`, of
  `monitoring`, of `ingress`), the rules
  loaded, and every (source pod, destination pod, port) connection attempted: each admitted
  one connects, each other one is dropped; then each rule removed in turn drops the flow it
  named (so the check fails when a rule goes missing), and back in place admits it again.
"""

from __future__ import annotations

import copy
import enum
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deploy" / "harness"))
import netns  # noqa: E402
import netpol  # noqa: E402

PRODUCTION = ROOT / "deploy" / "k8s" / "values-production.yaml"
RELEASE_NS = "tandem"
TIERS = ("router", "encoder", "language")
EPD_TIERS = (*TIERS, "prefill")
OUTSIDERS = {"other": "default", "monitor": "monitoring", "ingress": "ingress"}
PODS = (*EPD_TIERS, *OUTSIDERS)  # a world without prefill pods leaves that name unused
ANY = "any"
# E/P/D: prefill pods, the language pods decoding (prefill.enabled; the roles are CPU-only)
EPD_SET = ("prefill.enabled=true", "language.gpus=0")
WORLDS = {"default": (False, False), "production": (True, False),
          "epd": (False, True), "epd-production": (True, True)}  # (production, epd)

# The chart's intent, written from its own comment block (who may open what), per values
# file: (policy suffix, rule index) -> (sources, ports). Sources: pod names or ANY.
GRPC = {"encoder": 50061, "language": 50071, "prefill": 50071}
METRICS, HEALTH = 9090, 8090
ROUTER_PORTS = (8000, 50051)


def _transfer_range(production: bool) -> tuple[int, int]:
    """transfer.minPort..maxPort as the values files set them."""
    t = yaml.safe_load((netpol.CHART / "values.yaml").read_text())["transfer"]
    if production:
        t = {**t, **(yaml.safe_load(PRODUCTION.read_text()).get("transfer") or {})}
    return int(t["minPort"]), int(t["maxPort"])


def _intent(production: bool, epd: bool = False) -> dict[tuple[str, int], tuple[object, tuple]]:
    xfer = _transfer_range(production)
    metrics_from = frozenset({"monitor"}) if production else ANY
    router_from = frozenset({"ingress"}) if production else ANY
    if epd:  # the prefill pods take the language side of the encoder paths
        return {
            ("encoder", 0): (frozenset({"router", "prefill"}), ((GRPC["encoder"],) * 2,)),
            ("encoder", 1): (frozenset({"prefill"}), (xfer,)),
            ("encoder", 2): (metrics_from, ((METRICS, METRICS),)),
            ("encoder", 3): (ANY, ((HEALTH, HEALTH),)),
            ("language", 0): (frozenset({"router"}), ((GRPC["language"],) * 2,)),
            ("language", 1): (frozenset({"prefill"}), (xfer,)),
            ("language", 2): (metrics_from, ((METRICS, METRICS),)),
            ("language", 3): (ANY, ((HEALTH, HEALTH),)),
            ("prefill", 0): (frozenset({"router", "language"}), ((GRPC["prefill"],) * 2,)),
            ("prefill", 1): (frozenset({"encoder"}), (xfer,)),
            ("prefill", 2): (metrics_from, ((METRICS, METRICS),)),
            ("prefill", 3): (ANY, ((HEALTH, HEALTH),)),
            ("router", 0): (router_from, tuple((p, p) for p in ROUTER_PORTS)),
        }
    return {
        ("encoder", 0): (frozenset({"router", "language"}), ((GRPC["encoder"],) * 2,)),
        ("encoder", 1): (frozenset({"language"}), (xfer,)),
        ("encoder", 2): (metrics_from, ((METRICS, METRICS),)),
        ("encoder", 3): (ANY, ((HEALTH, HEALTH),)),
        ("language", 0): (frozenset({"router"}), ((GRPC["language"],) * 2,)),
        ("language", 1): (frozenset({"encoder"}), (xfer,)),
        ("language", 2): (metrics_from, ((METRICS, METRICS),)),
        ("language", 3): (ANY, ((HEALTH, HEALTH),)),
        ("router", 0): (router_from, tuple((p, p) for p in ROUTER_PORTS)),
    }


def _helm_or_skip() -> None:
    if not netpol.HELM.exists():
        pytest.skip("no .tools/helm (make helm)")


def _world(values: list[Path], addresses: dict[str, str], epd: bool = False):
    objs = netpol.render_chart(values, namespace=RELEASE_NS, set_values=EPD_SET if epd else ())
    pods = netpol.pods_of(objs, RELEASE_NS, addresses)
    assert sorted(p.name for p in pods) == sorted(EPD_TIERS if epd else TIERS)
    pods += [netpol.Pod(n, ns, {"app": n}, addresses[n]) for n, ns in OUTSIDERS.items()]
    namespaces = [netpol.Namespace(ns, {"kubernetes.io/metadata.name": ns})
                  for ns in {RELEASE_NS, *OUTSIDERS.values()}]
    return objs, pods, namespaces


def _fake_addresses() -> dict[str, str]:  # never dialed: strings for the translation
    return {n: f"10.231.9.{i + 2}" for i, n in enumerate(PODS)}


@pytest.mark.parametrize("world", WORLDS)
def test_each_rendered_rule_admits_what_the_chart_says(world):
    _helm_or_skip()
    production, epd = WORLDS[world]
    addrs = _fake_addresses()
    by_addr = {a: n for n, a in addrs.items()}
    objs, pods, namespaces = _world([PRODUCTION] if production else [], addrs, epd)
    plans = netpol.translate(netpol.policies_of(objs), pods, namespaces)
    intent = _intent(production, epd)
    seen = {}
    for name, plan in plans.items():
        assert plan.isolated == (name in EPD_TIERS), name
        for allow in plan.allows:
            key = (allow.policy.removeprefix("t-tandem-"), allow.rule)
            assert allow.policy == f"t-tandem-{name}"
            sources = ANY if allow.sources is None else frozenset(by_addr[s] for s in allow.sources)
            seen[key] = (sources, tuple((p.first, p.last) for p in allow.ports))
            assert all(p.protocol == "tcp" for p in allow.ports)
    # every rule the chart renders is one the intent names, and none is missing
    assert seen == intent


def test_selectors_peers_and_ports():
    ns = [netpol.Namespace("a", {"team": "x"}), netpol.Namespace("b", {"team": "y"})]
    pods = [netpol.Pod("p1", "a", {"role": "db", "tier": "1"}, "10.0.0.1", {"pg": ("tcp", 5432)}),
            netpol.Pod("p2", "a", {"role": "web"}, "10.0.0.2"),
            netpol.Pod("p3", "b", {"role": "web"}, "10.0.0.3")]
    pol = {"metadata": {"name": "db", "namespace": "a"}, "spec": {
        "podSelector": {"matchExpressions": [{"key": "role", "operator": "In", "values": ["db"]}]},
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": {"role": "web"}}}], "ports": [{"port": "pg"}]},
            {"from": [{"namespaceSelector": {"matchLabels": {"team": "y"}}}],
             "ports": [{"protocol": "UDP", "port": 53, "endPort": 54}]},
            {"from": [{"namespaceSelector": {}, "podSelector": {"matchExpressions": [
                {"key": "tier", "operator": "DoesNotExist"}]}}]},
            {"from": [{"ipBlock": {"cidr": "10.0.0.0/24", "except": ["10.0.0.3/32"]}}],
             "ports": [{"port": 22}]},
        ]}}
    plans = netpol.translate([pol], pods, ns)
    assert not plans["p2"].isolated and not plans["p3"].isolated
    a = plans["p1"].allows
    assert plans["p1"].isolated and len(a) == 4
    # podSelector alone: the policy's own namespace only (p3 is in b)
    assert a[0].sources == ("10.0.0.2",) and a[0].ports == (netpol.PortRange("tcp", 5432, 5432),)
    assert a[1].sources == ("10.0.0.3",) and a[1].ports == (netpol.PortRange("udp", 53, 54),)
    assert a[2].sources == ("10.0.0.2", "10.0.0.3") and a[2].ports is None
    assert a[3].sources == ("10.0.0.0/24",) and a[3].excepts == ("10.0.0.3/32",)
    text = plans["p1"].nft()
    assert "ip saddr { 10.0.0.2 } tcp dport 5432 accept" in text
    assert "udp dport 53-54 accept" in text
    assert "ip saddr != { 10.0.0.3/32 } tcp dport 22 accept" in text
    assert text.rstrip().splitlines()[-3].strip().startswith("counter drop")
    assert netpol.admits(plans["p1"], "10.0.0.2", "tcp", 5432)
    assert not netpol.admits(plans["p1"], "10.0.0.1", "tcp", 5432)  # p1 itself: not named
    assert netpol.admits(plans["p1"], "10.0.0.3", "tcp", 9)  # rule 2: every port
    assert netpol.admits(plans["p1"], "10.0.0.9", "tcp", 22)  # inside the block
    assert not netpol.admits(plans["p1"], "10.0.1.9", "tcp", 22)  # outside it
    only_block = netpol.PodPlan(plans["p1"].pod, True, (a[3],))
    assert not netpol.admits(only_block, "10.0.0.3", "tcp", 22)  # the block's except
    # a pod no policy selects: no drop at all
    assert "drop" not in plans["p2"].nft()


def test_egress_and_unknown_operators_are_refused_not_ignored():
    pods = [netpol.Pod("p", "a", {"x": "1"}, "10.0.0.1")]
    ns = [netpol.Namespace("a", {})]
    egress = {"metadata": {"name": "e", "namespace": "a"},
              "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{}]}}
    with pytest.raises(netpol.Untranslatable, match="Egress"):
        netpol.translate([egress], pods, ns)
    odd = {"metadata": {"name": "o", "namespace": "a"}, "spec": {"podSelector": {
        "matchExpressions": [{"key": "x", "operator": "Gt", "values": ["0"]}]}}}
    with pytest.raises(netpol.Untranslatable, match="Gt"):
        netpol.translate([odd], pods, ns)


# -- enforced in namespaces ---------------------------------------------------------------


class Outcome(enum.Enum):
    CONNECTED = "connected"
    REFUSED = "refused"  # an RST: nothing listening, or a reject rule
    DROPPED = "dropped"  # no answer: a drop rule


PROBE_TIMEOUT_S = 3.0


def _connect(address: str, port: int) -> Outcome:
    try:
        socket.create_connection((address, port), timeout=PROBE_TIMEOUT_S).close()
        return Outcome.CONNECTED
    except ConnectionRefusedError:
        return Outcome.REFUSED
    except TimeoutError:
        return Outcome.DROPPED


def _listen(ports: list[int]) -> list[socket.socket]:
    out = []
    for p in ports:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", p))
        s.listen(128)  # the kernel completes handshakes into the backlog: no accept() needed
        out.append(s)
    return out


def _probe_ports(intent, xfer: tuple[int, int], tiers=TIERS) -> dict[str, list[int]]:
    """Per tier: every port its rules name (a range's ends), and ports just outside."""
    out: dict[str, set[int]] = {t: {xfer[0] - 1, xfer[1] + 1, 7} for t in tiers}
    for (tier, _), (_, ranges) in intent.items():
        for first, last in ranges:
            out[tier] |= {first, last}
    return {t: sorted(ps) for t, ps in out.items()}


def _expected(intent, dest: str, source: str, port: int) -> bool:
    for (tier, _), (sources, ranges) in intent.items():
        if tier == dest and (sources == ANY or source in sources) and any(
            a <= port <= b for a, b in ranges
        ):
            return True
    return False


def _nft_or_skip() -> None:
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    if subprocess.run(["which", "nft"], capture_output=True).returncode != 0:
        pytest.skip("no nft (Debian: nftables)")
    _helm_or_skip()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLDS)
def test_policy_enforced_between_pod_namespaces(world):
    _nft_or_skip()
    netns.sweep_stale()
    production, epd = WORLDS[world]
    tiers = EPD_TIERS if epd else TIERS
    names = (*tiers, *OUTSIDERS)
    with netns.Network(list(names), subnet="10.231.1.0/24") as net:
        addrs = {n: node.address for n, node in net.nodes.items()}
        objs, pods, namespaces = _world([PRODUCTION] if production else [], addrs, epd)
        policies = netpol.policies_of(objs)
        plans = netpol.translate(policies, pods, namespaces)
        for plan in plans.values():
            netpol.apply(net, plan)
        intent = _intent(production, epd)
        xfer = _transfer_range(production)
        ports = _probe_ports(intent, xfer, tiers)
        listeners = [s for t in tiers for s in net.call_in(t, _listen, ports[t])]
        try:
            flows = [(src, dst, p) for dst in tiers for p in ports[dst] for src in names
                     if src != dst]

            def attempt(flow):
                src, dst, p = flow
                return net.call_in(src, _connect, addrs[dst], p)

            with ThreadPoolExecutor(32) as pool:
                got = dict(zip(flows, pool.map(attempt, flows), strict=True))
            want = {f: Outcome.CONNECTED if _expected(intent, f[1], f[0], f[2]) else Outcome.DROPPED
                    for f in flows}
            wrong = {f: (got[f].value, want[f].value) for f in flows if got[f] != want[f]}
            assert not wrong, wrong
            admitted = sum(o is Outcome.CONNECTED for o in got.values())
            print(f"{world}: {len(flows)} flows, "
                  f"{admitted} admitted, {len(flows) - admitted} dropped")
            # the three cases by name
            assert got[("router", "language", xfer[0])] is Outcome.DROPPED
            assert got[("encoder", "language", xfer[0])] is (
                Outcome.DROPPED if epd else Outcome.CONNECTED)
            if epd:  # E/P/D's paths by name: KV pages P -> D, Prefill D -> P, Attach P -> E
                assert got[("prefill", "language", xfer[0])] is Outcome.CONNECTED
                assert got[("language", "prefill", GRPC["prefill"])] is Outcome.CONNECTED
                assert got[("prefill", "encoder", GRPC["encoder"])] is Outcome.CONNECTED
                assert got[("encoder", "prefill", xfer[1])] is Outcome.CONNECTED
                assert got[("language", "encoder", GRPC["encoder"])] is Outcome.DROPPED
                assert got[("language", "prefill", xfer[0])] is Outcome.DROPPED
            assert got[("monitor", "encoder", METRICS)] is Outcome.CONNECTED
            assert got[("other", "encoder", METRICS)] is (
                Outcome.DROPPED if production else Outcome.CONNECTED)

            # each rule removed: a flow it named is dropped; restored: admitted again
            removed = 0
            for pol_index, pol in enumerate(policies):
                for rule_index in range(len(pol["spec"]["ingress"])):
                    key = (pol["metadata"]["name"].removeprefix("t-tandem-"), rule_index)
                    sources, ranges = intent[key]
                    dst = key[0]
                    src = next(s for s in names if s != dst and (sources == ANY or s in sources))
                    port = ranges[0][0]
                    cut = copy.deepcopy(policies)
                    del cut[pol_index]["spec"]["ingress"][rule_index]
                    netpol.apply(net, netpol.translate(cut, pods, namespaces)[dst])
                    without = net.call_in(src, _connect, addrs[dst], port)
                    netpol.apply(net, plans[dst])
                    back = net.call_in(src, _connect, addrs[dst], port)
                    assert (without, back) == (Outcome.DROPPED, Outcome.CONNECTED), (key, src)
                    removed += 1
            assert removed == len(intent)
        finally:
            for s in listeners:
                s.close()
    assert netns.list_ours() == []
