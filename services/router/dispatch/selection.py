"""Instance selection on plain data: least outstanding work, affinity, round-robin.

The policy never talks to the network. It sees `Candidate`s (address + a load figure that
already merges the instance's last GetLoad report with the router's own outstanding
requests) and answers one question: which instance gets this request.

Affinity is consistent hashing with bounded loads over a request's affinity keys — its
image hashes for encoders (whose embedding caches hold images), its conversation key for
language instances (whose prefix caches hold conversations): every key ranks the instances
by rendezvous (highest-random-weight) score, so adding or removing an instance only moves
the keys that hashed to it. The request goes to the instance most of its keys prefer,
unless that instance's load exceeds `bound = ceil(mean_load * (1 + slack)) + 1`; then the
next instance in the first key's ranking within the bound, else plain least-load.

A prompt with several images or videos may also name helper encoders beside the one it
goes to (`pick_helpers`, `split_encoders`): the least loaded other encoders of its model.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """An eligible instance (healthy, and taking work: `Instance.takes_work`) and its
    current load."""

    address: str
    load: float


class PickReason(enum.Enum):
    """Why the selector chose an instance (the router's trace names it on each choice)."""

    ROUND_ROBIN = "round_robin"  # the round_robin policy's turn
    LEAST_LOAD = "least_load"  # no affinity keys: the least loaded instance
    AFFINITY = "affinity"  # the instance most of the request's keys prefer
    AFFINITY_NEXT = "affinity_next"  # preferred ones over the bound: next in the first key's ranking
    OVERLOADED = "least_load_overloaded"  # every affinity target over the bound: least load


@dataclass(frozen=True)
class Choice:
    address: str
    reason: PickReason


class NoInstanceError(Exception):
    """No healthy instance of the wanted kind."""


def _hrw(key: str, address: str) -> int:
    digest = hashlib.blake2b(f"{key}|{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, addresses: Sequence[str]) -> list[str]:
    """Addresses ranked for `key`, best first (stable under membership changes)."""
    return sorted(addresses, key=lambda a: _hrw(key, a), reverse=True)


def load_bound(candidates: Sequence[Candidate], slack: float) -> float:
    """Highest load an affinity target may carry (bounded-load consistent hashing)."""
    mean = sum(c.load for c in candidates) / len(candidates)
    return math.ceil(mean * (1.0 + slack)) + 1


class Selector:
    """Picks one instance per request. `policy`: "least_load" or "round_robin"."""

    def __init__(self, policy: str = "least_load", affinity_slack: float = 0.25) -> None:
        if policy not in ("least_load", "round_robin"):
            raise ValueError(f"unknown policy {policy!r}")
        self.policy = policy
        self.affinity_slack = affinity_slack
        self._rr = itertools.count()

    def pick(
        self,
        candidates: Sequence[Candidate],
        keys: Sequence[str] = (),
        exclude: frozenset[str] | set[str] = frozenset(),
    ) -> str:
        """Address of the chosen instance for affinity `keys`; `exclude` lists addresses
        already tried."""
        return self.choose(candidates, keys, exclude).address

    def choose(
        self,
        candidates: Sequence[Candidate],
        keys: Sequence[str] = (),
        exclude: frozenset[str] | set[str] = frozenset(),
    ) -> Choice:
        """`pick`, with the reason for the choice."""
        pool = [c for c in candidates if c.address not in exclude]
        if not pool:
            raise NoInstanceError("no healthy instance available")
        pool.sort(key=lambda c: c.address)  # deterministic tie-breaks
        if self.policy == "round_robin":
            return Choice(pool[next(self._rr) % len(pool)].address, PickReason.ROUND_ROBIN)
        if keys:
            target = self._affinity(pool, keys)
            if target is not None:
                return target
            return Choice(self._least_load(pool), PickReason.OVERLOADED)
        return Choice(self._least_load(pool), PickReason.LEAST_LOAD)

    def _least_load(self, pool: Sequence[Candidate]) -> str:
        low = min(c.load for c in pool)
        tied = [c for c in pool if c.load == low]
        # NOTE: rotate among equally loaded instances so a burst that arrives before the
        # next load report does not all land on the first address.
        return tied[next(self._rr) % len(tied)].address

    def _affinity(self, pool: Sequence[Candidate], keys: Sequence[str]) -> Choice | None:
        loads = {c.address: c.load for c in pool}
        bound = load_bound(pool, self.affinity_slack)
        addresses = list(loads)
        votes = Counter(rendezvous_order(h, addresses)[0] for h in keys)
        # Most-preferred first; ties broken by the first key's ranking.
        first_rank = {a: i for i, a in enumerate(rendezvous_order(keys[0], addresses))}
        for addr in sorted(votes, key=lambda a: (-votes[a], first_rank[a])):
            if loads[addr] <= bound:
                return Choice(addr, PickReason.AFFINITY)
        for addr in rendezvous_order(keys[0], addresses):
            if loads[addr] <= bound:
                return Choice(addr, PickReason.AFFINITY_NEXT)
        return None


@dataclass(frozen=True)
class EncoderState:
    """What the helper rule knows of one encoder: the registry's view, as plain data."""

    address: str
    model: str  # the model its last load report named ("" before its first report)
    healthy: bool  # not ejected, and answered a load poll or a request since it was seen
    takes_work: bool  # neither draining nor, its ViT stalled, refusing new work
    load: float  # requests: this router's outstanding ones + other routers' (GetLoad)
    pending_patches: int  # vision patches waiting for or in its ViT (its last GetLoad)


def splittable(media: int, split_encoders: int, videos: int = 0) -> bool:
    """Whether a prompt with `media` images and videos (`videos` of them videos) may be
    split across encoders: two media, or one video (its temporal groups split)."""
    return split_encoders > 1 and (media >= 2 or videos >= 1)


def pick_helpers(
    encoders: Sequence[EncoderState],
    lead: str,
    media: int,
    split_encoders: int,
    exclude: frozenset[str] | set[str] = frozenset(),
    videos: int = 0,
    max_load: float = math.inf,
) -> list[str]:
    """The helper encoders of a prompt whose Encode goes to `lead`, best first.

    The rule (issue 27, a prompt split across encoders): a prompt with `media` >= 2 images
    or videos gets up to min(split_encoders, media) - 1 helpers (each writer encodes at
    least one of them, so more would idle); one with a video (`videos` >= 1: its temporal
    groups are units of their own, as many as the lead may split) up to split_encoders -
    1; chosen among the encoders that are healthy, take work (not draining, no stalled
    ViT), serve the lead's model, carry at most `max_load` requests in flight (a busy
    encoder's ViT is better spent on its own requests: under load a split only moves work
    around, and a helper renders the whole chat again), and are neither
    the lead nor in `exclude` (encoders that failed this request); least loaded first: by requests in flight (which include
    this router's own, counted at once), then patches waiting for or in its ViT, then address. None when
    split_encoders is 1, when the prompt has fewer than 2 media and no video, or when the
    lead is not a
    known encoder. They are candidates only: the lead decides which ranges, if any, each
    one encodes."""
    by_address = {e.address: e for e in encoders}
    if not splittable(media, split_encoders, videos) or lead not in by_address:
        return []
    limit = split_encoders - 1 if videos else min(split_encoders, media) - 1
    model = by_address[lead].model
    pool = [e for e in encoders
            if e.healthy and e.takes_work and e.model == model and e.load <= max_load
            and e.address != lead and e.address not in exclude]
    pool.sort(key=lambda e: (e.load, e.pending_patches, e.address))
    return [e.address for e in pool[:limit]]
