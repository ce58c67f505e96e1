"""ember's native attention kernel (ops/csrc/attention.cpp) against float32 attention on the same inputs."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

import ember.ops.native as native
from ember.cli.runtime import native_config
from ember.config import NativeConfig
from ember.ops import attention
from ember.ops.attention import varlen_attention


@pytest.fixture(scope="module")
def kernel() -> ctypes.CDLL:
    native.build_kernels(NativeConfig())
    lib = native.attention_kernel()
    if lib is None:
        pytest.skip(
            "the native attention kernel cannot run on this machine (it needs g++, x86-64 Linux and AVX-512 BF16)"
        )
    return lib


def _native(kernel: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int], causal: bool):
    """The kernel itself (its operator, which loading the library registered), whatever varlen_attention would choose."""
    return torch.ops.ember.native_attention(q, k, v, attention.seq_offsets(seqlens), causal)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int], causal: bool) -> torch.Tensor:
    """Float32 attention per sequence on the same bf16 values: (T, Hq, D) float32."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in seqlens:
        qs, ks, vs = (t[start : start + n].float().transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
        start += n
    return torch.cat(outs)


def _packed(seqlens: list[int], hq: int, hkv: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as views into one (T, Hq + 2 Hkv, D) projection, as Qwen3 lays them out."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(sum(seqlens), hq + 2 * hkv, d, generator=g) * 2).to(torch.bfloat16)
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


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("heads", "seqlens"), CASES)
def test_matches_float32_attention(
    kernel: ctypes.CDLL, heads: tuple[int, int, int], seqlens: list[int], causal: bool
) -> None:
    q, k, v = _packed(seqlens, *heads, seed=len(seqlens))
    got = _native(kernel, q, k, v, seqlens, causal).float()
    want = _reference(q, k, v, seqlens, causal)
    assert ((got - want).abs() <= 0.01 + 0.01 * want.abs()).all()  # bf16 keeps 8 bits: 0.4% per rounding
    cos = F.cosine_similarity(got.flatten(1), want.flatten(1))
    assert cos.min().item() > 0.9999


@pytest.mark.parametrize("causal", [True, False])
def test_a_late_key_far_above_the_earlier_ones(kernel: ctypes.CDLL, causal: bool) -> None:
    """Rows whose later key blocks score far above their first (the softmax's reference is raised, and a
    one-pass block is redone): still float32 attention's result."""
    q, k, v = _packed([700], 16, 8, 128, seed=3)
    k[600:610] *= 6  # scores of keys 600-609 reach ~6x the others'
    got = _native(kernel, q, k, v, [700], causal).float()
    want = _reference(q, k, v, [700], causal)
    assert ((got - want).abs() <= 0.01 + 0.01 * want.abs()).all()


def test_causal_and_bidirectional_differ(kernel: ctypes.CDLL) -> None:
    q, k, v = _packed([200], 4, 4, 64, seed=1)
    causal = _native(kernel, q, k, v, [200], True)
    both = _native(kernel, q, k, v, [200], False)
    assert torch.allclose(causal[-1].float(), both[-1].float(), atol=0.03)  # the last token sees every key
    assert not torch.allclose(causal[:100].float(), both[:100].float(), atol=0.1)  # early tokens see fewer keys


def test_a_sequence_alone_equals_it_inside_a_batch(kernel: ctypes.CDLL) -> None:
    seqlens = [300, 150, 77]
    q, k, v = _packed(seqlens, 16, 8, 128, seed=5)
    batch = _native(kernel, q, k, v, seqlens, True)
    alone = _native(kernel, q[300:450], k[300:450], v[300:450], [150], True)
    assert torch.equal(batch[300:450], alone)


def test_varlen_attention_uses_it_for_bf16(kernel: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(native._loaded, "attention", kernel)
    for seqlens in ([150, 30], [20, 9]):
        q, k, v = _packed(seqlens, 16, 8, 128, seed=2)
        assert torch.equal(varlen_attention(q, k, v, seqlens, causal=True), _native(kernel, q, k, v, seqlens, True))
    assert not attention._native_fits(*(t.float() for t in (q, k, v)))  # float32: SDPA


def test_it_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_NATIVE_ATTENTION", "0")
    assert not native_config().attention and native_config().elementwise
    monkeypatch.setenv("EMBER_NATIVE_ATTENTION", "1")
    assert native_config().attention


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_attention_is_varlen_attention_on_the_projection(dtype: torch.dtype) -> None:
    """The op a compiled layer calls: the same result from the packed projection and offsets, on the native
    kernel (bf16, where it runs) and on SDPA (float32)."""
    seqlens = [21, 5, 40, 1]
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(sum(seqlens), 16 + 2 * 8, 128, generator=g).to(dtype)
    q, k, v = qkv.split((16, 8, 8), dim=1)
    got = attention.packed_attention(qkv, attention.seq_offsets(seqlens), 8, True)
    assert torch.equal(got, varlen_attention(q, k, v, seqlens, causal=True))
