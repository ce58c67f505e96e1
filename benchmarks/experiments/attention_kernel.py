"""ember's native attention kernel against torch's SDPA path, on batches shaped like ember's, turn about.

Both sides get the same packed q/k/v (bf16, or float32 with --dtype float32; views of one (T, Hq + 2 Hkv, D)
projection, as the models lay them out) and compute the same attention: `varlen_attention`'s SDPA path (what
runs where the kernel does not) and the kernel's operator, each call alternating, medians of the times. With
--blocks, each of the kernel's block shapes (query rows x keys) is timed too, to check the choice it makes by
sequence length.
The kernel runs with whatever instruction set it was built for on this machine (printed first: AMX, or
AVX-512 BF16 where the CPU has no AMX or EMBER_MAX_ISA=avx512_bf16 caps it, or AVX2: float32 only). GFLOP/s
counts the two products' multiply-adds (causal: half the square).

    python benchmarks/experiments/attention_kernel.py
    python benchmarks/experiments/attention_kernel.py --cases "16/8/128:8x21,4x512,8000" --rounds 15 --blocks
    EMBER_MAX_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \
        python benchmarks/experiments/attention_kernel.py --dtype float32
    # ModernBERT's local layers:
    python benchmarks/experiments/attention_kernel.py --cases "12/12/64:4x512,2x2048,8000" --window 64
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

from ember.cli.runtime import maybe_reexec_with_allocator, native_config, prepare_process

prepare_process(None, None)  # threads as the server sizes them; EMBER_MAX_ISA as the server applies it

import torch  # noqa: E402 (after prepare_process: torch reads the thread settings at import)

from ember.ops import attention, native  # noqa: E402
from ember.ops.window import local_attention  # noqa: E402

# heads (query/kv/size) : batches (count x length, or a length), Qwen3-0.6B's and all-MiniLM-L6-v2's heads
DEFAULT = "16/8/128:8x21,16x64,4x512,2x1024,2048,8000;12/12/32:8x20,32x200"
_BLOCKS = ("32x32", "32x64", "32x128", "64x256", "128x128")


def _batch(spec: str) -> list[int]:
    count, _, length = spec.rpartition("x")
    return [int(length)] * int(count or 1)


def main() -> None:
    maybe_reexec_with_allocator(sys.argv[1:], program=[sys.executable, sys.argv[0]])  # time on the server's allocator
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT, help="HQ/HKV/D:BATCH,BATCH;... (BATCH: 8x21 or 8000)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--bidirectional", action="store_true", help="BERT-style attention (default causal)")
    ap.add_argument("--blocks", action="store_true", help="also time each fixed block shape of the kernel")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument(
        "--window", type=int, default=None, help="local attention (bidirectional): a token sees this many on each side"
    )
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    native.build_kernels(native_config())
    lib = native.attention_kernel()
    if lib is None:
        sys.exit("the native attention kernel does not run here: see `ember doctor`")
    if dtype not in native.native_attention_dtypes():
        sys.exit(f"this build of the kernel has no {args.dtype} (bf16 needs AVX-512 BF16): try --dtype float32")
    lib.ember_attention_isa.restype = ctypes.c_char_p
    causal = not args.bidirectional and args.window is None
    isa = lib.ember_attention_isa().decode()
    print(f"kernel: {isa}, {args.dtype}, threads {torch.get_num_threads()}, causal {causal}, window {args.window}")
    head = f"{'heads':>10s} {'batch':>8s} {'SDPA ms':>9s} {'kernel ms':>10s} {'SDPA / kernel':>14s} {'GFLOP/s':>8s}"
    print(head + ("".join(f" {b:>8s}" for b in _BLOCKS) if args.blocks else ""))
    for group in args.cases.split(";"):
        shape, _, batches = group.partition(":")
        hq, hkv, d = map(int, shape.split("/"))
        for spec in batches.split(","):
            lens = _batch(spec)
            ms = _time_case(lib, (hq, hkv, d), lens, dtype, causal, args.window, args.rounds, args.blocks)
            keys = [n / 2 if causal else n if args.window is None else min(n, 2 * args.window + 1) for n in lens]
            flop = sum(4 * n * m * d * hq for n, m in zip(lens, keys, strict=True))
            line = f"{shape:>10s} {spec:>8s} {ms['sdpa']:9.2f} {ms['kernel']:10.2f} {ms['sdpa'] / ms['kernel']:14.2f}"
            line += f" {flop / ms['kernel'] / 1e6:8.1f}"
            print(line + ("".join(f" {ms[b]:8.2f}" for b in _BLOCKS) if args.blocks else ""), flush=True)


def _time_case(
    lib: ctypes.CDLL,
    heads: tuple[int, int, int],
    lens: list[int],
    dtype: torch.dtype,
    causal: bool,
    window: int | None,
    rounds: int,
    blocks: bool,
) -> dict[str, float]:
    """Median milliseconds of each way (SDPA, the kernel, and each block shape with `blocks`), calls alternating."""
    hq, hkv, d = heads
    qkv = torch.randn(sum(lens), hq + 2 * hkv, d).to(dtype)
    q, k, v = qkv.split((hq, hkv, hkv), dim=1)
    cu = attention.seq_offsets(lens)
    ways = {
        "sdpa": lambda: _without_kernel(lambda: attention.packed_sdpa(qkv, cu, hkv, causal)),
        "kernel": lambda: torch.ops.ember.native_attention(q, k, v, cu, causal),
    }
    if window is not None:  # ember.ops.window's SDPA path (band masks, blocks) against the kernel with the window
        ways = {
            "sdpa": lambda: _without_kernel(lambda: local_attention(q, k, v, lens, window)),
            "kernel": lambda: torch.ops.ember.native_attention(q, k, v, cu, False, window),
        }
    if blocks:
        out = torch.empty_like(q)
        for i, name in enumerate(_BLOCKS):
            ways[name] = lambda i=i: _fixed(lib, q, k, v, out, cu, causal, -1 if window is None else window, i)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():
        way()  # warm: plans, buffers
    for _ in range(rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _without_kernel(fn):  # type: ignore[no-untyped-def]
    """fn() with the native kernel hidden from ember.ops (its SDPA path)."""
    lib = native._loaded.pop("attention")
    try:
        return fn()
    finally:
        native._loaded["attention"] = lib


def _fixed(lib: ctypes.CDLL, q, k, v, out, cu, causal: bool, window: int, blocks: int) -> None:  # type: ignore[no-untyped-def]
    """The kernel with one block shape, called through its C entry point (ember_attention_f32 for float32)."""
    d = q.shape[-1]
    entry = lib.ember_attention if q.dtype == torch.bfloat16 else lib.ember_attention_f32
    status = entry(
        ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(k.data_ptr()), ctypes.c_void_p(v.data_ptr()),
        ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(cu.data_ptr()), ctypes.c_int64(cu.numel() - 1),
        ctypes.c_int64(q.shape[1]), ctypes.c_int64(k.shape[1]), ctypes.c_int64(d), ctypes.c_int64(q.stride(0)),
        ctypes.c_int64(k.stride(0)), ctypes.c_int64(v.stride(0)), ctypes.c_int(int(causal)), ctypes.c_int64(window),
        ctypes.c_float(d**-0.5), ctypes.c_int(blocks),
    )  # fmt: skip
    assert status == 0, status


if __name__ == "__main__":
    main()
