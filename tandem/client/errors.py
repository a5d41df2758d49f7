"""Typed SDK errors, one class per kind of failure, mapped from gRPC status codes."""

from __future__ import annotations

import grpc

from tandem.errors import FIELD_METADATA


class TandemError(Exception):
    """Base class. `code` is the gRPC status code name; `field` names the offending input
    (e.g. "messages[0].content[1].image") when the server said which."""

    def __init__(self, code: str, message: str, field: str = "") -> None:
        super().__init__(f"{code}: {message}" + (f" ({field})" if field else ""))
        self.code = code
        self.message = message
        self.field = field


class InvalidRequestError(TandemError):
    """The request is malformed: bad image, empty chat, out-of-range parameter."""


class ResourceExhaustedError(TandemError):
    """An input is over a limit (image or prompt too large) or the router is at capacity."""


class AuthenticationError(TandemError):
    """Missing or wrong API key."""


class NotFoundError(TandemError):
    """Unknown model."""


class UnavailableError(TandemError):
    """No healthy instance, or the server went away; retried with backoff by the client."""


class DeadlineExceededError(TandemError):
    """The request's deadline passed."""


class RequestCancelledError(TandemError):
    """The call was cancelled."""


class InternalError(TandemError):
    """A server-side failure."""


_BY_CODE: dict[str, type[TandemError]] = {
    "INVALID_ARGUMENT": InvalidRequestError,
    "OUT_OF_RANGE": InvalidRequestError,
    "FAILED_PRECONDITION": InvalidRequestError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "UNAUTHENTICATED": AuthenticationError,
    "PERMISSION_DENIED": AuthenticationError,
    "NOT_FOUND": NotFoundError,
    "UNAVAILABLE": UnavailableError,
    "ABORTED": UnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "CANCELLED": RequestCancelledError,
}


def error_from_code(code: str, message: str, field: str = "") -> TandemError:
    return _BY_CODE.get(code, InternalError)(code, message, field)


def error_from_rpc(err: grpc.RpcError) -> TandemError:
    code = err.code() if hasattr(err, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = err.details() if hasattr(err, "details") else str(err)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    field = dict(trailing or ()).get(FIELD_METADATA, "")
    return error_from_code(name, details or name, field)
