"""What shared prefixes save on queries: one forward of 8 instruction-formatted queries (Qwen3-Embedding's query
prompt, ~18 tokens, before ~12-word queries) with the prefix computed once, against the same batch with each query
computed whole; alternating, new queries each round, median of the paired ratios (the first two rounds are warm-up).

    PYTHONPATH=benchmarks python benchmarks/experiments/shared_prefix.py [--model models/qwen3-emb-0.6b-random] \
        [--rounds 12] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from harness import cpu_name

from ember.cli.bench import make_texts
from ember.cli.runtime import maybe_reexec_with_allocator

ROOT = Path(__file__).resolve().parents[2]

INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "qwen3-emb-0.6b-random"))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    maybe_reexec_with_allocator(sys.argv[1:], [sys.executable, __file__])
    from ember import Embedder

    embedder = Embedder(args.model, dtype=args.dtype)
    runner = embedder._loaded.runner
    queries = make_texts((12,) * (args.batch * args.rounds), seed=11)
    ratios, times = [], {"shared": [], "whole": []}
    for r in range(args.rounds):
        batch = [embedder.tokenizer.encode(INSTRUCTION + q) for q in queries[r * args.batch : (r + 1) * args.batch]]
        took = {}
        for way in ["shared", "whole"] if r % 2 == 0 else ["whole", "shared"]:
            runner.share_prefixes = way == "shared"
            start = time.perf_counter()
            runner.run(batch)
            took[way] = time.perf_counter() - start
        print(f"round {r + 1}: {sum(map(len, batch))} tokens, shared {took['shared'] * 1e3:.0f} ms, whole "
              f"{took['whole'] * 1e3:.0f} ms", flush=True)  # fmt: skip
        if r >= 2:
            ratios.append(took["whole"] / took["shared"])
            for way in took:
                times[way].append(took[way])
    ms = {f"{way}_ms": statistics.median(t) * 1e3 for way, t in times.items()}
    result = {"cpu": cpu_name(), "model": args.model, "dtype": args.dtype, "batch": args.batch, **ms,
              "speedup": statistics.median(ratios), "range": [min(ratios), max(ratios)]}  # fmt: skip
    print(json.dumps(result, indent=2))
    out = ROOT / "benchmarks/results/shared-prefix-queries.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
