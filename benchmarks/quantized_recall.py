"""What the compact embedding types cost in retrieval: recall@10 of int8 and binary codes against float32 search
on the same vectors, with the bundled all-MiniLM-L6-v2 (or --model) over real English sentences.

    python benchmarks/quantized_recall.py                       # 4,000 documents, 300 queries
    python benchmarks/quantized_recall.py --docs 2000 --queries 200 --model models/some-model

The sentences are the first sentences of the docstrings of Python's standard library (real, varied English; no
download), de-duplicated and shuffled with a fixed seed; queries are held out from the documents. The codes are
made by the server's own function (ember.api.encoding.quantize, the same as /v2/embed and `embedding_type`).
For each query, the float32 top 10 (cosine) is the truth; recall@10 is the share of it each method finds:
int8 by the cosine of the decoded codes, binary by Hamming distance, and binary with rescoring (the top 100 by
Hamming re-ranked by float32 query x float32 document, as vector stores pair binary indexes with a rescore).
Results: benchmarks/results/quantized-recall-<model>.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sysconfig
import time
from pathlib import Path

import numpy as np

from ember import Embedder
from ember.api.encoding import quantize

ROOT = Path(__file__).resolve().parent.parent


def stdlib_sentences() -> list[str]:
    """First sentences of the standard library's docstrings: 6-40 words, mostly letters, no code."""
    seen: dict[str, None] = {}
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if {"test", "idlelib", "site-packages", "dist-packages"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            first = " ".join(re.split(r"(?<=[.!?])\s", " ".join(doc.split()), maxsplit=1)[0].split())
            words = first.split()
            letters = sum(c.isalpha() or c == " " for c in first) / max(1, len(first))
            if 6 <= len(words) <= 40 and letters > 0.9 and not re.search(r">>>|::|\(\)|\w\.\w", first):
                seen.setdefault(first)
    return list(seen)


def recall(truth: np.ndarray, found: np.ndarray) -> float:
    return float(np.mean([len(set(t) & set(f)) / len(t) for t, f in zip(truth, found, strict=True)]))


def top(scores: np.ndarray, k: int) -> np.ndarray:
    idx = np.argpartition(-scores, k, axis=1)[:, :k]
    return np.take_along_axis(idx, np.argsort(-np.take_along_axis(scores, idx, axis=1), axis=1), axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local model directory (default: the bundled MiniLM)")
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--rescore", type=int, default=100, help="binary candidates re-ranked by float32")
    args = ap.parse_args()

    sentences = stdlib_sentences()
    random.Random(0).shuffle(sentences)
    if len(sentences) < args.docs + args.queries:
        raise SystemExit(f"only {len(sentences)} sentences found; ask for fewer")
    queries, docs = sentences[: args.queries], sentences[args.queries : args.queries + args.docs]
    embedder = Embedder(args.model, dtype="float32")
    start = time.perf_counter()
    q = embedder.embed(queries, normalize=True).vectors
    d = embedder.embed(docs, normalize=True).vectors
    seconds = time.perf_counter() - start
    k = 10
    truth = top(q @ d.T, k)

    def decoded(codes: np.ndarray) -> np.ndarray:
        x = codes.astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    qi, di = decoded(quantize(q, "int8", "")), decoded(quantize(d, "int8", ""))
    qb, db = np.unpackbits(quantize(q, "ubinary", ""), axis=1), np.unpackbits(quantize(d, "ubinary", ""), axis=1)
    hamming = qb.astype(np.int32) @ (1 - db.T).astype(np.int32) + (1 - qb.astype(np.int32)) @ db.T.astype(np.int32)
    binary_top = top(-hamming.astype(np.float32), k)
    candidates = top(-hamming.astype(np.float32), args.rescore)
    rescored = np.take_along_axis(candidates, top(np.einsum("qd,qcd->qc", q, d[candidates]), k), axis=1)
    dim = d.shape[1]
    result = {
        "model": args.model or "sentence-transformers/all-MiniLM-L6-v2 (bundled)",
        "dimension": dim,
        "documents": len(docs),
        "queries": len(queries),
        "embed_seconds": round(seconds, 1),
        "recall_at_10": {
            "int8": round(recall(truth, top(qi @ di.T, k)), 4),
            "binary": round(recall(truth, binary_top), 4),
            f"binary_rescored_top{args.rescore}": round(recall(truth, rescored), 4),
        },
        "bytes_per_vector": {"float32": 4 * dim, "int8": dim, "binary": dim // 8},
    }
    print(json.dumps(result, indent=2))
    name = Path(args.model).name if args.model else "minilm"
    out = ROOT / "benchmarks" / "results" / f"quantized-recall-{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
