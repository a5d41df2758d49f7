"""One error type for the router, mapped to gRPC status codes and HTTP statuses (OpenAI's
error body is made at the HTTP edge: openai/errors.py).

`RouterError.code` is a gRPC status code name (as in `ErrorInfo.code`); `http_status` and
`grpc_code` derive from it; `tier` says which tier failed (the retry rules read it, never
the message text). A tier's RESOURCE_EXHAUSTED is a request over a limit, permanent: TOO_LARGE
(413, never retried) — gRPC's own message-size limit (the call's status), the encoder's input
limits, a prompt larger than a language instance's KV pool. Only the router's own admission
control says "try again later": OVERLOADED (429; RESOURCE_EXHAUSTED on gRPC).
"""

from __future__ import annotations

import enum
import time

import grpc

from tandem.errors import CULPRIT_METADATA, FIELD_METADATA, ServiceError

# code (gRPC name, or the router's own REQUEST_TIMEOUT / TOO_LARGE / OVERLOADED) -> HTTP
# status; unlisted: 500
_STATUS = {
    "INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404,
    "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "REQUEST_TIMEOUT": 408, "TOO_LARGE": 413,
    "OVERLOADED": 429,
    "RESOURCE_EXHAUSTED": 413, "CANCELLED": 499, "UNAVAILABLE": 503, "ABORTED": 503,
    "DEADLINE_EXCEEDED": 504,
}
# Router-internal codes that are not gRPC names, and what gRPC callers see instead.
_GRPC_ALIAS = {"TOO_LARGE": "RESOURCE_EXHAUSTED", "OVERLOADED": "RESOURCE_EXHAUSTED",
               "REQUEST_TIMEOUT": "DEADLINE_EXCEEDED"}


class Tier(enum.Enum):
    """Where an error arose: the router itself, or the tier whose call failed."""

    ROUTER = "router"
    ENCODER = "encoder"
    LANGUAGE = "language"


class RouterError(ServiceError):
    def __init__(
        self, code: str, message: str, param: str | None = None, tier: Tier = Tier.ROUTER,
        culprit: str = "",
    ) -> None:
        super().__init__(message, code)
        self.param = param
        self.tier = tier
        # another instance the failing tier blames (CULPRIT_METADATA: a split prompt's
        # silent helper encoder; a decode instance's prefill instance), "" when none: a
        # retry avoids it
        self.culprit = culprit

    @property
    def http_status(self) -> int:
        return _STATUS.get(self.code, 500)

    @property
    def grpc_code(self) -> grpc.StatusCode:
        name = _GRPC_ALIAS.get(self.code, self.code)
        return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)

    @property
    def grpc_name(self) -> str:
        return self.grpc_code.name


def _tier_code(name: str, tier: Tier) -> str:
    """RESOURCE_EXHAUSTED from any tier is a request over a limit, never overload (which
    only the router's admission reports, as OVERLOADED)."""
    return "TOO_LARGE" if name == "RESOURCE_EXHAUSTED" and tier is not Tier.ROUTER else name


def culprit_of(trailing) -> str:
    """The instance a call's trailing metadata blames (CULPRIT_METADATA), "" when none."""
    return dict(trailing or ()).get(CULPRIT_METADATA, "")


def from_rpc(err: grpc.RpcError, tier: Tier) -> RouterError:
    """Map a tier's gRPC failure; the input it names (trailing metadata FIELD_METADATA, as
    the encoder sends for a refused chat) becomes the error's `param`, the instance it
    blames (CULPRIT_METADATA) its `culprit`."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    name = code.name if code is not None else "UNKNOWN"
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return RouterError(_tier_code(name, tier), f"{tier.value}: {details}",
                       dict(trailing or ()).get(FIELD_METADATA) or None, tier,
                       culprit_of(trailing))


def internal_call_error(err: grpc.RpcError, tier: Tier, address: str,
                        deadline: float) -> RouterError:
    """A tier's failure on an internal call with a timeout of its own (shorter than the
    request's): running out of that timeout means the instance is stuck, UNAVAILABLE (the
    request may be retried elsewhere), never the request's DEADLINE_EXCEEDED, unless the
    request's own deadline (unix seconds) has passed too."""
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.time() < deadline:
        return RouterError("UNAVAILABLE", f"{tier.value} {address} did not answer in time",
                           tier=tier)
    return from_rpc(err, tier)


def from_error_info(info, tier: Tier, culprit: str = "") -> RouterError:
    """Map an `ErrorInfo` carried inside a stream; `culprit`: the instance the call's
    trailing metadata blames (`culprit_of`: a decode instance names its prefill instance)."""
    name = _tier_code(info.code or "INTERNAL", tier)
    return RouterError(name, f"{tier.value}: {info.message}", info.field or None, tier,
                       culprit)


# Codes after which another encoder may succeed: the instance, not the input, failed.
RETRYABLE_ENCODER = {"UNAVAILABLE", "INTERNAL", "UNKNOWN", "ABORTED", "CANCELLED"}

# Codes after which the whole request may be retried, if the caller has seen no output.
# DATA_LOSS: a language instance found its prompt's rows tampered with or stale (the
# transfer's tags or fence): the input is fine, so the request goes to another instance.
RETRYABLE_REQUEST = {"UNAVAILABLE", "ABORTED", "INTERNAL", "UNKNOWN", "DATA_LOSS"}
