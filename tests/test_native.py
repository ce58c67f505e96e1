"""ember's native attention kernel (ops/csrc/attention.cpp), float32 and bf16, against float64 attention on the same
inputs."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

import ember.ops.native as native
from ember import hardware
from ember.cli.runtime import native_config
from ember.ops import attention
from ember.ops.attention import varlen_attention
from ember.ops.window import local_attention


@pytest.fixture(scope="module")
def kernel() -> ctypes.CDLL:
    native.build_kernels(native_config())  # EMBER_CACHE_DIR as the server reads it
    lib = native.attention_kernel()
    if lib is None:
        pytest.skip(
            "the native attention kernel cannot run on this machine (it needs g++, and Linux on x86-64 with AVX2 + "
            "FMA or on aarch64)"
        )
    return lib


DTYPES = [torch.float32, torch.bfloat16]


def _runs(dtype: torch.dtype) -> None:
    if dtype not in native.native_attention_dtypes():
        pytest.skip(f"this build of the kernel has no {dtype} (bf16 needs AVX-512 BF16)")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Within a rounding of the dtype: bf16 keeps 8 bits (0.4% a rounding), float32 24."""
    tol = 0.01 if dtype == torch.bfloat16 else 1e-4
    return bool(((got.double() - want).abs() <= tol + tol * want.abs()).all())


def _native(kernel: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int], causal: bool):
    """The kernel itself (its operator, which loading the library registered), whatever varlen_attention would choose."""
    return torch.ops.ember.native_attention(q, k, v, attention.seq_offsets(seqlens), causal)


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int], causal: bool, window: int | None = None
) -> torch.Tensor:
    """Float64 attention per sequence on the same values (a token seeing the tokens within `window` positions of it,
    when given): (T, Hq, D) float64."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in seqlens:
        qs, ks, vs = (t[start : start + n].double().transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        i = torch.arange(n)
        mask = (i[:, None] >= i[None, :]) if causal else torch.ones(n, n, dtype=torch.bool)
        if window is not None:
            mask &= (i[:, None] - i[None, :]).abs() <= window
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
        start += n
    return torch.cat(outs)


def _packed(
    seqlens: list[int], hq: int, hkv: int, d: int, seed: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, ...]:
    """q, k, v as views into one (T, Hq + 2 Hkv, D) projection, as Qwen3 lays them out."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(sum(seqlens), hq + 2 * hkv, d, generator=g) * 2).to(dtype)
    return qkv.split((hq, hkv, hkv), dim=1)


CASES = [
    ((16, 8, 128), [130]),
    ((16, 8, 128), [1, 63, 64, 65, 200]),
    ((6, 2, 64), [129, 5, 300, 128]),
    ((4, 4, 32), [250, 17]),
    ((16, 8, 128), [2100, 40]),  # blocks of 32 query rows x 128 keys
    ((16, 8, 128), [20, 20, 20, 1, 15, 63]),  # under 64 tokens: blocks of 32 x 32
    ((16, 8, 128), [100, 64, 3]),  # under 128 tokens: 32 x 64
    ((4, 2, 64), [6200, 70]),  # from 6,144 tokens: 64 x 256
    ((12, 12, 32), [5, 31, 32, 33, 2]),  # all-MiniLM-L6-v2's heads
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("heads", "seqlens"), CASES)
def test_matches_float64_attention(
    kernel: ctypes.CDLL, heads: tuple[int, int, int], seqlens: list[int], causal: bool, dtype: torch.dtype
) -> None:
    _runs(dtype)
    q, k, v = _packed(seqlens, *heads, seed=len(seqlens), dtype=dtype)
    got = _native(kernel, q, k, v, seqlens, causal)
    assert got.dtype == dtype
    want = _reference(q, k, v, seqlens, causal)
    assert _close(got, want, dtype)
    cos = F.cosine_similarity(got.double().flatten(1), want.flatten(1))
    assert cos.min().item() > (0.9999 if dtype == torch.bfloat16 else 0.9999999)


