"""Turns on the one model thread when several models share it: the batch whose work is due first goes next, and no
model takes two turns in a row while another model's batch waits.

Each model's engine forms its batches with its own scheduler (its own budgets and its own measured cost per
token), then asks for a turn with the earliest deadline among the batch's requests. Deadlines are absolute times
(arrival + estimated work), so the order is earliest-deadline-first across the models' queued work. A flood keeps
its requests overdue, though (they wait longer than their own work), and would then take every turn: so after a
model's turn, the next goes to another model's waiting batch if there is one. Under a flood on one model, a
request to another waits for at most the batch running when it arrived (engines cut their batches short while
they share the thread: EngineConfig.shared_batch_seconds).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["ACTIVE_SECONDS", "Turns"]

ACTIVE_SECONDS = 5.0
"""A model that asked for a turn this recently is active: the others cut their batches short for it."""


class Turns:
    """An asyncio lock granted by earliest deadline (ties: first asked). Use on one event loop."""

    def __init__(self) -> None:
        self._waiting: list[tuple[float, int, object, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._held = False
        self._last: object = None  # who had the last turn
        self._asked: dict[int, float] = {}  # id(owner) -> when it last asked for a turn
        self.members = 0
        """The engines taking turns (each registers itself)."""

    def leave(self) -> int:
        """An engine stops taking turns: how many remain."""
        self.members -= 1
        return self.members

    def others_active(self, owner: object, now: float, within: float = ACTIVE_SECONDS) -> bool:
        """Whether another model asked for a turn in the last `within` seconds."""
        return any(k != id(owner) and now - t < within for k, t in self._asked.items())

    @property
    def held(self) -> bool:
        return self._held

    @property
    def waiting(self) -> int:
        return sum(1 for *_, f in self._waiting if not f.done())

    async def acquire(self, deadline: float, owner: object = None) -> None:
        """Wait until no batch runs and this one is next: the earliest deadline among the waiting batches of models
        other than the one that ran last (its own only when no other model waits)."""
        self._asked[id(owner)] = asyncio.get_running_loop().time()
        if not self._held and not self.waiting:
            self._held, self._last = True, owner
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (deadline, next(self._order), owner, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted as we were cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        """End this turn: the next goes as acquire() says; none waiting frees the thread."""
        live = [w for w in self._waiting if not w[-1].done()]
        others = [w for w in live if w[2] is not self._last or w[2] is None]
        if not live:
            self._waiting, self._held, self._last = [], False, None
            return
        chosen = min(others or live)
        live.remove(chosen)
        heapq.heapify(live)
        self._waiting = live
        self._last = chosen[2]
        chosen[-1].set_result(None)
