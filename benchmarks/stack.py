"""The retrieval stack in one process against two single-model servers, same machine, same run.

    python benchmarks/stack.py [--rounds 3] [--seconds 20]

Models: the bundled all-MiniLM-L6-v2 (real weights) embeds; a cross-encoder in cross-encoder/ms-marco-MiniLM-L-6-v2's
exact shape (BERT, 6 layers, 384 wide; random weights, built once under models/) reranks.

- stack: one `ember serve` running both (`--models`), computing on every core;
- pair: two servers, one model each, each bound to its own core (`--cpu-bind`), as two pods of one core each;
- same: the embedder alone, its flood embedding the same passages instead (what the query's latency would be under
  the same flood on its own model).

Mixed load on each leg for `--seconds`: two clients rerank (a query and 20 new passages of ~40 words, back to back:
a flood) while one client sends single short queries to the embedder, `--query-rate` a second (a RAG question's
first step). Reported:
the embedding p50, the rerank throughput (pairs/s) and the peak RSS (the pair's summed). Legs alternate within each
round (the order reversed every other round); the table holds medians over rounds. Writes
benchmarks/results/stack.json. Never run it beside tests or another benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from harness import ROOT, PeakRss, checkpoints, cpu_description, ember_command, launch, settled, stop, write_result

from ember.cli.bench import make_texts

RERANKER = ROOT / "models" / "ms-marco-minilm-l6-shape-random"


def build_reranker() -> Path:
    if not (RERANKER / "config.json").is_file():
        checkpoints().build_cross_encoder(RERANKER, kind="bert", layers=6, hidden=384, heads=12)
    return RERANKER


async def _embed_client(url: str, queries: list[str], until: float, rate: float) -> list[float]:
    """Single queries, one at a time, `rate` a second (the next one at once when one took longer)."""
    latencies = []
    async with httpx.AsyncClient(timeout=120) as http:
        i = 0
        while time.monotonic() < until:
            await asyncio.sleep(max(0.0, 1 / rate - (latencies[-1] if latencies else 0.0)))
            start = time.perf_counter()
            r = await http.post(f"{url}/v1/embeddings", json={"model": "embed", "input": queries[i % len(queries)]})
            r.raise_for_status()
            latencies.append(time.perf_counter() - start)
            i += 1
    return latencies


async def _rerank_client(url: str, until: float, offset: int, same: bool = False) -> int:
    """Reranks (a query and 20 passages) back to back; `same`: embeds the 20 passages instead."""
    pairs = 0
    async with httpx.AsyncClient(timeout=120) as http:
        i = offset
        while time.monotonic() < until:
            docs = make_texts((40,) * 20, seed=i)  # new passages each time: nothing answered from a cache
            if same:
                r = await http.post(f"{url}/v1/embeddings", json={"model": "embed", "input": docs})
            else:
                body = {"model": "rerank", "query": f"question {i} about retrieval latency", "documents": docs}
                r = await http.post(f"{url}/rerank", json=body)
            r.raise_for_status()
            pairs += len(docs)
            i += 20
    return pairs


async def _load(embed_url: str, rerank_url: str, seconds: float, rate: float, same: bool = False) -> dict[str, float]:
    queries = [f"what is the {i}th way to cut retrieval latency?" for i in range(100_000)]
    until = time.monotonic() + seconds
    embed, *reranks = await asyncio.gather(
        _embed_client(embed_url, queries, until, rate),
        _rerank_client(rerank_url, until, 0, same),
        _rerank_client(rerank_url, until, 10**6, same),
    )
    return {"embed_p50_ms": 1000 * statistics.median(embed), "embeds": len(embed),
            "rerank_pairs_per_s": sum(reranks) / seconds}  # fmt: skip


def _warm(embed_url: str, rerank_url: str) -> None:
    body = {"model": "embed", "input": "warm"}
    httpx.post(f"{embed_url}/v1/embeddings", json=body, timeout=120).raise_for_status()
    body = {"model": "rerank", "query": "q", "documents": ["d"]}
    httpx.post(f"{rerank_url}/rerank", json=body, timeout=120).raise_for_status()


def stack_leg(models_file: Path, seconds: float, rate: float, port: int = 18200) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    cmd = ember_command(None, port, "--served-model-name", "embed", "--models", str(models_file))
    proc, _ = launch(cmd, url, ROOT / "benchmarks/results/stack-server.log")
    try:
        with PeakRss(proc.pid) as peak:
            settled(url)
            _warm(url, url)
            out = asyncio.run(_load(url, url, seconds, rate))
        return {**out, "peak_rss_gib": peak.bytes / 2**30}
    finally:
        stop(proc)


def same_leg(seconds: float, rate: float, port: int = 18220) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    proc, _ = launch(
        ember_command(None, port, "--served-model-name", "embed"), url, ROOT / "benchmarks/results/stack-same.log"
    )
    try:
        with PeakRss(proc.pid) as peak:
            settled(url)
            httpx.post(f"{url}/v1/embeddings", json={"input": "warm"}, timeout=120).raise_for_status()
            out = asyncio.run(_load(url, url, seconds, rate, same=True))
        return {**out, "peak_rss_gib": peak.bytes / 2**30}
    finally:
        stop(proc)


def pair_leg(seconds: float, rate: float, port: int = 18210) -> dict[str, float]:
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    cmds = [
        ember_command(None, port, "--served-model-name", "embed", "--cpu-bind", "0"),
        ember_command(str(RERANKER), port + 1, "--served-model-name", "rerank", "--cpu-bind", "1"),
    ]
    logs = [ROOT / f"benchmarks/results/stack-pair-{i}.log" for i in range(2)]
    procs = [launch(c, u, log)[0] for c, u, log in zip(cmds, urls, logs, strict=True)]
    try:
        with PeakRss(procs[0].pid) as embed_peak, PeakRss(procs[1].pid) as rerank_peak:
            for url in urls:
                settled(url)
            _warm(*urls)
            out = asyncio.run(_load(urls[0], urls[1], seconds, rate))
        return {**out, "peak_rss_gib": (embed_peak.bytes + rerank_peak.bytes) / 2**30}
    finally:
        for proc in procs:
            stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--query-rate", type=float, default=10.0, help="single queries a second (default 10)")
    args = ap.parse_args()
    build_reranker()
    models_file = Path(tempfile.mkdtemp()) / "stack-models.yaml"
    models_file.write_text(f"- model: {RERANKER}\n  served_model_name: rerank\n")
    t, q = args.seconds, args.query_rate
    legs = {
        "stack": lambda: stack_leg(models_file, t, q),
        "pair": lambda: pair_leg(t, q),
        "same": lambda: same_leg(t, q),
    }
    runs: dict[str, list[dict[str, float]]] = {leg: [] for leg in legs}
    for r in range(args.rounds):
        for leg in list(legs) if r % 2 == 0 else list(legs)[::-1]:
            result = legs[leg]()
            runs[leg].append(result)
            print(f"round {r + 1} {leg}: {json.dumps({k: round(v, 2) for k, v in result.items()})}", flush=True)
    med = {leg: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for leg, rs in runs.items()}
    s, p = med["stack"], med["pair"]
    print(f"\n{cpu_description()}; medians of {args.rounds} rounds, {args.seconds:.0f} s of mixed load each\n")
    print("| | one process, both models, 2 cores | two servers, one core each | stack / pair |")
    print("|---|---|---|---|")
    print(f"| embedding p50 (one short query) | {s['embed_p50_ms']:.1f} ms | {p['embed_p50_ms']:.1f} ms | "
          f"{s['embed_p50_ms'] / p['embed_p50_ms']:.2f}x |")  # fmt: skip
    print(f"| rerank throughput | {s['rerank_pairs_per_s']:.0f} pairs/s | {p['rerank_pairs_per_s']:.0f} pairs/s | "
          f"{s['rerank_pairs_per_s'] / p['rerank_pairs_per_s']:.2f}x |")  # fmt: skip
    print(f"| peak RSS | {s['peak_rss_gib']:.2f} GiB | {p['peak_rss_gib']:.2f} GiB | "
          f"{s['peak_rss_gib'] / p['peak_rss_gib']:.2f}x |")  # fmt: skip
    print(f"\nthe same flood on the embedder itself (embedding the passages): query p50 "
          f"{med['same']['embed_p50_ms']:.1f} ms")  # fmt: skip
    out = write_result("stack", {"seconds": args.seconds, "rounds": runs, "median": med})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
