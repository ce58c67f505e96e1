"""Where one short query's time goes: tokenising, the forward layer by layer (attention, MLP, norms), pooling,
the engine's own path (queue, batch wait, model thread), and HTTP end to end, each as a median.

    PYTHONPATH=benchmarks python benchmarks/experiments/query_profile.py [--model models/qwen3-emb-0.6b-random] \
        [--dtype auto] [--rounds 30]

In-process parts run on the Embedder's runner with the server's threads; the HTTP part starts `ember serve` with
its default flags (the embedding cache off, so every query is computed) and sends one query at a time. The GEMM
floor is the model's FLOPs for the query at the GEMM rate probed in the same run (benchmarks/harness/roofline.py).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from run import start_server, stop  # restarts this script under tcmalloc, as the server runs

ROOT = Path(__file__).resolve().parents[2]

QUERY = "how do I size an embedding server for a four core kubernetes pod"


def _median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def in_process(model: str, dtype: str, rounds: int) -> dict[str, float]:
    import torch

    from ember import Embedder
    from ember.cli.runtime import native_config
    from ember.config import EngineConfig
    from ember.engine.engine import AsyncEngine, EmbedParams

    embedder = Embedder(model, dtype=dtype, native=native_config())
    runner, tokenizer = embedder._loaded.runner, embedder.tokenizer
    ids = tokenizer.encode(QUERY)
    for _ in range(3):
        embedder.embed(QUERY)
    stages: dict[str, list[float]] = defaultdict(list)
    blocks = getattr(runner.model, "layers", None) or getattr(runner.model, "blocks", None) or []
    spans: dict[str, float] = {}

    def timed(name: str, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(lambda *_: spans.__setitem__(name, time.perf_counter()))
        module.register_forward_hook(lambda *_: stages[name].append(time.perf_counter() - spans[name]))

    for block in blocks:
        for part in ("self_attn", "attention", "attn", "mlp", "feed_forward"):
            if hasattr(block, part):
                timed(f"layer.{part}", getattr(block, part))
    for _ in range(rounds):
        start = time.perf_counter()
        tokenizer.encode(QUERY)
        stages["tokenise"].append(time.perf_counter() - start)
        start = time.perf_counter()
        runner.run([ids])
        stages["runner.run (forward + pooling)"].append(time.perf_counter() - start)
    out = {name: _median_ms(t) * (len(blocks) if name.startswith("layer.") else 1) for name, t in stages.items()}
    out = {(f"{k} (x{len(blocks)} layers)" if k.startswith("layer.") else k): v for k, v in out.items()}

    async def through_engine() -> list[float]:
        engine = AsyncEngine(runner, tokenizer, EngineConfig(), None)
        await engine.start()
        times = []
        try:
            for _ in range(rounds):
                start = time.perf_counter()
                await engine.embed(QUERY, EmbedParams())
                times.append(time.perf_counter() - start)
        finally:
            await engine.stop()
        return times

    out["engine.embed (tokenise, queue, batch wait, model thread)"] = _median_ms(asyncio.run(through_engine()))
    out["tokens"] = len(ids)
    return out


def over_http(model: str, dtype: str, rounds: int) -> float:
    import httpx

    proc, _, _ = start_server(model, ["--dtype", dtype, "--embedding-cache-size", "0"])
    try:
        with httpx.Client(timeout=60) as client:
            times = []
            for i in range(rounds + 3):
                start = time.perf_counter()
                r = client.post("http://127.0.0.1:18123/v1/embeddings", json={"input": f"{QUERY} {i}", "model": model})
                r.raise_for_status()
                if i >= 3:
                    times.append(time.perf_counter() - start)
    finally:
        stop(proc)
    return _median_ms(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models/qwen3-emb-0.6b-random"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--no-http", action="store_true")
    args = ap.parse_args()
    from ember.hardware import auto_dtype

    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    stages = in_process(args.model, dtype, args.rounds)
    tokens = stages.pop("tokens")
    roofline = str(ROOT / "benchmarks/harness/roofline.py")
    limit = subprocess.run([sys.executable, roofline, args.model, dtype, str(int(tokens))],
                           capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]  # fmt: skip
    rate = ast.literal_eval(limit)["tokens_per_s"]
    print(f"one query of {tokens:.0f} tokens, {dtype}; GEMM floor {1000 * tokens / rate:.1f} ms ({limit})")
    for name, ms in stages.items():
        print(f"  {name:60s} {ms:8.2f} ms")
    if not args.no_http:
        print(f"  {'HTTP end to end (ember serve, default flags, cache off)':60s} "
              f"{over_http(args.model, dtype, args.rounds):8.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
