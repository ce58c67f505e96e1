"""Indexing a corpus: `ember embed` against the in-process `Embedder` on the same texts, against the way teams
script it today (an asyncio loop over the OpenAI client against `ember serve`), and `ember embed --ray` with 2
actors of 1 CPU against `ember embed` with 2 threads; with the peak RSS of `ember embed` at two corpus sizes.

    python benchmarks/indexing.py --docs 4000 --rounds 2                           # the bundled MiniLM
    python benchmarks/indexing.py --model models/qwen3-emb-0.6b-random --docs 120 --legs embedder,embed
    python benchmarks/indexing.py --docs 20000 --rounds 1 --legs embed --rss-docs 2000   # peak RSS, 2k vs 20k

Documents have the `mixed` workload's lengths (16..1024 tokens, uniform), new texts each round. Every leg runs in
a process of its own, one at a time, in alternating order; the figures are medians over rounds, and each ratio is
the median of the rounds' paired ratios. Each leg's seconds exclude loading the model, except Ray's, which include
starting its actors (each loads the model) but not the cluster. Results: benchmarks/results/indexing-<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, cpu_name, launch, stop

from ember.cli.bench import make_texts

LEGS = ("embedder", "embed", "client", "ray")


def corpus(path: Path, docs: int, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    texts = make_texts(tuple(rng.randint(16, 1024) for _ in range(docs)), seed=seed)
    table = pa.table({"id": [f"doc-{seed}-{i}" for i in range(docs)], "text": texts})
    pq.write_table(table, path, row_group_size=1000)  # as corpus files are written: not one 20,000-row group


def ember(*argv: str) -> list[str]:
    return [sys.executable, "-m", "ember.cli.main", *argv]


def run_leg(leg: str, model: str | None, src: Path, work: Path, port: int, part_rows: int | None = None
            ) -> dict[str, float]:  # fmt: skip
    """One leg, in processes of its own: {tokens, seconds, peak_rss_mib of the embedding process}."""
    model_flag = (["--model", model] if model else []) + (["--part-rows", str(part_rows)] if part_rows else [])
    out = work / f"out-{leg}"
    shutil.rmtree(out, ignore_errors=True)
    if leg == "embed":
        return _child(ember("embed", str(src), "-o", str(out), "--truncate", "--id-column", "id", *model_flag))
    if leg == "ray":
        return _child(ember("embed", str(src), "-o", str(out), "--truncate", "--id-column", "id", *model_flag,
                            "--ray", "--actors", "2", "--cpus-per-actor", "1", "--log-level", "warning"))  # fmt: skip
    if leg == "embedder":
        return _child([sys.executable, __file__, "--in-process", str(src), *(["--model", model] if model else [])])
    server, _ = launch(ember("serve", *([model] if model else []), "--host", "127.0.0.1", "--port", str(port)),
                       f"http://127.0.0.1:{port}", work / "server.log")  # fmt: skip
    while "fused kernels" not in (work / "server.log").read_text():
        time.sleep(0.2)  # its steady state, as `ember embed` and the Embedder reach it before their clocks start
    try:
        return asyncio.run(client_loop(f"http://127.0.0.1:{port}/v1", src))
    finally:
        stop(server)


def _child(cmd: list[str]) -> dict[str, float]:
    """Run a command whose last stdout line is JSON with tokens and seconds; add its own peak RSS (wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{err.read()[-3000:]}")
        result = json.loads(out.read().strip().splitlines()[-1])
    return {"tokens": result["tokens"], "seconds": result["seconds"], "peak_rss_mib": usage.ru_maxrss / 1024}


async def client_loop(base_url: str, src: Path, batch: int = 32, concurrency: int = 4) -> dict[str, float]:
    """What teams write today: the OpenAI client, batches of 32 texts, 4 requests in flight."""
    import pyarrow.parquet as pq
    from openai import AsyncOpenAI

    texts = pq.read_table(src, columns=["text"]).column("text").to_pylist()
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=5, timeout=600)
    model = (await client.models.list()).data[0].id
    batches = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    tokens = 0
    gate = asyncio.Semaphore(concurrency)

    async def one(chunk: list[str]) -> None:
        nonlocal tokens
        async with gate:
            r = await client.embeddings.create(model=model, input=chunk, extra_body={"truncate_prompt_tokens": -1})
            tokens += r.usage.prompt_tokens

    start = time.perf_counter()
    await asyncio.gather(*(one(c) for c in batches))
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "peak_rss_mib": float("nan")}


