"""The elementwise work between matrix multiplies (RMSNorm, q/k norm + rotary, SwiGLU), one pass each.

In eager torch a bf16 RMSNorm is five passes over memory with float32 copies; these functions are
written so that torch.compile (inductor's C++ backend) fuses each into one vectorised loop, several
times faster, and faster end to end (benchmarks/NOTES.md). Until `compiling()` has
built them they run eagerly, so a model works the same with or without a C++ compiler.
In bf16, where ember's native elementwise library runs (csrc/elementwise.cpp), SwiGLU and the q/k norm +
rotary are its operators instead: inductor's kernels for them ran at 1/4-1/2 of memory speed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ember.hardware import find_compiler
from ember.ops.native import elementwise_kernel
from ember.ops.rope import apply_rope

__all__ = [
    "Fused",
    "can_compile",
    "compiled",
    "compiling",
    "qk_norm_rope",
    "qk_rope",
    "rms_norm",
    "silu_mul",
    "swiglu",
]

_local = threading.local()

GRAPHS_PER_FUNCTION = 64
"""Graphs one fused function may hold. One region serves every instance of its class, and each model of another
width, dtype or layer kind (float32 strips, int8, ...) compiles graphs of its own: dynamo's default of 8 would fail
the ninth such model in a process (several served with --models, or a test run), where fullgraph=True allows no
fallback."""


InductorOptions = dict[str, str | int | bool | Callable[..., Any]]
"""What torch.compile's `options` takes: inductor's config names and values."""

REGION_OPTIONS: InductorOptions = {
    "cpp_wrapper": True,
    "cpp_wrapper_build_separate": True,
}
"""inductor's options for the regions (`Fused.region`). `cpp_wrapper`: the code that calls a region's kernels one
after another is C++ rather than Python. The region of 27 decoder layers makes ~10 calls a layer (products,
attention, the fused elementwise loops), and in Python each took a few microseconds during which the other compute
thread waited: one 18-token query on the Qwen3-0.6B shape in float32 ran ~4% faster, outputs equal to float32
rounding. `cpp_wrapper_build_separate`: the wrapper is compiled apart from the kernels, so a cold build takes ~1.1x
the Python wrapper's time rather than ~1.8x. The small fused functions keep the Python wrapper: one call each, and
bf16 models built of them measured level to 2% slower with the C++ one (benchmarks/NOTES.md)."""


class Fused:
    """A function of tensors whose first axis is tokens, compiled once for any token count.

    It runs eagerly unless the calling thread is inside `compiled()` (and its kernel was built by
    `compiling()`); single-token calls stay eager (dynamic shapes treat a size of 1 apart).
    On a method (`Fused.region`) it compiles a stretch of a module, GEMMs included, for the
    instances it is asked to; one graph serves every such instance of the class, and the fused
    functions it calls are traced into it.
    """

    registry: ClassVar[list[Fused]] = []

    def __init__(
        self,
        fn: Callable[..., Any],
        when: Callable[[Any], bool] | None = None,
        options: InductorOptions | None = None,
    ) -> None:
        self.fn = fn
        self.when = when
        self.options = options
        self.__doc__ = fn.__doc__
        self._candidate: Callable[..., Any] | None = None
        self._fast: Callable[..., Any] | None = None
        self._tried = False
        Fused.registry.append(self)

    @staticmethod
    def region(when: Callable[[Any], bool]) -> Callable[[Callable[..., Any]], Fused]:
        """A method compiled as one region for the instances where `when(instance)` holds."""
        return lambda fn: Fused(fn, when, REGION_OPTIONS)

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.fn(*args)
        mode = getattr(_local, "mode", None)
        if mode is None or _tokens(args) < 2 or (self.when is not None and not self.when(args[0])):
            return self.fn(*args)
        if mode == "fast" and self._fast is not None:
            return self._fast(*args)
        if mode == "compiling":
            if self._candidate is None:
                self._candidate = torch.compile(self.fn, fullgraph=True, options=self.options)
            _mark_tokens_dynamic(args)
            self._tried = True
            with torch._dynamo.config.patch(recompile_limit=GRAPHS_PER_FUNCTION):
                return self._candidate(*args)
        return self.fn(*args)


def _tokens(args: tuple[Any, ...]) -> int:
    return next(a.shape[0] for a in args if isinstance(a, torch.Tensor))


def _mark_tokens_dynamic(args: tuple[Any, ...]) -> None:
    """Compile for any token count, and for nothing else: only the first axis of the activations
    (tensors of 2+ dims) is symbolic, and the length of integer vectors (a batch's sequence offsets, for
    any number of sequences). Weights, head counts and widths stay constants; with every size
    symbolic (`dynamic=True`) inductor split the q/k norm + rotary into several loops over float32
    temporaries, with masked tails, a slower kernel (benchmarks/NOTES.md)."""
    for a in args:
        if isinstance(a, torch.Tensor) and (a.dim() >= 2 or (a.dim() == 1 and not a.is_floating_point())):
            torch._dynamo.mark_dynamic(a, 0)


def can_compile() -> bool:
    """torch.compile on CPU writes C++ and needs a compiler to build it."""
    return find_compiler() is not None


@contextmanager
def _mode(mode: str | None) -> Iterator[None]:
    before = getattr(_local, "mode", None)
    _local.mode = mode
    try:
        yield
    finally:
        _local.mode = before


@contextmanager
def compiling() -> Iterator[None]:
    """Fused functions called on this thread inside the block get compiled (for any token count);
    once it ends without error, `compiled()` uses them on every thread."""
    with _mode("compiling"):
        yield
    for f in Fused.registry:
        if f._tried and f._candidate is not None:
            f._fast = f._candidate


def compiled(enabled: bool = True) -> AbstractContextManager[None]:
    """Inside: fused functions on this thread use their compiled kernels, where built (no-op if not enabled)."""
    return _mode("fast") if enabled else nullcontext()


# Qwen3 / Llama family. BERT's LayerNorm and GELU are single ATen kernels already (left eager).


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


@Fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, in float32, rounded once to x's dtype."""
    return _rms(x, weight, eps).to(x.dtype)


