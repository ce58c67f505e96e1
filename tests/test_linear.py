"""float32 layers on bf16 weights (ember.ops.linear.Bf16Linear and csrc/linear.cpp): the product against float64, the
fallback and the release to float32, and whole models loaded from bf16 checkpoints against sentence-transformers."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ember.engine.build as build_mod
import ember.ops.linear as linear_mod
from checkpoints import build_bert, build_qwen3, build_qwen3_reranker
from corpus import SENTENCES
from ember import Embedder, Reranker
from ember.config import NativeConfig
from ember.hardware import cpu_flags
from ember.ops.linear import Bf16Linear, hold_bf16, pack_bf16, release_bf16, unpack_bf16
from ember.ops.native import build_kernels, linear_kernel
from parity import cos, st_reference

TEXTS = [*SENTENCES[:12], SENTENCES[50]]
AVX512 = {"avx512f", "avx512bw"} <= cpu_flags()


@pytest.fixture(scope="module")
def kernel():
    if not AVX512:
        pytest.skip("the bf16-weight kernel is built for AVX-512 only (this CPU, as capped, has none)")
    build_kernels(NativeConfig())
    if linear_kernel() is None:
        pytest.skip("the native linear kernel did not build here (no compiler?)")
    return linear_kernel()


@pytest.fixture(autouse=True)
def bf16_linear_holds(monkeypatch):
    """The models here hold their bf16 matrices as Bf16Linear, as where the float32 product's strips are not chosen
    (AMD Zen 4/5); on an Intel CPU with AVX-512 they go to strips (tests/test_linear_f32.py)."""
    monkeypatch.setattr(build_mod, "strip_f32", lambda: False)


def _layer(k: int, n: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    """A float32 layer whose weights are bf16 values, as loaded from a bf16 checkpoint."""
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    layer.weight.data = layer.weight.data.bfloat16().float()
    return layer.requires_grad_(False)


def test_packing_round_trips_exactly():
    w = torch.randn(96, 40).bfloat16()
    words = pack_bf16(w)
    assert words.shape == (3, 40, 16) and words.dtype == torch.int32
    assert torch.equal(unpack_bf16(words), w.float())
    # word d of input k: channel d in the low half, channel d + 16 in the high half (strip 1, input 5, d = 3)
    word = int(words[1, 5, 3]) & 0xFFFFFFFF
    low, high = (word & 0xFFFF) << 16, word & 0xFFFF0000
    as_float = torch.tensor([low, high], dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert as_float.tolist() == [w[32 + 3, 5].float().item(), w[32 + 19, 5].float().item()]


# rows: single rows, register-block tails (12 rows a block on AVX-512), and past 512 rows, where the kernel widens
# the weights for oneMKL instead
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 21, 168, 512, 513, 700])
@pytest.mark.parametrize(("k", "n", "bias"), [(64, 128, True), (1024, 96, False), (33, 32, True)])
def test_kernel_matches_float64(kernel, rows, k, n, bias):
    layer = _layer(k, n, bias)
    held = Bf16Linear(layer)
    x = torch.randn(rows, k)
    ref = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    y = held(x)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_kernel_takes_spaced_rows_and_leading_axes(kernel):
    layer = _layer(64, 64)
    held = Bf16Linear(layer)
    x = torch.randn(6, 128)[:, :64]  # rows 128 apart: the kernel reads them in place
    assert torch.allclose(held(x), layer(x), atol=1e-5)
    x3 = torch.randn(2, 3, 64)
    assert held(x3).shape == (2, 3, 64) and torch.allclose(held(x3), layer(x3), atol=1e-5)


def test_a_row_alone_equals_the_row_in_a_batch(kernel):
    held = Bf16Linear(_layer(256, 128))
    x = torch.randn(40, 256)
    batch = held(x)
    for i in (0, 11, 12, 39):
        assert torch.equal(held(x[i : i + 1]), batch[i : i + 1])


def test_until_the_kernel_loads_the_layer_widens_its_weights(monkeypatch):
    layer = _layer(64, 96)
    held = Bf16Linear(layer)
    monkeypatch.setattr(linear_mod, "linear_kernel", lambda: None)
    x = torch.randn(7, 64)
    assert torch.equal(held(x), layer(x))  # the same float32 product: the weights are exactly the layer's


def test_hold_and_release(monkeypatch):
    model = nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 96), nn.Linear(96, 40))
    with torch.no_grad():
        for m in model:
            m.weight.data = m.weight.data.bfloat16()  # as _load_weights leaves a bf16 checkpoint's matrices
    assert hold_bf16(model) == 1  # 40 outputs are not whole strips of 32: that layer is widened instead
    assert isinstance(model[1], Bf16Linear) and type(model[2]) is nn.Linear
    assert model[0].weight.dtype == model[2].weight.dtype == torch.float32 and model[1].bias.dtype == torch.float32
    before = model(torch.tensor([1, 2, 3]))
    assert release_bf16(model) == 1 and type(model[1]) is nn.Linear and model[1].weight.dtype == torch.float32
    assert torch.allclose(model(torch.tensor([1, 2, 3])), before, atol=1e-5)


@pytest.fixture(scope="module")
def qwen3_bf16(tmp_path_factory):
    return build_qwen3(tmp_path_factory.mktemp("qwen3-bf16"), dtype="bfloat16")


def _held(embedder: Embedder) -> int:
    return sum(isinstance(m, Bf16Linear) for m in embedder._loaded.runner.model.modules())


def test_float32_on_a_bf16_checkpoint_holds_bf16_and_matches_sentence_transformers(kernel, qwen3_bf16):
    embedder = Embedder(str(qwen3_bf16), dtype="float32")
    assert _held(embedder) == 2 * 4  # q/k/v, o, gate/up and down of both layers
    ours, _ = embedder.embed(TEXTS)
    ref = st_reference(qwen3_bf16, TEXTS, model_kwargs={"dtype": torch.float32})
    assert cos(ours, ref).min() >= 0.99999
    alone = np.stack([embedder.embed([t])[0][0] for t in TEXTS[:3]])
    assert cos(alone, ours[:3]).min() >= 0.999999
    # the same model with the switch off: float32 weights, the same vectors
    off = Embedder(str(qwen3_bf16), dtype="float32", native=dataclasses.replace(NativeConfig(), linear=False))
    assert _held(off) == 0
    assert cos(off.embed(TEXTS)[0], ours).min() >= 0.999999


def test_where_the_kernel_does_not_load_the_layers_go_back_to_float32(monkeypatch, qwen3_bf16):
    import ember.engine.build as build_mod
    import ember.engine.runner as runner_mod

    monkeypatch.setattr(build_mod, "may_build", lambda name, config: True)  # held at load, as on an AVX-512 CPU
    monkeypatch.setattr(runner_mod, "linear_kernel", lambda: None)  # ... whose kernel then did not build
    embedder = Embedder(str(qwen3_bf16), dtype="float32")
    assert _held(embedder) == 0
    model = embedder._loaded.runner.model
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ref = st_reference(qwen3_bf16, TEXTS, model_kwargs={"dtype": torch.float32})
    assert cos(embedder.embed(TEXTS)[0], ref).min() >= 0.99999


def test_float32_checkpoints_and_bf16_compute_hold_nothing(monkeypatch, tmp_path, qwen3_bf16):
    import ember.engine.build as build_mod

    monkeypatch.setattr(build_mod, "may_build", lambda name, config: True)  # as on an AVX-512 CPU with a compiler
    held: list[int] = []
    monkeypatch.setattr(build_mod, "hold_bf16", lambda net, *a: held.append(linear_mod.hold_bf16(net, *a)) or held[-1])
    Embedder(str(build_bert(tmp_path / "bert")), dtype="float32")  # float32 weights: nothing bf16 to hold
    assert held == [0]
    Embedder(str(qwen3_bf16), dtype="bfloat16")
    Embedder(str(qwen3_bf16), dtype="float32", quantization="int8")
    assert held == [0]  # neither asked to hold
    Embedder(str(qwen3_bf16), dtype="float32")
    assert held == [0, 8]


def test_a_bf16_bert_checkpoint_in_float32(kernel, tmp_path):
    """Biases, LayerNorms and position embeddings of a bf16 checkpoint: the layers hold bf16, the rest is widened."""
    path = build_bert(tmp_path / "bert", dtype="bfloat16", hidden=64, intermediate=128)
    embedder = Embedder(str(path), dtype="float32")
    model = embedder._loaded.runner.model
    assert _held(embedder) == 2 * 4  # q/k/v, attention out, intermediate, out of both layers
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ref = st_reference(path, TEXTS, model_kwargs={"dtype": torch.float32})
    assert cos(embedder.embed(TEXTS)[0], ref).min() >= 0.99999


def test_a_tied_matrix_is_widened_once():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    model[0].weight.data = model[0].weight.data.bfloat16()
    model[1].weight = model[0].weight  # as SPLADE ties its decoder to the word embeddings
    assert hold_bf16(model) == 0  # 10 outputs: not whole strips
    assert model[1].weight is model[0].weight and model[0].weight.dtype == torch.float32
    loaded = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))  # as load_state_dict(assign=True) ties them:
    shared = torch.randn(10, 8).bfloat16()  # two Parameters over one tensor
    loaded[0].weight, loaded[1].weight = (nn.Parameter(shared, requires_grad=False) for _ in range(2))
    assert loaded[0].weight is not loaded[1].weight
    assert hold_bf16(loaded) == 0
    assert loaded[1].weight is loaded[0].weight and loaded[0].weight.dtype == torch.float32


def test_a_float32_reranker_on_a_bf16_checkpoint_equals_transformers(kernel, tmp_path):
    """Qwen3-Reranker ships bf16: its layers hold bf16, and its score row (P(yes) against P(no): the difference of two
    LM-head rows) stays float32, which bf16 would round."""
    from test_rerank import PAIRS, RERANKER_OVERRIDES, _qwen3_reference

    path = build_qwen3_reranker(tmp_path / "reranker", seed=5, dtype="bfloat16")
    ours = Reranker(str(path), dtype="float32", hf_overrides=RERANKER_OVERRIDES)
    model = ours._loaded.runner.model
    assert sum(isinstance(m, Bf16Linear) for m in model.modules()) == 2 * 4
    assert model.score.weight.dtype == torch.float32
    np.testing.assert_allclose(ours.score(PAIRS[:8]), _qwen3_reference(path, PAIRS[:8]), atol=1e-5)


def test_float32_layers_packed_for_onednn_equal_nn_linear_across_the_row_slice():
    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    packed = linear_mod.PackedLinear(layer)
    for rows in (1, 17, linear_mod.F32_SLICE + 5):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(packed(x), layer(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x, "gelu"), F.gelu(layer(x)), atol=1e-5, rtol=1e-5)
    x = torch.randn(linear_mod.F32_SLICE + 5, 64)
    torch.testing.assert_close(packed(x)[-3:], packed(x[-3:]), atol=1e-6, rtol=1e-6)  # a row alone = in a batch


@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_float32_models_on_onednn_match_sentence_transformers(monkeypatch, tmp_path, family):
    """As on an AMD CPU: float32 layers packed for oneDNN, parity with the reference and batch invariance."""
    monkeypatch.setattr(linear_mod, "onednn_f32", lambda: True)
    monkeypatch.setattr(build_mod, "strip_f32", lambda: False)  # oneDNN's layers, not ember's float32 product
    path = build_bert(tmp_path / "m") if family == "bert" else build_qwen3(tmp_path / "m", dtype="float32")
    embedder = Embedder(str(path), dtype="float32")
    packed = sum(isinstance(m, linear_mod.PackedLinear) for m in embedder._loaded.runner.model.modules())
    assert packed >= 8
    ours, _ = embedder.embed(TEXTS)
    assert cos(ours, st_reference(path, TEXTS)).min() >= 0.9999
    alone = np.stack([embedder.embed([t])[0][0] for t in TEXTS[:3]])
    assert cos(alone, ours[:3]).min() >= 0.999999
    monkeypatch.setattr(linear_mod, "onednn_f32", lambda: False)
    plain = Embedder(str(path), dtype="float32")
    assert not any(isinstance(m, linear_mod.PackedLinear) for m in plain._loaded.runner.model.modules())
