"""Two builds of the native attention kernel against each other: the source at a git revision and the working tree's.

Both are compiled with the command ember uses on this machine (-march=native, less what EMBER_MAX_ISA caps) and called
through their C entry points on the same packed q/k/v, calls alternating (A B, B A, ...), medians of the times; the
largest difference between their outputs is printed too. What changed in the kernel, measured without a model or
a server around it.

    python benchmarks/experiments/attention_builds.py --rev HEAD~1 --dtype float32
    python benchmarks/experiments/attention_builds.py --rev main --cases "12/12/32:8x20,32x200" --dtype bfloat16
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ember.cli.runtime import maybe_reexec_with_allocator, prepare_process

prepare_process(None, None)  # threads as the server sizes them; EMBER_MAX_ISA as the server applies it

import torch  # noqa: E402 (after prepare_process: torch reads the thread settings at import)

from ember.hardware import find_compiler  # noqa: E402
from ember.ops import cxx, native  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CSRC = "src/ember/ops/csrc"
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _build(sources: Path, out: Path) -> ctypes.CDLL:
    command = cxx.compile_command(find_compiler() or "g++", sources / "attention.cpp", out, native._march())
    subprocess.run(command, check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    for entry in ("ember_attention_f32", "ember_attention"):
        if hasattr(lib, entry):
            getattr(lib, entry).argtypes = [_P] * 5 + [_I] * 7 + [ctypes.c_int, _I, ctypes.c_float, ctypes.c_int]
    return lib


def _at_rev(rev: str, into: Path) -> Path:
    """The kernel's sources (attention.cpp and the headers beside it) as they were at `rev`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()  # fmt: skip
    for name in names:
        if name == "attention.cpp" or name.endswith(".h"):
            blob = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT, check=True, capture_output=True)
            (into / name).write_bytes(blob.stdout)
    return into


def main() -> None:
    maybe_reexec_with_allocator(sys.argv[1:], program=[sys.executable, sys.argv[0]])  # time on the server's allocator
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare the working tree's kernel with")
    ap.add_argument("--cases", default="16/8/128:8x21,4x512,2048,8000;12/12/32:8x20,32x200")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    ap.add_argument("--rounds", type=int, default=0, help="calls per build (default: by size, 5 to 41)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        old_src = _at_rev(args.rev, Path(tmp))
        libs = {"old": _build(old_src, Path(tmp) / "old.so"), "new": _build(ROOT / CSRC, Path(tmp) / "new.so")}
        libs["old"].ember_attention_isa.restype = ctypes.c_char_p
        print(f"{args.rev} against the working tree, {args.dtype}, built for "
              f"{libs['old'].ember_attention_isa().decode()}, threads {torch.get_num_threads()}")  # fmt: skip
        print(f"{'heads':>10s} {'batch':>8s} {'old ms':>9s} {'new ms':>9s} {'old / new':>10s} {'max diff':>9s}")
        for group in args.cases.split(";"):
            shape, _, batches = group.partition(":")
            hq, hkv, d = map(int, shape.split("/"))
            for spec in batches.split(","):
                count, _, length = spec.rpartition("x")
                lens = [int(length)] * int(count or 1)
                ms, diff = _time(libs, (hq, hkv, d), lens, dtype, args.rounds)
                print(f"{shape:>10s} {spec:>8s} {ms['old']:9.3f} {ms['new']:9.3f} {ms['old'] / ms['new']:10.2f} "
                      f"{diff:9.1e}", flush=True)  # fmt: skip


def _time(libs: dict[str, ctypes.CDLL], heads: tuple[int, int, int], lens: list[int], dtype: torch.dtype,
          rounds: int) -> tuple[dict[str, float], float]:  # fmt: skip
    hq, hkv, d = heads
    torch.manual_seed(0)
    qkv = torch.randn(sum(lens), hq + 2 * hkv, d).to(dtype)
    q, k, v = qkv.split((hq, hkv, hkv), dim=1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    outs = {name: torch.empty_like(q, memory_format=torch.contiguous_format) for name in libs}
    entry = "ember_attention" if dtype == torch.bfloat16 else "ember_attention_f32"

    def call(name: str) -> None:
        status = getattr(libs[name], entry)(q.data_ptr(), k.data_ptr(), v.data_ptr(), outs[name].data_ptr(),
                                            cu.data_ptr(), len(lens), hq, hkv, d, qkv.stride(0), qkv.stride(0),
                                            qkv.stride(0), 1, -1, d**-0.5, -1)  # fmt: skip
        assert status == 0, f"{name}: status {status}"

    for name in (*libs, *libs):
        call(name)  # warm
    rounds = rounds or max(5, min(41, int(4e5 / (sum(n * n for n in lens) / len(lens) + 1e3))))
    times: dict[str, list[float]] = {name: [] for name in libs}
    for r in range(rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            start = time.perf_counter()
            call(name)
            times[name].append(time.perf_counter() - start)
    diff = (outs["old"].float() - outs["new"].float()).abs().max().item()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}, diff


if __name__ == "__main__":
    main()
