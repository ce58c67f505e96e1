"""float32 layers on ember's float32 product (ember.ops.linear.StripLinear and csrc/linear_f32.cpp): the product
against float64 (register blocks with the next strip prefetched; taller batches in panels of rows), a row alone equal to the row in a batch, the fallbacks (before the kernel loads, and oneDNN's layer
where it never does), and whole models laid out for it against sentence-transformers."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ember.engine.build as build_mod
import ember.engine.runner as runner_mod
import ember.ops.linear as linear_mod
import ember.ops.quant as quant
from checkpoints import build_bert, build_qwen3
from corpus import SENTENCES
from ember import Embedder
from ember.config import NativeConfig
from ember.ops.fused import can_compile
from ember.ops.linear import (
    PackedLinear,
    StripLinear,
    pack_bf16,
    pack_f32,
    per_row_kernels,
    release_strips,
    strip_width,
    unpack_bf16,
    unpack_f32,
)
from ember.ops.native import build_kernels, linear_f32_kernel
from ember.ops.quant import Int8Linear
from parity import cos, st_reference

TEXTS = [*SENTENCES[:12], SENTENCES[50]]
PANEL = 256  # csrc/linear_f32.cpp's kPanel: taller batches run in panels of this many rows


@pytest.fixture(scope="module")
def kernel():
    build_kernels(NativeConfig())
    if linear_f32_kernel() is None:
        pytest.skip("the float32 linear kernel did not build here (no compiler, or no AVX2/FMA or NEON)")
    return linear_f32_kernel()


def _layer(k: int, n: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


@pytest.mark.parametrize("width", [16, 32])
def test_packing_round_trips_exactly(width):
    w = torch.randn(96, 40)
    strips = pack_f32(w, width)
    assert strips.shape == (96 // width, 40, width)
    assert torch.equal(strips[1, 7], w[width : 2 * width, 7])  # strip 1, input 7: channels width..2 width - 1
    assert torch.equal(unpack_f32(strips), w)


def test_the_strip_width_is_the_kernels(kernel):
    assert kernel.ember_linear_f32_strip() == strip_width()
    with pytest.raises(RuntimeError, match="must be packed"):  # a layout of another width is refused, not misread
        torch.ops.ember.linear_f32w(torch.randn(3, 40), pack_f32(torch.randn(64, 40), 48 - strip_width()), None)


@pytest.mark.parametrize("rows", [1, 5, 7, 15, 21, 64, 160, PANEL, 2 * PANEL + 7])
@pytest.mark.parametrize(("k", "n", "bias"), [(96, 64, True), (200, 160, False), (1024, 32, True), (203, 128, True)])
def test_kernel_matches_float64(kernel, rows, k, n, bias):  # k = 203: a depth the prefetch streams do not divide
    layer = _layer(k, n, bias)
    x = torch.randn(rows, k)
    expected = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    ours = torch.ops.ember.linear_f32w(x, pack_f32(layer.weight.detach()), layer.bias)
    torch.testing.assert_close(ours.double(), expected, atol=2e-5 * k**0.5, rtol=1e-5)


def _bf16_layer(k: int, n: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    """A layer of a bf16 checkpoint as the loader leaves it for hold_bf16: bf16 weights, a float32 bias."""
    layer = _layer(k, n, bias, seed)
    layer.weight = nn.Parameter(layer.weight.detach().bfloat16(), requires_grad=False)
    return layer


@pytest.mark.parametrize("rows", [1, 7, 15, 28, 52, 53, 64, PANEL + 7])  # 15 to 52: blocks of at most 13 rows
@pytest.mark.parametrize(("k", "n", "bias"), [(96, 64, True), (1024, 32, False), (203, 128, True)])
def test_bf16_words_match_float64(kernel, rows, k, n, bias):
    """The same product on a bf16 checkpoint's weights in strips of bf16 words: the bf16 values, widened exactly."""
    layer = _bf16_layer(k, n, bias)
    w = layer.weight.detach()
    words = pack_bf16(w, strip_width())
    assert words.shape == (n // strip_width(), k, strip_width() // 2) and torch.equal(unpack_bf16(words), w.float())
    x = torch.randn(rows, k)
    expected = F.linear(x.double(), w.double(), None if layer.bias is None else layer.bias.double())
    ours = torch.ops.ember.linear_f32h(x, words, layer.bias)
    torch.testing.assert_close(ours.double(), expected, atol=2e-5 * k**0.5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="must be packed"):  # float32 strips are not read as words
        torch.ops.ember.linear_f32h(x, pack_f32(w.float()), None)


def test_a_bf16_layer_holds_half_the_bytes_and_equals_its_float32_layer(kernel, monkeypatch):
    layer = _bf16_layer(256, 96)
    held, wide = StripLinear(layer), StripLinear(_layer(256, 96))
    wide.weight.copy_(pack_f32(layer.weight.detach().float()))  # the same values, as float32 strips
    assert held.bf16 and not wide.bf16
    assert held.weight.nbytes * 2 == wide.weight.nbytes
    x = torch.randn(PANEL + 23, 256)
    batch = held(x)
    assert torch.equal(batch, wide(x))  # the same sums in the same order
    assert torch.equal(held(x[5:6]), batch[5:6])
    widened = held.widened()
    assert widened.weight.dtype == torch.float32 and torch.equal(widened.weight, layer.weight.float())
    monkeypatch.setattr(linear_mod, "linear_f32_kernel", lambda: None)  # before the kernel loads
    torch.testing.assert_close(held(x), batch, atol=1e-5, rtol=1e-5)


def test_a_row_alone_equals_the_row_in_a_batch_and_spaced_rows_are_read(kernel):
    layer = _layer(256, 96)
    strip = StripLinear(layer)
    x = torch.randn(PANEL + 23, 256)
    batch = strip(x)
    for i in (0, 5, 22, PANEL + 3):  # in blocks of 6, 6, 6, 5 and panels; each row's sums in the order alone
        assert torch.equal(strip(x[i : i + 1]), batch[i : i + 1])
    spaced = torch.randn(23, 512)[:, ::2]  # a row stride that is not the width
    torch.testing.assert_close(strip(spaced), layer(spaced), atol=1e-5, rtol=1e-5)
    leading = torch.randn(2, 3, 256)  # leading axes, and an activation applied after the product
    torch.testing.assert_close(strip(leading, "gelu"), F.gelu(layer(leading)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 15, 160])
def test_the_sums_do_not_depend_on_how_many_threads_claim_the_strips(kernel, rows):
    """The threads claim strips from one counter, so which thread computes a strip changes from call to call;
    each strip is computed whole by one, so one thread, two and three give the same bits."""
    layer = _layer(200, 160)  # 10 strips of 16 (5 of 32): more strips than threads, and an odd count
    layers = (StripLinear(layer), StripLinear(_layer(200, 160).to(torch.bfloat16)))  # float32 strips, bf16 words
    x = torch.randn(rows, 200)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append([strip(x) for strip in layers])
    finally:
        torch.set_num_threads(before)
    assert layers[1].bf16 and not layers[0].bf16
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0], strict=True))
    torch.testing.assert_close(outs[0][0], layer(x), atol=1e-5, rtol=1e-5)


