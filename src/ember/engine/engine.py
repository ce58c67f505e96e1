"""The async engine: all of ember's concurrency lives here.

Requests are tokenised on a small thread pool, split into work items (one per input, or
one per window of a long input), and queued earliest-deadline-first, where a request's
deadline is its arrival time plus its token count times a per-token cost: short queries
overtake bulk work, and nothing starves. One model thread runs packed batches formed by
the token budget; a request whose client has gone is dropped before it is computed.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ember.config import EngineConfig, PoolerConfig
from ember.engine.inputs import Fitted, Input, check_dimensions, fit_length, split_inputs, tokenize
from ember.errors import EmberError, EngineDeadError, OverloadedError, ShuttingDownError
from ember.ops.head import embed_windows
from ember.tokenizer import Tokenizer
from ember.types import ModelInfo, Runner

__all__ = ["AsyncEngine", "EmbedParams", "EmbedResult"]

log = logging.getLogger(__name__)

_INLINE_TOKENIZE_CHARS = 2048
"""Requests up to this many characters (or token ids) are tokenised on the event loop itself."""

_CONCURRENCY_MEMORY_SECONDS = 1.0
"""How long a peak of requests in flight sets how many requests a batch waits for."""

_SETTLE_SECONDS = 0.002
"""On an idle engine, a batch starts once no request arrived for this long (a burst has landed)."""

BatchObserver = Callable[[int, int, float], None]
"""Called after each batch with (sequences, tokens, seconds)."""


@dataclass(frozen=True)
class EmbedParams:
    """Per-request options (OpenAI's and vLLM's field names)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool = True
    prompt: str = ""


@dataclass(frozen=True)
class EmbedResult:
    """Vectors in input order, exact token counts, and where the time went."""

    vectors: list[np.ndarray]
    token_counts: list[int]
    queue_seconds: float
    inference_seconds: float


@dataclass(eq=False)
class _Request:
    windows: list[list[list[int]]]  # per input, its windows of token ids
    token_counts: list[int]  # per input, the tokens reported in usage
    future: asyncio.Future[None]
    arrival: float
    pending: int  # windows not yet computed
    in_heap: int = 0  # windows waiting in the queue
    pooled: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    first_batch: float | None = None
    inference_seconds: float = 0.0
    cancelled: bool = False

    @property
    def tokens(self) -> int:
        return sum(len(w) for ws in self.windows for w in ws)


@dataclass(order=True)
class _Item:
    deadline: float
    seq: int
    request: _Request = field(compare=False)
    key: tuple[int, int] = field(compare=False)  # (input index, window index)
    ids: list[int] = field(compare=False)


