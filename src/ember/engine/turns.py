"""Turns on the one model thread when several models share it: the batch whose work is due first goes next.

Each model's engine forms its batches with its own scheduler (its own budgets and its own measured cost per
token), then asks for a turn with the earliest deadline among the batch's requests. Deadlines are absolute times
(arrival + estimated work), so earliest-deadline-first holds across all queued work: a flood on one model queues
behind a short query on another exactly as it would behind one on its own model.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["Turns"]


class Turns:
    """An asyncio lock granted by earliest deadline (ties: first asked). Use on one event loop."""

    def __init__(self) -> None:
        self._waiting: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._waiting if not f.done())

    async def acquire(self, deadline: float) -> None:
        """Wait until no batch runs and none due earlier is waiting."""
        if not self._held and not self.waiting:
            self._held = True
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (deadline, next(self._order), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted as we were cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        """End this turn: the earliest-due waiter (if any) runs next."""
        while self._waiting:
            _, _, future = heapq.heappop(self._waiting)
            if not future.done():
                future.set_result(None)
                return
        self._held = False
