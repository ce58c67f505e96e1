"""Rerank speed: 1 query x N documents of ~256 tokens, ember against the reference in the same run, turn about.

Models (random weights in a real model's exact shape, real tokenizers):
- qwen3: Qwen3-Reranker-0.6B's shape (vLLM's overrides), reference transformers' Qwen3ForCausalLM with the
  official prompt and P(yes) (batches of 16, padded on the left, as the model card does);
- bge: BAAI/bge-reranker-base's shape (XLM-R base, 1 label), reference sentence-transformers' CrossEncoder.
In-process: ember's Reranker against the reference, alternating, median of the paired ratios. Over HTTP: `ember
serve` (and a peer such as vLLM's CPU build, --peer-url) on POST /rerank with N documents, and the p50 latency of a
20-document rerank.

    python benchmarks/rerank.py --model qwen3 [--docs 100] [--rounds 3] \
        [--peer-url URL --peer-model NAME --peer-cmd "CMD" --peer-label "vLLM 0.32 CPU, bf16"]
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
from harness import ROOT, PeakRss, checkpoints, cpu_name, ensure_qwen3_model, frozen, launch, stop, use_server_allocator

from ember.cli.bench import make_texts

OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
QUERY = "which of these passages answers the question about retrieval latency?"
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
        ensure_qwen3_model(QWEN_EMBEDDING)
        config = json.loads((QWEN_EMBEDDING / "config.json").read_text())
        config.update(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True)
        for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
            if (QWEN_EMBEDDING / name).exists():
                (out / name).symlink_to(QWEN_EMBEDDING / name)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return out
    build_cross_encoder = checkpoints().build_cross_encoder

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

    from ember.models.classifier import QWEN3_RERANKER as prompt

    tok = AutoTokenizer.from_pretrained(str(path), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.bfloat16).eval()
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")

    @torch.inference_mode()
    def score(q: str, docs: list[str]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(docs), 16):
            texts = [prompt.head(q) + prompt.document.format(document=d) + prompt.suffix for d in docs[i : i + 16]]
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
    query = QUERY
    from ember.engine.pairs import ScoreParams

    tokens = sum(p.tokens for p in ours.pairs.fit([(query, d) for d in docs], ScoreParams()))
    ours.score([(query, d) for d in docs[:4]])  # warm both up
    theirs(query, docs[:4])
    shares = runner.share_prefixes  # only decoders pooled on their last token can
    legs = ["ember", "ember_whole", "reference"] if shares else ["ember", "reference"]
    times: dict[str, list[float]] = {leg: [] for leg in legs}
    for r in range(rounds):
        for who in legs[r % len(legs) :] + legs[: r % len(legs)]:
            runner.share_prefixes = shares and who == "ember"
            start = time.perf_counter()
            if who == "reference":
                theirs(query, docs)
            else:
                ours.rerank(query, docs)
            times[who].append(time.perf_counter() - start)
            print(f"in-process round {r + 1} {who}: {times[who][-1]:.2f} s", flush=True)
    runner.share_prefixes = shares

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


def http_round(url: str, model: str, docs: list[str], r: int, kind: str) -> tuple[float, list[float]]:
    """One round against one server: a rerank of every document (tokens/s by its usage) and three 20-document
    reranks (seconds each). Queries differ per round, so no server answers from a cache of an earlier one.
    Qwen3-Reranker requests carry the official prompt already formatted, as vLLM's example sends them (vLLM does
    not add it; ember takes a query so formatted as it is), so both servers read the same tokens."""

    def body(query: str, documents: list[str]) -> dict[str, object]:
        if kind == "qwen3":
            from ember.models.classifier import QWEN3_RERANKER as prompt

            query, documents = (
                prompt.head(query),
                [prompt.document.format(document=d) + prompt.suffix for d in documents],
            )
        return {"model": model, "query": query, "documents": documents}

    with httpx.Client(timeout=1800) as http:
        start = time.perf_counter()
        res = http.post(f"{url}/rerank", json=body(f"{QUERY} ({r})", docs))
        res.raise_for_status()
        rate = res.json()["usage"]["total_tokens"] / (time.perf_counter() - start)
        small = []
        for i in range(3):
            start = time.perf_counter()
            http.post(f"{url}/rerank", json=body(f"{QUERY} ({r}.{i})", docs[:20])).raise_for_status()
            small.append(time.perf_counter() - start)
    return rate, small


def over_http(path: Path, kind: str, docs: list[str], rounds: int, peer: argparse.Namespace) -> dict[str, object]:
    """`ember serve` (and the peer, when given), turn about; the idle server SIGSTOPped while the other works."""

    cmd = [sys.executable, "-m", "ember.cli.main", "serve", str(path), "--port", "18124", "--host", "127.0.0.1"]
    if kind == "qwen3":
        cmd += ["--hf-overrides", json.dumps(OVERRIDES)]
    log = ROOT / "benchmarks/results/server.log"
    servers: dict[str, tuple[str, str]] = {"ember": ("http://127.0.0.1:18124", str(path))}
    procs, ready = {}, {}
    try:
        procs["ember"], ready["ember"] = launch(cmd, servers["ember"][0], log)
        while "fused kernels" not in log.read_text():
            time.sleep(0.5)
        if peer.peer_url:
            servers["peer"] = (peer.peer_url, peer.peer_model or str(path))
            if peer.peer_cmd:
                procs["peer"], ready["peer"] = launch(
                    peer.peer_cmd, peer.peer_url, ROOT / "benchmarks/results/peer.log"
                )
        for url, model in servers.values():  # warm-up
            httpx.post(f"{url}/rerank", json={"model": model, "query": QUERY, "documents": docs[:4]},
                       timeout=600).raise_for_status()  # fmt: skip
        rates: dict[str, list[float]] = {who: [] for who in servers}
        small: dict[str, list[float]] = {who: [] for who in servers}
        with PeakRss(procs["ember"].pid) as ours_rss, PeakRss(procs.get("peer", procs["ember"]).pid) as peer_rss:
            for r in range(rounds):
                for who in list(servers) if r % 2 == 0 else list(servers)[::-1]:
                    idle = next((p.pid for w, p in procs.items() if w != who), None)
                    with frozen(idle):
                        rate, latencies = http_round(*servers[who], docs, r, kind)
                    rates[who].append(rate)
                    small[who] += latencies
                    p50 = statistics.median(latencies)
                    print(f"http round {r + 1} {who}: {rate:.0f} tok/s, 20 documents {p50:.2f} s", flush=True)
    finally:
        for proc in procs.values():
            stop(proc)
    out: dict[str, object] = {}
    for who in servers:
        row = {"tokens_per_s": statistics.median(rates[who]), "p50_20_docs_s": statistics.median(small[who]),
               "rounds_tokens_per_s": rates[who]}  # fmt: skip
        out[f"{who}_http"] = row | ({"ready_s": ready[who]} if who in ready else {})
    out["ember_http"]["peak_rss_gib"] = ours_rss.bytes / 2**30  # type: ignore[index]
    if "peer" in servers:
        out["peer_http"]["server"] = peer.peer_label  # type: ignore[index]
        if "peer" in procs:
            out["peer_http"]["peak_rss_gib"] = peer_rss.bytes / 2**30  # type: ignore[index]
        out["vs_peer"] = statistics.median(a / b for a, b in zip(rates["ember"], rates["peer"], strict=True))
        print(f"ember / peer over HTTP: {out['vs_peer']:.2f} (median of paired rounds)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peer-url", default=None, help="another server answering /rerank for the same checkpoint")
    ap.add_argument("--peer-model", default=None)
    ap.add_argument("--peer-cmd", default=None, help="starts the peer (then it is frozen while ember works)")
    ap.add_argument("--peer-label", default="peer", help="what the peer is, for the results file")
    ap.add_argument("--skip-in-process", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    use_server_allocator(__file__)  # the allocator `ember serve` uses
    path = build(args.model)
    docs = documents(args.docs, args.doc_tokens)

    results: dict[str, object] = {"model": args.model, "docs": args.docs, "doc_tokens": args.doc_tokens,
                                  "cpu": cpu_name()}  # fmt: skip
    if not args.skip_in_process:
        results["in_process"] = in_process(args.model, path, docs, args.rounds)
    if not args.skip_http:
        results |= over_http(path, args.model, docs, args.rounds, args)
    print(json.dumps(results, indent=2))
    out = Path(args.out) if args.out else ROOT / f"benchmarks/results/rerank-{args.model}.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
