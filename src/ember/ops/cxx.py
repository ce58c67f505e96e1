"""Compiling one of ember's C++ sources into a shared library linked against the installed torch, with its
SHA-256 beside it (ember.ops.native decides what to build, for which CPU, and where)."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["compile_command", "compile_library", "compiler_version", "sha256"]


def compile_command(compiler: str, source: Path, out: Path, target: list[str]) -> list[str]:
    """The command that builds `source` for `target` (-march=... flags) into `out`, linked against the installed
    torch and its OpenMP pool."""
    torch_dir = Path(torch.__file__).parent
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include"]
    lib = torch_dir / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        "-O3",
        *target,
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in includes),
        str(source),
        "-o",
        str(out),
        f"-L{lib}",
        "-ltorch_cpu",
        "-lc10",
        f"-Wl,-rpath,{lib}",
    ]


@functools.lru_cache(maxsize=4)
def compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.splitlines()[0] if done.stdout else "unknown"


def compile_library(compiler: str, source: Path, out: Path, target: list[str]) -> None:
    """Compile `source` for `target` into `out`, with its SHA-256 beside it (both replaced atomically)."""
    digest = out.with_name(out.name + ".sha256")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        command = compile_command(compiler, source, tmp_out, target)
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise subprocess.SubprocessError(
                done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"{compiler} failed"
            )
        (Path(tmp) / digest.name).write_text(sha256(tmp_out))
        os.replace(tmp_out, out)  # atomic: a concurrent start sees the whole file or none
        os.replace(Path(tmp) / digest.name, digest)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
