"""int8 weights with per-token dynamic int8 activations, applied to a built model from outside.

Weights are quantised once per output channel (symmetric), activations per token at run time
(symmetric, scale = max|x| / 127 of each token). Both are rotated first (ember.ops.rotation: the inputs of each
layer by a fixed block-Hadamard matrix, its weights by the same, once), which spreads the activations' few large
channels over the rest so that one scale per token keeps the ordinary channels. The int8 x int8 product runs in
one of:
- ember's kernel (csrc/int8_gemm.cpp; AMX, or AVX-512 VNNI on CPUs without AMX such as AMD EPYC), on weights
  in its tile layout: it takes the float activations, quantises each token itself (bit for bit as
  _quantize_tokens) and applies both scales on the way out. Once ember.ops.native has built it,
  `use_native_int8` repacks the layers for it (faster than oneDNN's matmul from 20 to 512 tokens: docs/performance.md,
  Kernels);
- oneDNN's AMX matmul on weights packed once at load (`onednn::qlinear_pointwise`, a multiple of the bf16
  GEMM rate on an AMX Xeon), which applies the weight scales; the token scales (which oneDNN takes only per
  tensor) are applied after it. On CPUs with AMX int8, layers start here, and stay here where the native
  kernel cannot run;
- `torch._int_mm` (VNNI where the CPU has it) everywhere else (until the native kernel is built, and on CPUs
  without AVX-512 VNNI): see `onednn_int8`;
- on x86 CPUs without VNNI or AMX (AVX2 only), a float32 product of the same int8 values (exact up to float32
  rounding of the sums): torch._int_mm runs reference code there, far slower than float32's (`int_mm_fast`). Once
  the float32 product's kernel is loaded (csrc/linear_f32.cpp), on int8 weights in its strips, widened as they are
  read (a quarter of float32's bytes streamed, at float32's rate of multiply-adds); until then each matrix is
  converted to float32 for oneMKL, call by call.

On the other two, each step is a plain torch op, so inside a compiled region (ops.fused) the activation
quantisation fuses into the norm before it and the rescale into whatever follows: run eagerly, those two
passes over memory cost about as much as the int8 GEMM saves.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
from torch import nn

from ember.hardware import cpu_flags
from ember.ops.fused import silu_mul
from ember.ops.glu import deinterleave_columns, interleave_glu
from ember.ops.gptq import MAX_INPUTS, gptq_int8, round_int8
from ember.ops.linear import pack_f32, replace_linears, strip_width
from ember.ops.native import int8_gemm_kernel, linear_f32_kernel
from ember.ops.rotation import BLOCK, block_size, hadamard, native_rotation, rotate, rotate_rows

__all__ = [
    "Int8Linear",
    "Int8Weights",
    "int8_gemm",
    "int8_mm",
    "int8_targets",
    "int_mm_fast",
    "onednn_int8",
    "pack_tiles",
    "quantize_int8",
    "use_native_int8",
]


@torch.library.custom_op("ember::int8_mm", mutates_args=())
def int8_mm(xq: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(T, K) int8 @ oneDNN-packed (K, N) int8 weights, times the weights' scales (N,): (T, N) in out_dtype.

    A custom op so torch.compile treats the packed (opaque) weights as an input, not a constant."""
    return torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, 0, packed, w_scale, _zero_points(w_scale.shape[0]), None, 1.0, 0, out_dtype, "none", [], ""
    )


