"""Linear layers with their weights packed once at load: bf16 layers on oneDNN's matmul, bias and activation fused;
float32 layers on oneDNN's packed matmul too on AMD CPUs, and on AMD CPUs without AVX-512 on ember's float32 product
(StripLinear) once its kernel loads; float32 layers of bf16 checkpoints on that product too on Intel CPUs with AVX-512,
elsewhere on ember's bf16-weight product (Bf16Linear).

`F.linear` in bf16 re-lays its plain (N, K) weights into oneDNN's blocked format on every call, then
adds the bias in a separate pass (a broadcast copy into the output); an activation after it is a third
pass. Packed once, the product, bias and activation are one kernel: faster end to end than the eager layers, most
on short batches, where the per-call re-layout is not amortised (benchmarks/NOTES.md).
Results equal the eager layers' to bf16 rounding; a CPU or torch build without oneDNN bf16 keeps nn.Linear.

float32 `F.linear` is oneMKL's sgemm, whose small-row products are slow on AMD CPUs: on a Zen 3 EPYC oneDNN's
packed matmul was more than twice as fast at a query's rows, level at 512 and slightly behind on longer batches
(benchmarks/NOTES.md). So on AMD, float32 layers are packed for oneDNN too, and a product of more than F32_SLICE
rows runs in slices of it (per row the fastest size). On Intel CPUs oneMKL stays (there oneDNN lost a few percent
on bulk batches on AVX-512).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.hardware import cpu_flags, cpu_vendor
from ember.ops.activations import ACTIVATIONS
from ember.ops.bf16_pairs import PairLinear, pairable
from ember.ops.native import linear_f32_kernel, linear_kernel

__all__ = [
    "ACTIVATIONS",
    "Bf16Linear",
    "PackedLinear",
    "StripLinear",
    "hold_bf16",
    "holdable",
    "linear_act",
    "onednn_bf16",
    "onednn_f32",
    "pack_bf16",
    "pack_f32",
    "pack_linears",
    "per_row_kernels",
    "release_bf16",
    "release_pairs",
    "release_strips",
    "replace_linears",
    "strip_f32",
    "strip_width",
    "unpack_bf16",
    "unpack_f32",
    "widen_bf16",
]

# The same activations as oneDNN post-ops: (attr, algorithm) of mkldnn._linear_pointwise.
_POST_OPS: dict[str, tuple[str, str]] = {
    "gelu": ("gelu", "none"),  # erf
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
    "silu": ("swish", ""),
}


@functools.cache
def onednn_bf16() -> bool:
    """Whether this torch build runs oneDNN's packed bf16 matmul on this CPU (checked once on a tiny product)."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        linear = nn.Linear(32, 16, bias=False, dtype=torch.bfloat16)
        nn.init.ones_(linear.weight)
        return bool((PackedLinear(linear)(torch.ones(2, 32, dtype=torch.bfloat16)) == 32).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class PackedLinear(nn.Module):
    """A drop-in for a bf16 nn.Linear, weights in oneDNN's packed layout; `forward(x, act)` also applies
    an activation named in ACTIVATIONS inside the same kernel."""

    per_row_kernels = True
    """oneDNN builds a kernel for each row count it meets (see per_row_kernels)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight: torch.Tensor  # oneDNN's packed layout of the (N, K) matrix
        self.bias: torch.Tensor | None
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        attr, algorithm = _POST_OPS[act] if act else ("none", "")
        if x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > F32_SLICE:
            parts = [
                torch.ops.mkldnn._linear_pointwise(part, self.weight, self.bias, attr, [], algorithm)
                for part in x.split(F32_SLICE)
            ]
            return torch.cat(parts)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, attr, [], algorithm)


F32_SLICE = 1024
"""Rows per float32 oneDNN product: above it, a product runs in slices of this many rows."""


@functools.cache
def onednn_f32() -> bool:
    """Whether float32 layers go to oneDNN's packed matmul here: on AMD x86 CPUs, where oneMKL's small products are
    slow (see the module's docstring), when this torch build runs it (checked once on a tiny product)."""
    if cpu_vendor() != "AuthenticAMD":
        return False
    try:
        linear = nn.Linear(32, 16, bias=False)
        nn.init.ones_(linear.weight)
        return bool((PackedLinear(linear)(torch.ones(2, 32)) == 32).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def linear_act(linear: nn.Module, x: torch.Tensor, act: str) -> torch.Tensor:
    """ACTIVATIONS[act](linear(x)): one kernel when the layer is packed."""
    if isinstance(linear, PackedLinear | StripLinear | PairLinear):
        return linear(x, act)
    return ACTIVATIONS[act](linear(x))


def strip_f32() -> bool:
    """Whether float32 layers are laid out for ember's float32 product (StripLinear) here, where the kernel builds:
    on AMD CPUs without AVX-512 (Zen 2 and 3), where it was measured against oneDNN's packed matmul, and a bf16
    checkpoint's matrices on Intel CPUs from AVX2 up, where it was measured against Bf16Linear on AVX-512 (twice as
    fast at a query's rows, level from 512 to 2,048 rows, so it runs at every height: a compiled region holds one
    graph for any batch) and against the float32 weights oneMKL otherwise runs on AVX2 (a query in about half the
    time, level from 4 x 500 tokens). Zen 4 and 5 (AVX-512) keep oneDNN until it is measured there. (On Intel,
    float32 checkpoints' layers stay on oneMKL: pack_linears packs float32 layers only where onednn_f32.)"""
    if cpu_vendor() == "GenuineIntel":
        return {"avx2", "fma"} <= cpu_flags()
    return onednn_f32() and "avx512f" not in cpu_flags()


def strip_width() -> int:
    """Output channels per strip of ember's float32 product here: two registers of channels, as csrc/linear_f32.cpp is
    built for this CPU (32 where it targets AVX-512, 16 on AVX2 and NEON); once loaded, what the library says (a
    prebuilt AVX2 library on an AVX-512 CPU takes 16)."""
    lib = linear_f32_kernel()
    if lib is not None:
        return int(lib.ember_linear_f32_strip())
    return 32 if "avx512f" in cpu_flags() else 16


def pack_linears(
    model: nn.Module, dtype: torch.dtype, strips: bool = False, pairs: bool = False, glu: str | None = None
) -> int:
    """Replace each nn.Linear of `model` by a PackedLinear, where oneDNN runs bf16 (bf16 models) or is the faster
    float32 product (float32 models on AMD); with `strips` (float32 only), by a StripLinear where its width allows;
    with `pairs` (bf16 only), by a PairLinear where its shape allows, SwiGLU in its epilogue for those whose name
    matches `glu`; returns how many. (Layers already replaced, e.g. int8 or Bf16Linear ones, are left as they are.)"""
    if not ((dtype == torch.bfloat16 and onednn_bf16()) or (dtype == torch.float32 and onednn_f32())):
        return 0
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    if pairs and dtype == torch.bfloat16:
        swiglu = {name for name in names if glu and re.search(glu, name)}
        pair = lambda on: lambda m: PairLinear(m, on) if pairable(m) else PackedLinear(m)  # noqa: E731
        return sum(replace_linears(model, [name], pair(name in swiglu)) for name in names)
    if not (strips and dtype == torch.float32):
        return replace_linears(model, names, PackedLinear)
    width = strip_width()
    return replace_linears(model, names, lambda m: StripLinear(m) if m.out_features % width == 0 else PackedLinear(m))


def release_strips(model: nn.Module) -> int:
    """Every StripLinear of `model` back to oneDNN's packed layer where it is the faster float32 product (AMD), else
    to a float32 nn.Linear (where the float32 kernel did not load); returns how many."""
    names = [name for name, m in model.named_modules() if isinstance(m, StripLinear)]
    return replace_linears(model, names, lambda m: PackedLinear(m.widened()) if onednn_f32() else m.widened())


def release_pairs(model: nn.Module) -> int:
    """Every PairLinear of `model` back to oneDNN's packed layer (where ember's bf16 product did not load)."""
    names = [name for name, m in model.named_modules() if isinstance(m, PairLinear)]
    return replace_linears(model, names, lambda m: PackedLinear(m.plain()))


def replace_linears(model: nn.Module, names: list[str], make: Callable[[Any], nn.Module]) -> int:
    """Replace each layer of `model` named in `names` (nn.Linear, or one of ours) by make(it), one at a time (so
    each old matrix can be freed as it goes); returns how many."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child)))
    return len(names)


# linear_f32w(x, w, bias): float32 (T, K) activations times float32 weights packed by pack_f32 ((N / S, K, S), S the
# strip_width),
# plus a float32 bias (N,) if any: (T, N) float32. Implemented in C++ by the native library (csrc/linear_f32.cpp).
torch.library.define("ember::linear_f32w", "(Tensor x, Tensor w, Tensor? bias) -> Tensor")


@torch.library.register_fake("ember::linear_f32w")
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0] * w.shape[2]))


# linear_f32h(x, w, bias): the same product on bf16 weights packed by pack_bf16 in strips of strip_width() channels
# ((N / S, K, S / 2) int32 words).
torch.library.define("ember::linear_f32h", "(Tensor x, Tensor w, Tensor? bias) -> Tensor")


@torch.library.register_fake("ember::linear_f32h")
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0] * w.shape[2] * 2))


# linear_f32q(x, w, bias): the same product on int8 weights packed by pack_f32 ((N / S, K, S) int8), widened to
# float32 as they are read (ember.ops.quant's int8 layers where the CPU has no int8 matrix instructions).
torch.library.define("ember::linear_f32q", "(Tensor x, Tensor w, Tensor? bias) -> Tensor")


@torch.library.register_fake("ember::linear_f32q")
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0] * w.shape[2]))


def pack_f32(w: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """(N, K) float32 (or int8) weights -> the float32 kernel's layout: strips of `width` (default: strip_width())
    output channels, (N / width, K, width)."""
    n, k = w.shape
    width = width or strip_width()
    return w.reshape(n // width, width, k).transpose(1, 2).contiguous()


def unpack_f32(strips: torch.Tensor) -> torch.Tensor:
    """pack_f32's strips back to the (N, K) matrix."""
    count, k, width = strips.shape
    return strips.transpose(1, 2).reshape(count * width, k)


def per_row_kernels(model: nn.Module) -> bool:
    """Whether a linear layer of `model` runs on a library that builds a kernel for each row count it meets: oneDNN,
    under PackedLinear, a bf16 nn.Linear, and int8 layers on torch._int_mm or oneDNN (a module says so in its
    `per_row_kernels`). Batches for such a model run at a few rounded token counts (TorchRunner.pads); ember's own
    products (StripLinear, Bf16Linear, the native int8 kernel) and oneMKL's float32 one run any count as it is."""
    for module in model.modules():
        if getattr(module, "per_row_kernels", False):
            return True
        if isinstance(module, nn.Linear) and module.weight.dtype != torch.float32:
            return True
    return False


class StripLinear(nn.Module):
    """A drop-in for a float32 nn.Linear (outputs a multiple of strip_width()), weights in strips for ember's float32
    product (csrc/linear_f32.cpp: the weights streamed while computed, taller batches in panels of rows): pack_f32's
    float32 strips, or, for a bf16 checkpoint's matrix (a bf16 `linear.weight`), pack_bf16's words in strips of the
    same width, widened in registers (half the memory and the same results: its values are those bf16 ones);
    `forward(x, act)` also applies an activation named in ACTIVATIONS. Until the kernel is loaded, the weights are
    laid out plainly on each call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight: torch.Tensor  # pack_f32's strips, or pack_bf16's words
        self.bias: torch.Tensor | None
        w = linear.weight.detach()
        self.bf16 = w.dtype == torch.bfloat16
        self.register_buffer("weight", pack_bf16(w, strip_width()) if self.bf16 else pack_f32(w.float()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        if linear_f32_kernel() is not None and x.dtype == torch.float32:
            rows = x.reshape(-1, self.in_features)
            product = torch.ops.ember.linear_f32h if self.bf16 else torch.ops.ember.linear_f32w
            y = product(rows, self.weight, self.bias).view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.plain(), self.bias)
        return ACTIVATIONS[act](y) if act else y

    def plain(self) -> torch.Tensor:
        """The (N, K) float32 matrix."""
        return unpack_bf16(self.weight) if self.bf16 else unpack_f32(self.weight)

    def widened(self) -> nn.Linear:
        """The float32 nn.Linear this layer stands for."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.plain().contiguous(), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias, requires_grad=False)
        return linear


# linear_bf16w(x, w, bias): float32 (T, K) activations times bf16 weights packed by pack_bf16 ((N / 32, K, 16) int32
# words), plus a float32 bias (N,) if any: (T, N) float32. Implemented in C++ by the native library
# (csrc/linear.cpp registers it when ember.ops.native.build_kernels loads it).
torch.library.define("ember::linear_bf16w", "(Tensor x, Tensor w, Tensor? bias) -> Tensor")


@torch.library.register_fake("ember::linear_bf16w")
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0] * 32))


