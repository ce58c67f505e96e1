"""ember's native elementwise operators (ops/csrc/elementwise.cpp) against the functions they stand in for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ember.ops.native as native
from ember.config import NativeConfig
from ember.ops import fused
from ember.ops.rope import rope_cos_sin, rope_inv_freq


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    native.build_kernels(NativeConfig())
    if native.elementwise_kernel() is None:
        pytest.skip(
            "the native elementwise kernels cannot run on this machine (they need g++, x86-64 Linux, AVX-512 BF16)"
        )


@pytest.mark.parametrize(("tokens", "width"), [(1, 3072), (7, 3072), (300, 3072), (5, 40), (3, 2)])
def test_silu_mul_is_float32_swiglu_rounded_once(tokens: int, width: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * width, generator=g) * 3).to(torch.bfloat16)
    got = torch.ops.ember.silu_mul(gate_up)
    want = F.silu(gate_up[:, :width].float()) * gate_up[:, width:].float()
    assert got.shape == (tokens, width) and got.dtype == torch.bfloat16
    # one bf16 rounding (up to 2^-8 of the value) plus the kernel's exp and reciprocal (~1e-4)
    assert ((got.float() - want).abs() <= (2**-8 + 1e-4) * want.abs() + 1e-6).all()
    assert fused.silu_mul(gate_up) is not None and torch.equal(fused.silu_mul(gate_up), got)  # what models call


def test_silu_mul_takes_strided_and_batched_inputs() -> None:
    x = torch.randn(4, 6, 64, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.ember.silu_mul(x), torch.ops.ember.silu_mul(x.reshape(24, 64)).reshape(4, 6, 32))
    wide = torch.randn(10, 100, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.ember.silu_mul(wide[:, :64]), torch.ops.ember.silu_mul(wide[:, :64].contiguous()))


@pytest.mark.parametrize(
    ("tokens", "heads", "d"), [(1, (16, 8), 128), (37, (16, 8), 128), (300, (6, 2), 64), (9, (4, 4), 256)]
)
def test_qk_norm_rope_equals_the_reference_function(tokens: int, heads: tuple[int, int], d: int) -> None:
    n_q, n_kv = heads
    g = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, n_q + 2 * n_kv, d, generator=g) * 2).to(torch.bfloat16)
    q_weight = (torch.rand(d, generator=g) + 0.5).to(torch.bfloat16)
    k_weight = (torch.rand(d, generator=g) + 0.5).to(torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(tokens) + 11, rope_inv_freq(d, {"rope_theta": 1e6}), torch.bfloat16)
    got = fused.qk_norm_rope(qkv, n_kv, q_weight, k_weight, cos, sin, 1e-6)
    assert torch.equal(got, torch.ops.ember.qk_norm_rope(qkv, n_kv, q_weight, k_weight, cos, sin, 1e-6))
    wide = [t.float() for t in (q_weight, k_weight, cos, sin)]  # held as float32: the same values, the same bits
    assert torch.equal(got, torch.ops.ember.qk_norm_rope(qkv, n_kv, *wide, 1e-6))
    want = fused._qk_norm_rope.fn(qkv, n_kv, q_weight, k_weight, cos, sin, 1e-6)  # the torch function, eager
    assert torch.equal(got[:, n_q + n_kv :], qkv[:, n_q + n_kv :])  # v untouched
    diff = (got.float() - want.float()).abs()
    assert (diff <= 2**-7 * want.float().abs() + 1e-6).all()  # at most a bf16 step where float32 sums round apart
    assert (diff > 0).float().mean() < 1e-3


@pytest.mark.parametrize(
    ("tokens", "k", "b"), [(1, 1024, 64), (15, 3072, 64), (300, 1024, 64), (7, 96, 32), (5, 48, 16)]
)
def test_hadamard_rotate_is_the_rotation_product_in_float32_rounded_once(tokens: int, k: int, b: int) -> None:
    from ember.ops.rotation import hadamard, rotate_rows

    g = torch.Generator().manual_seed(tokens + k)
    x = (torch.randn(tokens, k, generator=g) * 3).to(torch.bfloat16)
    x[:, 5] = 200.0  # an outlier channel, as rotation is there for
    h = hadamard(b)
    got = torch.ops.ember.hadamard_rotate(x, h)
    want = (x.double().reshape(-1, b) @ h.double()).reshape(tokens, k)
    assert got.shape == (tokens, k) and got.dtype == torch.bfloat16
    # one bf16 rounding of float32 sums: within half a bf16 step of the exact product, plus float32's own
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-3).all()
    assert torch.equal(rotate_rows(x, h), got)  # what int8 layers call on bf16 rows
    wide = torch.randn(tokens, k + 64, dtype=torch.bfloat16, generator=g)
    assert torch.equal(
        torch.ops.ember.hadamard_rotate(wide[:, :k], h), torch.ops.ember.hadamard_rotate(wide[:, :k].contiguous(), h)
    )


def test_hadamard_rotate_matches_the_matrix_product_path_and_refuses_other_blocks() -> None:
    from ember.ops.rotation import hadamard, rotate

    x = torch.randn(40, 1024, dtype=torch.bfloat16)
    h = hadamard(64)
    got, mm = torch.ops.ember.hadamard_rotate(x, h).float(), rotate(x, h).float()
    assert (got - mm).abs().max() <= 2**-7 * mm.abs().max()  # the same product; sums in another order
    assert torch.equal(torch.ops.ember.hadamard_rotate(x[:1], h), torch.ops.ember.hadamard_rotate(x, h)[:1])
    with pytest.raises(RuntimeError, match="blocks of 16, 32 or 64"):
        torch.ops.ember.hadamard_rotate(x, hadamard(128))
