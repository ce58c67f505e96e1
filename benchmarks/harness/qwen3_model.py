"""Build a local stand-in for Qwen/Qwen3-Embedding-0.6B for benchmarks (no network access).

Same config and key names as the real checkpoint, seeded random weights streamed to
safetensors tensor by tensor, the real Qwen3 tokenizer and the sentence-transformers files.

    PYTHONPATH=benchmarks python -m harness.qwen3_model --out models/qwen3-emb-0.6b-random
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from harness.models import checkpoints

_builders = checkpoints().builders  # the tests' checkpoint builders
QWEN3_EMBEDDING_0_6B_CONFIG, QWEN3_PROMPTS = _builders.QWEN3_EMBEDDING_0_6B_CONFIG, _builders.QWEN3_PROMPTS
write_qwen3_random_safetensors, write_st_pooling = _builders.write_qwen3_random_safetensors, _builders.write_st_pooling
build_qwen3_tokenizer = checkpoints().build_qwen3_tokenizer

DEFAULT_OUT = Path("models/qwen3-emb-0.6b-random")


def make_config(layers: int | None, hidden: int | None, dtype: str) -> dict[str, Any]:
    """The Qwen3-Embedding-0.6B config, optionally with fewer layers / a smaller width.

    A smaller ``hidden`` uses 4 query heads, 2 KV heads of size ``hidden // 4`` and an
    intermediate size of ``3 * hidden``.
    """
    config = dict(QWEN3_EMBEDDING_0_6B_CONFIG)
    if layers is not None:
        config.update(num_hidden_layers=layers, max_window_layers=layers)
    if hidden is not None:
        if hidden % 4:
            raise ValueError("--hidden must be a multiple of 4")
        config.update(
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
        )
    config["torch_dtype"] = dtype
    return config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (default 28)")
    parser.add_argument("--hidden", type=int, default=None, help="smaller width (default 1024)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--check", action="store_true", help="load with sentence-transformers and encode")
    return parser.parse_args(argv)


def check(out: Path) -> None:
    """Load the checkpoint with sentence-transformers and embed two texts."""
    from sentence_transformers import SentenceTransformer

    start = time.perf_counter()
    model = SentenceTransformer(str(out), device="cpu")
    emb = model.encode(["What is the capital of France?", "Paris is in France."])
    print(f"check: sentence-transformers embeddings {emb.shape} ({time.perf_counter() - start:.1f}s)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = make_config(args.layers, args.hidden, args.dtype)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    n_params = write_qwen3_random_safetensors(out, config, args.seed)
    print(f"weights: {n_params / 1e6:.1f}M params ({time.perf_counter() - start:.1f}s)")
    build_qwen3_tokenizer(out)
    write_st_pooling(
        out,
        "lasttoken",
        normalize=True,
        hidden=config["hidden_size"],
        prompts=QWEN3_PROMPTS,
        max_seq_length=config["max_position_embeddings"],
    )
    print(f"wrote {out} ({time.perf_counter() - start:.1f}s)")
    if args.check:
        check(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
