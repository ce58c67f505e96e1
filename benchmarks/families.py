"""Embedding speed per model family: ember's Embedder against sentence-transformers on the same random weights in a
real model's exact shape, in one process, turn about.

Shapes (layers, widths and attention layout of the real checkpoint; the all-MiniLM WordPiece tokenizer, so the
vocabulary is 30,522 rather than the model's own, which changes the embedding lookup and nothing else):
- embeddinggemma: google/embeddinggemma-300m (Gemma 3, 24 layers, 768 wide, 3 heads of 256, sliding window 512,
  mean pooling, Dense 768->3072->768, Normalize);
- modernbert: answerdotai/ModernBERT-base (22 layers, 768 wide, local window 128, global every third; mean pooling
  as nomic-ai/modernbert-embed-base);
- splade: naver/splade-v3 (BERT-base + its MLM head, SpladePooling max), reference SparseEncoder;
- nomic: nomic-ai/nomic-embed-text-v1.5 (12 layers, 768 wide, rotary, SwiGLU); its reference is remote code that
  cannot run here, so only ember's figure is printed;
- qwen2: Alibaba-NLP/gte-Qwen2-1.5B-instruct (Qwen2, 28 layers, 1,536 wide, 12 heads, 2 KV heads, MLP 8,960, LAST
  pooling), causal as transformers runs it;
- llama: meta-llama/Llama-3.2-1B as a LAST-pooled embedder (16 layers, 2,048 wide, 32 heads, 8 KV heads, MLP
  8,192, rope theta 500,000).
The two decoders use the real Qwen3 tokenizer (151,669 entries; Llama 3.2's own has 128,256).

Workload: N documents of ~256 tokens (or --tokens; ember bench's texts), batch of all of them, bf16 (or --dtype),
the process's threads. Each round times ember then the reference on the same texts; the ratio is the median of the
rounds' ratios.

    python benchmarks/families.py [--families embeddinggemma,modernbert,splade,nomic] [--docs 64] [--rounds 3]
    python benchmarks/families.py --families qwen2,llama --docs 16
    python benchmarks/families.py --families modernbert,embeddinggemma --docs 8 --tokens 2048  # the local layers
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from harness import ROOT, checkpoints, cpu_name, use_server_allocator

checkpoints()  # the tests' checkpoint builders, importable as `checkpoints` below

MODELS = ROOT / "models"


def _gemma(out: Path) -> None:
    import transformers

    from checkpoints.builders import _build_model, _save_model, _write_bert_tokenizer, write_st_pooling

    vocab = _write_bert_tokenizer(out, 2048)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=768, intermediate_size=1152, num_hidden_layers=24, num_attention_heads=3,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        use_bidirectional_attention=True, max_position_embeddings=2048, rope_theta=1e6, pad_token_id=0,
        architectures=["Gemma3TextModel"],
    )  # fmt: skip
    _save_model(_build_model(transformers.Gemma3TextModel, config, 0), out, prefix=None,
                architectures=["Gemma3TextModel"])  # fmt: skip
    write_st_pooling(out, "mean", normalize=True, hidden=768, max_seq_length=2048)
    _two_dense(out)


def _two_dense(out: Path) -> None:
    """EmbeddingGemma's Dense 768->3072->768 (no bias, Identity) between Pooling and Normalize."""
    import torch
    from safetensors.torch import save_file

    modules = json.loads((out / "modules.json").read_text())
    norm = modules.pop()
    for i, (d_in, d_out) in enumerate([(768, 3072), (3072, 768)]):
        path = f"{2 + i}_Dense"
        (out / path).mkdir(exist_ok=True)
        cfg = {"in_features": d_in, "out_features": d_out, "bias": False,
               "activation_function": "torch.nn.modules.linear.Identity"}  # fmt: skip
        (out / path / "config.json").write_text(json.dumps(cfg))
        weight = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(i)) / d_in**0.5
        save_file({"linear.weight": weight}, str(out / path / "model.safetensors"))
        modules.append({"idx": 2 + i, "name": str(2 + i), "path": path, "type": "sentence_transformers.models.Dense"})
    norm.update(idx=4, name="4", path="4_Normalize")
    (out / "4_Normalize").mkdir(exist_ok=True)
    modules.append(norm)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))


