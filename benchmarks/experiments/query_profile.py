"""Where one short query's time goes: tokenising, the forward layer by layer (attention, MLP, norms), pooling,
the engine's own path (queue, batch wait, model thread), and HTTP end to end, each as a median.

    PYTHONPATH=benchmarks python benchmarks/experiments/query_profile.py [--model models/qwen3-emb-0.6b-random] \
        [--dtype auto] [--rounds 30]

In-process parts run the Embedder's runner on one thread, which then serves as the engine's model thread (as
`ember serve` keeps all model work on one thread), and time the engine's path turn about with a bare forward handed
to that thread from the event loop; the HTTP part starts `ember serve` with its default flags (the embedding cache
off, so every query is computed) and sends one query at a time. The GEMM floor is the model's FLOPs for the query
at the GEMM rate probed in the same run (benchmarks/harness/roofline.py).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from run import start_server, stop  # restarts this script under tcmalloc, as the server runs

ROOT = Path(__file__).resolve().parents[2]

QUERY = "how do I size an embedding server for a four core kubernetes pod"


def _median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def in_process(model: str, dtype: str, rounds: int) -> dict[str, float]:
    """Every forward on one thread, which then serves as the engine's model thread: OpenMP keeps a pool of workers
    for each thread that runs parallel work, and with two pools on 2 cores its workers sleep between kernels, which
    would slow every forward measured after the first pool (ember serve runs all model work on its model thread)."""
    import torch

    from ember import Embedder
    from ember.cli.runtime import native_config
    from ember.config import EngineConfig
    from ember.engine.engine import AsyncEngine, EmbedParams

    thread = ThreadPoolExecutor(1, thread_name_prefix="ember-model")
    embedder = thread.submit(Embedder, model, dtype=dtype, native=native_config()).result()
    runner, tokenizer = embedder._loaded.runner, embedder.tokenizer
    ids = tokenizer.encode(QUERY)
    for _ in range(3):
        thread.submit(embedder.embed, QUERY).result()
    stages: dict[str, list[float]] = defaultdict(list)
    blocks = getattr(runner.model, "layers", None) or getattr(runner.model, "blocks", None) or []
    spans: dict[str, float] = {}

    def timed(name: str, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(lambda *_: spans.__setitem__(name, time.perf_counter()))
        module.register_forward_hook(lambda *_: stages[name].append(time.perf_counter() - spans[name]))

    parts = ("self_attn", "attention", "attn", "mlp", "feed_forward")
    hooked = [(part, getattr(b, part)) for b in blocks for part in parts if hasattr(b, part)]
    for part, module in hooked:
        timed(f"layer.{part}", module)

    def forward() -> None:
        start = time.perf_counter()
        tokenizer.encode(QUERY)
        stages["tokenise"].append(time.perf_counter() - start)
        start = time.perf_counter()
        runner.run([ids])
        stages["runner.run (forward + pooling)"].append(time.perf_counter() - start)

    for _ in range(rounds):
        thread.submit(forward).result()
    out = {name: _median_ms(t) * (len(blocks) if name.startswith("layer.") else 1) for name, t in stages.items()}
    out = {(f"{k} (x{len(blocks)} layers)" if k.startswith("layer.") else k): v for k, v in out.items()}
    for _, module in hooked:  # the engine's rows below time whole requests only
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()

    async def through_engine() -> tuple[list[float], list[float]]:
        engine = AsyncEngine(runner, tokenizer, EngineConfig(), None, model_thread=thread)
        await engine.start()
        loop = asyncio.get_running_loop()
        direct, engined = [], []
        try:
            for _ in range(rounds):  # turn about: the model thread alone, then the whole engine path
                start = time.perf_counter()
                await loop.run_in_executor(thread, runner.run, [ids])
                direct.append(time.perf_counter() - start)
                start = time.perf_counter()
                await engine.embed(QUERY, EmbedParams())
                engined.append(time.perf_counter() - start)
        finally:
            await engine.stop()
        return direct, engined

    direct, engined = asyncio.run(through_engine())
    out["runner.run handed to the model thread from the event loop"] = _median_ms(direct)
    out["engine.embed (tokenise, queue, batch wait, model thread)"] = _median_ms(engined)
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
