"""Hosts on one machine: each node a Linux network namespace with its own private address,
all joined by a bridge that lives in a namespace of its own.

    with Network(["head", "w1", "w2"]) as net:          # root: `ip netns` + veth + bridge
        net.popen("head", ["ray", "start", ...])          # a process on a node
        net.call_in("w1", fn, *args)                      # a Python call on a node's network
        net.isolate("w1")                                 # its link cut (and back: reconnect)
        net.kill_all("w1")                                # every process of the node, SIGKILL

Layout (nothing is added to the machine's own network namespace, so the private subnet
is reachable only from inside the namespaces made here):

    netns <prefix>-sw:   bridge "br0" (no address), one veth end per node, "p-<node>"
    netns <prefix>-<node>: "lo" up, "eth0" (the veth's other end) with 10.x.y.(2+i)/24

Teardown (close(), the context's exit, and an atexit backstop) always runs to the end:
every process inside each namespace is killed (`ip netns pids`), then each namespace is
deleted, which destroys its veth end and the bridge with it. `sweep_stale()` removes what
a killed run (SIGKILL of the test process) left: the prefix carries the creating pid.

Reused by the chart's pods harness (issue 40) and the NetworkPolicy check
(deploy/harness/netpol.py): a "node" is any network endpoint (a Ray node, a pod).
"""

from __future__ import annotations

import atexit
import ctypes
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

PREFIX = "tdm"  # every namespace made here is named tdm<pid>-<name>
CLONE_NEWNET = 0x40000000
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")  # veth "p-<name>" fits IFNAMSIZ (15)


class HarnessUnavailable(RuntimeError):
    """This machine cannot build namespaces (not root, no `ip`): callers skip."""


def unavailable_reason() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (Debian: iproute2)"
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        return "no network namespaces in this kernel"
    return ""


