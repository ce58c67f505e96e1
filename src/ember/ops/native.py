"""ember's C++ kernels (csrc/): built on this machine at first use, cached, loaded with ctypes.

- attention.cpp: flash attention over packed sequences (ember.ops.attention): float32 from AVX2 + FMA up (16-lane
  loops from AVX-512 up) and on aarch64 (NEON), and bf16 on AMX or AVX-512 BF16;
- int8_gemm.cpp: the int8 linear layers' matrix product, on AMX or AVX-512 VNNI (ember.ops.quant);
- elementwise.cpp: SwiGLU's silu(gate) * up and Qwen3's q/k norm + rotary, bf16 (ember.ops.fused), and int8 layers'
  input rotation (ember.ops.rotation);
- linear.cpp: float32 linear layers on bf16 weights (a bf16 checkpoint's, held as bf16), AVX-512 (ember.ops.linear);
- linear_f32.cpp: float32 linear layers on AMD CPUs without AVX-512, weights streamed while computed, float32 or a
  bf16 checkpoint's bf16 (ember.ops.linear); and int8 layers' products on x86 CPUs without VNNI or AMX, on int8
  weights widened as they are read (ember.ops.quant);
- linear_bf16.cpp: a bf16 model's linear layers on AMD CPUs with AVX-512 BF16, weights streamed while computed
  (ember.ops.bf16_pairs).

Loading a library also registers its torch operators (ember::native_attention, ember::int8_gemm,
ember::silu_mul, ember::qk_norm_rope, ember::hadamard_rotate, ember::linear_bf16w, ember::linear_f32w,
ember::linear_f32h, ember::linear_f32q, ember::linear_bf16d, ember::linear_bf16d_glu; their schemas are defined in
Python), which compiled regions call through the dispatcher without Python.

Two ways to get them, tried in this order:

- Built ahead of time (`ember build-kernels`, e.g. at image build, where a compiler is): one library per kernel and
  CPU tier it runs on (`amx`: x86-64-v4 + AVX-512 BF16/VNNI + AMX; `avx512_bf16`: x86-64-v4 + AVX-512 BF16/VNNI;
  `avx512`: x86-64-v4, attention and the bf16-weight linear layers (Skylake-SP to Ice Lake Xeons); `avx2`:
  x86-64-v3, attention and the float32 linear layers; `aarch64`: ARMv8-A, attention only, built on an aarch64
  machine), keyed by the sources and torch's version and C++ ABI, not by the building machine. At start, the best
  tier this CPU (as capped by EMBER_MAX_ISA) runs is loaded; no compiler is needed where the service runs. A
  tier's build targets every CPU of that tier, so one image serves Sapphire Rapids, Zen 4/5 and Cooper Lake alike
  (and one arm64 image every Graviton).
- Built on this machine at first use, with `-march=native` (less what EMBER_MAX_ISA caps; `-mcpu=native` on
  aarch64), about 30 s for all of them, on the engine's kernel thread beside serving; keyed also by the compiler's
  version, the exact command and this CPU's flags.

Both link against the installed torch and use its OpenMP pool; nothing is compiled at `pip install`. Until a kernel
is loaded, and wherever it cannot be built or run (no compiler and no prebuilt library, a CPU without what it needs,
another OS, switched off in NativeConfig), its callers use torch's own ops (SDPA; oneDNN's int8 matmul;
torch.compile's kernels). Libraries live in NativeConfig.cache_dir, each with its SHA-256; a library whose bytes do
not match (truncated, corrupt, or not ember's) is never loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import platform
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.config import NativeConfig
from ember.errors import ConfigError
from ember.hardware import ISA_TIERS, cpu_flags, find_compiler, isa_tier, native_cpu_flags, usable_cpu_flags
from ember.ops import cxx
from ember.types import KernelStatus

__all__ = [
    "PREBUILT_TIERS",
    "attention_kernel",
    "build_kernels",
    "cache_dir",
    "elementwise_kernel",
    "int8_gemm_kernel",
    "linear_bf16_kernel",
    "linear_f32_kernel",
    "linear_kernel",
    "may_build",
    "native_attention_dtypes",
    "prebuild",
    "prebuilt_tiers_here",
]

log = logging.getLogger("ember.native")

_CSRC = Path(__file__).with_name("csrc")


@dataclass(frozen=True)
class _Kernel:
    name: str  # csrc/<name>.cpp, the exported ember_<name>_usable(), and NativeConfig's field
    needs: frozenset[str]  # the CPU flags it needs on x86-64
    fallback: str  # what runs instead
    arm: frozenset[str] | None = None  # ... and on aarch64 (None: it is not built there)

    def needs_here(self) -> frozenset[str] | None:
        """The CPU flags it needs on this machine's architecture; None where it is not built for it."""
        return {"x86_64": self.needs, "aarch64": self.arm}.get(platform.machine())


