"""What ember's compact forms cost in retrieval, on real weights and real English sentences (the bundled
all-MiniLM-L6-v2, or --model):

- compute dtypes: the vectors ember computes in bfloat16 and with `--quantization int8` (float32 and bfloat16
  activations) against the ones it computes in float32, by recall@10 and nDCG@10 of search with them;
- embedding types: int8 and binary codes of the float32 vectors (/v2/embed's `embedding_types`,
  `encoding_format`), by recall@10 against float32 search on the same vectors;
- with --reranker DIR, a cross-encoder's scores in each dtype against its float32 scores, over each query's
  float32 top 30 documents: Kendall's tau, and how much of the float32 top 10 each keeps.

    python benchmarks/quantized_recall.py                       # 3,000 documents, 300 queries
    python benchmarks/quantized_recall.py --docs 2000 --queries 200 --model models/some-model

The sentences are the first sentences of the docstrings of Python's standard library (real, varied English; no
download), de-duplicated and shuffled with a fixed seed; queries are held out from the documents. The codes are
made by the server's own function (ember.api.encoding.quantize, the same as /v2/embed and `embedding_type`).
For each query, the float32 top 10 (cosine) is the truth; recall@10 is the share of it each method finds:
int8 by the cosine of the decoded codes, binary by Hamming distance, and binary with rescoring (the top 100 by
Hamming re-ranked by float32 query x float32 document, as vector stores pair binary indexes with a rescore).
nDCG@10 grades the float32 top 10 by rank (10 for the first, 1 for the tenth, 0 past it).
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

from ember import Embedder, Reranker
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


def ndcg(truth: np.ndarray, found: np.ndarray) -> float:
    """nDCG of `found` with the truth's documents graded by their rank in it (k for the first ... 1 for the last)."""
    k = truth.shape[1]
    discount = 1 / np.log2(np.arange(2, k + 2))
    ideal = float((np.arange(k, 0, -1) * discount).sum())
    out = []
    for t, f in zip(truth, found, strict=True):
        grade = {int(doc): k - rank for rank, doc in enumerate(t)}
        out.append(sum(grade.get(int(doc), 0) * discount[i] for i, doc in enumerate(f[:k])) / ideal)
    return float(np.mean(out))


DTYPES: dict[str, dict[str, str]] = {
    "bfloat16": {"dtype": "bfloat16"},
    "int8 (float32 activations)": {"dtype": "float32", "quantization": "int8"},
    "int8 (bfloat16 activations)": {"dtype": "bfloat16", "quantization": "int8"},
    "int8, plain rounding (float32 activations)": {"dtype": "float32", "quantization": "int8", "calibration": "none"},
    "int8, plain rounding (bfloat16 activations)": {"dtype": "bfloat16", "quantization": "int8", "calibration": "none"},
}
"""int8 rounds its weights against ember's bundled calibration text (GPTQ) unless calibration is none."""


def compute_dtypes(model: str | None, queries: list[str], docs: list[str], truth: np.ndarray) -> dict[str, dict]:
    """Search with the vectors each dtype computes, against float32's truth."""
    rows = {}
    for name, options in DTYPES.items():
        e = Embedder(model, **options)
        q, d = e.embed(queries, normalize=True).vectors, e.embed(docs, normalize=True).vectors
        found = top(q @ d.T, truth.shape[1])
        rows[name] = {"recall_at_10": round(recall(truth, found), 4), "ndcg_at_10": round(ndcg(truth, found), 4)}
        print(name, rows[name], flush=True)
    return rows


def kendall_tau(a: np.ndarray, b: np.ndarray) -> float:
    """Kendall's tau-a of two score lists over the same items."""
    da, db = np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :])
    n = len(a)
    return float((da * db).sum() / (n * (n - 1)))


def reranker_agreement(path: str, queries: list[str], docs: list[str], candidates: np.ndarray) -> dict[str, dict]:
    """A cross-encoder's ranking of each query's candidates in each dtype, against its float32 ranking."""
    pairs = [(q, docs[int(i)]) for q, row in zip(queries, candidates, strict=True) for i in row]
    shape = candidates.shape

    def scores(**options: str) -> np.ndarray:
        return np.asarray(Reranker(path, **options).score(pairs), dtype=np.float64).reshape(shape)

    ref = scores(dtype="float32")
    rows = {}
    for name, options in DTYPES.items():
        got = scores(**options)
        taus = [kendall_tau(r, g) for r, g in zip(ref, got, strict=True)]
        kept = recall(top(ref, 10), top(got, 10))
        rows[name] = {"kendall_tau_median": round(float(np.median(taus)), 4), "top10_kept": round(kept, 4)}
        print("reranker", name, rows[name], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local model directory (default: the bundled MiniLM)")
    ap.add_argument("--reranker", default=None, help="a local cross-encoder directory to compare across dtypes")
    ap.add_argument("--docs", type=int, default=3000)
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
    dim = d.shape[1]
    result = {
        "model": args.model or "sentence-transformers/all-MiniLM-L6-v2 (bundled)",
        "dimension": dim,
        "documents": len(docs),
        "queries": len(queries),
        "embed_seconds": round(seconds, 1),
        "compute_dtype_against_float32": compute_dtypes(args.model, queries, docs, truth),
        "recall_at_10": embedding_types(q, d, truth, args.rescore),
        "bytes_per_vector": {"float32": 4 * dim, "int8": dim, "binary": dim // 8},
    }
    if args.reranker:
        result["reranker"] = args.reranker
        result["reranker_against_float32"] = reranker_agreement(args.reranker, queries, docs, top(q @ d.T, 30))
    print(json.dumps(result, indent=2))
    name = Path(args.model).name if args.model else "minilm"
    out = ROOT / "benchmarks" / "results" / f"quantized-recall-{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


def embedding_types(q: np.ndarray, d: np.ndarray, truth: np.ndarray, rescore: int) -> dict[str, float]:
    """Search with int8 and binary codes of the float32 vectors (made as the server makes them)."""
    k = truth.shape[1]

    def decoded(codes: np.ndarray) -> np.ndarray:
        x = codes.astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    qi, di = decoded(quantize(q, "int8", "")), decoded(quantize(d, "int8", ""))
    qb, db = np.unpackbits(quantize(q, "ubinary", ""), axis=1), np.unpackbits(quantize(d, "ubinary", ""), axis=1)
    hamming = qb.astype(np.int32) @ (1 - db.T).astype(np.int32) + (1 - qb.astype(np.int32)) @ db.T.astype(np.int32)
    binary_top = top(-hamming.astype(np.float32), k)
    candidates = top(-hamming.astype(np.float32), rescore)
    rescored = np.take_along_axis(candidates, top(np.einsum("qd,qcd->qc", q, d[candidates]), k), axis=1)
    return {
        "int8": round(recall(truth, top(qi @ di.T, k)), 4),
        "binary": round(recall(truth, binary_top), 4),
        f"binary_rescored_top{rescore}": round(recall(truth, rescored), 4),
    }


if __name__ == "__main__":
    main()
