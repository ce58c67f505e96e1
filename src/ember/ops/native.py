"""ember's one C++ kernel (csrc/attention.cpp): built on this machine at first use, cached, loaded with ctypes.

It is compiled with `g++ -march=native` against the installed torch's headers and libraries, so it
uses this CPU's AMX and AVX-512 and torch's own OpenMP pool; nothing is compiled at `pip install`.
The build (about 6 s) runs on the kernel-compiling thread beside serving; until it is loaded, and on
any machine where it cannot be built or run (no compiler, no AMX, another OS), attention goes through
torch's SDPA as before. The library is cached under $EMBER_CACHE_DIR (default ~/.cache/ember), keyed
by the source, torch's version and the CPU's flags, so later starts load it in milliseconds.
Set EMBER_NATIVE_ATTENTION=0 to never build or use it.
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
from pathlib import Path

import torch

from ember.hardware import cpu_flags

__all__ = ["attention_kernel", "build_attention", "native_attention_enabled"]

log = logging.getLogger("ember.native")

_SOURCE = Path(__file__).with_name("csrc") / "attention.cpp"
_lock = threading.Lock()
_kernel: ctypes.CDLL | None = None
_tried = False


def native_attention_enabled() -> bool:
    return os.environ.get("EMBER_NATIVE_ATTENTION", "1").strip().lower() not in ("0", "false", "no", "off")


def attention_kernel() -> ctypes.CDLL | None:
    """The loaded library, once `build_attention` has built it on this machine; else None."""
    return _kernel


def build_attention() -> ctypes.CDLL | None:
    """Builds (or loads from the cache) and checks the attention library; None where it cannot run.
    Safe to call from several threads and more than once: the work is done once per process."""
    global _kernel, _tried
    with _lock:
        if _tried:
            return _kernel
        _tried = True
        if not native_attention_enabled() or platform.system() != "Linux" or platform.machine() != "x86_64":
            return None
        if not cpu_flags() >= {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f"}:
            log.info("native attention: this CPU has no AMX bf16; attention uses torch's SDPA")
            return None
        compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            return None
        try:
            lib = ctypes.CDLL(str(_library(compiler)))
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("native attention could not be built (%s); attention uses torch's SDPA", exc)
            return None
        lib.ember_attention.restype = ctypes.c_int
        lib.ember_attention.argtypes = (
            [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_int, ctypes.c_float, ctypes.c_int]
        )
        if lib.ember_attention_usable() != 1:
            log.info("native attention: the kernel may not use AMX tiles here; attention uses torch's SDPA")
            return None
        _kernel = lib
        return lib


def _cache_dir() -> Path:
    root = os.environ.get("EMBER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "ember"
    )
    return Path(root)


def _library(compiler: str) -> Path:
    """The built library for this source, torch and CPU: from the cache, else compiled into it."""
    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256()
    for part in (
        _SOURCE.read_bytes(),
        torch.__version__.encode(),
        compiler.encode(),
        " ".join(sorted(cpu_flags())).encode(),
    ):
        key.update(part)
    out = _cache_dir() / f"ember_attention-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include"]
    lib = torch_dir / "lib"
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [
            compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
            *(f"-I{p}" for p in includes), str(_SOURCE), "-o", str(tmp_out),
            f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise subprocess.SubprocessError(
                done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "g++ failed"
            )
        os.replace(tmp_out, out)  # atomic: a concurrent start sees the whole file or none
    log.info("native attention built: %s", out)
    return out
