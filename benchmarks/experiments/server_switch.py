"""ember served with an environment switch on and off, one server at a time, alternating: one client's query latency,
8 clients' queries, and the server's peak memory.

Each side is a fresh `ember serve` (the switch is read at start-up); once its native kernels and compiled regions
are in use (GET /info), it gets --single queries one after another (a RAG query path: p50 and p99) and the
`queries` workload of `ember bench` (200 queries, 8 closed-loop clients). Sides alternate on, off, off, on ...;
medians over rounds are printed with off / on.

    PYTHONPATH=benchmarks python benchmarks/experiments/server_switch.py --switch EMBER_NATIVE_LINEAR --dtype float32
    EMBER_MAX_ISA=avx512 PYTHONPATH=benchmarks python benchmarks/experiments/server_switch.py \
        --switch EMBER_NATIVE_LINEAR --dtype float32 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
from harness import (
    QWEN_DIR,
    PeakRss,
    launch,
    stop,
)

from ember.cli.bench import WORKLOADS, make_texts, run_workload

ROOT = Path(__file__).resolve().parents[2]

URL = "http://127.0.0.1:8200"


def _wait_for_kernels(timeout: float = 600) -> None:
    """Until /info says the compiled regions are in use (the native kernels' build finishes before them)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        kernels = httpx.get(f"{URL}/info", timeout=5).json().get("kernels", {})
        if kernels.get("fused", {}).get("active"):
            return
        time.sleep(1)
    raise SystemExit("the server's kernels were not in use after 10 minutes")


def _single(n: int, round: int) -> list[float]:
    """n queries of ~20 tokens, one at a time: each one's seconds."""
    texts = make_texts((20,) * n, seed=1000 + round)
    out = []
    with httpx.Client(timeout=120) as client:
        for text in texts:
            start = time.perf_counter()
            client.post(f"{URL}/v1/embeddings", json={"input": text, "model": "m"}).raise_for_status()
            out.append(time.perf_counter() - start)
    return out


def _side(args: argparse.Namespace, on: bool, round: int) -> dict[str, float]:
    env = {**os.environ, args.switch: "1" if on else "0"}
    cmd = [sys.executable, "-m", "ember.cli.main", "serve", args.model, "--dtype", args.dtype, "--port", URL[-4:],
           "--served-model-name", "m"]  # fmt: skip
    os.environ.update(env)  # launch() passes the environment on
    proc, ready = launch(cmd, URL, ROOT / "benchmarks/results/server-switch.log")
    try:
        with PeakRss(proc.pid) as peak:
            _wait_for_kernels()
            single = sorted(_single(args.single, round))
            queries = asyncio.run(run_workload(URL, "m", WORKLOADS["queries"], round=round))
        return {
            "ready s": ready,
            "1 client p50 ms": 1e3 * single[len(single) // 2],
            "1 client p99 ms": 1e3 * single[int(len(single) * 0.99)],
            "8 clients tok/s": queries.tokens_per_s,
            "8 clients p50 ms": queries.p50_ms,
            "peak RSS GiB": peak.bytes / 2**30,
        }
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", required=True, help="an EMBER_NATIVE_* variable")
    ap.add_argument("--model", default=str(QWEN_DIR))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--single", type=int, default=40, help="queries sent one at a time per side")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            runs[on].append(_side(args, on, r))
            print(f"round {r + 1}, {args.switch}={int(on)}: {runs[on][-1]}", flush=True)
    print(f"{'':>18s} {'on':>9s} {'off':>9s} {'off / on':>9s}")
    for key in runs[True][0]:
        on, off = (statistics.median(x[key] for x in runs[side]) for side in (True, False))
        print(f"{key:>18s} {on:9.2f} {off:9.2f} {off / on:9.2f}")


if __name__ == "__main__":
    main()
