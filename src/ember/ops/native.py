"""ember's C++ kernels (csrc/): built on this machine at first use, cached, loaded with ctypes.

- attention.cpp: flash attention over packed sequences, bf16 (ember.ops.attention);
- int8_gemm.cpp: the int8 linear layers' matrix product (ember.ops.quant);
- elementwise.cpp: SwiGLU's silu(gate) * up and Qwen3's q/k norm + rotary, bf16 (ember.ops.fused).

Loading a library also registers its torch operators (ember::native_attention, ember::int8_gemm,
ember::silu_mul, ember::qk_norm_rope; their schemas are defined in Python), which compiled regions call
through the dispatcher without Python.

Each is compiled with `g++ -march=native` against the installed torch's headers and libraries, so it
uses this CPU's AMX and AVX-512 and torch's own OpenMP pool; nothing is compiled at `pip install`.
The builds (about 20 s for the three here) run on the kernel-compiling thread beside serving; until a kernel is
loaded, and on any machine where it cannot be built or run (no compiler, no AMX, another OS), its
callers use torch's own ops (SDPA; oneDNN's int8 matmul; torch.compile's kernels) as before. Libraries are cached under
$EMBER_CACHE_DIR (default ~/.cache/ember), keyed by the source, torch's version and the CPU's flags,
so later starts load them in milliseconds. EMBER_NATIVE_ATTENTION=0 / EMBER_NATIVE_INT8=0 /
EMBER_NATIVE_ELEMENTWISE=0 switch each off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.hardware import cpu_flags

__all__ = ["attention_kernel", "build_kernels", "elementwise_kernel", "int8_gemm_kernel", "native_enabled"]

log = logging.getLogger("ember.native")

_CSRC = Path(__file__).with_name("csrc")


@dataclass(frozen=True)
class _Kernel:
    name: str  # csrc/<name>.cpp, and the exported ember_<name>_usable()
    switch: str  # the environment variable that turns it off
    needs: frozenset[str]  # CPU flags
    fallback: str  # what runs instead, for the log


_KERNELS = (
    _Kernel("attention", "EMBER_NATIVE_ATTENTION", frozenset({"amx_bf16", "amx_tile", "avx512_bf16", "avx512f"}),
            "attention uses torch's SDPA"),
    _Kernel("int8_gemm", "EMBER_NATIVE_INT8", frozenset({"amx_int8", "amx_tile", "avx512_bf16", "avx512f"}),
            "int8 layers use oneDNN"),
    _Kernel("elementwise", "EMBER_NATIVE_ELEMENTWISE", frozenset({"avx512_bf16", "avx512bw", "avx512f"}),
            "SwiGLU and q/k norm + rotary use torch.compile's kernels"),
)  # fmt: skip

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}
_tried = False


def native_enabled(switch: str) -> bool:
    """Whether the kernel that environment variable `switch` governs may be built and used (default yes)."""
    return os.environ.get(switch, "1").strip().lower() not in ("0", "false", "no", "off")


def attention_kernel() -> ctypes.CDLL | None:
    """The attention library, once `build_kernels` has built it on this machine; else None."""
    return _loaded.get("attention")


def int8_gemm_kernel() -> ctypes.CDLL | None:
    """The int8 matrix-product library, once `build_kernels` has built it on this machine; else None."""
    return _loaded.get("int8_gemm")


def elementwise_kernel() -> ctypes.CDLL | None:
    """The bf16 elementwise library (SwiGLU, q/k norm + rotary), once `build_kernels` has built it; else None."""
    return _loaded.get("elementwise")


def build_kernels() -> dict[str, ctypes.CDLL]:
    """Builds (or loads from the cache) and checks every kernel this machine can run; returns them by name.
    Safe to call from several threads and more than once: the work is done once per process."""
    global _tried
    with _lock:
        if not _tried:
            _tried = True
            for kernel in _KERNELS:
                lib = _build(kernel)
                if lib is not None:
                    _loaded[kernel.name] = lib
        return dict(_loaded)


def _build(kernel: _Kernel) -> ctypes.CDLL | None:
    if not native_enabled(kernel.switch) or platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    if not cpu_flags() >= kernel.needs:
        log.info("native %s: this CPU lacks %s; %s", kernel.name, " ".join(sorted(kernel.needs - cpu_flags())),
                 kernel.fallback)  # fmt: skip
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(_library(compiler, _CSRC / f"{kernel.name}.cpp")))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native %s could not be built (%s); %s", kernel.name, exc, kernel.fallback)
        return None
    if getattr(lib, f"ember_{kernel.name}_usable")() != 1:
        log.info("native %s: the kernel may not run here; %s", kernel.name, kernel.fallback)
        return None
    return lib


def _cache_dir() -> Path:
    root = os.environ.get("EMBER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "ember"
    )
    return Path(root)


def _library(compiler: str, source: Path) -> Path:
    """The built library for this source (and the headers beside it), torch and CPU: from the cache, else
    compiled into it."""
    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256()
    headers = sorted(source.parent.glob("*.h"))  # what the sources include (amx.h, vec.h)
    for part in (
        source.read_bytes(),
        *(h.read_bytes() for h in headers),
        torch.__version__.encode(),
        compiler.encode(),
        " ".join(sorted(cpu_flags())).encode(),
    ):
        key.update(part)
    out = _cache_dir() / f"ember_{source.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include"]
    lib = torch_dir / "lib"
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [
            compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
            *(f"-I{p}" for p in includes), str(source), "-o", str(tmp_out),
            f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise subprocess.SubprocessError(
                done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "g++ failed"
            )
        os.replace(tmp_out, out)  # atomic: a concurrent start sees the whole file or none
    log.info("native %s built: %s", source.stem, out)
    return out
