"""bf16 weights in pairs of inputs, for ember's bf16 product on AVX-512 BF16 (csrc/linear_bf16.cpp).

`vdpbf16ps` multiplies 16 pairs of bf16 values by 16 pairs and adds each pair's two products to a float32 sum; with
one pair of an activation row's inputs broadcast, a register of weights holds 16 output channels' weights for those
two inputs. pack_pairs lays an (N, K) matrix out that way, in strips of 32 channels, once at load.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ember.hardware import cpu_flags, cpu_vendor
from ember.ops.activations import ACTIVATIONS
from ember.ops.fused import silu_mul
from ember.ops.glu import deinterleave_columns, deinterleave_glu, interleave_glu
from ember.ops.native import linear_bf16_kernel

__all__ = [
    "STREAMED_BYTES",
    "STRIP",
    "PairLinear",
    "pack_pairs",
    "pair_bf16",
    "pairable",
    "streams_weights",
    "takes_pairs",
    "unpack_pairs",
]

STRIP = 32
"""Output channels per strip: two registers of 16."""

# linear_bf16d(x, w, bias): bf16 (T, K) activations times bf16 weights packed by pack_pairs ((N / 32, K / 2, 32)
# int32 words), plus a float32 bias (N,) if any: (T, N) bf16. linear_bf16d_glu(x, w, bias): the same for a SwiGLU's
# gates and ups interleaved in blocks of 16 (ember.ops.glu), giving silu(gate) * up, (T, N / 2), each rounded as the
# plain product's and silu_mul's are. (Two operators, not a flag: inductor's C++ wrapper passes an operator's
# arguments as traced, without the schema's defaults.) Implemented in C++ by the native library
# (csrc/linear_bf16.cpp registers them when ember.ops.native.build_kernels loads it).
torch.library.define("ember::linear_bf16d", "(Tensor x, Tensor w, Tensor? bias) -> Tensor")
torch.library.define("ember::linear_bf16d_glu", "(Tensor x, Tensor w, Tensor? bias) -> Tensor")


@torch.library.register_fake("ember::linear_bf16d")
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0] * STRIP))


@torch.library.register_fake("ember::linear_bf16d_glu")
def _glu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0] * STRIP // 2))


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 weights (N a multiple of 32, K even) -> (N / 32, K / 2, 32) int32 words, word c of input pair i of
    a strip holding its channel c's weights of inputs 2i (low 16 bits) and 2i + 1 (high 16 bits)."""
    n, k = w.shape
    pairs = w.bfloat16().reshape(n // STRIP, STRIP, k // 2, 2).transpose(1, 2).contiguous()  # (N/32, K/2, 32, 2)
    return pairs.view(torch.int32).reshape(n // STRIP, k // 2, STRIP)


def unpack_pairs(words: torch.Tensor) -> torch.Tensor:
    """pack_pairs' words back to the (N, K) bf16 matrix."""
    strips, half, width = words.shape
    pairs = words.contiguous().view(torch.bfloat16).reshape(strips, half, width, 2)
    return pairs.transpose(1, 2).reshape(strips * width, half * 2)


@functools.cache
def pair_bf16() -> bool:
    """Whether a bf16 model's linear layers are laid out for ember's bf16 product (PairLinear) here, where its
    kernel builds: on AMD CPUs with AVX-512 BF16 (Zen 4 and 5), where it was measured against oneDNN's packed bf16
    matmul (a query's products in 0.8-0.9x the time, level from 160 to 512 rows, 1.04-1.05x at 2,048:
    benchmarks/NOTES.md). AMX CPUs keep oneDNN, whose tall products run on AMX; Intel CPUs without AMX run float32
    (ember.hardware.auto_dtype) and are not measured in bf16."""
    return cpu_vendor() == "AuthenticAMD" and "avx512_bf16" in cpu_flags() and "amx_bf16" not in cpu_flags()


STREAMED_BYTES = 96 << 20
"""bf16 linear weights from which a model's layers go to PairLinear (where pair_bf16): a query's products then read
them from memory (a Zen 4 or 5 core complex has 32 MB of L3), where ember's product streams faster than oneDNN's.
Below, the weights stay in the caches and the products are bound by their multiply-adds, where oneDNN's is as fast
at a query's rows and a few percent faster on tall batches (all-MiniLM-L6-v2, 21 MB, on a Zen 5: on ember's product
one query took 0.94-0.99x oneDNN's time, 32 x 128 tokens 1.03-1.05x; benchmarks/NOTES.md)."""


def streams_weights(model: nn.Module) -> bool:
    """Whether `model`'s linear layers hold at least STREAMED_BYTES in bf16 (a meta-device model will do)."""
    return 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)) >= STREAMED_BYTES


def takes_pairs(dtype: torch.dtype, model: nn.Module) -> bool:
    """Whether `model`'s layers, computed in `dtype`, go to PairLinear here: bf16, pair_bf16() and streams_weights."""
    return dtype == torch.bfloat16 and pair_bf16() and streams_weights(model)


def pairable(linear: nn.Linear) -> bool:
    """Whether PairLinear takes `linear`'s shape: outputs a multiple of STRIP, inputs even."""
    return linear.out_features % STRIP == 0 and linear.in_features % 2 == 0


class PairLinear(nn.Module):
    """A drop-in for a bf16 nn.Linear (pairable), weights in pack_pairs' layout for ember's bf16 product
    (csrc/linear_bf16.cpp); `forward(x, act)` also applies an activation named in ACTIVATIONS. The same products as
    oneDNN's bf16 matmul, in float32 sums rounded once to bf16; the bias (float32) is added before that rounding.
    With `glu` (a SwiGLU's gate and up projections side by side, [gate; up] rows), its rows are held interleaved
    (ember.ops.glu) and `silu_mul(x)` gives silu(gate) * up from the product's epilogue, the (T, 2 I) intermediate
    never written; `forward` still gives [gate, up]. Until the kernel is loaded, the weights are laid out plainly
    on each call."""

    def __init__(self, linear: nn.Linear, glu: bool = False) -> None:
        super().__init__()
        self.weight: torch.Tensor  # pack_pairs' words
        self.bias: torch.Tensor | None
        self.glu = glu and linear.out_features % (2 * STRIP) == 0  # whole strips of gates and ups
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().float()
        if self.glu:
            weight, bias = interleave_glu(weight), None if bias is None else interleave_glu(bias)
        self.register_buffer("weight", pack_pairs(weight))
        self.register_buffer("bias", None if bias is None else bias.contiguous())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        if linear_bf16_kernel() is not None and x.dtype == torch.bfloat16:
            rows = x.reshape(-1, self.in_features)
            y = torch.ops.ember.linear_bf16d(rows, self.weight, self.bias)
        else:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            y = F.linear(x.reshape(-1, self.in_features), unpack_pairs(self.weight).to(x.dtype), bias)
        y = (deinterleave_columns(y) if self.glu else y).view(*x.shape[:-1], self.out_features)
        return ACTIVATIONS[act](y) if act else y

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this SwiGLU layer's output (made with `glu`): (..., K) -> (..., out_features / 2)."""
        if not (self.glu and linear_bf16_kernel() is not None and x.dtype == torch.bfloat16):
            return silu_mul(self(x))
        y = torch.ops.ember.linear_bf16d_glu(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features // 2)

    def plain(self) -> nn.Linear:
        """The bf16 nn.Linear this layer stands for."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        weight, bias = unpack_pairs(self.weight), self.bias
        if self.glu:
            weight, bias = deinterleave_glu(weight), None if bias is None else deinterleave_glu(bias)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.bfloat16(), requires_grad=False)
        return linear