def _fixed_blocks(kernel: ctypes.CDLL, q, k, v, seqlens: list[int], causal: bool, blocks: int):  # type: ignore[no-untyped-def]
    """The kernel through its C entry point with one block shape (its code `blocks`): (status, output)."""
    entry = kernel.ember_attention if q.dtype == torch.bfloat16 else kernel.ember_attention_f32
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)  # contiguous (T, Hq, D), as the kernel writes it
    cu = attention.seq_offsets(seqlens)
    status = entry(
        *(ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, out, cu)), ctypes.c_int64(len(seqlens)),
        *(ctypes.c_int64(n) for n in (q.shape[1], k.shape[1], q.shape[2], q.stride(0), k.stride(0), v.stride(0))),
        ctypes.c_int(int(causal)), ctypes.c_int64(-1), ctypes.c_float(q.shape[2] ** -0.5), ctypes.c_int(blocks),
    )  # fmt: skip
    return status, out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_every_block_shape_computes_the_same_attention(kernel: ctypes.CDLL, causal: bool, dtype: torch.dtype) -> None:
    """Each block shape the kernel chooses from (32 x 32 to 64 x 256, and 128 x 128, which long inputs take on AMD
    Zen 1-3), forced on one batch: float64 attention's result whatever this CPU's lengths would pick."""
    _runs(dtype)
    seqlens = [300, 70, 5, 129]
    q, k, v = _packed(seqlens, 4, 2, 64, seed=11, dtype=dtype)
    want = _reference(q, k, v, seqlens, causal)
    for blocks in range(5):  # 32 x 32, 32 x 64, 32 x 128, 64 x 256, 128 x 128
        status, out = _fixed_blocks(kernel, q, k, v, seqlens, causal, blocks)
        assert status == 0 and _close(out, want, dtype), blocks
    assert _fixed_blocks(kernel, q, k, v, seqlens, causal, 5)[0] == 1  # no such shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_a_late_key_far_above_the_earlier_ones(kernel: ctypes.CDLL, causal: bool, dtype: torch.dtype) -> None:
    """Rows whose later key blocks score far above their first (the softmax's reference is raised, and a
    one-pass block is redone): still float64 attention's result."""
    _runs(dtype)
    q, k, v = _packed([700], 16, 8, 128, seed=3, dtype=dtype)
    k[600:610] *= 6  # scores of keys 600-609 reach ~6x the others'
    got = _native(kernel, q, k, v, [700], causal)
    assert _close(got, _reference(q, k, v, [700], causal), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_and_bidirectional_differ(kernel: ctypes.CDLL, dtype: torch.dtype) -> None:
    _runs(dtype)
    q, k, v = _packed([200], 4, 4, 64, seed=1, dtype=dtype)
    causal = _native(kernel, q, k, v, [200], True)
    both = _native(kernel, q, k, v, [200], False)
    assert torch.allclose(causal[-1].float(), both[-1].float(), atol=0.03)  # the last token sees every key
    assert not torch.allclose(causal[:100].float(), both[:100].float(), atol=0.1)  # early tokens see fewer keys


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sequence_alone_equals_it_inside_a_batch(kernel: ctypes.CDLL, dtype: torch.dtype) -> None:
    _runs(dtype)
    seqlens = [300, 150, 77]
    q, k, v = _packed(seqlens, 16, 8, 128, seed=5, dtype=dtype)
    batch = _native(kernel, q, k, v, seqlens, True)
    alone = _native(kernel, q[300:450], k[300:450], v[300:450], [150], True)
    assert torch.equal(batch[300:450], alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_attention_uses_it(kernel: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    _runs(dtype)
    monkeypatch.setitem(native._loaded, "attention", kernel)
    for seqlens in ([150, 30], [20, 9]):
        q, k, v = _packed(seqlens, 16, 8, 128, seed=2, dtype=dtype)
        assert torch.equal(varlen_attention(q, k, v, seqlens, causal=True), _native(kernel, q, k, v, seqlens, True))
    assert not attention._native_fits(*(t.half() for t in (q, k, v)))  # float16: SDPA
    assert not attention._native_fits(q[..., :48], k[..., :48], v[..., :48])  # a head size it does not take: SDPA


WINDOWS = [
    ((12, 12, 64), [700, 30, 129], 64),  # ModernBERT's local layers: 64 on either side
    ((4, 2, 128), [1300, 513, 40], 256),  # EmbeddingGemma's sliding layers: 256 on either side
    ((4, 2, 64), [1300, 40], 512),  # a window wider than a block of keys
    ((4, 4, 32), [300, 65, 64, 1], 0),  # each token itself alone
    ((4, 4, 32), [90, 33], 31),  # windows ending inside a block of keys
    ((4, 2, 64), [6300], 100),  # a long sequence, a short window: blocks of 32 x 64
    ((2, 1, 64), [6500], 6200),  # a window of 6,144 keys or more: blocks of 64 x 256
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "seqlens", "window"), WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_a_window_matches_banded_attention(
    kernel: ctypes.CDLL, heads: tuple[int, int, int], seqlens: list[int], window: int, dtype: torch.dtype, causal: bool
) -> None:
    _runs(dtype)
    q, k, v = _packed(seqlens, *heads, seed=window, dtype=dtype)
    got = torch.ops.ember.native_attention(q, k, v, attention.seq_offsets(seqlens), causal, window)
    want = _reference(q, k, v, seqlens, causal, window)
    assert _close(got, want, dtype)
    if max(seqlens) > window + 1:  # the window is not every key: the result differs from full attention
        assert not _close(got, _reference(q, k, v, seqlens, causal), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_local_attention_runs_on_it_and_agrees_with_the_sdpa_path(
    kernel: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """ModernBERT's and EmbeddingGemma's local layers call the kernel once for the batch; without it (SDPA: band
    masks and blocks) they compute the same attention."""
    _runs(dtype)
    seqlens, window = [400, 100, 20, 250], 64
    q, k, v = _packed(seqlens, 12, 12, 64, seed=9, dtype=dtype)
    monkeypatch.setitem(native._loaded, "attention", kernel)
    got = local_attention(q, k, v, seqlens, window)
    assert torch.equal(got, torch.ops.ember.native_attention(q, k, v, attention.seq_offsets(seqlens), False, window))
    monkeypatch.delitem(native._loaded, "attention")
    sdpa = local_attention(q, k, v, seqlens, window)
    want = _reference(q, k, v, seqlens, False, window)
    assert _close(got, want, dtype) and _close(sdpa, want, dtype)


def test_the_build_is_this_tiers_and_says_which_dtypes_it_computes(kernel: ctypes.CDLL) -> None:
    kernel.ember_attention_isa.restype = ctypes.c_char_p
    isa = kernel.ember_attention_isa().decode()
    bf16 = {torch.float32, torch.bfloat16}
    assert native.native_attention_dtypes() == (bf16 if isa in ("amx", "avx512_bf16") else {torch.float32})
    tier = hardware.isa_tier()  # this process's tier (as capped by EMBER_MAX_ISA): its loops are that tier's
    assert isa == ("neon" if tier.startswith("aarch64") else tier)
    if isa in ("avx512", "avx2", "neon"):
        q, k, v = _packed([10], 2, 2, 32, seed=1)
        with pytest.raises(RuntimeError, match="this build has no bf16"):
            _native(kernel, q, k, v, [10], True)


def test_it_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_NATIVE_ATTENTION", "0")
    assert not native_config().attention and native_config().elementwise
    monkeypatch.setenv("EMBER_NATIVE_ATTENTION", "1")
    assert native_config().attention


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_attention_is_varlen_attention_on_the_projection(dtype: torch.dtype) -> None:
    """The op a compiled layer calls: the same result from the packed projection and offsets, on the native
    kernel where it runs (either dtype) and on SDPA elsewhere."""
    seqlens = [21, 5, 40, 1]
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(sum(seqlens), 16 + 2 * 8, 128, generator=g).to(dtype)
    q, k, v = qkv.split((16, 8, 8), dim=1)
    got = attention.packed_attention(qkv, attention.seq_offsets(seqlens), 8, True)
    assert torch.equal(got, varlen_attention(q, k, v, seqlens, causal=True))
