"""Connections at the transport: a cap on how many are open, and a read timeout while a request is being sent.

uvicorn gives every accepted connection a file descriptor for as long as the client keeps it, and waits forever
for headers or a body that never finish: ~20,000 idle half-sent connections exhaust the descriptors, and then even
/health times out. `guarded_protocol` wraps uvicorn's HTTP protocol (httptools or h11) so that:

- at `max_connections`, a new connection evicts the connection that has waited longest for its request's bytes
  (half-sent headers, a stalled body, an idle keep-alive), so a probe or a real client still gets in while someone
  holds connections open; when every connection is computing a request, the new one is closed instead. Either way,
  one warning per 10 s with a count, never a traceback per connection;
- a request must arrive whole (headers and body) within `read_timeout` seconds of its first byte, or its
  connection is closed: the bound is on the whole request, so a client sending a byte every few seconds is cut off
  like one that sends nothing. A connection whose request is being computed is never timed out; an idle one
  between requests is uvicorn's keep-alive timeout's;
- a connection whose client stops taking its answer for `write_timeout` seconds (the transport's buffer stays
  full) is aborted, which frees the answer it held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

__all__ = ["guarded_protocol"]

log = logging.getLogger("ember.api")

_WARN_EVERY = 10.0


class _Refusals:
    """Connections refused since the last warning, for one warning per _WARN_EVERY seconds."""

    def __init__(self) -> None:
        self.count = 0
        self.last = -_WARN_EVERY

    def note(self, limit: int) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= _WARN_EVERY:
            log.warning(
                "closed %d connection(s) beyond --max-connections %d (the longest-waiting half-sent or idle ones "
                "first)",
                self.count,
                limit,
            )
            self.count, self.last = 0, now


def _make_room(new: Any, kind: type, refusals: _Refusals, limit: int) -> bool:
    """At the cap: close the connection that has waited longest for its request's bytes, or `new` itself when every
    other one is computing a request; False when `new` was closed."""
    refusals.note(limit)
    others: list[Any] = [c for c in new.connections if isinstance(c, kind) and c is not new]
    others = [c for c in others if c._waiting()]
    victim = min(others, key=lambda c: c._waiting_since, default=None)
    if victim is None:
        new.connections.discard(new)
        new.transport.abort()
        return False
    victim.connections.discard(victim)
    victim.transport.abort()
    return True


def _cancel(*timers: asyncio.TimerHandle | None) -> None:
    for timer in timers:
        if timer is not None:
            timer.cancel()


def _abort_stalled_reader(transport: asyncio.BaseTransport, seconds: float) -> None:
    if not transport.is_closing():
        log.info("closed a connection whose client took none of its answer for %.0f s", seconds)
        transport.abort()  # type: ignore[attr-defined]


def guarded_protocol(max_connections: int, read_timeout: float, write_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with the connection cap and the read and write timeouts above."""
    refusals, base = _Refusals(), AutoHTTPProtocol

    class Guarded(base):  # type: ignore[valid-type,misc]
        _read_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        _waiting_since = 0.0  # when the connection last began to wait for request bytes
        _reading, _timed = False, None  # a request's bytes began; the finished cycle whose successor is timed

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._waiting_since = time.monotonic()
            if len(self.connections) > max_connections and not _make_room(self, Guarded, refusals, max_connections):
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle  # a request's cycle exists only once its headers are whole
            if not self._reading or (cycle is not None and cycle.response_complete and cycle is not self._timed):
                self._reading, self._timed = True, cycle  # these bytes begin a request: timed whole from now
                self._arm()
            super().data_received(data)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._not_reading)

        def resume_writing(self) -> None:
            super().resume_writing()
            _cancel(self._write_timer)
            self._write_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            _cancel(self._read_timer, self._write_timer)
            super().connection_lost(exc)

        def _not_reading(self) -> None:
            self._write_timer = None
            _abort_stalled_reader(self.transport, write_timeout)

        def _waiting(self) -> bool:
            """Waiting for the client: no request yet, between requests, or a body not yet whole."""
            cycle = self.cycle
            return cycle is None or cycle.response_complete or cycle.more_body

        def _arm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            if not self._waiting():
                self._waiting_since = time.monotonic()
            self._read_timer = self.loop.call_later(read_timeout, self._stalled)

        def _stalled(self) -> None:
            self._read_timer = None
            if self._waiting() and not self.transport.is_closing():
                self.transport.close()

    return Guarded
