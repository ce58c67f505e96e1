"""bf16 layers on ember's bf16 product (ember.ops.bf16_pairs.PairLinear and csrc/linear_bf16.cpp): the product
against float64 at a query's rows and in panels of taller batches, a row alone equal to the row in a batch, where it
takes the layers, the fallbacks (before the kernel loads, and oneDNN's layer where it never does), and a whole bf16
model laid out for it against sentence-transformers and against oneDNN's layers."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ember.engine.runner as runner_mod
import ember.ops.bf16_pairs as pairs_mod
from checkpoints import build_qwen3
from corpus import SENTENCES
from ember import Embedder
from ember.config import NativeConfig
from ember.ops.bf16_pairs import PairLinear, pack_pairs, pairable, streams_weights, unpack_pairs
from ember.ops.fused import can_compile, silu_mul
from ember.ops.linear import PackedLinear, linear_act, onednn_bf16, per_row_kernels, release_pairs
from ember.ops.native import build_kernels, linear_bf16_kernel
from parity import cos, st_reference

TEXTS = [*SENTENCES[:12], SENTENCES[50]]


@pytest.fixture(scope="module")
def kernel():
    build_kernels(NativeConfig())
    if linear_bf16_kernel() is None:
        pytest.skip("the bf16 linear kernel did not build here (no compiler, or no AVX-512 BF16)")
    return linear_bf16_kernel()


def _layer(k: int, n: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).bfloat16()


def test_packing_round_trips_exactly():
    w = torch.randn(96, 40).bfloat16()
    words = pack_pairs(w)
    assert words.shape == (3, 20, 32) and words.dtype == torch.int32
    pair = words[1, 7].view(torch.bfloat16).reshape(32, 2)  # strip 1, inputs 14 and 15 of channels 32..63
    assert torch.equal(pair[:, 0], w[32:64, 14]) and torch.equal(pair[:, 1], w[32:64, 15])
    assert torch.equal(unpack_pairs(words), w)


@pytest.mark.parametrize("rows", [1, 9, 14, 15, 18, 29, 64, 300, 513])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_float64(kernel, rows, bias):
    """float32 sums of the bf16 products, rounded once: within bf16's rounding of float64's result, at a query's
    rows (one or two register blocks, the next strip prefetched as streams) and in panels of taller batches."""
    layer = _layer(200, 96, bias)  # 100 input pairs: a depth the prefetch streams do not divide
    x = torch.randn(rows, 200).bfloat16()
    ref = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    y = PairLinear(layer)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-3).all()


def test_a_row_alone_equals_the_row_in_a_batch_and_leading_axes_are_kept(kernel):
    held = PairLinear(_layer(128, 64))
    x = torch.randn(40, 128).bfloat16()
    batch = held(x)
    for i in (0, 17, 39):
        assert torch.equal(held(x[i : i + 1]), batch[i : i + 1])
    assert torch.equal(held(x.view(4, 10, 128)), batch.view(4, 10, 64))
    spaced = torch.randn(40, 256).bfloat16()[:, :128]  # rows of x 256 apart
    assert torch.equal(held(spaced), held(spaced.contiguous()))


def test_the_activation_is_applied_after_the_product(kernel):
    layer = _layer(64, 64)
    x = torch.randn(7, 64).bfloat16()
    held = PairLinear(layer)
    assert torch.equal(linear_act(held, x, "gelu"), F.gelu(held(x)))


@pytest.mark.parametrize("rows", [1, 14, 15, 29, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_swiglu_in_the_epilogue_equals_the_plain_product_then_silu_mul_bit_for_bit(kernel, rows, bias):
    """A SwiGLU gate/up layer (gates and ups interleaved in blocks of 16) gives silu(gate) * up from the product's
    epilogue, each rounded where the plain product and silu_mul round: the same bits. Its forward still gives
    [gate, up], and its plain layer is the original."""
    layer = _layer(200, 2 * 96, bias)  # 96 gates and 96 ups: three strips of each
    plain, glu = PairLinear(layer), PairLinear(layer, glu=True)
    assert glu.glu and not plain.glu
    x = torch.randn(rows, 200).bfloat16()
    assert torch.equal(glu.silu_mul(x), silu_mul(plain(x)))
    assert glu.silu_mul(x).shape == (rows, 96)
    assert torch.equal(glu(x), plain(x))
    back = glu.plain()
    assert torch.equal(back.weight, layer.weight)
    assert not bias or torch.equal(back.bias, layer.bias)


def test_a_swiglu_layer_whose_halves_are_not_whole_strips_keeps_the_plain_product(kernel):
    layer = _layer(64, 2 * 48)  # 48 gates: not whole strips of 32
    glu = PairLinear(layer, glu=True)
    x = torch.randn(3, 64).bfloat16()
    assert not glu.glu and torch.equal(glu.silu_mul(x), silu_mul(PairLinear(layer)(x)))


def test_until_the_kernel_loads_a_swiglu_layer_computes_it_plainly(monkeypatch):
    monkeypatch.setattr(pairs_mod, "linear_bf16_kernel", lambda: None)
    layer = _layer(64, 2 * 64)
    x = torch.randn(9, 64).bfloat16()
    glu = PairLinear(layer, glu=True)
    assert torch.equal(glu(x), layer(x))
    assert torch.equal(glu.silu_mul(x), silu_mul(layer(x)))


def test_until_the_kernel_loads_the_layer_lays_its_weights_out_plainly(monkeypatch):
    monkeypatch.setattr(pairs_mod, "linear_bf16_kernel", lambda: None)
    layer = _layer(64, 32)
    x = torch.randn(9, 64).bfloat16()
    assert torch.equal(PairLinear(layer)(x), layer(x))


@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN packs bf16 weights only with AVX-512 or AVX-NE-CONVERT")
def test_released_to_onednns_layer_where_the_kernel_does_not_load():
    model = nn.Sequential(_layer(64, 32), nn.ReLU(), _layer(32, 64, bias=False))
    x = torch.randn(5, 64).bfloat16()
    expected = model(x)
    for i in (0, 2):
        model[i] = PairLinear(model[i])
    assert not per_row_kernels(model)  # ember's product runs any row count as it is
    assert release_pairs(model) == 2
    assert all(type(m) is PackedLinear for m in (model[0], model[2]))
    assert per_row_kernels(model)
    torch.testing.assert_close(model(x), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("vendor", "flags", "pairs"),
    [
        ("AuthenticAMD", {"avx512f", "avx512bw", "avx512_bf16"}, True),  # Zen 4/5
        ("AuthenticAMD", {"avx2", "fma"}, False),  # Zen 2/3: no bf16 products
        ("GenuineIntel", {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16"}, False),  # AMX: oneDNN's tall products
        ("GenuineIntel", {"avx512f", "avx512bw", "avx512_bf16"}, False),  # AMX hidden: float32 there, not measured
    ],
)
def test_where_the_bf16_product_takes_the_layers(monkeypatch, vendor, flags, pairs):
    pairs_mod.pair_bf16.cache_clear()
    monkeypatch.setattr(pairs_mod, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(pairs_mod, "cpu_flags", lambda: frozenset(flags))
    try:
        assert pairs_mod.pair_bf16() is pairs
    finally:
        pairs_mod.pair_bf16.cache_clear()
    assert pairable(nn.Linear(64, 32)) and not pairable(nn.Linear(63, 32)) and not pairable(nn.Linear(64, 48))


def test_only_models_whose_weights_outgrow_the_caches_take_the_bf16_product():
    """A query's products stream the weights from memory only where they outgrow the caches: Qwen3-Embedding-0.6B's
    shape does, all-MiniLM-L6-v2's does not."""
    with torch.device("meta"):
        qwen3_06b = nn.Sequential(*[nn.Linear(1024, 4096 + 2 * 1024 + 1024 + 2 * 3072) for _ in range(28)])
        minilm = nn.Sequential(*[nn.Linear(384, 3 * 384 + 384 + 2 * 1536) for _ in range(6)])
    assert streams_weights(qwen3_06b) and not streams_weights(minilm)


