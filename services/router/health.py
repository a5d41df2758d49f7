"""What the router can serve now, from its view of the tiers (front-end independent; the
HTTP door answers it on /health and /ready, the gRPC door on grpc.health.v1).

Two questions, two answers:

    serves_some  not draining, and at least one language instance healthy (E/P/D: one
                 decode and one prefill instance): every kind of
                 request needs a language instance, and with one the router serves text
                 chats (encoder_bypass), raw-prompt completions and /tokenize even while
                 every encoder is down. HTTP /health (200 / 503): what a load balancer or
                 kubelet should ask before sending this router traffic.
    serves_all   not draining, and at least one instance of every tier healthy: image and
                 video chats too. HTTP /ready and the gRPC service "tandem.v1.Router" (what
                 `tandem up` waits for before it prints ready), for a balancer that wants
                 every tier behind the router it picks.

Each tier's state goes in the answer's body either way, so an operator reading /health
sees which tier is missing (`TierHealth.state`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TierState(enum.Enum):
    SERVING = "serving"  # at least one healthy instance
    DOWN = "down"  # instances known, none healthy (ejected, draining or not yet polled)
    ABSENT = "absent"  # no instance known (none configured, or DNS resolves to none)


class Status(enum.Enum):
    OK = "ok"  # every tier serving
    DEGRADED = "degraded"  # some requests served (a language instance), not all
    UNAVAILABLE = "unavailable"  # nothing served (no language instance, or draining)


@dataclass(frozen=True)
class TierHealth:
    healthy: int  # instances that take requests now
    instances: int  # instances known (static list and DNS)

    @property
    def state(self) -> TierState:
        if self.healthy:
            return TierState.SERVING
        return TierState.DOWN if self.instances else TierState.ABSENT


@dataclass(frozen=True)
class Health:
    encoder: TierHealth
    language: TierHealth  # E/P/D: the decode instances
    draining: bool
    prefill: TierHealth | None = None  # E/P/D: the prefill instances (None: not split)

    @property
    def serves_some(self) -> bool:
        return (not self.draining and self.language.healthy > 0
                and (self.prefill is None or self.prefill.healthy > 0))

    @property
    def serves_all(self) -> bool:
        return self.serves_some and self.encoder.healthy > 0

    @property
    def status(self) -> Status:
        if self.serves_all:
            return Status.OK
        return Status.DEGRADED if self.serves_some else Status.UNAVAILABLE
