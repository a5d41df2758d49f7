"""Every service's log lines: a level on each, text or JSON (`--log-format`).

    configure_logging("json")   # once, at process start (serving.run_service does it)

text:  2026-11-25 01:02:03,456 INFO tandem.router.dispatcher req-1: ok (stop) in 87 ms
json:  {"ts": "2026-11-25T01:02:03.456Z", "level": "INFO", "logger": "...", "msg": "...",
        "exc": "..." (when there is one)}

Library loggers (grpc, uvicorn, Mooncake's Python side) go through the same root handler,
so their lines carry a level and the same format too.
"""

from __future__ import annotations

import json
import logging
import sys
import time

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out = {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname,
               "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