@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN packs bf16 weights only with AVX-512 or AVX-NE-CONVERT")
def test_a_bf16_model_on_the_bf16_product_matches_sentence_transformers_and_onednn(kernel, monkeypatch, tmp_path):
    """As on a Zen 4 or 5 EPYC: every matrix of a bf16 Qwen3 in pairs, batches at their own token counts, the
    vectors those of the reference and of the same model on oneDNN's layers (EMBER_NATIVE_LINEAR_BF16=0), a text
    alone equal to it in a batch; where the kernel then does not load, the layers go to oneDNN's and still match."""
    monkeypatch.setattr(pairs_mod, "pair_bf16", lambda: True)
    monkeypatch.setattr(pairs_mod, "streams_weights", lambda _: True)  # the test model's are a few KB
    path = build_qwen3(tmp_path / "m", dtype="bfloat16")
    embedder = Embedder(str(path), dtype="bfloat16")
    model = embedder._loaded.runner.model
    assert sum(isinstance(m, PairLinear) for m in model.modules()) == 2 * 4
    gate_ups = [m for name, m in model.named_modules() if name.endswith("gate_up_proj")]
    assert len(gate_ups) == 2 and all(m.glu for m in gate_ups)  # SwiGLU in the product's epilogue
    assert not embedder._loaded.runner.pads
    ours, _ = embedder.embed(TEXTS)
    assert cos(ours, st_reference(path, TEXTS, model_kwargs={"dtype": torch.bfloat16})).min() >= 0.999
    onednn = Embedder(str(path), dtype="bfloat16", native=dataclasses.replace(NativeConfig(), linear_bf16=False))
    assert not any(isinstance(m, PairLinear) for m in onednn._loaded.runner.model.modules())
    assert cos(onednn.embed(TEXTS)[0], ours).min() >= 0.9995
    alone = np.stack([embedder.embed([t])[0][0] for t in TEXTS[:3]])
    assert cos(alone, ours[:3]).min() >= 0.9999
    monkeypatch.setattr(runner_mod, "linear_bf16_kernel", lambda: None)
    embedder._loaded.runner.load_kernels()
    assert not any(isinstance(m, PairLinear) for m in model.modules())
    assert embedder._loaded.runner.pads  # now on oneDNN's layers, which build a kernel per row count
    assert cos(embedder.embed(TEXTS)[0], ours).min() >= 0.9995


