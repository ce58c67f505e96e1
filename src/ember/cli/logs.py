"""The process's log lines: the human format, or one JSON object per line (--log-format json) for log pipelines."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime

import orjson

__all__ = ["ACCESS_FIELDS", "JsonFormatter", "setup_logging"]

ACCESS_FIELDS = (
    "request_id",
    "model",
    "method",
    "route",
    "status",
    "tokens",
    "total_ms",
    "tokenize_ms",
    "queue_ms",
    "inference_ms",
    "client",
)
"""What an access line (logger ember.access) carries beside its message, as fields of its own in JSON. Never the
inputs' text."""


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "message"}, an access line's ACCESS_FIELDS, and "exception" when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ACCESS_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


def setup_logging(level: str, fmt: str = "text") -> None:
    """Log to stderr at `level`: the human format, or JSON lines (`fmt` "json"), for ember's loggers and, with
    uvicorn's left unconfigured (serve passes log_config=None), for uvicorn's as well."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
