"""Long documents: peak server RSS for a 32,000-token document, and query latency while it is embedded.

    PYTHONPATH=benchmarks python benchmarks/experiments/long_docs.py
    # Qwen3-0.6B shape, bf16, --max-model-len 8192, chunked processing

Prints the query p50/p99 on an idle server and while the long document runs, and the order things finished in.
Never run beside tests or another benchmark.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import httpx
from harness import QWEN_DIR, peak_rss
from run import start_server

from ember.cli.bench import make_texts

ROOT = Path(__file__).resolve().parents[2]

URL = "http://127.0.0.1:18123"


async def queries(http: httpx.AsyncClient, n: int, done: list[str]) -> list[float]:
    latencies = []
    for text in make_texts((20,) * n, seed=7):
        start = time.perf_counter()
        r = await http.post(f"{URL}/v1/embeddings", json={"model": str(QWEN_DIR), "input": text})
        r.raise_for_status()
        latencies.append(time.perf_counter() - start)
    done.append("queries")
    return latencies


async def long_doc(http: httpx.AsyncClient, done: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    r = await http.post(f"{URL}/v1/embeddings", json={"model": str(QWEN_DIR), "input": make_texts((32000,))[0]})
    r.raise_for_status()
    done.append("document")
    return r.json()["usage"]["prompt_tokens"], time.perf_counter() - start


async def main() -> None:
    proc, _ = start_server(
        str(QWEN_DIR),
        ["--dtype", "bfloat16", "--max-model-len", "8192", "--pooler-config", '{"enable_chunked_processing": true}'],
    )
    try:
        async with httpx.AsyncClient(timeout=900) as http:
            idle = await queries(http, 20, [])
            done: list[str] = []
            doc_task = asyncio.create_task(long_doc(http, done))
            await asyncio.sleep(1.0)
            busy = await queries(http, 20, done)
            tokens, seconds = await doc_task
        rss = peak_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait()

    def q(xs: list[float]) -> str:
        p = statistics.quantiles(xs, n=100, method="inclusive")
        return f"p50 {p[49] * 1000:6.0f} ms, p99 {p[98] * 1000:6.0f} ms"

    print(
        f"32k document: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.0f} tok/s; "
        f"server peak RSS {rss / 2**30:.2f} GiB"
    )
    print(f"queries on an idle server:       {q(idle)}")
    print(f"queries while the document runs: {q(busy)}   (finished first: {done[0]})")


if __name__ == "__main__":
    asyncio.run(main())
