"""Slowing down a client whose requests keep being refused (issue 16's text flood).

A request refused as the client's fault (a 4xx other than 429 and 499: bad input, a prompt
over the token limit, a missing key, a body sent too slowly) still costs the cluster the work
of reading, parsing and checking it: ~40 ms of CPU across router and encoder for a 2 MB text
over the token limit. A client that sends such requests back to back takes that CPU from
everyone else; a cap on its requests in flight does not help (one at a time is still a
closed loop), only time does.

So each client (`admission.client_id`: its address) has a budget of refused bytes, a token
bucket: `burst` bytes, refilled at `rate` bytes a second. Each refusal costs
max(bytes read, FLOOR_BYTES). While a client's budget is below zero, its requests wait —
before their bodies are read, so a waiting flood costs a socket and nothing else — one at a
time until the debt is repaid. The debt is capped at `max_hold_s` of refill, so a request
waits at most that long for the debt itself; one still queued behind its client's other
held requests after `max_hold_s` is answered 429 with Retry-After. Requests that are served
cost nothing: a heavy but well-formed client is never slowed.

    enter(client) ──▶ budget >= 0 and nobody of this client waiting ──▶ Ticket (no gate)
                 └──▶ in debt ──▶ wait for the client's gate, then for the debt ──▶ Ticket
                                  └──▶ past max_hold_s ──▶ HeldTooLong (429, Retry-After)
    (the debt is capped at max_hold_s of refill: alone, a request always passes in time;
     queued behind the client's other held requests, it may not)
    Ticket.answered(status, bytes) ──▶ refused? charge ──▶ gate released (also by close())
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

FLOOR_BYTES = 4096  # a refusal costs at least this: small bad requests add up too
HOLD_SLACK_S = 1.0  # beyond max_hold_s: a lone request's capped debt always passes in time
MAX_CLIENTS = 100_000  # accounts kept (LRU); one evicted forgets its debt


def refused(status: int) -> bool:
    """Statuses that are the client's fault. 429 is the router's own load (or this hold);
    499 a client that left."""
    return 400 <= status < 500 and status not in (429, 499)


class HeldTooLong(Exception):
    """The client's debt would hold this request past `max_hold_s`."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"too many refused requests from this client: retry in "
                         f"{retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass
class _Account:
    level: float  # bytes of budget left; negative = debt
    at: float  # when `level` was last refilled
    gate: asyncio.Lock = field(default_factory=asyncio.Lock)  # one waiter at a time in debt


class Ticket:
    """One request's pass: say how it was answered (`answered`), and `close()` at the end
    (idempotent; releases the client's gate if this request held it)."""

    def __init__(self, budget: RefusalBudget, account: _Account, gated: bool) -> None:
        self._budget, self._account, self._gated = budget, account, gated

    def answered(self, status: int, nbytes: int) -> None:
        if refused(status):
            self._budget.charge(self._account, nbytes)
        self.close()

    def close(self) -> None:
        if self._gated:
            self._gated = False
            self._account.gate.release()


class RefusalBudget:
    """Per-client refused-bytes budgets (see the module). `rate` 0 turns it off."""

    def __init__(self, rate: float, burst: float, max_hold_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_hold: Callable[[str], None] | None = None) -> None:
        self.rate, self.burst, self.max_hold_s = rate, burst, max_hold_s
        self.clock = clock
        self.on_hold = on_hold or (lambda outcome: None)  # "passed" | "refused"
        self._accounts: OrderedDict[str, _Account] = OrderedDict()

    def _account(self, client: str) -> _Account:
        now = self.clock()
        acct = self._accounts.get(client)
        if acct is None:
            acct = self._accounts[client] = _Account(self.burst, now)
            if len(self._accounts) > MAX_CLIENTS:
                self._evict()
        else:
            self._accounts.move_to_end(client)
            acct.level = min(self.burst, acct.level + (now - acct.at) * self.rate)
            acct.at = now
        return acct

    def _evict(self) -> None:
        """Drop the least recently seen account that nobody waits on."""
        for key, acct in self._accounts.items():
            if not acct.gate.locked():
                del self._accounts[key]
                return

    def level(self, client: str) -> float:
        """The client's budget now (bytes; negative = debt)."""
        return self._account(client).level

    def charge(self, account: _Account, nbytes: int) -> None:
        """A refusal's cost. The debt is capped at `max_hold_s` of refill: one huge refused
        request (a 64 MB upload cut at the limit) holds its client for `max_hold_s` at most,
        never shuts it out for minutes."""
        cost = max(nbytes, FLOOR_BYTES)
        account.level = max(account.level - cost, -self.rate * self.max_hold_s)

    async def enter(self, client: str) -> Ticket:
        """Wait while `client` is in debt (see the module); raises HeldTooLong."""
        acct = self._account(client)
        if self.rate <= 0 or (acct.level >= 0 and not acct.gate.locked()):
            return Ticket(self, acct, gated=False)
        try:
            async with asyncio.timeout(self.max_hold_s + HOLD_SLACK_S):
                await acct.gate.acquire()
                try:
                    while (acct := self._account(client)).level < 0:
                        await asyncio.sleep(-acct.level / self.rate)
                except BaseException:
                    acct.gate.release()
                    raise
        except TimeoutError:
            self.on_hold("refused")
            debt = max(0.0, -self._account(client).level)
            raise HeldTooLong(max(1, math.ceil(debt / self.rate))) from None
        self.on_hold("passed")
        return Ticket(self, acct, gated=True)
