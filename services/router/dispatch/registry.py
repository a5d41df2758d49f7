"""The router's view of the tiers: instances from config and DNS, load polling, health.

One `Pool` per tier. Membership comes from the static list plus, when configured, a DNS
name re-resolved every `dns_refresh_s` (a Kubernetes headless Service resolves to every
ready pod). Every `load_refresh_s` each live instance is asked `GetLoad`; a failed poll or
a failed request counts against it (`HealthTracker`), and ejected instances are probed
with grpc.health.v1 until they answer SERVING.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.internal_tls import InternalTLS, aio_channel, load_internal_tls
from tandem.services.router.config import RouterConfig
from tandem.services.router.dispatch.health import HealthTracker, InstanceState
from tandem.services.router.dispatch.selection import Candidate, EncoderState
from tandem.v1 import encoder_pb2, encoder_pb2_grpc, language_pb2, language_pb2_grpc

log = logging.getLogger("tandem.router")

# Requests carry inline images; the gRPC default of 4 MiB is too small for them.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass
class Instance:
    """One encoder or language instance. `outstanding` counts this router's requests on it;
    `external` is the part of its last load report that other routers put there."""

    kind: str
    address: str
    channel: grpc.aio.Channel
    stub: object
    health_stub: health_pb2_grpc.HealthStub
    tracker: HealthTracker
    outstanding: int = 0
    external: int = 0
    # Set when the instance is ejected (a fresh one when it is back in service): requests
    # waiting on it stop waiting and move elsewhere at once (a frozen process only ever
    # answers with silence, so nothing else would end their wait before the timeouts).
    ejected: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    kv_used: float = 0.0
    draining: bool = False
    vit_stalled: bool = False  # an encoder whose ViT call stalled (GetLoad)
    model: str = ""
    pending_patches: int = 0  # an encoder's vision patches waiting for or in its ViT (GetLoad)
    running: int = 0  # a language instance's running batch (GetLoad)
    waiting: int = 0  # a language instance's queue, prompts in transfer included (GetLoad)

    @property
    def load(self) -> float:
        return self.outstanding + self.external + self.kv_used

    @property
    def takes_work(self) -> bool:
        """Whether its last load report says it takes new work (it refuses it while
        draining, and an encoder while its ViT is stalled)."""
        return not (self.draining or self.vit_stalled)


def _reported_work(kind: str, r) -> tuple[int, float]:
    """(requests in flight, KV pages used fraction) from a GetLoad answer."""
    if kind == "encoder":
        return r.queued_requests, 0.0
    used = 1.0 - r.free_kv_pages / r.total_kv_pages if r.total_kv_pages else 0.0
    return r.transferring + r.waiting + r.running, used


class Pool:
    """All instances of one tier."""

    def __init__(self, kind: str, eject_after: int, rpc_timeout_s: float = 2.0,
                 tls: InternalTLS | None = None) -> None:
        assert kind in ("encoder", "language", "prefill")  # prefill: language --role prefill
        self.kind, self.tls = kind, tls  # mTLS to the tiers with the router's certificate
        self.eject_after = eject_after
        self.rpc_timeout_s = rpc_timeout_s
        self.instances: dict[str, Instance] = {}

    def _connect(self, address: str) -> Instance:
        channel = aio_channel(address, self.tls, CHANNEL_OPTIONS)
        stub_cls = (
            encoder_pb2_grpc.EncoderStub if self.kind == "encoder" else language_pb2_grpc.LanguageStub
        )
        return Instance(
            kind=self.kind,
            address=address,
            channel=channel,
            stub=stub_cls(channel),
            health_stub=health_pb2_grpc.HealthStub(channel),
            tracker=HealthTracker(self.eject_after),
        )

    async def set_addresses(self, addresses: list[str]) -> None:
        """Add new addresses, drop vanished ones (their in-flight calls keep their channel
        until they end: we close it only once nothing is outstanding)."""
        wanted = list(dict.fromkeys(addresses))
        for addr in wanted:
            if addr not in self.instances:
                self.instances[addr] = self._connect(addr)
                log.info("%s %s added", self.kind, addr)
        for addr in [a for a in self.instances if a not in wanted]:
            inst = self.instances.pop(addr)
            log.info("%s %s removed", self.kind, addr)
            if inst.outstanding == 0:
                await inst.channel.close()

    def candidates(self) -> list[Candidate]:
        return [
            Candidate(i.address, i.load)
            for i in self.instances.values()
            if i.tracker.healthy and i.takes_work
        ]

    def states(self) -> list[EncoderState]:
        """Every instance as plain data, eligible or not (the helper rule filters)."""
        return [
            EncoderState(i.address, i.model, i.tracker.healthy, i.takes_work, i.load,
                         i.pending_patches)
            for i in self.instances.values()
        ]

    def healthy_count(self) -> int:
        return len(self.candidates())

    def record_failure(self, address: str) -> None:
        inst = self.instances.get(address)
        if inst is not None and inst.tracker.record_failure():
            log.warning("%s %s ejected after %d failures", self.kind, address, self.eject_after)
            inst.ejected.set()

    def record_success(self, address: str) -> None:
        inst = self.instances.get(address)
        if inst is not None:
            inst.tracker.record_success()

    async def verify(self, address: str) -> None:
        """A request on `address` failed: count it against the instance only if the
        instance itself does not answer a health check (a peer-caused failure, e.g. the
        other tier closing a room, must not eject a healthy instance)."""
        inst = self.instances.get(address)
        if inst is None:
            return
        try:
            r = await inst.health_stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=min(1.0, self.rpc_timeout_s)
            )
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        self.record_failure(address)

    async def _poll_one(self, inst: Instance) -> None:
        if inst.tracker.state is InstanceState.EJECTED:
            try:
                r = await inst.health_stub.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=self.rpc_timeout_s
                )
                serving = r.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                serving = False
            inst.tracker.record_probe(serving)
            if serving:
                inst.ejected = asyncio.Event()
                log.info("%s %s back in service", self.kind, inst.address)
            return
        request = (
            encoder_pb2.EncoderGetLoadRequest()
            if self.kind == "encoder"
            else language_pb2.LanguageGetLoadRequest()
        )
        try:
            local_at_ask = inst.outstanding
            r = await inst.stub.GetLoad(request, timeout=self.rpc_timeout_s)
        except grpc.RpcError:
            self.record_failure(inst.address)
            return
        work, kv_used = _reported_work(self.kind, r)
        inst.external = max(0, work - local_at_ask)
        inst.kv_used = kv_used
        inst.draining = r.draining
        inst.model = r.model
        if self.kind == "encoder":
            inst.pending_patches = r.queued_patches + r.vit_patches
            inst.vit_stalled = r.vit_stalled
        else:
            inst.running, inst.waiting = r.running, r.waiting + r.transferring
        inst.tracker.record_success()

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll_one(i) for i in list(self.instances.values())))

    async def close(self) -> None:
        for inst in self.instances.values():
            await inst.channel.close()
        self.instances.clear()


async def resolve(dns: str) -> list[str]:
    """`name:port` -> every `ip:port` it resolves to (empty on failure)."""
    host, _, port = dns.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"DNS target must be name:port, got {dns!r}")
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        log.warning("resolving %s failed: %s", dns, e)
        return []
    out = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        out.append(f"[{ip}]:{sockaddr[1]}" if family == socket.AF_INET6 else f"{ip}:{sockaddr[1]}")
    return sorted(set(out))


class Registry:
    """Both pools plus the background loops that keep them current."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        tls = load_internal_tls(cfg, "tandem router", "router")
        self.encoders = Pool("encoder", cfg.eject_after_failures, tls=tls)
        self.languages = Pool("language", cfg.eject_after_failures, tls=tls)
        # E/P/D: the prefill instances (then `languages` are the decode instances)
        self.prefills = Pool("prefill", cfg.eject_after_failures, tls=tls)
        self._tasks: list[asyncio.Task] = []
        self.first_poll = asyncio.Event()

    def pool(self, kind: str) -> Pool:
        return {"encoder": self.encoders, "language": self.languages,
                "prefill": self.prefills}[kind]

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode run on separate instances (E/P/D)."""
        return bool(self.cfg.prefills or self.cfg.prefill_dns)

    def model_name(self) -> str:
        if self.cfg.model:
            return self.cfg.model
        for inst in list(self.languages.instances.values()) + list(
            self.encoders.instances.values()
        ):
            if inst.model:
                return inst.model
        return ""

    async def refresh_membership(self) -> None:
        for pool, static, dns in (
            (self.encoders, self.cfg.encoders, self.cfg.encoder_dns),
            (self.languages, self.cfg.languages, self.cfg.language_dns),
            (self.prefills, self.cfg.prefills, self.cfg.prefill_dns),
        ):
            found = await resolve(dns) if dns else []
            if dns and not found:
                # NOTE: a transient DNS failure must not empty the pool.
                found = [a for a in pool.instances if a not in static]
            await pool.set_addresses(list(static) + found)

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.dns_refresh_s)
            await self.refresh_membership()

    async def _load_loop(self) -> None:
        while True:
            await asyncio.gather(self.encoders.poll(), self.languages.poll(),
                                 self.prefills.poll())
            self.first_poll.set()
            await asyncio.sleep(self.cfg.load_refresh_s)

    async def start(self) -> None:
        await self.refresh_membership()
        self._tasks.append(asyncio.create_task(self._load_loop()))
        if self.cfg.encoder_dns or self.cfg.language_dns or self.cfg.prefill_dns:
            self._tasks.append(asyncio.create_task(self._dns_loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.encoders.close()
        await self.languages.close()
        await self.prefills.close()