class AsyncEngine:
    """Embeds requests from many clients through one model thread, in continuous batches."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        pooler: PoolerConfig | None = None,
        *,
        tokenizer_threads: int = 1,
        observer: BatchObserver | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.pooler = pooler or PoolerConfig()
        self.observer = observer
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="ember-model")
        self._tokenize_pool = ThreadPoolExecutor(max(1, tokenizer_threads), thread_name_prefix="ember-tok")
        self.kernels = "eager"
        """eager, compiling, compiled or failed (then it stays eager): see EngineConfig.compile_kernels."""
        self._heap: list[_Item] = []
        self._heap_tokens = 0
        self._waiting = 0  # requests with windows in the queue
        self._peaks: deque[tuple[float, int]] = deque()  # (time, requests in flight), counts decreasing
        self._last_batch_end = -float("inf")
        self._counter = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.closing = False
        self.seconds_per_token = self.config.seconds_per_token
        """Measured model cost (moving average over batches): deadlines and Retry-After use it."""
        self.queued_requests = 0
        self.queued_tokens = 0
        self.running_seqs = 0
        self.running_tokens = 0

    @property
    def info(self) -> ModelInfo:
        return self.runner.info

    @property
    def alive(self) -> bool:
        """True while the engine can embed (its scheduler task is running)."""
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Warm the model up on the model thread (its first call pays for kernel selection), then serve.

        All model work stays on that one thread: OpenMP keeps a pool of workers for each thread that ran
        parallel work, and once they outnumber the CPUs its workers sleep between kernels instead of
        spinning (measured on all-MiniLM: a core idle 27% of the time over HTTP instead of 11%, and in-process
        a forward 1.08-1.14x slower beside one extra pool). The kernels are compiled on a thread of their
        own that ends when they are built, so its pool goes with it."""
        self._wakeup = asyncio.Event()
        warm = [self.tokenizer.encode("warm up")]
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._model_thread, self.runner.embed, warm)
        self._task = asyncio.create_task(self._run(), name="ember-scheduler")
        if self.config.compile_kernels:
            self.kernels = "compiling"
            threading.Thread(target=self._compile, name="ember-compile", daemon=True).start()

    def _compile(self) -> None:
        """Builds the fused kernels beside serving (the model thread keeps running eagerly meanwhile)."""
        start = time.perf_counter()
        try:
            self.runner.compile()
        except Exception:  # a compiler problem must never take serving down: stay eager
            self.kernels = "failed"
            log.warning("fused kernels could not be compiled; serving with eager kernels", exc_info=True)
            return
        self.kernels = "compiled"
        log.info("fused kernels compiled in %.1fs; serving with them", time.perf_counter() - start)

    async def stop(self, grace_seconds: float = 30.0) -> None:
        """Refuse new work, let queued and running requests finish (up to the grace period), stop."""
        self.closing = True
        deadline = time.monotonic() + grace_seconds
        while self.queued_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._model_thread.shutdown(wait=True, cancel_futures=True)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def run_in_tokenizer(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run tokenizer work off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def embed(self, inputs: Any, params: EmbedParams = EmbedParams()) -> EmbedResult:
        """Embed inputs (texts or token ids); raises EmberError subclasses for bad input or overload."""
        self._check_accepting()
        items: list[Input] = split_inputs(inputs)
        dimensions = params.dimensions if params.dimensions is not None else self.pooler.dimensions
        check_dimensions(self.info, dimensions)
        if self.queued_requests >= self.config.max_queued_requests:
            raise self._overloaded()
        args = (self.tokenizer, items, params.prompt, params.add_special_tokens)
        small = sum(len(x) for x in items) <= _INLINE_TOKENIZE_CHARS
        # a short request tokenises in microseconds: handing it to a thread would cost more
        seqs = tokenize(*args) if small else await self.run_in_tokenizer(tokenize, *args)
        request = self._admit([self._fit(ids, params) for ids in seqs])
        try:
            await request.future
        except asyncio.CancelledError:
            request.cancelled = True
            raise
        finally:
            self.queued_requests -= 1
            self.queued_tokens -= request.tokens
        return self._finish(request, params, dimensions)

    def _check_accepting(self) -> None:
        if self.closing:
            raise ShuttingDownError("the server is shutting down and accepts no new requests")
        if not self.alive:
            raise EngineDeadError("the embedding engine is not running")

    def _fit(self, ids: list[int], params: EmbedParams) -> Fitted:
        return fit_length(
            ids,
            self.info.max_model_len,
            self.tokenizer.special_tokens,
            truncate_to=params.truncate_prompt_tokens,
            side=params.truncation_side,
            pooler=self.pooler,
            auto_truncate=self.config.auto_truncate,
        )

    def _overloaded(self) -> OverloadedError:
        wait = max(1.0, self.queued_tokens * self.seconds_per_token)
        return OverloadedError(
            f"server overloaded: {self.queued_requests} requests and {self.queued_tokens} tokens queued; retry later",
            retry_after=round(wait),
        )

    def _admit(self, fitted: list[Fitted]) -> _Request:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        windows = [f.windows for f in fitted]
        pending = sum(len(ws) for ws in windows)
        request = _Request(windows, [f.tokens for f in fitted], loop.create_future(), now, pending)
        cfg = self.config
        if self.queued_requests >= cfg.max_queued_requests or (
            self.queued_tokens + request.tokens > cfg.max_queued_tokens and self.queued_requests > 0
        ):
            raise self._overloaded()
        self.queued_requests += 1
        self.queued_tokens += request.tokens
        while self._peaks and self._peaks[-1][1] <= self.queued_requests:
            self._peaks.pop()
        self._peaks.append((now, self.queued_requests))
        deadline = now + request.tokens * self.seconds_per_token
        for i, ws in enumerate(windows):
            for j, ids in enumerate(ws):
                heapq.heappush(self._heap, _Item(deadline, next(self._counter), request, (i, j), ids))
                self._heap_tokens += len(ids)
        request.in_heap = pending
        self._waiting += pending > 0
        assert self._wakeup is not None
        self._wakeup.set()
        return request

    def _finish(self, request: _Request, params: EmbedParams, dimensions: int | None) -> EmbedResult:
        normalize = self.info.pooling.normalize if params.normalize is None else params.normalize
        vectors = []
        for i, ws in enumerate(request.windows):
            parts = [request.pooled[(i, j)] for j in range(len(ws))]
            vectors.append(embed_windows(parts, [len(w) for w in ws], dimensions, normalize))
        started = request.first_batch or request.arrival
        return EmbedResult(
            vectors,
            request.token_counts,
            queue_seconds=started - request.arrival,
            inference_seconds=request.inference_seconds,
        )

    def _form_batch(self) -> list[_Item]:
        """Pop items earliest-deadline-first within the token and sequence budgets."""
        batch: list[_Item] = []
        tokens = 0
        while self._heap and len(batch) < self.config.max_num_seqs:
            item = self._heap[0]
            if item.request.cancelled or item.request.future.done():
                self._pop()
                continue
            if batch and tokens + len(item.ids) > self.config.max_num_batched_tokens:
                break
            self._pop()
            batch.append(item)
            tokens += len(item.ids)
        return batch

    def _pop(self) -> _Item:
        item = heapq.heappop(self._heap)
        self._heap_tokens -= len(item.ids)
        item.request.in_heap -= 1
        if item.request.in_heap == 0:
            self._waiting -= 1
        return item

    async def _gather(self) -> None:
        """Wait briefly (up to batch_wait_seconds) for more requests to join the batch about to start.

        A window longer than the token budget waits the whole time, so that queries arriving meanwhile
        overtake it. Otherwise the wait ends once the queue holds a full budget, or as many requests as were
        in flight at once in the last second: closed-loop clients whose answers just went out come back and
        share one forward (rather than settling into halves that alternate), and a lone client's request
        starts at once. On an engine that ran nothing in the last second it ends once no request arrived
        for 2 ms, so a burst lands in one batch."""
        assert self._wakeup is not None
        budget = self.config.max_num_batched_tokens
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.batch_wait_seconds
        idle = time.monotonic() - self._last_batch_end > _CONCURRENCY_MEMORY_SECONDS
        expected = self._recent_concurrency()
        while self._heap:
            ordinary = len(self._heap[0].ids) <= budget
            if ordinary and (self._heap_tokens >= budget or (not idle and self._waiting >= expected)):
                return
            left = deadline - loop.time()
            if left <= 0:
                return
            if ordinary and idle:  # wait only while requests keep landing
                left = min(left, _SETTLE_SECONDS)
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except TimeoutError:
                return

    def _recent_concurrency(self) -> int:
        """The most requests in flight at once in the last second (at least 1)."""
        now = time.monotonic()
        while self._peaks and now - self._peaks[0][0] > _CONCURRENCY_MEMORY_SECONDS:
            self._peaks.popleft()
        return self._peaks[0][1] if self._peaks else 1  # a peak counts the request that made it: >= 1

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._heap:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._gather()
            batch = self._form_batch()
            if batch:
                await self._run_batch(loop, batch)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Item]) -> None:
        start = time.monotonic()
        for item in batch:
            if item.request.first_batch is None:
                item.request.first_batch = start
        self.running_seqs, self.running_tokens = len(batch), sum(len(it.ids) for it in batch)
        try:
            out = await loop.run_in_executor(self._model_thread, self.runner.embed, [it.ids for it in batch])
        except Exception as e:  # the model failed on this batch: fail its requests, keep serving
            log.exception("batch of %d sequences failed", len(batch))
            for item in batch:
                if not item.request.future.done():
                    item.request.future.set_exception(
                        e if isinstance(e, EmberError) else EmberError(f"embedding failed: {e}")
                    )
            return
        finally:
            self.running_seqs = self.running_tokens = 0
        self._last_batch_end = time.monotonic()
        seconds = self._last_batch_end - start
        tokens = sum(len(it.ids) for it in batch)
        self.seconds_per_token = 0.8 * self.seconds_per_token + 0.2 * seconds / tokens
        if self.observer is not None:
            self.observer(len(batch), tokens, seconds)
        for request in {item.request for item in batch}:
            request.inference_seconds += seconds
        for row, item in enumerate(batch):
            request = item.request
            request.pooled[item.key] = out[row]
            request.pending -= 1
            if request.pending == 0 and not request.future.done():
                request.future.set_result(None)
