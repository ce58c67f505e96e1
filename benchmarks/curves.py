"""Throughput against batch size (in-process) and query latency against concurrency (HTTP), as PNG plots.

    python benchmarks/curves.py [--model DIR]      # writes docs/img/throughput-vs-batch.png, latency-vs-concurrency.png

Never run beside tests or another benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from harness import QWEN_DIR, ROOT, stop
from run import start_server

from ember import Embedder
from ember.cli.bench import WORKLOADS, run_workload


def throughput_vs_batch(model: str, sizes: list[int]) -> list[float]:
    embedder = Embedder(model, dtype="bfloat16", max_batch_tokens=1 << 20)
    rng = __import__("numpy").random.default_rng(0)
    out = []
    for b in sizes:
        docs = [[*rng.integers(1000, 100000, 511).tolist(), 151643] for _ in range(b)]
        embedder.embed(docs)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            embedder.embed(docs)
            runs.append(b * 512 / (time.perf_counter() - start))
        out.append(sorted(runs)[1])
        print(f"batch {b:3d} x 512 tokens: {out[-1]:.0f} tok/s", flush=True)
    return out


def latency_vs_concurrency(model: str, levels: list[int]) -> list[tuple[float, float, float]]:
    proc, _, _ = start_server(model, ["--dtype", "bfloat16"])
    try:
        out = []
        for c in levels:
            w = replace(WORKLOADS["queries"], concurrency=c)
            r = asyncio.run(run_workload("http://127.0.0.1:18123", model, w))
            out.append((r.p50_ms, r.p99_ms, r.tokens_per_s))
            print(
                f"{c:3d} clients: p50 {r.p50_ms:.0f} ms, p99 {r.p99_ms:.0f} ms, {r.tokens_per_s:.0f} tok/s", flush=True
            )
        return out
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(QWEN_DIR))
    args = ap.parse_args()
    sizes, levels = [1, 2, 4, 8, 16, 32], [1, 2, 4, 8, 16, 32]
    tput = throughput_vs_batch(args.model, sizes)
    lat = latency_vs_concurrency(args.model, levels)
    img = ROOT / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([s * 512 for s in sizes], tput, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per batch (512-token documents)")
    ax.set_ylabel("tokens/s")
    ax.set_title("ember throughput vs batch size (Qwen3-0.6B shape, bf16, 2 threads)")
    fig.tight_layout()
    fig.savefig(img / "throughput-vs-batch.png", dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(levels, [p50 for p50, _, _ in lat], marker="o", label="p50")
    ax.plot(levels, [p99 for _, p99, _ in lat], marker="o", label="p99")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients (~20-token queries)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("ember query latency vs concurrency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(img / "latency-vs-concurrency.png", dpi=110)
    (ROOT / "benchmarks" / "results" / "curves.json").write_text(
        json.dumps({"batch_sizes": sizes, "tokens_per_s": tput, "concurrency": levels, "latency": lat}, indent=2)
    )


if __name__ == "__main__":
    main()
