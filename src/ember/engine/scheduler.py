"""The scheduler: which work runs next, and when a batch should start (pure: no threads, no clock of its own).

A request becomes work items (one per input, or one per window of a long input), queued earliest-deadline-first,
where a request's deadline is its arrival plus its tokens times the measured cost of a token: short queries
overtake bulk work, and nothing starves. Batches are formed by a token and a sequence budget; work of cancelled
requests is dropped when a batch is formed. Every method that depends on time takes `now` (seconds, any
monotonic origin), so the async engine and the offline Embedder drive the same decisions and tests need no sleeps.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ember.config import EngineConfig
from ember.errors import OverloadedError
from ember.types import POOLED, Output

__all__ = ["BatchSpan", "Request", "Scheduler", "WorkItem", "batch_inputs"]

CONCURRENCY_MEMORY_SECONDS = 1.0
"""How long a peak of requests in flight sets how many requests a batch waits for."""

SETTLE_SECONDS = 0.002
"""On an idle engine, a batch starts once no request arrived for this long (a burst has landed)."""


class BatchSpan(NamedTuple):
    """One batch a request ran in: when (monotonic seconds), and how large."""

    start: float
    end: float
    sequences: int
    tokens: int


@dataclass(eq=False)
class Request:
    """One client request: its windows, what it counts for in `usage`, and its pooled windows as they come."""

    windows: list[list[list[int]]]  # per input, its windows of token ids
    token_counts: list[int]  # per input, the tokens reported in usage
    arrival: float
    pending: int  # windows not yet computed
    token_types: list[list[list[int]]] | None = None  # per window, its tokens' segments (pairs); None: all 0
    output: Output = "embed"  # what each window gives: its pooled vector, or a vector or weight per token
    vectors: int = 0  # the dimension-wide vectors its answer holds, as the memory plan counts answers
    tokens: int = 0  # the tokens it queues: its windows' less those the cache answered
    in_queue: int = 0  # windows waiting in the queue
    pooled: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    first_batch: float | None = None
    inference_seconds: float = 0.0
    batches: list[BatchSpan] = field(default_factory=list)  # each batch it had rows in
    cancelled: bool = False
    failed: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.pending == 0 or self.failed is not None


@dataclass(order=True)
class WorkItem:
    """One window of one input, ordered by deadline, then by arrival."""

    deadline: float
    seq: int
    request: Request = field(compare=False)
    key: tuple[int, int] = field(compare=False)  # (input index, window index)
    ids: list[int] = field(compare=False)
    types: list[int] | None = field(compare=False, default=None)


@dataclass(frozen=True)
class _Gather:
    """The decision state of the wait before one batch, fixed when that wait starts."""

    started: float
    idle: bool  # nothing ran for a while: wait only while a burst keeps landing
    expected: int  # requests in flight at the recent peak: wait for that many


class Scheduler:
    """Requests in, batches out: admission, EDF order, token/sequence budgets and the batch-wait decision."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.seconds_per_token = config.seconds_per_token
        """Measured model cost (moving average over batches): deadlines and Retry-After use it."""
        self.queued_requests = 0  # admitted and not yet released
        self.queued_tokens = 0
        self.queued_vectors = 0  # answer vectors of admitted requests
        self.held_vectors = 0  # answers computed and released, still being written to slow clients (hold_answer)
        self._heap: list[WorkItem] = []
        self._heap_tokens = 0
        self._running_tokens = 0  # tokens of the batch formed and not yet completed
        self._measured = False  # a batch has completed: seconds_per_token is this model's, not the default guess
        self._waiting = 0  # requests with work in the queue
        self._peaks: deque[tuple[float, int]] = deque()  # (time, requests in flight), counts decreasing
        self._last_arrival = -float("inf")
        self._last_batch_end = -float("inf")
        self._gather: _Gather | None = None
        self._counter = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self._heap)

    def check_room(self) -> None:
        """Refuse at once (before any tokenising) when the queue already holds its most requests."""
        if self.queued_requests >= self.config.max_queued_requests:
            raise self.overloaded()

    def overloaded(self, wait: float | None = None) -> OverloadedError:
        """429: the queue is full; retry after `wait` seconds (default: the time the whole queue takes)."""
        wait = max(1.0, self.queued_tokens * self.seconds_per_token if wait is None else wait)
        return OverloadedError(
            f"server overloaded: {self.queued_requests} requests and {self.queued_tokens} tokens queued; retry later",
            retry_after=math.ceil(wait),
        )

    def wait_before(self, deadline: float) -> float:
        """Estimated seconds of work that runs before a request with this deadline: the running batch, and the
        queued work due earlier (EDF order)."""
        ahead = sum(len(it.ids) for it in self._heap if it.deadline <= deadline and not it.request.cancelled)
        running = self._running_tokens if self._measured else 0  # the first batch: no cost of its own known yet
        return (ahead + running) * self.seconds_per_token

    def admit(
        self,
        windows: list[list[list[int]]],
        token_counts: list[int],
        now: float,
        token_types: list[list[list[int]]] | None = None,
        output: Output = "embed",
        max_seconds: float | None = None,
        vectors: int | None = None,
        done: dict[tuple[int, int], np.ndarray] | None = None,
    ) -> Request:
        """Queue a request's windows (with their token types, for pairs), or raise OverloadedError when the
        queue's budgets are spent, its estimated wait before it starts is over max_queue_seconds, or its wait and
        its own work are over `max_seconds` (the client's timeout). `output`: what it wants of each window;
        `vectors`: what its answer holds, in vectors of the model's width (default: one per input); `done`: windows
        whose output is already known (the embedding cache), never queued."""
        done = done or {}
        pending = sum(len(ws) for ws in windows) - len(done)
        count = len(windows) if vectors is None else vectors
        request = Request(windows, token_counts, now, pending, token_types, output, count)
        request.tokens = sum(len(w) for i, ws in enumerate(windows) for j, w in enumerate(ws) if (i, j) not in done)
        request.pooled.update(done)
        cfg = self.config
        if self.queued_requests >= cfg.max_queued_requests or (
            (self.queued_requests > 0 or self.held_vectors > 0)
            and (
                self.queued_tokens + request.tokens > cfg.max_queued_tokens
                or self.queued_vectors + self.held_vectors + request.vectors > (cfg.max_queued_vectors or math.inf)
            )
        ):
            raise self.overloaded()
        if self.queued_requests > 0:  # an empty queue admits anything its budgets hold: it could never wait less
            own = request.tokens * self.seconds_per_token
            ahead = self.wait_before(now + own)
            if ahead > cfg.max_queue_seconds:  # its wait to start: after the excess, the work ahead has shrunk to fit
                raise self.overloaded(ahead - cfg.max_queue_seconds)
            if max_seconds is not None and ahead + own > max_seconds:  # the client's limit counts its own work too
                raise self.overloaded(ahead + own - max_seconds)
        self.queued_requests += 1
        self.queued_tokens += request.tokens
        self.queued_vectors += request.vectors
        while self._peaks and self._peaks[-1][1] <= self.queued_requests:
            self._peaks.pop()
        self._peaks.append((now, self.queued_requests))
        self._last_arrival = now
        deadline = now + request.tokens * self.seconds_per_token
        for i, ws in enumerate(windows):
            for j, ids in enumerate(ws):
                if (i, j) in done:
                    continue
                types = token_types[i][j] if token_types else None
                heapq.heappush(self._heap, WorkItem(deadline, next(self._counter), request, (i, j), ids, types))
                self._heap_tokens += len(ids)
        request.in_queue = pending
        self._waiting += pending > 0
        return request

    def release(self, request: Request) -> None:
        """The request's caller is done with it (answered, failed or gone): its budget is free again.
        Its work still queued, if any, is dropped when the next batch is formed."""
        request.cancelled = request.cancelled or not request.done
        self.queued_requests -= 1
        self.queued_tokens -= request.tokens
        self.queued_vectors -= request.vectors

    def hold_answer(self, vectors: int) -> None:
        """An answer of `vectors` (of the model's width) is still being written: it stays in the answers' budget,
        so requests whose answers would not fit beside it are refused (429) rather than held in memory too."""
        self.held_vectors += vectors

    def release_answer(self, vectors: int) -> None:
        self.held_vectors -= vectors

    def wait_seconds(self, now: float) -> float:
        """How long to wait for more requests before forming the next batch (0: start it now).

        Up to batch_wait_seconds. A window longer than the token budget waits the whole time, so that queries
        arriving meanwhile overtake it. Otherwise the wait ends once the queue holds a full budget, or as many
        requests as were in flight at once in the last second: closed-loop clients whose answers just went out
        come back and share one forward (rather than settling into halves that alternate), and a lone client's
        request starts at once. On an engine that ran nothing in the last second it ends once no request
        arrived for SETTLE_SECONDS, so a burst lands in one batch."""
        if not self._heap:
            return 0.0
        if self._gather is None:
            idle = now - self._last_batch_end > CONCURRENCY_MEMORY_SECONDS
            self._gather = _Gather(now, idle, self._recent_concurrency(now))
        g = self._gather
        budget = self.config.max_num_batched_tokens
        ordinary = len(self._heap[0].ids) <= budget
        if ordinary and (self._heap_tokens >= budget or (not g.idle and self._waiting >= g.expected)):
            return 0.0
        left = g.started + self.config.batch_wait_seconds - now
        if ordinary and g.idle:  # wait only while requests keep landing
            left = min(left, max(g.started, self._last_arrival) + SETTLE_SECONDS - now)
        return max(0.0, left)

    def next_batch(self, now: float, max_tokens: int | None = None) -> list[WorkItem]:
        """Pop work earliest-deadline-first within the token and sequence budgets (a longer window runs alone);
        `max_tokens` cuts the token budget for this batch."""
        self._gather = None
        batch: list[WorkItem] = []
        tokens = 0
        budget = min(self.config.max_num_batched_tokens, max_tokens or self.config.max_num_batched_tokens)
        while self._heap and len(batch) < self.config.max_num_seqs:
            item = self._heap[0]
            if item.request.cancelled or item.request.done:
                self._pop()
                continue
            if batch and tokens + len(item.ids) > budget:
                break
            self._pop()
            batch.append(item)
            tokens += len(item.ids)
        for item in batch:
            if item.request.first_batch is None:
                item.request.first_batch = now
        self._running_tokens = tokens
        return batch

    def _pop(self) -> WorkItem:
        item = heapq.heappop(self._heap)
        self._heap_tokens -= len(item.ids)
        item.request.in_queue -= 1
        if item.request.in_queue == 0:
            self._waiting -= 1
        return item

    def _recent_concurrency(self, now: float) -> int:
        """The most requests in flight at once in the last second (at least 1)."""
        while self._peaks and now - self._peaks[0][0] > CONCURRENCY_MEMORY_SECONDS:
            self._peaks.popleft()
        return self._peaks[0][1] if self._peaks else 1  # a peak counts the request that made it: >= 1

    def complete(
        self, batch: list[WorkItem], pooled: np.ndarray | list[np.ndarray], seconds: float, now: float
    ) -> list[Request]:
        """Record a batch's pooled rows (or token states); returns the requests it finished."""
        self._last_batch_end = now
        self._running_tokens = 0
        self._measured = True
        tokens = sum(len(it.ids) for it in batch)
        self.seconds_per_token = 0.8 * self.seconds_per_token + 0.2 * seconds / max(1, tokens)
        span = BatchSpan(now - seconds, now, len(batch), tokens)
        for request in {id(it.request): it.request for it in batch}.values():
            request.inference_seconds += seconds
            request.batches.append(span)
        finished = []
        for row, item in enumerate(batch):
            request = item.request
            if request.failed is not None:
                continue
            request.pooled[item.key] = pooled[row]
            request.pending -= 1
            if request.pending == 0:
                finished.append(request)
        return finished

    def fail(self, batch: list[WorkItem], error: BaseException, now: float) -> list[Request]:
        """The model failed on this batch: its requests fail (and nothing else); returns them."""
        self._last_batch_end = now
        self._running_tokens = 0
        failed = []
        for request in {id(it.request): it.request for it in batch}.values():
            if request.failed is None and request.pending > 0:
                request.failed = error
                failed.append(request)
        return failed


def batch_inputs(batch: list[WorkItem]) -> tuple[list[list[int]], list[list[int]] | None, list[Output] | None]:
    """A batch's token ids; when any of its items has them, token types (0 for the others); when any of its
    requests wants more than pooled vectors, each row's output (else None)."""
    ids = [it.ids for it in batch]
    outputs = [it.request.output for it in batch]
    wanted = outputs if any(o not in POOLED for o in outputs) else None
    if all(it.types is None for it in batch):
        return ids, None, wanted
    return ids, [it.types if it.types is not None else [0] * len(it.ids) for it in batch], wanted
