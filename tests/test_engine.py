"""The async engine on a fake runner: batching, ordering, backpressure, cancellation, failures."""

import asyncio
import threading

import numpy as np
import pytest

from ember.config import EngineConfig, PoolerConfig
from ember.engine import engine as engine_module
from ember.engine.engine import AsyncEngine, EmbedParams
from ember.errors import EngineDeadError, OverloadedError, ShuttingDownError


def run(coro):
    return asyncio.run(coro)


async def _started(runner, tokenizer, **kw):
    pooler = kw.pop("pooler", None)
    engine = AsyncEngine(runner, tokenizer, EngineConfig(**kw), pooler)
    await engine.start()
    return engine


def test_concurrent_requests_are_batched_and_each_gets_its_own_vectors(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer)
        runner.gate.clear()  # hold the model so requests pile up and share batches
        texts = [f"text number {i} " * (1 + i % 5) for i in range(32)]
        tasks = [asyncio.create_task(engine.embed([t])) for t in texts]
        await asyncio.sleep(0.05)
        runner.gate.set()
        results = await asyncio.gather(*tasks)
        await engine.stop()
        return texts, results

    texts, results = run(main())
    assert len(runner.batches) < len(texts)  # batching happened
    for text, result in zip(texts, results, strict=True):
        ids = tokenizer.encode(text)
        assert result.token_counts == [len(ids)]
        np.testing.assert_allclose(result.vectors[0], runner.expected(ids), atol=1e-6)


def test_batches_respect_token_and_sequence_limits(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer, max_num_batched_tokens=20, max_num_seqs=3)
        runner.gate.clear()
        tasks = [asyncio.create_task(engine.embed([[7] * 6])) for _ in range(10)]
        await asyncio.sleep(0.05)
        runner.gate.set()
        await asyncio.gather(*tasks)
        await engine.stop()

    run(main())
    for batch in runner.batches[1:]:
        assert len(batch) <= 3 and sum(map(len, batch)) <= 20


def test_a_lone_client_does_not_pay_the_batch_wait(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer, batch_wait_seconds=5.0)
        # one client, one request at a time: nothing else is coming, so none of them waits the 5 s
        results = [await asyncio.wait_for(engine.embed([[3, 4, 5]]), 2.5) for _ in range(3)]
        await engine.stop()
        return results

    results = run(main())
    assert [len(b) for b in runner.batches[1:]] == [1, 1, 1]
    assert all(r.queue_seconds < 2.5 for r in results)


def test_a_burst_on_an_idle_engine_lands_in_one_batch(runner, tokenizer, monkeypatch):
    monkeypatch.setattr(engine_module, "_SETTLE_SECONDS", 0.2)  # wide, so a slow CI machine keeps the spacing

    async def main():
        engine = await _started(runner, tokenizer, batch_wait_seconds=5.0)

        async def client(i):  # four requests landing 20 ms apart on an engine that ran nothing yet
            await asyncio.sleep(0.02 * i)
            return await engine.embed([[30 + i, 2]])

        await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(4))), 2.5)
        await engine.stop()

    run(main())
    assert [len(b) for b in runner.batches[1:]] == [4]  # not the first alone, and not after the 5 s


def test_closed_loop_clients_share_one_batch_and_do_not_wait_for_more(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer, batch_wait_seconds=5.0)

        async def client(i, n):  # each sends its next request when the last one is answered
            for j in range(n):
                await engine.embed([[10 + i, 20 + j]])

        runner.gate.clear()
        clients = [asyncio.create_task(client(0, 4))]  # finds an idle engine: starts at once, alone
        await asyncio.sleep(0.05)
        clients += [asyncio.create_task(client(i, 3)) for i in (1, 2, 3)]  # arrive while it runs
        await asyncio.sleep(0.05)
        runner.gate.set()
        await asyncio.wait_for(asyncio.gather(*clients), 2.5)
        await engine.stop()

    run(main())
    # four requests have been in flight at once, so the next batches wait for all four clients (not for
    # the 5 s, and never settling into a batch of three and a batch of one that take turns)
    assert [len(b) for b in runner.batches[1:]] == [1, 4, 4, 4]


def test_short_queries_overtake_a_long_bulk_request(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer, max_num_batched_tokens=32, max_num_seqs=1)
        runner.gate.clear()
        done = []
        bulk = asyncio.create_task(engine.embed([[9] * 30] * 20))
        bulk.add_done_callback(lambda _: done.append("bulk"))
        await asyncio.sleep(0.02)
        queries = [asyncio.create_task(engine.embed([[4, 5]])) for _ in range(3)]
        for q in queries:
            q.add_done_callback(lambda _: done.append("query"))
        await asyncio.sleep(0.02)
        runner.gate.set()
        await asyncio.gather(bulk, *queries)
        await engine.stop()
        return done

    assert run(main()) == ["query", "query", "query", "bulk"]


