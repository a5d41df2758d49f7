"""The wire's `FinishReason` as OpenAI's `finish_reason` strings: one map, one way.

The language tier maps its request status onto the wire (`services/language/engine/request.py`
`FINISH_REASONS`); the router keeps the wire's value and turns it into OpenAI's string at
its HTTP edge only (`services/router/openai/`), the SDK when it reads the wire. ERROR carries
an `ErrorInfo` and is never a finish reason a caller sees.
"""

from __future__ import annotations

from tandem.v1 import common_pb2

TO_OPENAI = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