def _modernbert(out: Path) -> None:
    import transformers

    from checkpoints.builders import _build_model, _write_bert_tokenizer, write_st_pooling

    vocab = _write_bert_tokenizer(out, 8192)
    config = transformers.ModernBertConfig(
        vocab_size=vocab, hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12,
        local_attention=128, global_attn_every_n_layers=3, pad_token_id=0, cls_token_id=101, sep_token_id=102,
        bos_token_id=101, eos_token_id=102, architectures=["ModernBertModel"],
    )  # fmt: skip
    _build_model(transformers.ModernBertModel, config, 0).save_pretrained(str(out))
    write_st_pooling(out, "mean", normalize=True, hidden=768, max_seq_length=8192)


def _from_test_builder(build, out: Path, **shape: Any) -> None:
    """A test builder's checkpoint at a real model's shape, written beside `out` and moved into it."""
    import shutil

    tmp = build(out.with_name(out.name + "-tmp"), **shape)
    shutil.rmtree(out)
    shutil.move(str(tmp), str(out))


def _splade(out: Path) -> None:
    from checkpoints.families import build_splade

    _from_test_builder(build_splade, out, layers=12, hidden=768, heads=12)


def _nomic(out: Path) -> None:
    from checkpoints.families import build_nomic_bert

    _from_test_builder(build_nomic_bert, out, layers=12, hidden=768, heads=12, inner=3072)


def _qwen2(out: Path) -> None:
    from checkpoints.families import build_decoder

    _from_test_builder(build_decoder, out, family="qwen2", layers=28, hidden=1536, heads=12, kv_heads=2,
                       intermediate=8960, rope_theta=1e6)  # fmt: skip


def _llama(out: Path) -> None:
    from checkpoints.families import build_decoder

    _from_test_builder(build_decoder, out, family="llama", layers=16, hidden=2048, heads=32, kv_heads=8,
                       intermediate=8192, rope_theta=5e5)  # fmt: skip


BUILDERS = {"embeddinggemma": _gemma, "modernbert": _modernbert, "splade": _splade, "nomic": _nomic,
            "qwen2": _qwen2, "llama": _llama}  # fmt: skip


def model_dir(family: str) -> Path:
    out = MODELS / f"{family}-random"
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        BUILDERS[family](out)
    return out


def reference(family: str, path: Path, dtype: str):
    """sentence-transformers on the same weights, or None where it cannot run (nomic's remote code)."""
    import torch

    if family == "nomic":
        return None
    kw = {"device": "cpu", "model_kwargs": {"dtype": getattr(torch, dtype)}}
    if family == "splade":
        from sentence_transformers import SparseEncoder

        model = SparseEncoder(str(path), **kw)
        return lambda texts: model.encode(texts, batch_size=32)
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), **kw)
    return lambda texts: model.encode(texts, batch_size=32, convert_to_numpy=True)


def timed(fn, texts) -> float:
    start = time.perf_counter()
    fn(texts)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(BUILDERS))
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256, help="words per document (~tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    use_server_allocator(__file__)  # the allocator `ember serve` uses

    from ember import Embedder
    from ember.cli.bench import make_texts

    rows = []
    for family in args.families.split(","):
        path = model_dir(family)
        embedder = Embedder(str(path), dtype=args.dtype)
        texts = make_texts((args.tokens,) * args.docs, seed=7)
        tokens = sum(embedder.embed(texts).token_counts)
        ref = reference(family, path, args.dtype)
        if ref is not None:
            ref(texts[:4])  # warm-up
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(timed(embedder.embed, texts))
            if ref is not None:
                theirs.append(timed(ref, texts))
        row = {"family": family, "tokens": tokens, "ember_tok_s": tokens / statistics.median(ours)}
        if theirs:
            row["reference_tok_s"] = tokens / statistics.median(theirs)
            row["ratio"] = statistics.median(t / o for o, t in zip(ours, theirs, strict=True))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del embedder, ref
    result = {"cpu": cpu_name(), "dtype": args.dtype, "docs": args.docs, "words": args.tokens, "rounds": args.rounds}
    result["rows"] = rows
    print(f"\n{result['cpu']}, {args.dtype}, {args.docs} documents of ~{args.tokens} words")
    print(f"{'family':<16}{'ember tok/s':>12}{'reference tok/s':>17}{'ratio':>8}")
    for r in rows:
        ref_s = f"{r['reference_tok_s']:.0f}" if "reference_tok_s" in r else "-"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        print(f"{r['family']:<16}{r['ember_tok_s']:>12.0f}{ref_s:>17}{ratio:>8}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
