"""The async engine on a fake runner: futures, threads, cancellation, failures and kernels.

Scheduling decisions (order, budgets, batch wait) are the pure Scheduler's, tested without a clock in
test_scheduler.py; here the engine is only waited on for states it reaches, never timed."""

import asyncio
import threading

import numpy as np
import pytest

from ember.config import EngineConfig, PoolerConfig
from ember.engine.engine import AsyncEngine, EmbedParams
from ember.errors import EngineDeadError, OverloadedError, ShuttingDownError


def run(coro):
    return asyncio.run(coro)


async def until(condition, polls=5000):
    """Yield to the engine until `condition()` holds (a state it must reach, not a time)."""
    for _ in range(polls):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the engine never reached the state the test waits for")


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
        await until(lambda: engine.queued_requests == len(texts))
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


def test_token_states_and_pooled_vectors_share_a_batch_and_each_gets_its_own(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer)
        runner.batches.clear()  # the warm-up's
        runner.gate.clear()
        texts = ["first text here", "second", "and a third one"]
        pooled = asyncio.create_task(engine.embed(texts[:2]))
        tokens = asyncio.create_task(engine.embed(texts[2:], EmbedParams(output="token_embed", normalize=False)))
        await until(lambda: engine.queued_requests == 2)
        runner.gate.set()
        results = await asyncio.gather(pooled, tokens)
        await engine.stop()
        return texts, results

    texts, (pooled, tokens) = run(main())
    assert len(runner.batches) == 1  # one forward served both kinds
    for text, vector in zip(texts[:2], pooled.vectors, strict=True):
        np.testing.assert_allclose(vector, runner.expected(tokenizer.encode(text)), atol=1e-6)
    ids = tokenizer.encode(texts[2])
    np.testing.assert_array_equal(tokens.vectors[0], runner.table[ids])
    assert tokens.token_counts == [len(ids)]


def test_a_cancelled_request_is_never_computed(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer)
        runner.gate.clear()
        first = asyncio.create_task(engine.embed([[1, 2, 3]]))
        await until(lambda: engine.running_seqs == 1)  # the first batch is running (blocked on the gate)
        gone = asyncio.create_task(engine.embed([[11, 12, 13, 14]]))
        await until(lambda: engine.queued_requests == 2)
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
        await until(lambda: engine.queued_requests == 2)
        with pytest.raises(OverloadedError) as e:
            await engine.embed([[3] * 10])
        assert e.value.retry_after >= 1
        runner.gate.set()
        await asyncio.gather(*held)
        assert engine.queued_requests == 0 and engine.queued_tokens == 0
        await engine.embed([[3] * 10])  # accepted again once the queue drains
        await engine.stop()

    run(main())


def test_a_clients_timeout_shorter_than_the_wait_is_refused_at_once(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer, seconds_per_token=0.1, max_queue_seconds=60.0)
        await engine.embed([[3] * 4])  # one measured batch: from then on the running batch counts in the wait
        runner.gate.clear()
        held = asyncio.create_task(engine.embed([[3] * 30] * 4))  # 12 s of work at the assumed cost
        await until(lambda: engine.running_seqs == 4)  # on the model thread (held there by the gate)
        with pytest.raises(OverloadedError) as e:
            await engine.embed([[3] * 10], timeout=5.0)
        assert e.value.retry_after >= 1
        queued = asyncio.create_task(engine.embed([[3] * 10], timeout=60.0))  # within its own limit: admitted
        await until(lambda: engine.queued_requests == 2)
        runner.gate.set()
        await asyncio.gather(held, queued)
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
        await until(lambda: not _kernel_threads())  # the kernel thread ends with its work (and its OpenMP pool)
        after = await engine.embed(["served after"])
        await engine.stop()
        return engine.kernels, result, after

    kernels, result, after = run(main())
    assert kernels["fused"].active == (error is None)
    assert kernels["fused"].detail.startswith("compile failed" if error else "torch.compile regions")
    assert kernels["attention"] == runner.load_kernels()[0]  # the runner's report, as /info and /metrics show it
    assert len(result.vectors) == len(after.vectors) == 1
    assert runner.compiled.is_set() == (error is None)


def _kernel_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ember-kernels")]


def test_kernels_are_not_compiled_unless_asked_but_native_ones_still_load(runner, tokenizer):
    async def main():
        engine = await _started(runner, tokenizer)
        await engine.embed(["x"])
        await until(lambda: not _kernel_threads())
        await engine.stop()
        return engine.kernels

    kernels = run(main())
    assert not runner.compiled.is_set()
    assert kernels["fused"].detail == "off (--enforce-eager)" and not kernels["fused"].active
    assert "attention" in kernels  # --enforce-eager governs torch.compile only


def test_serve_start_up_runs_no_torch_work_on_the_main_thread(tmp_path, monkeypatch):
    """OpenMP keeps a pool of workers for every thread that ran parallel work, and the main thread lives as long as
    the server: one tiny product there at start-up left a second pool, and with more pooled workers than CPUs the
    model thread's worker slept between kernels instead of spinning (a served query took longer than the same
    forward in-process). Planning and loading run on a thread that ends with them: no torch operator may run on
    the main thread while `ember serve` starts. The CPU is taken to be an AMD one, whose plan checks oneDNN's
    float32 product on a tiny matrix."""

    from checkpoints.builders import build_bert
    from ember.cli import serve
    from ember.cli.main import build_parser
    from ember.ops import linear
    from torch_ops import ThreadOps

    build_bert(tmp_path / "m")
    monkeypatch.setattr(linear, "cpu_vendor", lambda: "AuthenticAMD")
    linear.onednn_f32.cache_clear()
    args = build_parser().parse_args(["serve", str(tmp_path / "m"), "--dtype", "float32", "--enforce-eager"])
    try:
        with ThreadOps() as main_thread:
            models = serve._models(args, threads=2)
    finally:
        linear.onednn_f32.cache_clear()  # the next test sees its own CPU again
    assert len(models) == 1 and models[0].names == (str(tmp_path / "m"),)
    assert main_thread.ops == []
