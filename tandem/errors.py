"""The one base error of Tandem's services: a message and a gRPC status code name.

Every tier raises a subclass (`RouterError`, `ChatError`, `AdmissionError`,
`TransferError`); servicers map `code` straight onto a gRPC status or an `ErrorInfo`, and
callers decide on `code` and on typed fields (a tier, a room), never on message text.
"""

from __future__ import annotations

import grpc

# The trailing metadata key under which a failed gRPC call names the offending input (the
# router sets it, the SDK reads it into TandemError.field): "sampling.temperature", ...
FIELD_METADATA = "tandem-error-field"
# The trailing metadata key under which a failed gRPC call names another instance whose
# failure caused its own (an encoder leading a split prompt names the helper that stalled;
# a decode instance names the prefill instance of its request): the router's retry of the
# request avoids that instance and health-checks it.
CULPRIT_METADATA = "tandem-error-culprit"


async def abort(context, code: grpc.StatusCode, message: str, *, field: str = "",
                culprit: str = "") -> None:
    """End a gRPC call with `code`, naming the offending input (`field`: FIELD_METADATA)
    and the instance to blame (`culprit`: CULPRIT_METADATA) when there are any.

    NOTE: the one place servicers attach these: grpc refuses None as trailing metadata
    (the call then ends UNKNOWN, its code lost), so an absent value is left out."""
    meta = tuple((k, v) for k, v in ((FIELD_METADATA, field), (CULPRIT_METADATA, culprit)) if v)
    await context.abort(code, message, meta)


def blame(context, culprit: str) -> None:
    """Name `culprit` (CULPRIT_METADATA) in the trailing metadata of a streamed call whose
    failure goes out in-stream (an `ErrorInfo` as its last message, the call itself OK): a
    decode instance blaming the prefill instance of its request. The same key `abort`
    sets, read the same way (the router's `from_rpc`, `culprit_of`)."""
    if culprit:
        context.set_trailing_metadata(((CULPRIT_METADATA, culprit),))


class ServiceError(Exception):
    """`code` is a gRPC status code name ("INVALID_ARGUMENT", "UNAVAILABLE", ...)."""

    code: str = "INTERNAL"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return getattr(grpc.StatusCode, self.code, grpc.StatusCode.INTERNAL)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"
