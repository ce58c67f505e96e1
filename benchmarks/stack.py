"""The retrieval stack in one process against two single-model servers, same machine, same run.

    python benchmarks/stack.py [--rounds 3] [--seconds 20]

Models: the bundled all-MiniLM-L6-v2 (real weights) embeds; a cross-encoder in cross-encoder/ms-marco-MiniLM-L-6-v2's
exact shape (BERT, 6 layers, 384 wide; random weights, built once under models/) reranks.

- stack: one `ember serve` running both (`--models`), computing on every core;
- pair: two servers, one model each, each bound to its own core (`--cpu-bind`), as two pods of one core each.

Mixed load on each leg for `--seconds`: two clients rerank (a query and 20 passages of ~40 words, back to back)
while one client sends single short queries to the embedder one at a time (a RAG question's first step). Reported:
the embedding p50, the rerank throughput (pairs/s) and the peak RSS (the pair's summed). Legs alternate within each
round (the order reversed every other round); the table holds medians over rounds. Writes
benchmarks/results/stack.json. Never run it beside tests or another benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
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


async def _embed_client(url: str, queries: list[str], until: float) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(timeout=120) as http:
        i = 0
        while time.monotonic() < until:
            start = time.perf_counter()
            r = await http.post(f"{url}/v1/embeddings", json={"model": "embed", "input": queries[i % len(queries)]})
            r.raise_for_status()
            latencies.append(time.perf_counter() - start)
            i += 1
    return latencies


async def _rerank_client(url: str, passages: list[str], until: float, offset: int) -> int:
    pairs = 0
    async with httpx.AsyncClient(timeout=120) as http:
        i = offset
        while time.monotonic() < until:
            docs = [passages[(i + k) % len(passages)] for k in range(20)]
            body = {"model": "rerank", "query": f"question {i} about retrieval latency", "documents": docs}
            (await http.post(f"{url}/rerank", json=body)).raise_for_status()
            pairs += len(docs)
            i += 20
    return pairs


async def _load(embed_url: str, rerank_url: str, seconds: float) -> dict[str, float]:
    queries = [f"what is the {i}th way to cut retrieval latency?" for i in range(200)]
    passages = make_texts((40,) * 400, seed=3)
    until = time.monotonic() + seconds
    embed, *reranks = await asyncio.gather(
        _embed_client(embed_url, queries, until),
        _rerank_client(rerank_url, passages, until, 0),
        _rerank_client(rerank_url, passages, until, 200),
    )
    return {"embed_p50_ms": 1000 * statistics.median(embed), "embeds": len(embed),
            "rerank_pairs_per_s": sum(reranks) / seconds}  # fmt: skip


def _warm(url: str) -> None:
    httpx.post(f"{url}/v1/embeddings", json={"model": "embed", "input": "warm"}, timeout=120).raise_for_status()
    httpx.post(f"{url}/rerank", json={"model": "rerank", "query": "q", "documents": ["d"]}, timeout=120)


def stack_leg(models_file: Path, seconds: float, port: int = 18200) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    cmd = ember_command(None, port, "--served-model-name", "embed", "--models", str(models_file))
    proc, _ = launch(cmd, url, ROOT / "benchmarks/results/stack-server.log")
    try:
        with PeakRss(proc.pid) as peak:
            settled(url)
            _warm(url)
            out = asyncio.run(_load(url, url, seconds))
        return {**out, "peak_rss_gib": peak.bytes / 2**30}
    finally:
        stop(proc)


def pair_leg(seconds: float, port: int = 18210) -> dict[str, float]:
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
                _warm(url)
            out = asyncio.run(_load(urls[0], urls[1], seconds))
        return {**out, "peak_rss_gib": (embed_peak.bytes + rerank_peak.bytes) / 2**30}
    finally:
        for proc in procs:
            stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    build_reranker()
    models_file = ROOT / "benchmarks/results/stack-models.yaml"
    models_file.write_text(f"- model: {RERANKER}\n  served_model_name: rerank\n")
    runs: dict[str, list[dict[str, float]]] = {"stack": [], "pair": []}
    for r in range(args.rounds):
        for leg in ("stack", "pair") if r % 2 == 0 else ("pair", "stack"):
            result = stack_leg(models_file, args.seconds) if leg == "stack" else pair_leg(args.seconds)
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
    out = write_result("stack", {"seconds": args.seconds, "rounds": runs, "median": med})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