def pack_bf16(w: torch.Tensor, width: int = 32) -> torch.Tensor:
    """(N, K) bf16 weights -> the native kernels' layout: strips of `width` output channels, (N / width, K,
    width / 2) int32 words, word d of input k holding channel d in its low 16 bits and channel d + width / 2 in its
    high 16 bits."""
    n, k = w.shape
    half = width // 2
    pairs = w.reshape(n // width, 2, half, k).permute(0, 3, 2, 1).contiguous()  # (N / width, K, half, 2)
    return pairs.view(torch.int32).reshape(n // width, k, half)


def unpack_bf16(words: torch.Tensor) -> torch.Tensor:
    """pack_bf16's words back to the (N, K) matrix, as float32 (exact)."""
    strips, k, half = words.shape
    pairs = words.view(torch.bfloat16).reshape(strips, k, half, 2)
    return pairs.permute(0, 3, 2, 1).reshape(strips * 2 * half, k).float()


class Bf16Linear(nn.Module):
    """A drop-in for a float32 nn.Linear whose weights are bf16 values (a bf16 checkpoint's), held as bf16: half
    the memory, and half the bytes each product streams, where ember's native kernel runs (csrc/linear.cpp; above
    512 rows it widens the matrix into a float32 buffer each thread keeps, as large as the largest layer, and runs
    oneMKL); until it is loaded, the weights are widened on each call. Results are those of the float32 layer up to
    the order of the sums."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight: torch.Tensor  # pack_bf16's words
        self.bias: torch.Tensor | None
        self.register_buffer("weight", pack_bf16(linear.weight.detach().bfloat16()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if linear_kernel() is not None and x.dtype == torch.float32:
            y = torch.ops.ember.linear_bf16w(x.reshape(-1, self.in_features), self.weight, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, unpack_bf16(self.weight).to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def widened(self) -> nn.Linear:
        """The float32 nn.Linear this layer stands for."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(unpack_bf16(self.weight), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias, requires_grad=False)
        return linear


def holdable(model: nn.Module, strips: bool = False) -> dict[str, nn.Linear]:
    """The nn.Linear layers of `model` whose outputs fill the bf16-weight kernel's strips (32 outputs for Bf16Linear,
    strip_width() for StripLinear with `strips`): those hold_bf16 may hold, by name."""
    width = strip_width() if strips else 32
    return {name: m for name, m in model.named_modules() if type(m) is nn.Linear and m.out_features % width == 0}


def hold_bf16(model: nn.Module, strips: bool = False) -> int:
    """In a float32 model loaded with its bf16 checkpoint matrices left bf16 (ember.engine.build): replace each
    nn.Linear holding bf16 weights by a Bf16Linear where the kernel takes its shape (outputs a multiple of 32), or
    with `strips` by a StripLinear on bf16 words (outputs a multiple of strip_width()), then widen every other bf16
    parameter and buffer to float32; returns how many layers hold bf16."""
    names = [name for name, m in holdable(model, strips).items() if m.weight.dtype == torch.bfloat16]
    held = replace_linears(model, names, StripLinear if strips else Bf16Linear)
    widen_bf16(model)
    return held


def widen_bf16(model: nn.Module, keep: Collection[nn.Module] = ()) -> None:
    """Every bf16 parameter and buffer of `model` to float32, except the weights Bf16Linear and StripLinear hold and
    those of the modules in `keep`."""
    # by the bf16 tensor's memory, not its Python object: a tied matrix (SPLADE's decoder) stays one, though loading
    # with assign=True gives each module its own Parameter over the shared tensor
    widened: dict[tuple[Any, ...], torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, Bf16Linear | StripLinear) or module in keep:
            continue
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for key, t in table.items():
                if t is not None and t.dtype == torch.bfloat16:
                    same = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
                    if same not in widened:
                        wide = t.detach().float()
                        param = isinstance(t, nn.Parameter)
                        widened[same] = nn.Parameter(wide, requires_grad=False) if param else wide
                    table[key] = widened[same]


def release_bf16(model: nn.Module) -> int:
    """Every Bf16Linear of `model` back to a float32 nn.Linear (where the native kernel cannot run, oneMKL on float32
    weights is faster than widening them on every call); returns how many."""
    names = [name for name, m in model.named_modules() if isinstance(m, Bf16Linear)]
    return replace_linears(model, names, Bf16Linear.widened)
