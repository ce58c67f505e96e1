"""int8 mode: the kernels against exact integer arithmetic, accuracy against float32 on the real
MiniLM and on Qwen3, what each model quantises, and compiled against eager."""

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

import ember.engine.build as build_mod
from checkpoints import build_bert, build_qwen3
from corpus import DOCUMENTS, QUERIES, SENTENCES
from ember import Embedder
from ember.config import ModelConfig, NativeConfig
from ember.engine.build import plan
from ember.models.checkpoint import parameter_count
from ember.models.llama import Block, LlamaModel
from ember.ops import quant
from ember.ops.fused import can_compile
from ember.ops.glu import deinterleave_columns, interleave_glu
from ember.ops.linear import pack_f32, strip_width
from ember.ops.native import build_kernels, int8_gemm_kernel, linear_f32_kernel
from ember.ops.quant import Int8Linear, int8_gemm, onednn_int8, pack_tiles, use_native_int8
from ember.ops.rotation import block_size, hadamard, rotate


def _native_int8() -> bool:
    build_kernels(NativeConfig())
    return int8_gemm_kernel() is not None


@pytest.fixture
def native_int8() -> None:
    if not _native_int8():
        pytest.skip("ember's native int8 kernel cannot run here (it needs g++, x86-64 Linux, AMX int8 or AVX-512 VNNI)")


