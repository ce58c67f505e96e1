"""Rerank speed: 1 query x N documents of ~256 tokens, ember against the reference in the same run, turn about.

Models (random weights in a real model's exact shape, real tokenizers):
- qwen3: Qwen3-Reranker-0.6B's shape (vLLM's overrides), reference transformers' Qwen3ForCausalLM with the
  official prompt and P(yes) (batches of 16, padded on the left, as the model card does);
- bge: BAAI/bge-reranker-base's shape (XLM-R base, 1 label), reference sentence-transformers' CrossEncoder.
In-process: ember's Reranker against the reference, alternating, median of the paired ratios. Over HTTP: `ember
serve` (and a peer such as vLLM's CPU build, --peer-url) on POST /rerank with N documents, and the p50 latency of a
20-document rerank.

    python benchmarks/rerank.py --model qwen3 [--docs 100] [--rounds 3] [--peer-url URL --peer-model NAME]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from run import launch, stop  # noqa: E402

from ember.cli.bench import make_texts  # noqa: E402
from ember.cli.runtime import maybe_reexec_with_allocator  # noqa: E402

OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
QWEN_EMBEDDING = ROOT / "models" / "qwen3-emb-0.6b-random"
MODELS = {"qwen3": ROOT / "models" / "qwen3-reranker-0.6b-random", "bge": ROOT / "models" / "bge-reranker-base-random"}


def build(kind: str) -> Path:
    """The model directory, made once: Qwen3-Reranker-0.6B is Qwen3-Embedding-0.6B's shape as a causal LM with tied
    embeddings (its weights are the embedding stand-in's); bge-reranker-base is XLM-R base with one label."""
    out = MODELS[kind]
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if kind == "qwen3":
        if not QWEN_EMBEDDING.is_dir():
            import subprocess

            subprocess.run([sys.executable, str(ROOT / "benchmarks/make_qwen3_model.py"), "--out", str(QWEN_EMBEDDING)],
                           check=True)  # fmt: skip
        config = json.loads((QWEN_EMBEDDING / "config.json").read_text())
        config.update(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True)
        for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
            if (QWEN_EMBEDDING / name).exists():
                (out / name).symlink_to(QWEN_EMBEDDING / name)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return out
    from checkpoints.builders import build_cross_encoder

    shutil.rmtree(out)
    return build_cross_encoder(out, kind="xlm-roberta", layers=12, hidden=768, heads=12, max_position=512)


def documents(n: int, tokens: int) -> list[str]:
    return make_texts((tokens,) * n, seed=7)


def reference(kind: str, path: Path):
    """A callable scoring (query, documents) the reference way, in bfloat16."""
    import torch

    if kind == "bge":
        from sentence_transformers import CrossEncoder

        ce = CrossEncoder(str(path), device="cpu", model_kwargs={"torch_dtype": torch.bfloat16})
        return lambda q, docs: ce.predict([(q, d) for d in docs], batch_size=32)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ember.engine.pairs import QWEN3_RERANKER_SUFFIX, qwen3_reranker_prompt

    tok = AutoTokenizer.from_pretrained(str(path), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.bfloat16).eval()
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")

    @torch.inference_mode()
    def score(q: str, docs: list[str]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(docs), 16):
            texts = [qwen3_reranker_prompt(q) + f"<Document>: {d}" + QWEN3_RERANKER_SUFFIX for d in docs[i : i + 16]]
            batch = tok(texts, padding=True, add_special_tokens=False, return_tensors="pt")
            last = model(**batch).logits[:, -1, [no, yes]].float()
            out += torch.softmax(last, -1)[:, 1].tolist()
        return out

    return score


def in_process(kind: str, path: Path, docs: list[str], rounds: int) -> dict[str, object]:
    """ember against the reference, turn about; for a decoder also ember with shared prefixes off ("whole": each
    pair computes the system prompt, instruction and query itself), to measure what sharing saves."""
    from ember import Reranker

    ours = Reranker(str(path), hf_overrides=OVERRIDES if kind == "qwen3" else None)
    runner = ours._loaded.runner
    theirs = reference(kind, path)
    query = "which of these passages answers the question about retrieval latency?"
    from ember.engine.pairs import ScoreParams

    tokens = sum(p.tokens for p in ours.pairs.fit([(query, d) for d in docs], ScoreParams()))
    ours.score([(query, d) for d in docs[:4]])  # warm both up
    theirs(query, docs[:4])
    legs = ["ember", "ember_whole", "reference"] if runner.share_prefixes else ["ember", "reference"]
    times: dict[str, list[float]] = {leg: [] for leg in legs}
    for r in range(rounds):
        for who in legs[r % len(legs) :] + legs[: r % len(legs)]:
            runner.share_prefixes = who == "ember"
            start = time.perf_counter()
            if who == "reference":
                theirs(query, docs)
            else:
                ours.rerank(query, docs)
            times[who].append(time.perf_counter() - start)
            print(f"in-process round {r + 1} {who}: {times[who][-1]:.2f} s", flush=True)
    runner.share_prefixes = "ember_whole" in legs

    def ratio(slow: str, fast: str) -> float:
        return statistics.median(b / a for a, b in zip(times[fast], times[slow], strict=True))

    rates = ", ".join(f"{leg} {tokens / statistics.median(t):.0f} tok/s" for leg, t in times.items())
    out: dict[str, object] = {f"{leg}_s": t for leg, t in times.items()}
    out |= {"speedup": ratio("reference", "ember"), "pair_tokens": tokens}
    if "ember_whole" in times:
        out["prefix_sharing_speedup"] = ratio("ember_whole", "ember")
        out["whole_speedup"] = ratio("reference", "ember_whole")
    print(f"pair tokens {tokens}: {rates}; " + ", ".join(f"{k} {v:.2f}" for k, v in out.items() if "speedup" in k))
    return out


def over_http(url: str, model: str, docs: list[str], rounds: int) -> dict[str, float]:
    query = "which of these passages answers the question about retrieval latency?"
    big, small = [], []
    with httpx.Client(timeout=900) as http:
        http.post(f"{url}/rerank", json={"model": model, "query": query, "documents": docs[:4]}).raise_for_status()
        for _ in range(rounds):
            start = time.perf_counter()
            r = http.post(f"{url}/rerank", json={"model": model, "query": query, "documents": docs})
            r.raise_for_status()
            big.append(r.json()["usage"]["total_tokens"] / (time.perf_counter() - start))
        for i in range(10):
            start = time.perf_counter()
            http.post(f"{url}/rerank", json={"model": model, "query": f"{query} {i}", "documents": docs[:20]})
            small.append(time.perf_counter() - start)
    return {"tokens_per_s": statistics.median(big), "p50_20_docs_s": statistics.median(small)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peer-url", default=None, help="another server answering /rerank for the same checkpoint")
    ap.add_argument("--peer-model", default=None)
    ap.add_argument("--skip-in-process", action="store_true")
    args = ap.parse_args()
    maybe_reexec_with_allocator(sys.argv[1:], [sys.executable, __file__])  # the allocator `ember serve` uses
    path = build(args.model)
    docs = documents(args.docs, args.doc_tokens)
    results: dict[str, object] = {"model": args.model, "docs": args.docs, "doc_tokens": args.doc_tokens}
    if not args.skip_in_process:
        results["in_process"] = in_process(args.model, path, docs, args.rounds)
    cmd = [sys.executable, "-m", "ember.cli.main", "serve", str(path), "--port", "18124", "--host", "127.0.0.1"]
    if args.model == "qwen3":
        cmd += ["--hf-overrides", json.dumps(OVERRIDES)]
    proc, ready = launch(cmd, "http://127.0.0.1:18124", ROOT / "benchmarks/results/server.log")
    try:
        while "fused kernels" not in (ROOT / "benchmarks/results/server.log").read_text():
            time.sleep(0.5)
        results["ember_http"] = over_http("http://127.0.0.1:18124", str(path), docs, args.rounds) | {"ready_s": ready}
    finally:
        stop(proc)
    if args.peer_url:
        results["peer_http"] = over_http(args.peer_url, args.peer_model or str(path), docs, args.rounds)
    print(json.dumps(results, indent=2))
    out = ROOT / f"benchmarks/results/rerank-{args.model}.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