@dataclass(frozen=True)
class Node:
    """One endpoint: its namespace's name, its address on the shared subnet."""

    name: str
    netns: str
    address: str  # dotted IPv4, no prefix length
    port_name: str  # its veth end in the switch namespace


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _netns_pids(netns: str) -> list[int]:
    r = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _kill_netns_processes(netns: str) -> int:
    """SIGKILL every process in the namespace until none is left; how many were killed.
    NOTE: a loop, because a process may fork between the listing and the kill. A killed
    process is left for its owner to reap (a dead one, a zombie, is no longer listed): it
    used to be reaped here when it was this process's child, and then its owner's
    `Popen.wait()` found no child and returned 0 instead of -9 (a CI run's
    test_netpol_harness saw it whenever the kill had landed before this waitpid)."""
    killed = 0
    for _ in range(50):
        pids = [p for p in _netns_pids(netns) if p != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        threading.Event().wait(0.1)
    raise RuntimeError(f"processes keep appearing in {netns}: {_netns_pids(netns)}")


def list_ours(all_pids: bool = False) -> list[str]:
    """Namespaces made by this harness: this process's, or every process's (all_pids)."""
    r = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    mine = f"{PREFIX}{os.getpid()}-"
    return [n for n in names if re.match(rf"^{PREFIX}\d+-", n) and (all_pids or n.startswith(mine))]


def sweep_stale() -> list[str]:
    """Delete namespaces whose creating process is gone (a SIGKILLed run); their names."""
    gone = []
    for name in list_ours(all_pids=True):
        pid = int(re.match(rf"^{PREFIX}(\d+)-", name).group(1))
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            _kill_netns_processes(name)
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


class Network:
    """Namespaces `names` on one /24 (default 10.231.0.0/24), bridged. Build with the
    context manager (or build()/close()); close() is idempotent and always completes."""

    def __init__(self, names: list[str], subnet: str = "10.231.0.0/24") -> None:
        net = ipaddress.ip_network(subnet)
        if not net.is_private or net.version != 4 or net.prefixlen > 29:
            raise ValueError(f"subnet must be a private IPv4 network of /29 or wider: {subnet}")
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"node names must be distinct and non-empty: {names}")
        for n in names:
            if not _NAME_RE.match(n) or n == "sw":
                raise ValueError(f"node name {n!r}: [a-z][a-z0-9]{{0,9}}, not 'sw'")
        hosts = list(net.hosts())
        if len(names) + 1 > len(hosts):
            raise ValueError(f"{subnet} has room for {len(hosts) - 1} nodes")
        self.subnet = net
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.nodes = {
            n: Node(n, f"{self.prefix}-{n}", str(hosts[i + 1]), f"p-{n}")
            for i, n in enumerate(names)
        }
        self._built: list[str] = []  # namespaces made so far, deleted in reverse
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------

    def build(self) -> Network:
        reason = unavailable_reason()
        if reason:
            raise HarnessUnavailable(reason)
        atexit.register(self.close)
        try:
            self._add_netns(self.switch)
            self.sw("ip", "link", "add", "br0", "type", "bridge")
            self.sw("ip", "link", "set", "br0", "up")
            for node in self.nodes.values():
                self._add_netns(node.netns)
                # both ends born inside their namespaces: nothing appears in the root one
                _ip("link", "add", "name", "eth0", "netns", node.netns, "type", "veth",
                    "peer", "name", node.port_name, "netns", self.switch)
                self.sw("ip", "link", "set", node.port_name, "master", "br0", "up")
                self.exec(node.name, "ip", "link", "set", "lo", "up")
                self.exec(node.name, "ip", "addr", "add",
                          f"{node.address}/{self.subnet.prefixlen}", "dev", "eth0")
                self.exec(node.name, "ip", "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._built.append(name)

    def close(self) -> list[str]:
        """Kill every process in every namespace, delete the namespaces; the names
        deleted. Runs every step even when one fails; raises at the end if any did."""
        if self._closed:
            return []
        self._closed = True
        errors, deleted = [], []
        for name in reversed(self._built):
            try:
                _kill_netns_processes(name)
            except Exception as e:  # noqa: BLE001  NOTE: go on with the deletion
                errors.append(f"{name}: {e}")
            r = _ip("netns", "del", name, check=False)
            if r.returncode == 0:
                deleted.append(name)
            else:
                errors.append(f"ip netns del {name}: {r.stderr.strip()}")
        self._built.clear()
        atexit.unregister(self.close)
        if errors:
            raise RuntimeError("teardown: " + "; ".join(errors))
        return deleted

    def __enter__(self) -> Network:
        return self.build()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running things on a node ---------------------------------------------------------

    def argv(self, node: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[node].netns, *argv]

    def exec(self, node: str, *argv: str, timeout_s: float = 60) -> str:
        r = subprocess.run(self.argv(node, list(argv)), capture_output=True, text=True,
                           timeout=timeout_s)
        if r.returncode != 0:
            raise RuntimeError(f"[{node}] {' '.join(argv)}: {r.stderr.strip() or r.stdout}")
        return r.stdout

    def sw(self, *argv: str) -> str:
        r = subprocess.run(["ip", "netns", "exec", self.switch, *argv], capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"[switch] {' '.join(argv)}: {r.stderr.strip()}")
        return r.stdout

    def popen(self, node: str, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.argv(node, argv), **kwargs)

    def call_in(self, node: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args) on a fresh thread moved into the node's network namespace (setns
        applies to the calling thread only): its sockets belong to that node."""
        box: dict[str, object] = {}

        def run() -> None:
            try:
                fd = os.open(f"/run/netns/{self.nodes[node].netns}", os.O_RDONLY)
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns")
                finally:
                    os.close(fd)
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001  NOTE: re-raised on the caller
                box["error"] = e

        t = threading.Thread(target=run, name=f"netns-{node}", daemon=True)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    # -- failure --------------------------------------------------------------------------

    def isolate(self, node: str) -> None:
        """Cut the node's link (its switch port down): packets to and from it are lost."""
        self.sw("ip", "link", "set", self.nodes[node].port_name, "down")

    def reconnect(self, node: str) -> None:
        self.sw("ip", "link", "set", self.nodes[node].port_name, "up")

    def kill_all(self, node: str) -> int:
        """SIGKILL every process running in the node's namespace; how many."""
        return _kill_netns_processes(self.nodes[node].netns)

    def pids(self, node: str) -> list[int]:
        return _netns_pids(self.nodes[node].netns)