def _exact(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """What per-token int8 x per-channel int8 should give, in float64 from the definition: inputs and weights
    rotated by the same block-diagonal Hadamard matrix (blocks of up to 128), then quantised."""
    k = linear.in_features
    r = torch.block_diag(*[hadamard(block_size(k)).double()] * (k // block_size(k)))  # (K, K), orthonormal
    w, x = linear.weight.double() @ r, x.double() @ r
    ws = w.abs().amax(1).clamp(min=1e-8) / 127
    wq = (w / ws[:, None]).round().clamp(-127, 127)
    xs = x.double().abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    xq = (x.double() / xs).round().clamp(-127, 127)
    return (xq @ wq.t()) * xs * ws + (0 if linear.bias is None else linear.bias.double())


@pytest.mark.parametrize("backend", ["onednn", "int_mm", "native", "float", "strips"])
def test_int8_linear_is_exact_integer_arithmetic(backend, monkeypatch):
    """Each way an int8 layer multiplies: oneDNN's (AMX), torch._int_mm, ember's int8 kernel (AMX or VNNI), and on
    CPUs without either, the int8 values in float32: converted per call, or in the float32 product's int8 strips."""
    if backend == "onednn" and not onednn_int8():
        pytest.skip("oneDNN's int8 matmul is not used here (it needs AMX int8 and a torch build with it)")
    if backend == "native" and not _native_int8():
        pytest.skip("ember's native int8 kernel cannot run here")
    if backend == "strips" and not _strips():
        pytest.skip("the float32 product's kernel cannot run here")
    monkeypatch.setattr(quant, "onednn_int8", lambda: backend in ("onednn", "native"))
    monkeypatch.setattr(quant, "int_mm_fast", lambda: backend not in ("float", "strips"))
    if backend == "strips":  # as on a CPU without VNNI or AMX, where ember's int8 kernel is not built
        monkeypatch.setattr(quant, "int8_gemm_kernel", lambda: None)
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96)
    x = torch.randn(37, 128) * torch.linspace(0.01, 30, 37)[:, None]  # tokens of very different scales
    layer = Int8Linear(linear, torch.float32)
    if backend in ("native", "strips"):
        assert use_native_int8(layer) == 1
    dims = {"native": 5, "strips": 3}.get(backend, 2)
    assert layer.onednn == (backend in ("onednn", "native")) and layer.qweight.dim() == dims
    got, want = layer(x).double(), _exact(linear, x)
    assert ((got - want).abs() / want.abs().amax(1, keepdim=True)).max() < 1e-5  # float32 rounding only


def _strips() -> bool:
    build_kernels(NativeConfig())
    return linear_f32_kernel() is not None


@pytest.mark.parametrize("tokens", [1, 7, 15, 300])
def test_int8_strips_give_torch_int_mms_sums_and_a_row_alone_its_row_in_a_batch(tokens):
    """The float32 product on int8 strips (CPUs without VNNI or AMX): every sum exactly the integer one (below
    2**24, as here), whatever the rows' blocking."""
    if not _strips():
        pytest.skip("the float32 product's kernel cannot run here")
    g = torch.Generator().manual_seed(tokens)
    width = strip_width()
    xq = torch.randint(-127, 128, (tokens, 768), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (3 * width, 768), dtype=torch.int8, generator=g)
    strips = pack_f32(w, width)
    assert strips.dtype == torch.int8 and strips.nbytes == w.nbytes
    got = torch.ops.ember.linear_f32q(xq.float(), strips, None)
    assert torch.equal(got.long(), xq.long() @ w.long().t())
    assert torch.equal(torch.ops.ember.linear_f32q(xq[-1:].float(), strips, None), got[-1:])
    with pytest.raises(RuntimeError, match="must be packed"):  # float32 strips are not read as int8
        torch.ops.ember.linear_f32q(xq.float(), pack_f32(w.float(), width), None)


@pytest.mark.usefixtures("native_int8")
@pytest.mark.parametrize("tokens", [1, 15, 16, 28, 29, 33, 100, 700])
@pytest.mark.parametrize(("k", "n"), [(64, 32), (384, 1152), (1024, 160), (3072, 96)])
def test_native_int8_kernel_is_exact_integer_arithmetic(tokens, k, n):
    """Every tail of 16 tokens, inputs in chunks that fit L2 (700 x 3,072), both output dtypes."""
    g = torch.Generator().manual_seed(tokens * k + n)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    x = torch.randint(-127, 128, (tokens, k), dtype=torch.int8, generator=g)
    ws, xs = torch.rand(n, generator=g) / 100, torch.rand(tokens, 1, generator=g) / 10
    want = (x.double() @ w.double().t()) * ws.double() * xs.double()
    tiles = pack_tiles(w)
    assert tiles.shape == (n // 16, k // 64, 16, 16, 4)
    got = int8_gemm(x, tiles, ws, xs, None, torch.float32, False).double()
    assert ((got - want).abs() / want.abs().amax()).max() < 1e-6
    got = int8_gemm(x, tiles, ws, xs, None, torch.bfloat16, False).double()
    assert ((got - want).abs() <= want.abs() / 128 + 1e-6).all()  # one bf16 rounding


@pytest.mark.usefixtures("native_int8")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 17, 168])
@pytest.mark.parametrize("k", [64, 3072])
def test_native_kernel_quantises_tokens_as_torch_does(dtype, tokens, k):
    """Float activations quantised inside the kernel give, to the bit, what quantising them in torch
    (_quantize_tokens, the other kernels' path) and passing int8 gives; rows read with their stride."""
    g = torch.Generator().manual_seed(tokens + k)
    x = (torch.randn(tokens, k, generator=g) * torch.logspace(-3, 2, tokens)[:, None]).to(dtype)
    x[0, :4] = torch.tensor([0.5, -1.5, 2.5, -127.0], dtype=dtype)  # ties to even, and amax on a negative
    w = torch.randint(-127, 128, (96, k), dtype=torch.int8, generator=g)
    tiles, ws = pack_tiles(w), torch.rand(96, generator=g)
    xq, xs = quant._quantize_tokens(x)
    want = int8_gemm(xq, tiles, ws, xs, None, torch.float32, False)
    assert torch.equal(int8_gemm(x, tiles, ws, None, None, torch.float32, False), want)
    wide = torch.zeros(tokens, k + 64, dtype=dtype)
    wide[:, :k] = x
    assert torch.equal(int8_gemm(wide[:, :k], tiles, ws, None, None, torch.float32, False), want)
    with pytest.raises(RuntimeError, match="shapes refused"):
        int8_gemm(x.half(), tiles, ws, None, None, torch.float32, False)


@pytest.mark.usefixtures("native_int8")
@pytest.mark.parametrize("glu", [False, True])
def test_native_int8_gives_a_token_alone_what_it_gets_in_any_batch(glu):
    """A query's few tokens (register blocks of their own count, without AMX) and a batch's (tiles of 16) take
    different paths through the kernel: each token's row is the same, to the bit, in either."""
    g = torch.Generator().manual_seed(11)
    k, n = 1024, 192
    x = (torch.randn(40, k, generator=g) * torch.logspace(-2, 1, 40)[:, None]).bfloat16()
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    ws = torch.rand(n, generator=g) / 300
    tiles, scale = (pack_tiles(interleave_glu(w)), interleave_glu(ws)) if glu else (pack_tiles(w), ws)
    whole = int8_gemm(x, tiles, scale, None, None, torch.float32, glu)
    for rows in (slice(5, 6), slice(0, 13), slice(3, 31), slice(11, 40)):
        assert torch.equal(int8_gemm(x[rows], tiles, scale, None, None, torch.float32, glu), whole[rows])


@pytest.mark.usefixtures("native_int8")
@pytest.mark.parametrize("tokens", [3, 40])
def test_native_swiglu_epilogue_is_silu_of_gate_times_up(tokens):
    """A SwiGLU layer's product with silu(gate) * up applied in the kernel, on gate/up interleaved tiles."""
    g = torch.Generator().manual_seed(tokens)
    k, i = 128, 96  # gate and up 96 wide each
    w = torch.randint(-127, 128, (2 * i, k), dtype=torch.int8, generator=g)
    x = torch.randint(-127, 128, (tokens, k), dtype=torch.int8, generator=g)
    ws, xs = torch.rand(2 * i, generator=g) / 300, torch.rand(tokens, 1, generator=g) / 10
    y = (x.double() @ w.double().t()) * ws.double() * xs.double()  # (T, 2 I): values up to ~10
    want = torch.nn.functional.silu(y[:, :i]) * y[:, i:]
    tiles = pack_tiles(interleave_glu(w))
    got = int8_gemm(x, tiles, interleave_glu(ws), xs, None, torch.float32, True).double()
    assert got.shape == (tokens, i)
    assert ((got - want).abs() / want.abs().amax()).max() < 2e-4  # rcp14: 2^-14 relative
    plain = int8_gemm(x, tiles, interleave_glu(ws), xs, None, torch.float32, False)
    assert torch.allclose(deinterleave_columns(plain).double(), y, rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("native_int8")
def test_an_int8_swiglu_layer_gives_the_same_on_either_kernel():
    torch.manual_seed(3)
    linear = torch.nn.Linear(128, 192, bias=False)
    x = torch.randn(21, 128)
    onednn, native = Int8Linear(linear, torch.float32, glu=True), Int8Linear(linear, torch.float32, glu=True)
    assert use_native_int8(native) == 1 and native.qweight.dim() == 5 and onednn.qweight.dim() == 2
    assert torch.allclose(native(x), onednn(x), rtol=1e-5, atol=1e-5)  # columns back in [gate, up] order
    want = torch.nn.functional.silu(onednn(x)[:, :96]) * onednn(x)[:, 96:]
    assert torch.allclose(native.silu_mul(x), want, rtol=1e-3, atol=1e-4)
    assert torch.allclose(onednn.silu_mul(x), want)


@pytest.mark.usefixtures("native_int8")
def test_layers_move_to_the_native_kernel_while_forwards_run():
    """The compile thread repacks the layers while the engine serves: forwards meanwhile run each layer on
    one kernel or the other, never on a half-moved one (tiles with oneDNN's scales, say)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(24)))
    quant.quantize_int8(model, torch.float32, r"\d")
    x = torch.randn(40, 256)
    want = model(x)  # every layer on oneDNN
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                results.append(model(x))
            except BaseException as e:  # reported by the assertion below
                errors.append(e)
                return

    server = threading.Thread(target=serve)
    server.start()
    time.sleep(0.05)
    moved = use_native_int8(model)
    time.sleep(0.05)
    stop.set()
    server.join()
    assert moved == 24 and not errors and len(results) >= 2
    for got in [*results, model(x)]:  # the kernels differ only in float32 rounding and int8 ties
        assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.999


@pytest.mark.usefixtures("native_int8")
def test_only_shapes_the_native_kernel_takes_move_to_it():
    model = torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.Linear(96, 128), torch.nn.Linear(128, 80))
    quant.quantize_int8(model, torch.bfloat16, r"\d")
    assert use_native_int8(model) == 1  # 96 inputs and 80 outputs stay on oneDNN
    assert [m.qweight.dim() for m in model] == [5, 2, 2]
    assert use_native_int8(model) == 0  # and moving twice is a no-op
    assert model(torch.randn(3, 128, dtype=torch.bfloat16)).shape == (3, 80)


def test_int8_weights_are_packed_for_onednn():
    if not onednn_int8():
        pytest.skip("oneDNN's int8 matmul is not used here (it needs AMX int8 and a torch build with it)")
    layer = Int8Linear(torch.nn.Linear(64, 32, bias=False), torch.bfloat16)
    assert layer.qweight.is_mkldnn and layer.qweight.dtype == torch.int8
    assert layer(torch.randn(5, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


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
    # rotated int8 keeps >= 0.999 on these real weights; without the rotation the worst sentence fell to 0.992
    assert (a * b).sum(1).min() >= 0.998
    scores = lambda e: e.embed(QUERIES).vectors @ e.embed(DOCUMENTS).vectors.T  # noqa: E731
    s32, s8 = scores(ref), scores(q8)
    assert (s32.argmax(1) == s8.argmax(1)).all()  # every query still finds its document first
    # and any two documents int8 puts in the other order were within 0.01 of each other in float32
    swapped = np.sign(s32[:, :, None] - s32[:, None, :]) * np.sign(s8[:, :, None] - s8[:, None, :]) < 0
    assert np.abs(s32[:, :, None] - s32[:, None, :])[swapped].max(initial=0) < 0.01


def test_only_feed_forward_layers_are_int8(minilm_pair):
    _, q8 = minilm_pair
    modules = dict(q8._loaded.runner.model.named_modules())
    int8 = sorted(n for n, m in modules.items() if isinstance(m, Int8Linear))
    assert len(int8) == 12 and all("intermediate" in n or n.endswith(".output.dense") for n in int8)
    assert not any("attention" in n for n in int8)
    assert "int8" in q8.info.dtype


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return build_qwen3(tmp_path_factory.mktemp("q8"), layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32)


def test_qwen3_int8_stays_close_and_quantises_every_linear_layer(qwen3_path):
    a = Embedder(str(qwen3_path), dtype="float32", enforce_eager=True).embed(SENTENCES[:20]).vectors
    q8 = Embedder(str(qwen3_path), dtype="bfloat16", quantization="int8", enforce_eager=True)
    assert (a * q8.embed(SENTENCES[:20]).vectors).sum(1).min() >= 0.99
    modules = dict(q8._loaded.runner.model.named_modules())
    assert sum(isinstance(m, Int8Linear) for m in modules.values()) == 4 * 4  # qkv o gate_up down
    assert sorted(n for n, m in modules.items() if getattr(m, "glu", False)) == [
        f"layers.{i}.mlp.gate_up_proj" for i in range(4)
    ]
    assert not any(isinstance(m, torch.nn.Linear) for m in modules.values())
    n_int8 = sum(m.in_features * m.out_features for m in modules.values() if isinstance(m, Int8Linear))
    params = parameter_count(qwen3_path)  # the memory plan counts those at one byte, the rest at two
    assert plan(ModelConfig(str(qwen3_path), dtype="bfloat16", quantization="int8")).memory.weights_bytes == (
        2 * (params - n_int8) + n_int8
    )


def test_qwen3_int8_runs_on_int8_strips_where_the_cpu_has_no_int8_instructions(qwen3_path, monkeypatch):
    """As on a Zen 3 EPYC or a Haswell Xeon (no VNNI, no AMX): once the float32 product's kernel loads, every int8
    layer holds its int8 weights in its strips (one byte a weight), and the vectors are those of the same int8
    values converted to float32 on each call; a text alone equals the same text in a batch."""
    if not _strips():
        pytest.skip("the float32 product's kernel cannot run here")
    monkeypatch.setattr(quant, "int_mm_fast", lambda: False)
    monkeypatch.setattr(quant, "onednn_int8", lambda: False)
    monkeypatch.setattr(quant, "int8_gemm_kernel", lambda: None)
    texts = SENTENCES[:12]
    held = Embedder(str(qwen3_path), dtype="float32", quantization="int8", calibration="none")
    layers = [m for m in held._loaded.runner.model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * 4
    assert all(m.qweight.dim() == 3 and m.qweight.dtype == torch.int8 for m in layers)
    assert all(m.qweight.numel() == m.in_features * m.out_features for m in layers)
    no_strips = dataclasses.replace(NativeConfig(), linear_f32=False)
    converted = Embedder(str(qwen3_path), dtype="float32", quantization="int8", calibration="none", native=no_strips)
    assert all(m.qweight.dim() == 2 for m in converted._loaded.runner.model.modules() if isinstance(m, Int8Linear))
    ours = held.embed(texts).vectors
    assert (ours * converted.embed(texts).vectors).sum(1).min() >= 0.99999
    assert float(held.embed(texts[3]).vectors[0] @ ours[3]) >= 0.999999


def test_float32_int8_is_quantised_straight_from_the_checkpoints_bf16_matrices(tmp_path, monkeypatch):
    """Without calibration (or with its weights cached), a bf16 checkpoint's int8 layers are quantised from its bf16
    matrices, the model never widened to float32 first: the same int8 values and vectors as through float32, and
    every other tensor float32."""
    path = build_qwen3(tmp_path / "m", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, dtype="bfloat16")
    config = ModelConfig(str(path), dtype="float32", quantization="int8", calibration="none")
    assert build_mod._int8_from_checkpoint(config, plan(config))
    quantised_from: list[set[torch.dtype]] = []  # the matrices' dtypes as quantisation meets them
    real = build_mod._quantize

    def spy(net, *args, **kwargs):
        quantised_from.append({m.weight.dtype for m in net.modules() if type(m) is torch.nn.Linear})
        return real(net, *args, **kwargs)

    monkeypatch.setattr(build_mod, "_quantize", spy)
    direct = Embedder(str(path), dtype="float32", quantization="int8", calibration="none")
    monkeypatch.setattr(build_mod, "_int8_from_checkpoint", lambda *a: False)
    widened = Embedder(str(path), dtype="float32", quantization="int8", calibration="none")
    assert quantised_from == [{torch.bfloat16}, {torch.float32}]
    models = [e._loaded.runner.model for e in (direct, widened)]
    assert all(p.dtype == torch.float32 for p in models[0].parameters())
    assert all(b.dtype != torch.bfloat16 for b in models[0].buffers())
    layers = [[m for m in model.modules() if isinstance(m, Int8Linear)] for model in models]
    assert len(layers[0]) == len(layers[1]) == 2 * 4
    for a, b in zip(*layers, strict=True):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scale, b.scale)
    texts = SENTENCES[:8]
    assert (direct.embed(texts).vectors * widened.embed(texts).vectors).sum(1).min() >= 0.999999
    # a first, calibrating start: each matrix widened only as its layer runs, the same GPTQ rounding as through a
    # float32 model
    calibrated = []
    for direct_load in (True, False):
        monkeypatch.setattr(build_mod, "_int8_from_checkpoint", lambda *a, d=direct_load: d)
        native = NativeConfig(cache_dir=str(tmp_path / f"cache-{direct_load}"))  # each start calibrates
        e = Embedder(str(path), dtype="float32", quantization="int8", native=native)
        calibrated.append([m for m in e._loaded.runner.model.modules() if isinstance(m, Int8Linear)])
        assert all(p.dtype == torch.float32 for p in e._loaded.runner.model.parameters())
    assert quantised_from[-2:] == [{torch.bfloat16}, {torch.float32}]
    for a, b in zip(*calibrated, strict=True):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scale, b.scale)
    assert any(not torch.equal(a.qweight, b.qweight) for a, b in zip(calibrated[0], layers[0], strict=True))


def test_a_bf16_bert_in_float32_int8_widens_the_layers_it_does_not_quantise(tmp_path):
    """BERT-family models quantise only their feed-forward layers: quantised straight from the bf16 checkpoint,
    the attention projections, embeddings and norms then float32, close to float32's vectors."""
    path = build_bert(tmp_path / "bert", dtype="bfloat16", hidden=64, intermediate=128)
    q8 = Embedder(str(path), dtype="float32", quantization="int8", calibration="none")
    model = q8._loaded.runner.model
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 2
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ref = Embedder(str(path), dtype="float32").embed(SENTENCES[:8]).vectors
    assert (ref * q8.embed(SENTENCES[:8]).vectors).sum(1).min() >= 0.99


@pytest.mark.skipif(not can_compile(), reason="no C++ compiler for torch.compile")
def test_qwen3_int8_compiled_regions_match_eager(qwen3_path):
    """The compiled regions fuse quantisation into the norms around the int8 GEMMs: same numbers."""
    eager = Embedder(str(qwen3_path), dtype="bfloat16", quantization="int8", enforce_eager=True)
    fused = Embedder(str(qwen3_path), dtype="bfloat16", quantization="int8")
    assert fused._loaded.runner.compiled
    layers = [m for m in fused._loaded.runner.model.modules() if isinstance(m, Int8Linear)]
    assert all((m.qweight.dim() == 5) == _native_int8() for m in layers)  # on the native kernel where it runs
    texts = SENTENCES[:12]
    a, b = eager.embed(texts).vectors, fused.embed(texts).vectors
    # fused norms round differently, and an activation one ulp apart can land on the other side of
    # an int8 step: the two differ by int8's own noise (>= 0.99 of float32), not by a mistake
    assert (a * b).sum(1).min() >= 0.999
    alone = fused.embed(texts[3]).vectors[0]  # a text alone equals the same text in a batch
    assert float(alone @ b[3]) >= 0.9999


@pytest.mark.skipif(not can_compile(), reason="no C++ compiler for torch.compile")
def test_qwen3_int8_compiled_serves_any_batch_without_compiling_again(qwen3_path, monkeypatch):
    """The layers are one compiled region up to a token slice and slices around attention past it: the compile
    warm-up builds both (an unbuilt region would run eagerly), for any token and sequence count, so no batch
    meets a compilation while serving. A sequence gives the same on both paths."""
    fused = Embedder(str(qwen3_path), dtype="bfloat16", quantization="int8")
    assert all(region._fast is not None for region in (LlamaModel._stack, Block._project, Block._out_mlp))
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    g = torch.Generator().manual_seed(0)
    seqs = {n: torch.randint(10, 1000, (n,), generator=g).tolist() for n in (1, 5, 17, 200, 1000, 1200, 3000)}
    for lengths in ([5], [5] * 8, [17, 200, 5], [1], [1200, 1000], [3000]):
        fused.embed([seqs[n] for n in lengths])  # raises if any of them needs a new graph
    fused.embed_tokens([seqs[5], seqs[17]])  # every row wanted through the last layer: the same graph
    alone = fused.embed([seqs[1000]]).vectors[0]  # 1,000 tokens: one region per layer
    sliced = fused.embed([seqs[1200], seqs[1000]]).vectors[1]  # 2,200 tokens: the sliced path
    assert float(alone @ sliced) >= 0.999


def test_onednn_int8_is_used_only_with_amx_and_the_fallback_is_exact(monkeypatch):
    monkeypatch.setattr(quant, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni", "avx512_bf16"}))
    quant.onednn_int8.cache_clear()
    try:
        assert not quant.onednn_int8()  # oneDNN ran its reference int8 code there: ~1000x slower
        torch.manual_seed(0)
        linear = torch.nn.Linear(64, 48)
        layer = Int8Linear(linear, torch.float32)
        assert not layer.onednn and layer.qweight.shape == (64, 48)
        x = torch.randn(5, 64)
        torch.testing.assert_close(layer(x), _exact(linear, x).float(), atol=1e-4, rtol=1e-4)
    finally:
        quant.onednn_int8.cache_clear()


def test_rotation_is_orthonormal_and_leaves_products_unchanged():
    assert [block_size(k) for k in (384, 1536, 3072, 96, 40, 37)] == [64, 64, 64, 32, 8, 1]
    for b in (2, 8, 64):
        h = hadamard(b)
        torch.testing.assert_close(h @ h.t(), torch.eye(b), atol=1e-6, rtol=0)
    hadamard.cache_clear()
    assert torch.equal(hadamard(64), hadamard.__wrapped__(64))  # a fixed seed: the same signs in every process
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 384, generator=g), torch.randn(7, 384, generator=g)
    torch.testing.assert_close(rotate(x, hadamard(64)) @ rotate(w, hadamard(64)).t(), x @ w.t(), atol=1e-4, rtol=0)
    assert rotate(x.bfloat16(), hadamard(64)).dtype == torch.bfloat16


def test_rotation_keeps_an_outlier_channel_from_coarsening_the_rest():
    """A channel 40x the others in every token (as a LayerNorm's few large weights make it in real encoders) sets
    each token's int8 scale; rotated, it is spread over its block and the ordinary channels keep their steps."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 256)
    x = torch.randn(64, 384)
    x[:, 17] *= 40
    with torch.no_grad():
        want = linear(x)

    def error(layer: Int8Linear) -> float:
        with torch.no_grad():
            return float((layer(x) - want).norm() / want.norm())

    rotated, plain = error(Int8Linear(linear, torch.float32)), error(Int8Linear(linear, torch.float32, rotation=1))
    assert rotated < plain / 3, (rotated, plain)


@pytest.mark.parametrize(
    ("family", "floor"),
    [
        ("bert", 0.9999),
        ("xlm-roberta", 0.9999),
        ("qwen3", 0.999),
        ("gemma3", 0.99),
        ("modernbert", 0.9999),
        ("nomic", 0.997),
    ],
)
def test_every_quantised_family_stays_close_to_float32(family, floor, tmp_path):
    """int8 (rotated, float32 and bf16 activations) against float32 on the same small random checkpoint."""
    from checkpoints import build_bert
    from checkpoints.families import build_gemma3, build_modernbert, build_nomic_bert

    builders = {
        "bert": lambda: build_bert(tmp_path, layers=2, hidden=128, intermediate=512),
        "xlm-roberta": lambda: build_bert(tmp_path, kind="xlm-roberta", layers=2, hidden=128, intermediate=512),
        "qwen3": lambda: build_qwen3(tmp_path, layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32),
        "gemma3": lambda: build_gemma3(tmp_path),
        "modernbert": lambda: build_modernbert(tmp_path),
        "nomic": lambda: build_nomic_bert(tmp_path),
    }
    path = str(builders[family]())
    ref = Embedder(path, dtype="float32", enforce_eager=True).embed(SENTENCES).vectors
    for dtype in ("float32", "bfloat16"):
        q8 = Embedder(path, dtype=dtype, quantization="int8", enforce_eager=True)
        assert any(isinstance(m, Int8Linear) for m in q8._loaded.runner.model.modules())
        assert float((ref * q8.embed(SENTENCES).vectors).sum(1).min()) >= floor


def test_int8_product_runs_in_float32_where_torch_has_no_fast_int8_path(monkeypatch):
    """On x86 without VNNI or AMX torch._int_mm is reference code (~50x slower than float32): the same int8 values
    are multiplied in float32 there, a wide matrix a slice of columns at a time, with the same result."""
    cases = (
        ({"avx2", "fma"}, False),
        ({"sse4_2"}, False),
        ({"avx2", "avx512f", "avx512_vnni"}, True),
        ({"asimd"}, True),
    )
    for flags, fast in cases:
        monkeypatch.setattr(quant, "cpu_flags", lambda flags=flags: frozenset(flags))
        quant.int_mm_fast.cache_clear()
        assert quant.int_mm_fast() is fast
    quant.int_mm_fast.cache_clear()
    monkeypatch.undo()
    g = torch.Generator().manual_seed(0)
    xq = torch.randint(-127, 128, (5, 192), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (192, 2500), dtype=torch.int8, generator=g)
    want = xq.long() @ w.long()
    assert torch.equal(quant._float_int_mm(xq, w).long(), want)  # sums below 2**24: exact in float32
    assert torch.equal(quant._float_int_mm(xq, w, columns=4096).long(), want)