@pytest.mark.skipif(not can_compile(), reason="no C++ compiler for torch.compile")
@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN packs bf16 weights only with AVX-512 or AVX-NE-CONVERT")
def test_compiled_bf16_pairs_serve_any_batch_without_compiling_again(kernel, monkeypatch, tmp_path):
    """On the bf16 product, batches of up to a token slice run all layers but the last as one compiled region, longer
    ones per layer in slices: the compile warm-up builds every graph, so no batch of any height meets a compilation
    while serving, and a text gives the same in any batch and as the eager model."""
    monkeypatch.setattr(pairs_mod, "pair_bf16", lambda: True)
    monkeypatch.setattr(pairs_mod, "streams_weights", lambda _: True)  # the test model's are a few KB
    path = build_qwen3(tmp_path / "m", dtype="bfloat16")
    fused = Embedder(str(path), dtype="bfloat16")
    assert fused._loaded.runner.compiled
    assert any(isinstance(m, PairLinear) for m in fused._loaded.runner.model.modules())
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    g = torch.Generator().manual_seed(0)
    seqs = {n: torch.randint(10, 1000, (n,), generator=g).tolist() for n in (1, 5, 17, 300, 600, 1200, 1000)}
    for lengths in ([5], [5] * 8, [17, 300, 5], [1], [600], [1200, 600], [1200, 1000]):
        fused.embed([seqs[n] for n in lengths])  # raises if any of them needs a new graph
    eager = Embedder(str(path), dtype="bfloat16", enforce_eager=True)
    for lengths in ([17], [600], [1200, 600]):  # up to a slice, short and tall; past it
        got = fused.embed([seqs[n] for n in lengths]).vectors
        assert cos(got, eager.embed([seqs[n] for n in lengths]).vectors).min() >= 0.999
        assert cos(got[-1:], eager.embed([seqs[lengths[-1]]]).vectors).min() >= 0.999