_KERNELS = (
    _Kernel("attention", frozenset({"avx2", "fma"}), "torch's SDPA", arm=frozenset({"asimd"})),  # bf16: AVX-512 BF16
    _Kernel("int8_gemm", frozenset({"avx512_vnni", "avx512_bf16", "avx512bw", "avx512f"}), "torch's int8 matmul"),
    _Kernel("elementwise", frozenset({"avx512_bf16", "avx512bw", "avx512f"}), "torch.compile's kernels"),
    # 16 lanes only: its 8-lane build (AVX2) lost to oneMKL's float32 at 128-512 rows (benchmarks/NOTES.md)
    _Kernel("linear", frozenset({"avx512f", "avx512bw"}), "float32 weights on oneMKL"),
    # used on AMD CPUs without AVX-512 and on Intel ones from AVX2 up (ember.ops.linear.strip_f32); not built on ARM,
    # where it is not measured
    _Kernel("linear_f32", frozenset({"avx2", "fma"}), "oneDNN's packed float32 matmul"),
    # a bf16 model's products on AMD Zen 4/5 (ember.ops.bf16_pairs.PairLinear), every height
    _Kernel("linear_bf16", frozenset({"avx512_bf16", "avx512bw", "avx512f"}), "oneDNN's packed bf16 matmul"),
)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}
_tried: dict[str, KernelStatus] = {}
_attention_dtypes: frozenset[torch.dtype] = frozenset()