def in_process(src: Path, model: str | None) -> None:
    """The reference leg: the Embedder on the same texts, in parts of 10,000 as `ember embed` reads them."""
    import pyarrow.parquet as pq

    from ember import Embedder

    texts = pq.read_table(src, columns=["text"]).column("text").to_pylist()
    embedder = Embedder(model, auto_truncate=True)
    embedder.embed(texts[:8])  # as `ember embed`, whose clock starts after loading
    start = time.perf_counter()
    tokens = sum(sum(embedder.embed(texts[i : i + 10_000]).token_counts) for i in range(0, len(texts), 10_000))
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local model directory (default: the bundled MiniLM)")
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--legs", default=",".join(LEGS), help=f"comma list of {', '.join(LEGS)}")
    ap.add_argument("--rss-docs", type=int, default=0, help="also run `ember embed` on this many documents (RSS)")
    ap.add_argument("--part-rows", type=int, default=None, help="passed to `ember embed` (its default: 10,000)")
    ap.add_argument("--name", default=None, help="results file: indexing-NAME.json (default: the model's name)")
    ap.add_argument("--port", type=int, default=18141)
    ap.add_argument("--in-process", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.in_process:
        return in_process(Path(args.in_process), args.model)
    legs = [leg for leg in LEGS if leg in args.legs.split(",")]
    work = Path(tempfile.mkdtemp(prefix="ember-indexing-"))
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        corpus(work / "corpus.parquet", args.docs, seed=1000 + r)
        order = legs if r % 2 == 0 else legs[::-1]
        src = work / "corpus.parquet"
        rounds.append({leg: run_leg(leg, args.model, src, work, args.port, args.part_rows) for leg in order})
        rates = ", ".join(f"{k} {v['tokens'] / v['seconds']:.0f} tok/s" for k, v in rounds[-1].items())
        print(f"round {r + 1}: {rates}", file=sys.stderr)
    small = None
    if args.rss_docs:
        corpus(work / "small.parquet", args.rss_docs, seed=7)
        small = run_leg("embed", args.model, work / "small.parquet", work, args.port, args.part_rows)
    report(args, legs, rounds, small)
    shutil.rmtree(work, ignore_errors=True)


def report(args: argparse.Namespace, legs: list[str], rounds: list[dict], small: dict | None) -> None:
    rate = {leg: statistics.median(r[leg]["tokens"] / r[leg]["seconds"] for r in rounds) for leg in legs}
    pairs = {"embed / embedder": ("embed", "embedder"), "embed / client": ("embed", "client"),
             "ray / embed": ("ray", "embed")}  # fmt: skip
    ratios = {
        name: statistics.median((r[a]["tokens"] / r[a]["seconds"]) / (r[b]["tokens"] / r[b]["seconds"]) for r in rounds)
        for name, (a, b) in pairs.items()
        if a in legs and b in legs
    }
    result = {"cpu": cpu_name(), "model": args.model or "all-MiniLM-L6-v2 (bundled)", "docs": args.docs,
              "part_rows": args.part_rows,
              "rounds": rounds, "tokens_per_second": rate, "ratios": ratios}  # fmt: skip
    if small is not None and "embed" in legs:
        result["peak_rss_mib"] = {args.rss_docs: small["peak_rss_mib"], args.docs: rounds[-1]["embed"]["peak_rss_mib"]}
    name = args.name or (Path(args.model).name if args.model else "minilm")
    (ROOT / "benchmarks/results" / f"indexing-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['cpu']}, {result['model']}, {args.docs} documents, {args.rounds} round(s)")
    for leg in legs:
        print(f"  {leg:9s} {rate[leg]:8.0f} tokens/s")
    for name, value in ratios.items():
        print(f"  {name:17s} {value:.2f}x")
    if "peak_rss_mib" in result:
        print(
            "  ember embed peak RSS: " + ", ".join(f"{n} docs {v:.0f} MiB" for n, v in result["peak_rss_mib"].items())
        )


if __name__ == "__main__":
    main()