@int8_mm.register_fake
def _(xq: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return xq.new_empty((xq.shape[0], w_scale.shape[0]), dtype=out_dtype)


# int8_gemm(x, tiles, w_scale, x_scale, bias, out_dtype, glu): (T, K) activations @ weights in the native kernel's
# tile layout (pack_tiles), times the weights' float32 scales (N,) and the tokens', plus a float32 bias (N,) if
# any: (T, N) in out_dtype (bf16 or float32), rounded once. x is int8 with its tokens' scales x_scale (T, 1), or
# bf16 / float32 with x_scale None, which the kernel quantises per token itself (as _quantize_tokens does). With
# glu, for weights whose gates and ups alternate in blocks of 16 channels (interleave_glu): silu(gate) * up,
# (T, N / 2). Implemented in C++ by the native library (csrc/int8_gemm.cpp registers it when
# ember.ops.native.build_kernels loads it), so compiled regions call it without Python.
torch.library.define(
    "ember::int8_gemm",
    "(Tensor x, Tensor tiles, Tensor w_scale, Tensor? x_scale, Tensor? bias, ScalarType out_dtype, bool glu) -> Tensor",
)
int8_gemm = torch.ops.ember.int8_gemm


@torch.library.register_fake("ember::int8_gemm")
def _(
    x: torch.Tensor,
    tiles: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    glu: bool,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], w_scale.shape[0] // (2 if glu else 1)), dtype=out_dtype)


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 weights -> the native kernel's layout [N/16][K/64][16][16][4]: a 1 KB AMX tile per
    16 output channels x 64 inputs, each channel's 4 consecutive inputs side by side."""
    n, k = w.shape
    return w.reshape(n // 16, 16, k // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()


def _fits_tiles(linear: Int8Linear) -> bool:
    dtype_ok = linear.out_dtype in (torch.bfloat16, torch.float32)
    width = 64 if linear.glu else 32  # a SwiGLU layer's gates and ups each fill whole blocks
    return dtype_ok and linear.in_features % 64 == 0 and linear.out_features % width == 0


@functools.lru_cache(maxsize=16)
def _zero_points(n: int) -> torch.Tensor:
    """The weights' zero points (symmetric: all 0), made once per width rather than per call."""
    return torch.zeros(n, dtype=torch.long)


@functools.cache
def onednn_int8() -> bool:
    """Whether to use oneDNN's int8 matmul: on CPUs with AMX int8, where this torch build runs it (checked once on
    a tiny product). Elsewhere torch._int_mm: on an AMD EPYC with AVX-512 VNNI (no AMX) oneDNN runs its reference
    implementation (`ref_int8`, for the prepacked weights' layout), thousands of times slower (benchmarks/NOTES.md)."""
    if "amx_int8" not in cpu_flags():
        return False
    try:
        w = torch.ones(16, 32, dtype=torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(w, None)
        y = int8_mm(torch.ones(2, 32, dtype=torch.int8), packed, torch.ones(16), torch.float32)
        return bool((y == 32).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@functools.cache
def int_mm_fast() -> bool:
    """Whether torch._int_mm has a fast path on this CPU: on x86 only with VNNI or AMX (without them it runs reference
    code, far slower than float32: benchmarks/NOTES.md); assumed on aarch64 (not measured)."""
    flags = cpu_flags()
    if "asimd" in flags:  # aarch64
        return True
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


def _float_int_mm(xq: torch.Tensor, w: torch.Tensor, columns: int = 1024) -> torch.Tensor:
    """torch._int_mm's product (T, K) int8 @ (K, N) int8 in float32, converting the weights `columns` at a time
    (a whole 4,096 x 24,576 matrix in float32 would be 400 MB beyond the memory plan)."""
    xf = xq.float()
    n = w.shape[1]
    if n <= columns:
        return xf @ w.float()
    return torch.cat([xf @ w[:, j : j + columns].float() for j in range(0, n, columns)], dim=1)


def _quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: (T, K) -> int8 (T, K) and float32 scales (T, 1)."""
    xf = x.float()  # (T, K)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8)  # (T, 1)
    # times the reciprocal, not divided by the scale: a vector division per element made the fused
    # quantising kernels compute-bound
    xq = (xf * (127.0 / amax)).round().clamp(-127, 127).to(torch.int8)
    return xq, amax / 127.0


Int8Weights = tuple[torch.Tensor, torch.Tensor]
"""A layer's int8 weights (N, K) and float32 scales (N,), in the rotated basis."""


class Int8Linear(nn.Module):
    """A drop-in for nn.Linear holding int8 weights and float32 per-channel scales (N,).

    glu: the layer is a SwiGLU's gate and up projections side by side ([gate; up] rows, no bias);
    `silu_mul(x)` then gives silu(gate) * up, in one kernel on the native path.
    rotation: the largest block of inputs rotated together (ember.ops.rotation; 1 or less: not rotated)."""

    def __init__(
        self,
        linear: nn.Linear,
        out_dtype: torch.dtype,
        glu: bool = False,
        rotation: int = BLOCK,
        weights: Int8Weights | None = None,
    ) -> None:
        super().__init__()
        self.rotation = rotation_of(linear.in_features, rotation)  # (b, b), applied to inputs and weights
        # int8 (N, K) and scales (N,), rounded in the rotated basis: given (GPTQ, or read back), else plain rounding
        wq, scale = weights if weights is not None else round_int8(rotated_weight(linear, self.rotation))
        self.onednn = onednn_int8()
        self.int_mm = int_mm_fast()  # else torch._int_mm's inputs multiplied in float32
        self.qweight: torch.Tensor  # oneDNN's packed layout, (K, N) for torch._int_mm, or pack_tiles'
        self.scale: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer(
            "qweight", torch.ops.onednn.qlinear_prepack(wq, None) if self.onednn else wq.t().contiguous()
        )
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.tile_scale: torch.Tensor | None = None  # the scales in the native tiles' channel order
        self.out_dtype = out_dtype
        self.glu = glu and linear.bias is None
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def per_row_kernels(self) -> bool:
        """Whether it runs a product on oneDNN, which builds a kernel per row count (ember.ops.linear.per_row_kernels):
        its int8 product, but not on the native kernel's tiles or the float32 product's int8 strips; or its inputs'
        rotation in bf16 where the native transform does not run (a bf16 matmul of T * K / b rows)."""
        rotation = self.rotation
        rotated_bf16 = rotation is not None and self.out_dtype == torch.bfloat16 and not native_rotation(len(rotation))
        return rotated_bf16 or (self.qweight.dim() not in (3, 5) and (self.onednn or self.int_mm))

    def _rotated(self, x: torch.Tensor) -> torch.Tensor:
        """The inputs in the rotated basis the weights were quantised in."""
        return x if self.rotation is None else rotate_rows(x, self.rotation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.qweight  # read once: use_native_int8 may swap it from another thread
        x = self._rotated(x)
        if w.dim() == 5:  # the native kernel's tiles (tile_scale is set before them); it quantises x itself
            y = int8_gemm(x, w, self.tile_scale, None, self.bias, self.out_dtype, False)
            return deinterleave_columns(y) if self.glu else y
        xq, xs = _quantize_tokens(x)
        if self.onednn:
            y = int8_mm(xq, w, self.scale, self.out_dtype).float()
        else:  # rounded where oneDNN rounds (to out_dtype after the weight scales), so both give the same vectors
            if w.dim() == 3:  # int8 strips (use_native_int8), widened as they are read: the same sums in float32
                acc = torch.ops.ember.linear_f32q(xq.float(), w, None)
            else:
                acc = torch._int_mm(xq, w).float() if self.int_mm else _float_int_mm(xq, w)
            y = (acc * self.scale).to(self.out_dtype).float()
        y = y * xs
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this SwiGLU layer's output: (T, K) -> (T, out_features / 2)."""
        w = self.qweight
        if w.dim() == 5 and self.glu:
            return int8_gemm(self._rotated(x), w, self.tile_scale, None, None, self.out_dtype, True)
        return silu_mul(self(x))


def rotation_of(k: int, rotation: int = BLOCK) -> torch.Tensor | None:
    """The (b, b) rotation block for `k` inputs (ember.ops.rotation), or None where no block divides k."""
    b = block_size(k, rotation)
    return hadamard(b) if b > 1 else None


def rotated_weight(linear: nn.Linear, rotation: torch.Tensor | None) -> torch.Tensor:
    """The layer's float32 weights (N, K) in the rotated basis its inputs are quantised in."""
    w = linear.weight.detach().float()
    return w if rotation is None else rotate(w, rotation)


def int8_targets(model: nn.Module, pattern: str) -> dict[str, nn.Linear]:
    """The nn.Linear layers whose full name matches `pattern`: what quantize_int8 replaces."""
    wanted = re.compile(pattern)
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and wanted.search(name)}


def quantize_int8(
    model: nn.Module,
    dtype: torch.dtype,
    pattern: str,
    glu: str | None = None,
    *,
    calibrate: Callable[[], None] | None = None,
    known: Callable[[str], Int8Weights | None] = lambda name: None,
    keep: Callable[[str, Int8Weights], None] = lambda name, weights: None,
) -> int:
    """Replace each nn.Linear whose full name matches `pattern` by an Int8Linear; returns how many.
    Those whose name also matches `glu` are SwiGLU gate/up layers (Int8Linear's glu).

    Weights come from `known(name)` where it has them (a cache); else, with `calibrate` (which runs the float model
    on calibration text), each layer is rounded by GPTQ against the inputs it meets there, and replaced as soon as
    its own forward has run; else, or for a layer the calibration did not reach, by plain rounding. Each
    layer's weights go to `keep` once quantised."""
    names = list(int8_targets(model, pattern))  # names only: each float matrix is freed once replaced
    swiglu = {n for n in names if glu and re.search(glu, n)}

    def quantize(name: str, weights: Int8Weights | None) -> None:
        def make(linear: nn.Linear) -> Int8Linear:
            w = weights if weights is not None else round_int8(rotated_weight(linear, rotation_of(linear.in_features)))
            keep(name, w)
            return Int8Linear(linear, out_dtype=dtype, glu=name in swiglu, weights=w)

        replace_linears(model, [name], make)

    todo = []
    for name in names:
        weights = known(name)
        if weights is not None or calibrate is None:
            quantize(name, weights)
        else:
            todo.append(name)
    if todo and calibrate is not None:
        hooks = [model.get_submodule(n).register_forward_hook(_calibrated(n, quantize)) for n in todo]
        try:
            calibrate()
        finally:
            for hook in hooks:
                hook.remove()
    for name in todo:
        if not isinstance(model.get_submodule(name), Int8Linear):
            quantize(name, None)
    return len(names)


def _calibrated(name: str, quantize: Callable[[str, Int8Weights | None], None]) -> Callable[..., None]:
    """A forward hook that rounds its layer by GPTQ on the inputs it just met, and replaces it."""

    def hook(linear: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if not isinstance(linear, nn.Linear) or linear.in_features > MAX_INPUTS:
            return  # plain rounding, after the calibration
        rotation = rotation_of(linear.in_features)
        x = args[0].reshape(-1, linear.in_features)
        x = (x if rotation is None else rotate(x, rotation)).float()
        quantize(name, gptq_int8(rotated_weight(linear, rotation), x.T @ x))

    return hook


def use_native_int8(model: nn.Module, tiles: bool = True, strips: bool = True) -> int:
    """Once ember's native int8 kernel is built: move every Int8Linear of `model` whose shape it takes
    (inputs a multiple of 64, outputs of 32) to it, repacking the weights layer by layer; returns how many.
    Where it is not (no VNNI or AMX) but the float32 product's kernel is, and the CPU has no fast torch._int_mm:
    move the layers whose outputs fill its strips onto int8 strips it widens as it reads them (csrc/linear_f32.cpp;
    converting the whole int8 matrix to float32 on every call cost about 4x float32's time on a Zen 3 EPYC).

    `tiles` / `strips`: whether the configuration allows either kernel (a library, once loaded, stays loaded for
    the whole process, whatever another model's configuration says).

    Safe beside a forward on another thread: each layer's weights are swapped in one assignment, and a
    forward reads them once (a layer runs on whichever kernel its weights are packed for)."""
    if not tiles or int8_gemm_kernel() is None:
        return _use_int8_strips(model) if strips and linear_f32_kernel() is not None else 0
    moved = 0
    for layer in model.modules():
        if isinstance(layer, Int8Linear) and layer.qweight.dim() == 2 and _fits_tiles(layer):
            w = layer.qweight
            plain = (w.to_dense() if w.is_mkldnn else w).t()  # (N, K) either way
            if layer.glu:
                plain = interleave_glu(plain)
            layer.tile_scale = interleave_glu(layer.scale) if layer.glu else layer.scale
            layer.qweight = pack_tiles(plain)  # after tile_scale: a forward that sees the tiles has both
            moved += 1
    return moved


def _use_int8_strips(model: nn.Module) -> int:
    """use_native_int8's move onto the float32 product's int8 strips (layers on torch._int_mm's float fallback)."""
    width = strip_width()  # the loaded library's
    moved = 0
    for layer in model.modules():
        if not isinstance(layer, Int8Linear) or layer.out_features % width:
            continue
        if not (layer.onednn or layer.int_mm) and layer.qweight.dim() == 2:
            layer.qweight = pack_f32(layer.qweight.t(), width)  # (K, N) -> (N / width, K, width) int8
            moved += 1
    return moved
