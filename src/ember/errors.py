"""The one exception tree of ember.

Foreign errors (tokenizers, safetensors, huggingface_hub, torch) are translated into these
where they enter. Each class carries the HTTP status it means (`status`), so the edge's mapping is total: a new
class is a 500 only if it says so.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "EmberError",
    "EngineDeadError",
    "InputError",
    "InputTooLongError",
    "OverloadedError",
    "RequestTooLargeError",
    "ShuttingDownError",
    "UnsupportedModelError",
]


class EmberError(Exception):
    """Base of every error ember raises on purpose."""

    status = 500


class ConfigError(EmberError):
    """A flag, env var or config value is invalid; the message names it."""


class CheckpointError(EmberError):
    """A model directory or hub repo cannot be read: names the file or the weight key."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or pooling mode is not one ember can run."""


class InputError(EmberError):
    """A request's input is invalid (HTTP 400). `param` names the offending field."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InputTooLongError(InputError):
    """An input exceeds the model's context and neither chunking nor truncation applies."""


class RequestTooLargeError(InputError):
    """One request holds more work than the server ever queues at once (HTTP 413): it could never be admitted."""

    status = 413


class OverloadedError(EmberError):
    """The queue is full (HTTP 429); `retry_after` is a hint in seconds."""

    status = 429

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(EmberError):
    """The server is draining and accepts no new work (HTTP 503)."""

    status = 503


class EngineDeadError(EmberError):
    """The model thread has failed and cannot embed any more (HTTP 503)."""

    status = 503