def test_a_cancelled_request_is_never_computed(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer)
        runner.gate.clear()
        first = asyncio.create_task(engine.embed([[1, 2, 3]]))
        await asyncio.sleep(0.02)  # the first batch is now running (blocked on the gate)
        gone = asyncio.create_task(engine.embed([[11, 12, 13, 14]]))
        await asyncio.sleep(0.02)
        gone.cancel()
        runner.gate.set()
        await first
        after = await engine.embed([[21, 22]])
        await engine.stop()
        return after

    after = run(main())
    seen = [seq for batch in runner.batches for seq in batch]
    assert [11, 12, 13, 14] not in seen and [21, 22] in seen and after.token_counts == [2]


def test_overload_is_refused_at_once_with_retry_after(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer, max_queued_requests=2, max_queued_tokens=100)
        runner.gate.clear()
        held = [asyncio.create_task(engine.embed([[3] * 10])) for _ in range(2)]
        await asyncio.sleep(0.02)
        with pytest.raises(OverloadedError) as e:
            await engine.embed([[3] * 10])
        assert e.value.retry_after >= 1
        runner.gate.set()
        await asyncio.gather(*held)
        assert engine.queued_requests == 0 and engine.queued_tokens == 0
        await engine.embed([[3] * 10])  # accepted again once the queue drains
        await engine.stop()

    run(main())


def test_token_budget_of_the_queue_is_enforced(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer, max_queued_tokens=50)
        runner.gate.clear()
        held = asyncio.create_task(engine.embed([[3] * 30]))
        await asyncio.sleep(0.02)
        with pytest.raises(OverloadedError):
            await engine.embed([[3] * 30])
        runner.gate.set()
        await held
        await engine.stop()

    run(main())


def test_model_failure_fails_only_that_batch(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer)
        runner.fail_when = lambda batch: [66, 66] in batch
        with pytest.raises(Exception, match="simulated model failure"):
            await engine.embed([[66, 66]])
        ok = await engine.embed([[5, 6]])
        alive = engine.alive
        await engine.stop()
        return ok, alive

    ok, alive = run(main())
    assert ok.token_counts == [2] and alive


def test_stopping_refuses_new_work_and_a_stopped_engine_is_dead(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer)
        await engine.embed([[1]])
        stopping = asyncio.create_task(engine.stop(grace_seconds=1))
        await asyncio.sleep(0)
        with pytest.raises(ShuttingDownError):
            await engine.embed([[1]])
        await stopping
        engine.closing = False
        with pytest.raises(EngineDeadError):
            await engine.embed([[1]])

    run(main())


def test_chunked_input_is_the_token_weighted_mean_of_its_windows(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer, pooler=PoolerConfig(enable_chunked_processing=True))
        text = " ".join(f"word{i}" for i in range(40))
        ids = tokenizer.encode(text)
        result = await engine.embed([text])
        await engine.stop()
        return ids, result

    ids, result = run(main())
    max_len = runner.info.max_model_len
    assert len(ids) > max_len and result.token_counts == [len(ids)]
    content, room = ids[1:-1], max_len - 2
    windows = [[ids[0], *content[i : i + room], ids[-1]] for i in range(0, len(content), room)]
    assert all(len(w) <= max_len for w in windows)
    mean = sum(runner.expected(w) * len(w) for w in windows) / sum(len(w) for w in windows)
    np.testing.assert_allclose(result.vectors[0], mean / np.linalg.norm(mean), atol=1e-6)


def test_truncation_keeps_special_tokens_and_counts_what_was_embedded(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer)
        text = " ".join(f"word{i}" for i in range(40))
        right = await engine.embed([text], EmbedParams(truncate_prompt_tokens=8))
        left = await engine.embed([text], EmbedParams(truncate_prompt_tokens=-1, truncation_side="left"))
        await engine.stop()
        return tokenizer.encode(text), right, left

    ids, right, left = run(main())
    assert right.token_counts == [8] and left.token_counts == [32]
    np.testing.assert_allclose(right.vectors[0], runner.expected([*ids[:7], ids[-1]]), atol=1e-6)
    np.testing.assert_allclose(left.vectors[0], runner.expected([ids[0], *ids[-31:]]), atol=1e-6)


@pytest.mark.parametrize("error", [None, RuntimeError("no C++ compiler after all")])
def test_kernels_compile_beside_serving_and_a_failed_compile_keeps_serving(runner, tokenizer, error):
    runner.compile_error = error

    async def main():
        engine = await _started(runner, tokenizer, compile_kernels=True)
        result = await engine.embed(["served while compiling"])
        for _ in range(200):
            if engine.kernels != "compiling":
                break
            await asyncio.sleep(0.01)
        after = await engine.embed(["served after"])
        for _ in range(200):  # the compile thread ends with its work (and OpenMP's worker pool with it)
            if not _compile_threads():
                break
            await asyncio.sleep(0.01)
        await engine.stop()
        return engine.kernels, result, after

    kernels, result, after = run(main())
    assert kernels == ("failed" if error else "compiled")
    assert len(result.vectors) == len(after.vectors) == 1
    assert runner.compiled.is_set() == (error is None)
    assert _compile_threads() == []


def _compile_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ember-compile")]


def test_kernels_are_not_compiled_unless_asked(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer)
        await engine.embed(["x"])
        await engine.stop()
        return engine.kernels

    assert run(main()) == "eager" and not runner.compiled.is_set()