def test_until_the_kernel_loads_the_layer_lays_its_weights_out_plainly(monkeypatch):
    monkeypatch.setattr(linear_mod, "linear_f32_kernel", lambda: None)
    layer = _layer(64, 32)
    x = torch.randn(9, 64)
    torch.testing.assert_close(StripLinear(layer)(x), layer(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("amd", [True, False])
def test_released_to_onednns_layer_where_the_kernel_does_not_load(monkeypatch, amd):
    """Back to oneDNN's packed layer where it is the faster float32 product (AMD), else to a float32 nn.Linear."""
    monkeypatch.setattr(linear_mod, "onednn_f32", lambda: amd)
    model = nn.Sequential(_layer(64, 32), nn.ReLU(), _layer(32, 64, bias=False))
    x = torch.randn(5, 64)
    expected = model(x)
    for i in (0, 2):
        model[i] = StripLinear(model[i])
    assert release_strips(model) == 2
    kind = linear_mod.PackedLinear if amd else nn.Linear
    assert all(type(m) is kind for m in (model[0], model[2]))
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)
    layer = _layer(64, 32)
    widened = StripLinear(layer).widened()
    assert torch.equal(widened.weight, layer.weight) and torch.equal(widened.bias, layer.bias)


@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_float32_models_laid_out_for_the_kernel_match_sentence_transformers(kernel, monkeypatch, tmp_path, family):
    """As on a Zen 3 EPYC: float32 layers in strips, parity with the reference and a text alone equal to it in a
    batch; and where the kernel then does not load, the layers go to oneDNN's and still match."""
    monkeypatch.setattr(linear_mod, "onednn_f32", lambda: True)
    monkeypatch.setattr(build_mod, "strip_f32", lambda: True)
    path = build_bert(tmp_path / "m") if family == "bert" else build_qwen3(tmp_path / "m", dtype="float32")
    embedder = Embedder(str(path), dtype="float32")
    model = embedder._loaded.runner.model
    assert sum(isinstance(m, StripLinear) for m in model.modules()) >= 8
    ours, _ = embedder.embed(TEXTS)
    assert cos(ours, st_reference(path, TEXTS)).min() >= 0.9999
    alone = np.stack([embedder.embed([t])[0][0] for t in TEXTS[:3]])
    assert cos(alone, ours[:3]).min() >= 0.999999
    assert embedder._loaded.runner.compiled  # a decoder's layers are then one compiled region each, for any length
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (2, 9, 70, 301):
            embedder.embed([" ".join(["word"] * n), "short one"])
    monkeypatch.setattr(runner_mod, "linear_f32_kernel", lambda: None)
    embedder._loaded.runner.load_kernels()
    assert not any(isinstance(m, StripLinear) for m in model.modules())
    assert embedder._loaded.runner.pads  # now on oneDNN's layers, which build a kernel per row count
    again, _ = embedder.embed(TEXTS)
    assert cos(again, ours).min() >= 0.99999


def test_a_bf16_checkpoint_in_float32_holds_its_bf16_weights_in_strips(kernel, monkeypatch, tmp_path):
    """As on a Zen 3 EPYC with Qwen3-Embedding (a bf16 checkpoint) in float32: every matrix kept as its bf16 words
    (half the memory), the vectors those of the reference in float32 and of the same model with float32 strips;
    where the kernel then does not load, the layers go back to float32 oneDNN layers and still match."""
    monkeypatch.setattr(linear_mod, "onednn_f32", lambda: True)
    monkeypatch.setattr(build_mod, "strip_f32", lambda: True)
    path = build_qwen3(tmp_path / "m", dtype="bfloat16")
    embedder = Embedder(str(path), dtype="float32")
    model = embedder._loaded.runner.model
    strips = [m for m in model.modules() if isinstance(m, StripLinear)]
    assert len(strips) == 2 * 4 and all(m.bf16 and m.weight.dtype == torch.int32 for m in strips)
    assert not embedder._loaded.runner.pads  # no layer on oneDNN: batches run at their own token counts
    assert all(p.dtype == torch.float32 for p in model.parameters())  # norms and embeddings widened
    ours, _ = embedder.embed(TEXTS)
    ref = st_reference(path, TEXTS, model_kwargs={"dtype": torch.float32})
    assert cos(ours, ref).min() >= 0.99999
    alone = np.stack([embedder.embed([t])[0][0] for t in TEXTS[:3]])
    assert cos(alone, ours[:3]).min() >= 0.999999
    quantized = Embedder(str(path), dtype="float32", quantization="int8", calibration="none")
    assert not any(isinstance(m, StripLinear) and m.bf16 for m in quantized._loaded.runner.model.modules())
    wide = Embedder(str(path), dtype="float32", native=dataclasses.replace(NativeConfig(), linear=False))
    wide_strips = [m for m in wide._loaded.runner.model.modules() if isinstance(m, StripLinear)]
    assert len(wide_strips) == 2 * 4 and not any(m.bf16 for m in wide_strips)  # EMBER_NATIVE_LINEAR=0
    assert cos(wide.embed(TEXTS)[0], ours).min() >= 0.999999
    # the memory plan counts the held matrices at two bytes a weight (doctor and the limits say what they take)
    saved = wide._loaded.plan.memory.weights_bytes - embedder._loaded.plan.memory.weights_bytes
    assert saved == sum(m.weight.nbytes for m in strips) > 0
    monkeypatch.setattr(runner_mod, "linear_f32_kernel", lambda: None)
    embedder._loaded.runner.load_kernels()
    assert not any(isinstance(m, StripLinear) for m in model.modules())
    assert embedder._loaded.runner.pads  # now on oneDNN's layers, which build a kernel per row count
    assert cos(embedder.embed(TEXTS)[0], ours).min() >= 0.99999


@pytest.mark.skipif(not can_compile(), reason="no C++ compiler for torch.compile")
def test_compiled_float32_strips_serve_any_batch_without_compiling_again(kernel, monkeypatch, tmp_path):
    """On bf16 words in strips, batches of up to a token slice run all layers but the last as one compiled region,
    longer ones per layer in slices: the compile warm-up builds every graph, so no batch of any height meets a
    compilation while serving, and a text gives the same in any batch."""
    monkeypatch.setattr(linear_mod, "onednn_f32", lambda: True)
    monkeypatch.setattr(build_mod, "strip_f32", lambda: True)
    path = build_qwen3(tmp_path / "m", dtype="bfloat16")
    fused = Embedder(str(path), dtype="float32")
    assert fused._loaded.runner.compiled
    assert any(isinstance(m, StripLinear) and m.bf16 for m in fused._loaded.runner.model.modules())
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    g = torch.Generator().manual_seed(0)
    seqs = {n: torch.randint(10, 1000, (n,), generator=g).tolist() for n in (1, 5, 17, 300, 600, 1200, 1000)}
    for lengths in ([5], [5] * 8, [17, 300, 5], [1], [600], [1200, 600], [1200, 1000]):
        fused.embed([seqs[n] for n in lengths])  # raises if any of them needs a new graph
    fused.embed_tokens([seqs[5], seqs[17]])
    eager = Embedder(str(path), dtype="float32", enforce_eager=True)
    for lengths in ([17], [600], [1200, 600], [1200, 1000]):  # up to a slice, short and tall; past it
        got = fused.embed([seqs[n] for n in lengths]).vectors
        assert cos(got, eager.embed([seqs[n] for n in lengths]).vectors).min() >= 0.99999
        assert cos(got[-1:], eager.embed([seqs[lengths[-1]]]).vectors).min() >= 0.99999


@pytest.mark.parametrize(
    ("vendor", "flags", "strips"),
    [
        ("GenuineIntel", {"avx2", "fma", "avx512f", "avx512bw"}, True),  # Skylake-SP to Granite Rapids
        ("GenuineIntel", {"avx2", "fma"}, True),  # AVX2-only Xeons (Haswell, Broadwell)
        ("GenuineIntel", {"sse4_2", "avx"}, False),  # no AVX2: the kernel does not build
        ("AuthenticAMD", {"avx2", "fma"}, True),  # Zen 2/3
        ("AuthenticAMD", {"avx2", "fma", "avx512f", "avx512bw"}, False),  # Zen 4/5: oneDNN until measured there
    ],
)
def test_where_the_float32_product_takes_the_layers(monkeypatch, vendor, flags, strips):
    monkeypatch.setattr(linear_mod, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(linear_mod, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(linear_mod, "onednn_f32", lambda: vendor == "AuthenticAMD")
    assert linear_mod.strip_f32() is strips


def test_bf16_words_in_tall_batches_equal_float64(kernel):
    """Batches of any height run the strips' own product (panels of rows) on bf16 words and equal float64's."""
    layer = _bf16_layer(256, 96)
    held = StripLinear(layer)
    for rows in (512, 513, 1029, 2048):
        x = torch.randn(rows, 256)
        ref = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        y = held(x)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_batches_pad_only_where_a_layer_builds_a_kernel_per_row_count(kernel, monkeypatch):
    """oneDNN (PackedLinear, a bf16 nn.Linear, int8 on torch._int_mm or oneDNN) builds a kernel for each row count,
    so those models' batches run at a few rounded counts; ember's own products and oneMKL's float32 one do not."""
    assert not per_row_kernels(nn.Sequential(StripLinear(_layer(64, 64)), _layer(64, 32)))
    assert per_row_kernels(nn.Sequential(StripLinear(_layer(64, 64)), _layer(64, 32).bfloat16()))
    if linear_mod.onednn_bf16():  # oneDNN packs bf16 weights only on CPUs with AVX-512 or AVX-NE-CONVERT
        assert per_row_kernels(nn.Sequential(StripLinear(_layer(64, 64)), PackedLinear(_layer(64, 32).bfloat16())))
    int8 = Int8Linear(_layer(64, 64), torch.float32)
    int8.onednn, int8.int_mm = False, True
    int8.qweight = torch.zeros(64, 64, dtype=torch.int8)  # (K, N) for torch._int_mm
    assert per_row_kernels(nn.Sequential(int8))
    int8.qweight = pack_f32(torch.zeros(64, 64, dtype=torch.int8), strip_width())  # the float32 product's strips
    assert int8.rotation is not None and not per_row_kernels(nn.Sequential(int8))  # rotated in float32: oneMKL
    int8.out_dtype = torch.bfloat16  # a bf16 model's int8 layer: its inputs rotated by a bf16 matmul, on oneDNN
    monkeypatch.setattr(quant, "native_rotation", lambda b: False)
    assert per_row_kernels(nn.Sequential(int8))
    monkeypatch.setattr(quant, "native_rotation", lambda b: True)  # ... or by the native transform: no kernels
    assert not per_row_kernels(nn.Sequential(int8))
