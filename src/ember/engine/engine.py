"""The async engine: all of ember's concurrency lives here.

Requests are checked and tokenised (short ones on the event loop, long ones on a small thread pool), handed to
the pure `Scheduler`, and answered through futures. One model thread runs the batches the scheduler forms;
a request whose client has gone is dropped before it is computed. Faster kernels are prepared on a thread of
their own beside serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ember.config import EngineConfig, PoolerConfig, ServerConfig
from ember.engine.cache import EmbeddingCache
from ember.engine.inputs import EmbedParams, Preprocessor
from ember.engine.kernels import prepare_kernels
from ember.engine.pairs import PairPreprocessor, ScoreParams, cosine_scores, distinct_texts
from ember.engine.results import EmbedResult, ScoreResult, answer_vectors
from ember.engine.scheduler import Request, Scheduler, WorkItem, batch_inputs
from ember.engine.turns import Turns
from ember.errors import EmberError, EngineDeadError, InputError, RequestTooLargeError, ShuttingDownError
from ember.resources import release_free_memory
from ember.sizing import OUTPUT_VALUE_BYTES
from ember.tokenizer import Tokenizer
from ember.types import KernelStatus, ModelInfo, Output, Runner

__all__ = ["AsyncEngine", "EmbedParams", "EmbedResult", "ScoreParams", "ScoreResult"]

log = logging.getLogger(__name__)

_INLINE_TOKENIZE_CHARS = 2048
"""Requests up to this many characters (or token ids) are tokenised on the event loop itself."""

IDLE_RELEASE_SECONDS = 2.0
"""After this long idle following work, freed memory is handed back to the OS (ember.resources.release_free_memory)."""

DRAIN_MARGIN_SECONDS = 0.5
"""A drain answers what is still unfinished this long before its grace ends, so those answers go out in time."""

SHARED_BATCH_MIN_TOKENS = 128
"""The least a shared model thread's batch is cut to: at 64 a MiniLM-sized cross-encoder ran one pair per batch, at
half the throughput of 128 (benchmarks/stack.py, 2 cores)."""

BatchObserver = Callable[[int, int, float], None]
"""Called after each batch with (sequences, tokens, seconds)."""


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
        model_thread: ThreadPoolExecutor | None = None,
        turns: Turns | None = None,
    ) -> None:
        """`model_thread` and `turns`: the one model thread and its turns, shared with the engines of the other models
        a server runs (ember.engine.build.build_engines); by default this engine's own."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.preprocessor = Preprocessor(runner.info, tokenizer, pooler or PoolerConfig(), self.config.auto_truncate)
        self.pairs = PairPreprocessor(runner.info, tokenizer, self.config.auto_truncate)
        self.scheduler = Scheduler(self.config)
        self.cache = EmbeddingCache(self.config.cache_bytes) if self.config.cache_bytes else None
        """Outputs of windows already computed, by exact token ids (None: off)."""
        self.observer = observer
        if turns is not None:
            turns.members += 1
        self._owns_thread = model_thread is None
        self._left = False  # stopped taking turns
        self._model_thread = model_thread or ThreadPoolExecutor(1, thread_name_prefix="ember-model")
        self.turns = turns
        self._tokenize_pool = ThreadPoolExecutor(max(1, tokenizer_threads), thread_name_prefix="ember-tok")
        self.kernels: dict[str, KernelStatus] = {}
        """What each kernel does now (native ones and torch.compile's fused regions), for logs, /info, /metrics."""
        self._waiting: dict[int, tuple[Request, asyncio.Future[None]]] = {}  # id -> request, its caller's future
        self._drain_deadline: float | None = None
        self.model_busy = False
        """True while a batch runs on the model thread (a drain does not wait for one nobody will receive)."""
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.closing = False
        self.running_seqs = 0
        self.running_tokens = 0

    @property
    def info(self) -> ModelInfo:
        return self.runner.info

    @property
    def alive(self) -> bool:
        """True while the engine can embed (its scheduling task is running)."""
        return self._task is not None and not self._task.done()

    @property
    def queued_requests(self) -> int:
        return self.scheduler.queued_requests

    @property
    def queued_tokens(self) -> int:
        return self.scheduler.queued_tokens

    async def start(self) -> None:
        """Warm the model up on the model thread (its first call pays for kernel selection), then serve.

        All model work stays on that one thread: OpenMP keeps a pool of workers for each thread that ran
        parallel work, and once they outnumber the CPUs its workers sleep between kernels instead of
        spinning (measured on all-MiniLM: cores left idle over HTTP, and slower forwards beside one extra pool;
        benchmarks/NOTES.md). Kernels are built on a thread of their own that
        ends when they are, so its pool goes with it."""
        self._wakeup = asyncio.Event()
        warm = [self.tokenizer.encode("warm up")]
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._model_thread, self.runner.run, warm)
        self._task = asyncio.create_task(self._run(), name="ember-scheduler")
        fused = "building in the background" if self.config.compile_kernels else f"off ({self.config.eager_reason})"
        self.kernels["fused"] = KernelStatus("fused", False, fused)
        prepare = (self.runner, self.kernels, self.config.compile_kernels)
        threading.Thread(target=prepare_kernels, args=prepare, name="ember-kernels", daemon=True).start()

    def drain(self, grace_seconds: float) -> None:
        """Begin a drain (SIGTERM): refuse new work at once (503), finish what is queued and running, and at the
        end of the grace answer whatever is still unfinished with 503, dropping its queued work. Call on the loop."""
        if self._drain_deadline is not None:
            return
        self.closing = True
        self._drain_deadline = time.monotonic() + grace_seconds
        asyncio.get_running_loop().call_later(max(0.0, grace_seconds - DRAIN_MARGIN_SECONDS), self._abandon)

    def _abandon(self) -> None:
        """Fail every request still waiting (its queued windows are then never computed)."""
        error = ShuttingDownError("the server shut down before this request was computed (--shutdown-grace ran out)")
        left = [r for r, _ in self._waiting.values() if not r.done]
        for request in left:
            request.failed = error
        if left:
            log.warning("shutdown grace over: %d unfinished request(s) answered 503", len(left))
        self._settle(left)

    async def stop(self, grace_seconds: float = ServerConfig.shutdown_grace_seconds) -> None:
        """Refuse new work, let queued and running requests finish (up to the grace period, counted from the
        drain's start if one began), answer the rest 503, stop. A batch still on the model thread is not waited
        for: nobody is left to receive it."""
        self.drain(grace_seconds)
        assert self._drain_deadline is not None
        while self.scheduler.queued_requests and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.05)
        self._abandon()
        await asyncio.sleep(0)  # let the failed callers answer
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        last_out = self.turns is not None and not self._left and self.turns.leave() == 0
        self._left = True
        if self._owns_thread or last_out:  # a shared model thread goes with the last engine to stop
            self._model_thread.shutdown(wait=not self.model_busy, cancel_futures=True)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def hold_answer(self, nbytes: int) -> Callable[[], None]:
        """Count an answer body of `nbytes` in the memory plan's answers until the returned function is called (when
        the transport has taken its last byte): a slow reader's answer is memory held like a queued one."""
        vectors = -(-nbytes // max(1, self.info.dimension * OUTPUT_VALUE_BYTES))
        self.scheduler.hold_answer(vectors)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.scheduler.release_answer(vectors)

        return release

    async def run_in_tokenizer(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run tokenizer work off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def embed(
        self, inputs: Any, params: EmbedParams | None = None, *, timeout: float | None = None
    ) -> EmbedResult:
        """Embed inputs (texts or token ids); raises EmberError subclasses for bad input or overload. `timeout`:
        the client's own limit in seconds, refused at once (429) when the estimated wait exceeds it."""
        params = params or EmbedParams()
        self._check_accepting()
        if self.info.task != "embed" and params.output != "classify":
            raise InputError(
                f"model {self.info.name!r} ({self.info.architecture}) scores (query, document) pairs: use /rerank or "
                "/score",
                "input",
            )
        prepared = self.preprocessor.check(inputs, params)
        self.scheduler.check_room()
        small = sum(len(x) for x in prepared.items) <= _INLINE_TOKENIZE_CHARS
        # a short request tokenises in microseconds: handing it to a thread would cost more
        fit, start = self.preprocessor.fit, time.monotonic()
        fitted = fit(prepared, params) if small else await self.run_in_tokenizer(fit, prepared, params)
        tokenized = time.monotonic() - start
        request = await self._run_request(
            [f.windows for f in fitted], [f.tokens for f in fitted], output=params.output, timeout=timeout
        )
        return EmbedResult(
            self.preprocessor.vectors(request.windows, request.pooled, prepared),
            request.token_counts,
            *self._times(request),
            tokenized,
            tuple(request.batches),
        )

    async def score(
        self, pairs: list[tuple[str, str]], params: ScoreParams | None = None, *, timeout: float | None = None
    ) -> ScoreResult:
        """A relevance score per (query, document) pair: the cross-encoder's (or reranker's), or for an embedding
        model the cosine of the two texts' embeddings."""
        params = params or ScoreParams()
        self._check_accepting()
        if self.info.task == "embed":
            return await self._cosine(pairs, params, timeout)
        self.scheduler.check_room()
        small = sum(len(a) + len(b) for a, b in pairs) <= _INLINE_TOKENIZE_CHARS
        fit, start = self.pairs.fit, time.monotonic()
        built = fit(pairs, params) if small else await self.run_in_tokenizer(fit, pairs, params)
        tokenized = time.monotonic() - start
        request = await self._run_request(*self.pairs.windows(built), timeout=timeout)
        scores = self.pairs.scores(request.pooled, len(built), params)
        logits = tuple(request.pooled[(i, 0)] for i in range(len(built)))
        return ScoreResult(
            scores, request.token_counts, *self._times(request), tokenized, tuple(request.batches), logits
        )

    async def _cosine(self, pairs: list[tuple[str, str]], params: ScoreParams, timeout: float | None) -> ScoreResult:
        """An embedding model's score: each distinct text embedded once, then the cosine of each pair's vectors."""
        texts = distinct_texts(pairs)
        embed = EmbedParams(normalize=True, truncate_prompt_tokens=params.truncate_prompt_tokens)
        result = await self.embed(texts, embed, timeout=timeout)
        scores, counts = cosine_scores(pairs, texts, result.vectors, result.token_counts)
        return ScoreResult(
            scores, counts, result.queue_seconds, result.inference_seconds, result.tokenize_seconds, result.batches
        )

    async def _run_request(
        self,
        windows: list[list[list[int]]],
        counts: list[int],
        types: list[list[list[int]]] | None = None,
        *,
        output: Output = "embed",
        timeout: float | None = None,
    ) -> Request:
        """Queue a request's windows and wait for them; a cancelled caller's queued work is never computed.
        A request larger than the whole queue is refused (413): admitted into an empty queue, it would turn
        every other client away for as long as it runs."""
        tokens, limit = sum(len(w) for ws in windows for w in ws), self.config.max_queued_tokens
        if tokens > limit:
            raise RequestTooLargeError(
                f"this request holds {tokens} tokens, more than this server queues at once ({limit}, "
                "--max-queued-tokens as the memory plan allows): send its inputs in smaller requests",
                "input",
            )
        vectors = answer_vectors(output, len(windows), tokens, self.info.dimension)
        most = self.config.max_queued_vectors
        if most is not None and vectors > most:
            raise RequestTooLargeError(
                f"this request's answer holds {vectors} vectors, more than this server's memory plan keeps for "
                f"answers ({most}): send its inputs in smaller requests",
                "input",
            )
        keys, known = self.cache.lookup(windows, types, output) if self.cache is not None else ({}, {})
        request = self.scheduler.admit(windows, counts, time.monotonic(), types, output, timeout, vectors, known)
        if request.done:  # every window was in the cache
            self.scheduler.release(request)
            return request
        future = asyncio.get_running_loop().create_future()
        self._waiting[id(request)] = (request, future)
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            await future
        finally:
            del self._waiting[id(request)]
            self.scheduler.release(request)
        if self.cache is not None and keys:
            for at, key in keys.items():
                if at not in known:
                    self.cache.put(key, request.pooled.get(at))
        return request

    @staticmethod
    def _times(request: Request) -> tuple[float, float]:
        """(seconds queued before its first batch, seconds of the batches it ran in)."""
        return (request.first_batch or request.arrival) - request.arrival, request.inference_seconds

    def _check_accepting(self) -> None:
        if self.closing:
            raise ShuttingDownError("the server is shutting down and accepts no new requests")
        if not self.alive:
            raise EngineDeadError("the embedding engine is not running")

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        worked = False  # batches ran since memory was last released
        while True:
            self._wakeup.clear()
            if not self.scheduler.has_work:
                if worked:
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), IDLE_RELEASE_SECONDS)
                    except TimeoutError:
                        worked = False
                        loop.run_in_executor(None, release_free_memory)  # off the loop; nothing waits on it
                else:
                    await self._wakeup.wait()
                continue
            worked = True
            wait = self.scheduler.wait_seconds(time.monotonic())
            if wait > 0:  # more requests may join the batch: wait for one to arrive, or the time to pass
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), wait)
                continue
            formed = time.monotonic()
            batch = self.scheduler.next_batch(formed, self._shared_batch_tokens())
            if batch:
                await self._run_batch(loop, batch, formed)

    def _shared_batch_tokens(self) -> int | None:
        """With another model on the model thread that ran in the last few seconds, a batch cut to about
        config.shared_batch_seconds of this model's time (at least SHARED_BATCH_MIN_TOKENS), so its requests wait
        about that long for it; otherwise, no cut."""
        if self.turns is None or not self.turns.others_active(self, asyncio.get_running_loop().time()):
            return None
        return max(SHARED_BATCH_MIN_TOKENS, int(self.config.shared_batch_seconds / self.scheduler.seconds_per_token))

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[WorkItem], formed: float) -> None:
        if self.turns is not None:  # another model's batch may go first: its time counts as queueing
            await self.turns.acquire(min(it.deadline for it in batch), self)
        start = time.monotonic()
        for item in batch:
            if item.request.first_batch == formed:
                item.request.first_batch = start
        tokens = sum(len(it.ids) for it in batch)
        self.running_seqs, self.running_tokens = len(batch), tokens
        try:
            out = await loop.run_in_executor(self._model_thread, self._forward, *batch_inputs(batch))
        except Exception as e:  # the model failed on this batch: fail its requests, keep serving
            log.exception("batch of %d sequences failed", len(batch))
            error = e if isinstance(e, EmberError) else EmberError(f"embedding failed: {e}")
            self._settle(self.scheduler.fail(batch, error, time.monotonic()))
            return
        finally:
            self.running_seqs = self.running_tokens = 0
            if self.turns is not None:
                self.turns.release()
        end = time.monotonic()
        if self.observer is not None:
            self.observer(len(batch), tokens, end - start)
        self._settle(self.scheduler.complete(batch, out, end - start, end))

    def _forward(self, *inputs: Any) -> Any:
        """One batch on the model thread (model_busy while it runs)."""
        self.model_busy = True
        try:
            return self.runner.run(*inputs)
        finally:
            self.model_busy = False

    def _settle(self, requests: list[Request]) -> None:
        for request in requests:
            entry = self._waiting.get(id(request))
            if entry is None or entry[1].done():
                continue
            future = entry[1]
            if request.failed is not None:
                future.set_exception(request.failed)
            else:
                future.set_result(None)
