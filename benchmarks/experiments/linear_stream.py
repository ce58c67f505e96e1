"""float32 linear layers as a forward meets them: every layer's own matrices, read in turn from memory.

A product timed over and over on one matrix keeps that matrix in the caches; a forward of the 0.6B shape streams
1.76 GB of float32 weights. This times the shape's four products (q/k/v, o, gate/up, down) over --layers layers'
distinct random matrices, for each row count, with the weights laid out each way below, alternating the ways
round by round; it prints the median time per pass and each way's speed-up over torch's `F.linear`.

    python benchmarks/experiments/linear_stream.py                        # 16, 176 and 2,048 rows
    python benchmarks/experiments/linear_stream.py --rows 32,512 --layers 28
    EMBER_MAX_ISA=avx2 python benchmarks/experiments/linear_stream.py     # as an AVX2-only CPU would run them

Ways: `plain` (F.linear: oneMKL's sgemm, packing panels on every call), `onednn` (weights packed once for
oneDNN's matmul, as ember packs float32 layers on AMD), `onednn_bf16` (a bf16 model's layer: bf16 weights packed
for oneDNN, the activations converted to bf16 on each call), `pairs_bf16` (the same on ember's bf16 product, where
it builds: AVX-512 BF16), `mkl_packed` (oneMKL's packed sgemm), `bf16_upcast` (bf16 weights, converted to float32
on each call), `bf16_native` (ember's Bf16Linear on its native kernel, where it builds),
`strips`, `strips_bf16` and `strips_int8` (ember's float32 product on float32 strips, on bf16 words and on int8
weights with a scale per channel, as int8 layers hold them on CPUs without VNNI or AMX, where it builds).
benchmarks/NOTES.md ("Linear layers") has what they measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ember.cli.runtime import cap_isa, max_isa, maybe_reexec_with_allocator, native_config
from ember.engine.cpu import set_threads
from ember.ops.bf16_pairs import pack_pairs
from ember.ops.linear import Bf16Linear, pack_bf16, pack_f32, strip_width
from ember.ops.native import build_kernels, linear_bf16_kernel, linear_f32_kernel, linear_kernel
from ember.resources import cpu_budget

SHAPES = ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024))  # (K, N) of the 0.6B shape's products


def layouts(ws: list[torch.Tensor]) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """Each way's product x @ ws[i]^T, its weights laid out once here."""
    dnn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, 2048) for w in ws]
    half = [w.bfloat16() for w in ws]
    dnn_bf16 = [torch.ops.mkldnn._reorder_linear_weight(h, None) for h in half]
    ways = {
        "plain": lambda x, i: F.linear(x, ws[i]),
        "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, dnn[i], None, "none", [], ""),
        "mkl_packed": lambda x, i: torch.ops.mkl._mkl_linear(x, mkl[i], ws[i], None, x.shape[0]),
        "bf16_upcast": lambda x, i: F.linear(x, half[i].float()),
        # a bf16 model's layer: bf16 activations (the conversion counted) on oneDNN's packed bf16 matmul
        "onednn_bf16": lambda x, i: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), dnn_bf16[i], None, "none", [], ""),
    }
    if linear_f32_kernel() is not None:  # ember's float32 product: float32 strips, and bf16 words in strips
        width = strip_width()
        strips = [pack_f32(w, width) for w in ws]
        words = [pack_bf16(w.bfloat16(), width) for w in ws]
        ways["strips"] = lambda x, i: torch.ops.ember.linear_f32w(x, strips[i], None)
        ways["strips_bf16"] = lambda x, i: torch.ops.ember.linear_f32h(x, words[i], None)
        scales = [w.abs().amax(1) / 127 for w in ws]
        q8 = [pack_f32((w / s[:, None]).round().to(torch.int8), width) for w, s in zip(ws, scales, strict=True)]
        ways["strips_int8"] = lambda x, i: torch.ops.ember.linear_f32q(x, q8[i], None) * scales[i]
    if linear_bf16_kernel() is not None:  # a bf16 model's short products on ember's bf16 product
        words16 = [pack_pairs(h) for h in half]
        ways["pairs_bf16"] = lambda x, i: torch.ops.ember.linear_bf16d(x.bfloat16(), words16[i], None)
    if linear_kernel() is not None:
        held = []
        for w in ws:  # each as a float32 layer would be, then held as bf16
            layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            layer.weight = torch.nn.Parameter(w, requires_grad=False)
            held.append(Bf16Linear(layer))
        ways["bf16_native"] = lambda x, i: held[i](x)
    return ways


def main() -> None:
    maybe_reexec_with_allocator(sys.argv[1:], program=[sys.executable, sys.argv[0]])  # time on the server's allocator
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,176,2048", help="row counts (tokens in a batch), comma-separated")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    cap_isa(max_isa())
    set_threads(cpu_budget().usable)
    build_kernels(native_config())
    ws = [torch.randn(n, k) * 0.02 for _ in range(args.layers) for k, n in SHAPES]
    ways = layouts(ws)
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, w.shape[1]) for w in ws[: len(SHAPES)]]
        ref = [F.linear(x, w) for x, w in zip(xs, ws, strict=False)]
        for name, product in ways.items():  # each way's result, once, against F.linear's
            err = max(float((product(x, i) - r).abs().max()) for i, (x, r) in enumerate(zip(xs, ref, strict=True)))
            assert err < (0.2 if "int8" in name else 3e-2), f"{name}: differs from F.linear by {err}"
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds + 1):  # round 0 warms up and is not counted
            for name, product in ways.items():
                start = time.perf_counter()
                for i in range(len(ws)):
                    product(xs[i % len(SHAPES)], i)
                if r:
                    seconds[name].append(time.perf_counter() - start)
        plain = statistics.median(seconds["plain"])
        print(
            f"{rows:>5} rows: "
            + ", ".join(
                f"{name} {statistics.median(s) * 1e3:.0f} ms ({plain / statistics.median(s):.2f}x)"
                for name, s in seconds.items()
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
