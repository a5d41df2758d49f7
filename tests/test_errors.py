"""tandem.errors.abort: the one way a servicer ends a call with a code and, when there are
any, the input it names (FIELD_METADATA) and the instance it blames (CULPRIT_METADATA).

Over a real grpc.aio server: the code and message arrive as given, with or without
trailing metadata (grpc refuses None there and ends the call UNKNOWN instead, which once
turned every transfer failure without a culprit into UNKNOWN, a code the router retries).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.errors import CULPRIT_METADATA, FIELD_METADATA, abort

pytestmark = pytest.mark.timeout(60)

CASES = {
    "bare": (grpc.StatusCode.DEADLINE_EXCEEDED, {}),
    "field": (grpc.StatusCode.INVALID_ARGUMENT, {"field": "messages[0].content[1].image"}),
    "culprit": (grpc.StatusCode.UNAVAILABLE, {"culprit": "10.0.0.7:50061"}),
    "both": (grpc.StatusCode.DATA_LOSS, {"field": "x", "culprit": "10.0.0.8:50061"}),
}


async def _call(case: str) -> grpc.aio.AioRpcError:
    code, names = CASES[case]

    async def fail(request, context):
        await abort(context, code, f"{case} failed", **names)

    handler = grpc.method_handlers_generic_handler(
        "t.T", {"Fail": grpc.unary_unary_rpc_method_handler(fail)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                await ch.unary_unary("/t.T/Fail")(b"", timeout=30)
            except grpc.aio.AioRpcError as e:
                return e
            raise AssertionError("the call did not fail")
    finally:
        await server.stop(None)


@pytest.mark.parametrize("case", list(CASES))
def test_abort_keeps_the_code_and_names_only_what_is_given(case):
    code, names = CASES[case]
    err = asyncio.run(_call(case))
    assert (err.code(), err.details()) == (code, f"{case} failed")
    meta = dict(err.trailing_metadata() or ())
    assert meta.get(FIELD_METADATA) == names.get("field")
    assert meta.get(CULPRIT_METADATA) == names.get("culprit")