_V4 = ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic"]
PREBUILT_TIERS: dict[str, list[str]] = {
    "amx": [*_V4, "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
    "avx512_bf16": _V4,
    "avx512": ["-march=x86-64-v4", "-mtune=generic"],
    "avx2": ["-march=x86-64-v3", "-mtune=generic"],
    "aarch64": ["-march=armv8-a", "-mtune=generic"],
}
"""The CPU tiers `ember build-kernels` builds for, best first, and each one's target flags (ember.hardware tiers;
"aarch64" is every ARMv8-A CPU, NEON being part of it)."""


def prebuilt_tiers_here() -> list[str]:
    """The tiers of PREBUILT_TIERS this machine's compiler builds for: the x86-64 ones, or "aarch64"; none on
    other architectures."""
    x86 = [t for t in PREBUILT_TIERS if t in ISA_TIERS]
    return {"x86_64": x86, "aarch64": ["aarch64"]}.get(platform.machine(), [])


def attention_kernel() -> ctypes.CDLL | None:
    """The attention library, once `build_kernels` has built it on this machine; else None."""
    return _loaded.get("attention")


def int8_gemm_kernel() -> ctypes.CDLL | None:
    """The int8 matrix-product library, once `build_kernels` has built it on this machine; else None."""
    return _loaded.get("int8_gemm")


def linear_kernel() -> ctypes.CDLL | None:
    """The bf16-weight linear library, once `build_kernels` has built it on this machine; else None."""
    return _loaded.get("linear")


def linear_f32_kernel() -> ctypes.CDLL | None:
    """The float32 small-batch linear library, once `build_kernels` has built it on this machine; else None."""
    return _loaded.get("linear_f32")


def linear_bf16_kernel() -> ctypes.CDLL | None:
    """The bf16 small-batch linear library, once `build_kernels` has built it on this machine; else None."""
    return _loaded.get("linear_bf16")


def may_build(name: str, config: NativeConfig) -> bool:
    """Whether build_kernels will get kernel `name`, without building it: `config` allows it, this CPU (as capped)
    has what it needs, and there is a compiler or a prebuilt library for it."""
    kernel = next(k for k in _KERNELS if k.name == name)
    return config.enabled(name) and _origin(kernel, config)[2] is None


def native_attention_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the loaded attention library computes in: float32, and bf16 where it was built for AVX-512 BF16
    or AMX; none before it is loaded. (Read when loading, not here: compiled regions trace this.)"""
    return _attention_dtypes if "attention" in _loaded else frozenset()


def elementwise_kernel() -> ctypes.CDLL | None:
    """The bf16 elementwise library (SwiGLU, q/k norm + rotary, int8 inputs' rotation), once `build_kernels` has built
    it; else None."""
    return _loaded.get("elementwise")


def build_kernels(config: NativeConfig) -> list[KernelStatus]:
    """Builds (or loads from the cache) and checks every kernel `config` allows and this machine can run;
    reports each. Safe to call from several threads and more than once: each kernel is tried once per process
    (a library, once loaded, stays: its torch operators are registered for the whole process)."""
    report = []
    with _lock:
        for kernel in _KERNELS:
            status = _tried.get(kernel.name)
            if status is None and config.enabled(kernel.name):
                lib, detail = _build(kernel, config)
                if lib is not None and kernel.name == "attention":  # its dtypes first: read once it is loaded
                    global _attention_dtypes
                    bf16 = hasattr(lib, "ember_attention")  # built with AVX-512 BF16
                    _attention_dtypes = frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32})
                if lib is not None:
                    _loaded[kernel.name] = lib
                status = _tried[kernel.name] = KernelStatus(kernel.name, lib is not None, detail)
            elif status is None:
                switch = NativeConfig.switch(kernel.name)
                status = KernelStatus(kernel.name, False, f"disabled by {switch}=0; {kernel.fallback} instead")
            report.append(status)
    return report


def _build(kernel: _Kernel, config: NativeConfig) -> tuple[ctypes.CDLL | None, str]:
    """The loaded library, or None; and what happened, for the log."""
    instead = f"{kernel.fallback} instead"
    prebuilt, compiler, why_not = _origin(kernel, config)
    if why_not is not None:
        return None, why_not
    source, cache = _CSRC / f"{kernel.name}.cpp", cache_dir(config)
    try:
        if prebuilt is not None:
            path, how = prebuilt, "prebuilt, loaded from"
        else:
            assert compiler is not None
            path, how = _library(compiler, source, cache)
        lib = ctypes.CDLL(str(path))
        usable = getattr(lib, f"ember_{kernel.name}_usable")() == 1
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        log.warning("native %s could not be built (%s); %s", kernel.name, exc, instead)
        return None, f"build failed ({exc}); {instead}"
    if not usable:
        return None, f"the kernel may not run here (the OS refused AMX tile state); {instead}"
    return lib, f"{_isa(lib, kernel.name)}{how} {path}"


def _origin(kernel: _Kernel, config: NativeConfig) -> tuple[Path | None, str | None, str | None]:
    """Where the kernel's library would come from here: (a prebuilt library, else a compiler to build it with, or
    why neither, for the log)."""
    instead = f"{kernel.fallback} instead"
    needs = kernel.needs_here()
    if platform.system() != "Linux" or needs is None:
        where = "x86-64" if kernel.arm is None else "x86-64 or aarch64"
        return None, None, f"needs Linux on {where} ({platform.system()} {platform.machine()} here); {instead}"
    missing = needs - cpu_flags()
    if missing:
        capped = " (as capped by EMBER_MAX_ISA)" if cpu_flags() != usable_cpu_flags() else ""
        return None, None, f"this CPU{capped} lacks {' '.join(sorted(missing))}; {instead}"
    source, cache = _CSRC / f"{kernel.name}.cpp", cache_dir(config)
    prebuilt = next(filter(None, (_prebuilt(source, cache, tier) for tier in _runnable_tiers())), None)
    compiler = find_compiler(config.compiler) if prebuilt is None else None
    if prebuilt is None and compiler is None:
        return (
            None,
            None,
            (
                f"no C++ compiler (g++) and no prebuilt library in {cache} (build them with `ember build-kernels` at "
                f"image build); {instead}"
            ),
        )
    return prebuilt, compiler, None


def _runnable_tiers() -> list[str]:
    """The prebuilt tiers this CPU (as capped by EMBER_MAX_ISA) runs, best first."""
    tier = isa_tier(cpu_flags())
    if tier.startswith("aarch64"):
        return ["aarch64"]
    rank = ISA_TIERS.index(tier) if tier in ISA_TIERS else len(ISA_TIERS)
    return [t for t in PREBUILT_TIERS if t in ISA_TIERS and ISA_TIERS.index(t) >= rank]


def _prebuilt_path(source: Path, cache: Path, tier: str) -> Path:
    key = hashlib.sha256()
    for part in (
        source.read_bytes(),
        *(h.read_bytes() for h in sorted(source.parent.glob("*.h"))),
        torch.__version__.encode(),
        str(int(torch._C._GLIBCXX_USE_CXX11_ABI)).encode(),
        " ".join(PREBUILT_TIERS[tier]).encode(),
    ):
        key.update(part)
    return cache / f"ember_{source.stem}-{tier}-{key.hexdigest()[:16]}.so"


def _prebuilt(source: Path, cache: Path, tier: str) -> Path | None:
    """The library `ember build-kernels` made for this source, torch and tier, when it is there and whole."""
    out = _prebuilt_path(source, cache, tier)
    digest = out.with_name(out.name + ".sha256")
    try:
        if out.is_file() and digest.is_file() and digest.read_text().strip() == cxx.sha256(out):
            return out
    except OSError:
        return None
    if out.exists():
        log.warning("native %s: prebuilt %s does not match its checksum; not loading it", source.stem, out)
    return None


def prebuild(cache: Path, tiers: list[str], compiler: str) -> list[tuple[str, str, Path]]:
    """Builds every kernel for each tier (of prebuilt_tiers_here()) into `cache` (ember build-kernels):
    [(kernel, tier, library)]."""
    built = []
    for tier in tiers:
        if tier not in prebuilt_tiers_here():
            raise ConfigError(f"this {platform.machine()} machine does not build the {tier} tier")
        for kernel in (k for k in _KERNELS if _in_tier(k, tier)):
            source = _CSRC / f"{kernel.name}.cpp"
            out = _prebuilt_path(source, cache, tier)
            if _prebuilt(source, cache, tier) is None:
                cxx.compile_library(compiler, source, out, PREBUILT_TIERS[tier])
            built.append((kernel.name, tier, out))
    return built


def _in_tier(kernel: _Kernel, tier: str) -> bool:
    """Whether a tier's build holds the kernel: on x86-64, when its own tier (that of the flags it needs) is no
    higher; on aarch64, when it is built there at all."""
    if tier == "aarch64":
        return kernel.arm is not None
    return ISA_TIERS.index(isa_tier(kernel.needs)) >= ISA_TIERS.index(tier)


def _isa(lib: ctypes.CDLL, name: str) -> str:
    """'AMX, ' or 'AVX-512 BF16, ': the instruction set a library that has more than one was built for."""
    isa = getattr(lib, f"ember_{name}_isa", None)
    if isa is None:
        return ""
    isa.restype = ctypes.c_char_p
    names = {
        b"amx": "AMX, ",
        b"avx512_bf16": "AVX-512 BF16, ",
        b"avx512_vnni": "AVX-512 VNNI, ",
        b"avx512": "AVX-512, ",
        b"avx2": "AVX2, ",
        b"neon": "NEON, ",
    }
    return names.get(isa(), f"{isa().decode()}, ")


def _march() -> list[str]:
    """-march=native, less what a cap on the ISA (ember.hardware.limit_isa) hides from cpu_flags(): an AMX CPU
    capped to avx512_bf16 builds what an AMD EPYC runs. On aarch64, -mcpu=native (its tuning too)."""
    if platform.machine() == "aarch64":
        return ["-mcpu=native"]
    hidden = native_cpu_flags() - cpu_flags()
    off = []
    if "amx_tile" in hidden:
        off += ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    if "avx512_bf16" in hidden:
        off.append("-mno-avx512bf16")
    if "avx512f" in hidden:
        off.append("-mno-avx512f")
    return ["-march=native", *off]


def cache_dir(config: NativeConfig) -> Path:
    """Where ember keeps what it builds once (kernels, calibrated int8 weights)."""
    return Path(config.cache_dir) if config.cache_dir else Path.home() / ".cache" / "ember"


def _library(compiler: str, source: Path, cache: Path) -> tuple[Path, str]:
    """The built library for this source (and the headers beside it), compiler, command, torch and CPU, and how
    it was found: loaded from the cache when its checksum matches, else compiled into it."""
    key = hashlib.sha256()
    headers = sorted(source.parent.glob("*.h"))  # what the sources include (amx.h, vec.h)
    for part in (
        source.read_bytes(),
        *(h.read_bytes() for h in headers),
        torch.__version__.encode(),
        cxx.compiler_version(compiler).encode(),
        " ".join(cxx.compile_command(compiler, source, Path("OUT"), _march())).encode(),
        " ".join(sorted(cpu_flags())).encode(),
    ):
        key.update(part)
    out = cache / f"ember_{source.stem}-{key.hexdigest()[:16]}.so"
    digest = out.with_name(out.name + ".sha256")
    if out.is_file() and digest.is_file() and digest.read_text().strip() == cxx.sha256(out):
        return out, "loaded from"
    if out.exists():
        log.warning("native %s: cached %s does not match its checksum; rebuilding it", source.stem, out)
    # the first start on a machine compiles each kernel once (tens of seconds): say so before, and how long after
    log.warning("native %s: compiling it for this CPU with %s, once (cached in %s)...", source.stem, compiler, cache)
    start = time.perf_counter()
    cxx.compile_library(compiler, source, out, _march())
    log.warning("native %s built in %.0f s: %s", source.stem, time.perf_counter() - start, out)
    return out, "built into"
