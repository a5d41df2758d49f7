"""The wire's `FinishReason` and OpenAI's `finish_reason` strings: one map, both ways.

The language tier maps its request status onto the wire (`services/language/engine/request.py`
`FINISH_REASONS`); the router and the SDK read the wire through this map. ERROR carries
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
FROM_OPENAI = {name: reason for reason, name in TO_OPENAI.items()}