torch.library.define(
    "ember::qk_norm_rope",
    "(Tensor qkv, int n_kv, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, float eps) -> Tensor",
)
torch.library.define("ember::silu_mul", "(Tensor gate_up) -> Tensor")


@torch.library.register_fake("ember::qk_norm_rope")
def _(qkv: torch.Tensor, n_kv: int, *_: Any) -> torch.Tensor:
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


@torch.library.register_fake("ember::silu_mul")
def _(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _native(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and elementwise_kernel() is not None


def qk_norm_rope(
    qkv: torch.Tensor,
    n_kv: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Qwen3's per-head q/k RMSNorm then rotary on a packed (T, Hq + 2 Hkv, D) projection (Hkv = n_kv),
    v passed through: (T, Hq + 2 Hkv, D). cos and signed sin (T, 1, D). Rounds where the reference does."""
    if _native(qkv) and qkv.shape[-1] % 32 == 0 and qkv.shape[-1] <= 256:
        return torch.ops.ember.qk_norm_rope(qkv, n_kv, q_weight, k_weight, cos, sin, eps)
    return _qk_norm_rope(qkv, n_kv, q_weight, k_weight, cos, sin, eps)


@Fused
def _qk_norm_rope(
    qkv: torch.Tensor,
    n_kv: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    n_q = qkv.shape[1] - 2 * n_kv
    qk, v = qkv.split((n_q + n_kv, n_kv), dim=1)  # q and k heads normed together, each with its weight
    weight = torch.cat((q_weight.expand(n_q, -1), k_weight.expand(n_kv, -1)))  # (Hq + Hkv, D)
    normed = _rms(qk, weight, eps).to(qk.dtype).float()
    return torch.cat((apply_rope(normed, cos.float(), sin.float()).to(qk.dtype), v), dim=1)


@Fused
def qk_rope(qkv: torch.Tensor, n_kv: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the q and k heads of a packed (T, Hq + 2 Hkv, D) projection (Hkv = n_kv), v passed through,
    in the projection's dtype as transformers' Llama does: (T, Hq + 2 Hkv, D)."""
    qk, v = qkv.split((qkv.shape[1] - n_kv, n_kv), dim=1)
    return torch.cat((apply_rope(qk, cos, sin), v), dim=1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up, on gate and up side by side in the last axis: (T, 2 I) -> (T, I)."""
    return torch.ops.ember.silu_mul(gate_up) if _native(gate_up) else _silu_mul(gate_up)


@Fused
def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of linear(x) (gate and up side by side): in the layer's own kernel where it has
    one (an int8 layer's `silu_mul`, SwiGLU in its matrix product's epilogue), else silu_mul."""
    own = getattr(linear, "silu_mul", None)
    return own(x) if own is not None else silu_mul(linear(x))
