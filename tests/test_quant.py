"""int8 mode: accuracy against float32 on the real MiniLM and on Qwen3, and what it quantises."""

import numpy as np
import pytest
import torch

from corpus import DOCUMENTS, QUERIES, SENTENCES
from ember import Embedder
from ember.ops.quant import Int8Linear
from ember.testing import build_qwen3


def test_int8_linear_matches_float_on_one_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512)
    x = torch.randn(33, 256)
    cos = torch.nn.functional.cosine_similarity(linear(x), Int8Linear(linear, torch.float32)(x), dim=-1)
    assert cos.min() >= 0.999


@pytest.fixture(scope="module")
def minilm_pair():
    return Embedder(dtype="float32"), Embedder(dtype="bfloat16", quantization="int8")


def test_minilm_int8_stays_close_and_ranks_the_same(minilm_pair):
    ref, q8 = minilm_pair
    a, b = ref.embed(SENTENCES).vectors, q8.embed(SENTENCES).vectors
    assert (a * b).sum(1).min() >= 0.99
    # the top three of every query are unchanged; only near-tied irrelevant documents (scores within
    # 0.005 of each other, ~0.06 apart from relevance) may swap places below them
    top3 = lambda e: np.argsort(-(e.embed(QUERIES).vectors @ e.embed(DOCUMENTS).vectors.T), axis=1)[:, :3]  # noqa: E731
    assert (top3(ref) == top3(q8)).all()


def test_only_feed_forward_layers_are_int8(minilm_pair):
    _, q8 = minilm_pair
    modules = dict(q8._loaded.runner.model.named_modules())
    int8 = sorted(n for n, m in modules.items() if isinstance(m, Int8Linear))
    assert len(int8) == 12 and all("intermediate" in n or n.endswith(".output.dense") for n in int8)
    assert not any("attention" in n for n in int8)
    assert "int8" in q8.info.dtype


def test_qwen3_int8_stays_close(tmp_path):
    path = build_qwen3(tmp_path, layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32)
    a = Embedder(str(path), dtype="float32").embed(SENTENCES[:20]).vectors
    b = Embedder(str(path), dtype="bfloat16", quantization="int8").embed(SENTENCES[:20]).vectors
    assert (a * b).sum(1).min() >= 0.99
