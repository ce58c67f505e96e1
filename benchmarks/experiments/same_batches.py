"""ember's Embedder and sentence-transformers on identical batches, in one process, turn about.

The HTTP suite (run.py) puts the server, its client and tokenisation on the same cores; this compares
the libraries alone on the same list of texts and batch size, as a user swapping `model.encode` for
ember would. Configurations alternate round by round and medians are taken, which cancels the
host's drift. Every configuration counts the tokens it really embedded (sentence-transformers
truncates at max_seq_length; so does ember, to the model's max_model_len).

    python benchmarks/experiments/same_batches.py                      # the bundled all-MiniLM-L6-v2
    python benchmarks/experiments/same_batches.py --rounds 9 --texts 128 --words 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ember import Embedder
from ember.cli.bench import make_texts
from ember.cli.runtime import maybe_reexec_with_allocator
from ember.engine.cpu import set_threads
from ember.models.checkpoint import DEFAULT_MODEL, resolve_model
from ember.resources import cpu_budget

ROOT = Path(__file__).resolve().parents[2]

Encode = Callable[[list[str]], int]  # embeds the texts, returns the tokens it embedded


def ember_config(model: str, dtype: str, quantization: str | None, batch: int) -> Encode:
    # auto_truncate: cut at max_model_len (256 for MiniLM) as sentence-transformers does
    e = Embedder(model, dtype=dtype, quantization=quantization, auto_truncate=True)  # type: ignore[arg-type]

    def encode(texts: list[str]) -> int:
        return sum(sum(e.embed(texts[i : i + batch]).token_counts) for i in range(0, len(texts), batch))

    return encode


def st_config(model: str, dtype: torch.dtype, batch: int) -> Encode:
    from sentence_transformers import SentenceTransformer

    m = SentenceTransformer(str(resolve_model(model)), device="cpu", model_kwargs={"dtype": dtype})

    def encode(texts: list[str]) -> int:
        m.encode(texts, batch_size=batch)
        return sum(min(m.max_seq_length, len(ids)) for ids in m.tokenizer(texts)["input_ids"])

    return encode


def main() -> None:
    maybe_reexec_with_allocator(sys.argv[1:], program=[sys.executable, sys.argv[0]])  # time on the server's allocator
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--texts", type=int, default=64, help="texts per round")
    ap.add_argument("--words", type=int, default=256, help="words per text (about one token each)")
    ap.add_argument("--batch", type=int, default=32, help="texts per encode call, the same for every configuration")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    set_threads(cpu_budget().usable)
    configs = {
        "sentence-transformers float32 (its default)": st_config(args.model, torch.float32, args.batch),
        "sentence-transformers bfloat16": st_config(args.model, torch.bfloat16, args.batch),
        "ember bfloat16 (its default here)": ember_config(args.model, "bfloat16", None, args.batch),
        "ember float32": ember_config(args.model, "float32", None, args.batch),
        "ember int8": ember_config(args.model, "bfloat16", "int8", args.batch),
    }
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds + 1):  # round 0 warms every configuration up and is not counted
        texts = make_texts((args.words,) * args.texts, seed=r)
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            start = time.perf_counter()
            tokens = configs[name](texts)
            if r:
                rates[name].append(tokens / (time.perf_counter() - start))
    base = statistics.median(rates["sentence-transformers float32 (its default)"])
    base16 = statistics.median(rates["sentence-transformers bfloat16"])
    print(f"{args.texts} texts x ~{args.words} tokens, batches of {args.batch}, {args.rounds} rounds, medians")
    print(f"{'configuration':45s} {'tok/s':>8s} {'vs ST fp32':>11s} {'vs ST bf16':>11s}")
    for name, xs in rates.items():
        m = statistics.median(xs)
        print(f"{name:45s} {m:8.0f} {m / base:10.2f}x {m / base16:10.2f}x")
    out = ROOT / "benchmarks/results/same-batches.json"
    out.write_text(json.dumps({"args": vars(args), "tokens_per_s": rates}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
