"""Per-instance health bookkeeping on plain data: eject after N failures, probe back.

State machine of one instance, as the router sees it:

    UNKNOWN --(load report ok)--> HEALTHY --(N consecutive failures)--> EJECTED
       |                            ^                                     |
       +--(N consecutive failures)--+----(grpc.health.v1 SERVING)---------+

Only HEALTHY instances receive requests. A success anywhere resets the failure count.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class InstanceState(enum.Enum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    EJECTED = "ejected"


@dataclass
class HealthTracker:
    """Consecutive-failure counter with ejection; one per instance."""

    eject_after: int
    state: InstanceState = InstanceState.UNKNOWN
    consecutive_failures: int = 0
    ejections: int = 0

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if self.state is InstanceState.UNKNOWN:
            self.state = InstanceState.HEALTHY

    def record_failure(self) -> bool:
        """Count a failure; True when this failure ejected the instance."""
        self.consecutive_failures += 1
        if self.state is not InstanceState.EJECTED and (
            self.consecutive_failures >= self.eject_after
        ):
            self.state = InstanceState.EJECTED
            self.ejections += 1
            return True
        return False

    def record_probe(self, serving: bool) -> None:
        """Result of a grpc.health.v1 probe of an ejected instance."""
        if self.state is InstanceState.EJECTED and serving:
            self.state = InstanceState.HEALTHY
            self.consecutive_failures = 0

    @property
    def healthy(self) -> bool:
        return self.state is InstanceState.HEALTHY
