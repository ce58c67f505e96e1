"""ember's native int8 matrix product against torch's, on a whole forward's GEMMs, turn about.

The 0.6B model's four int8 GEMMs per layer (q/k/v 1024 -> 4096, o 2048 -> 1024, gate/up 1024 -> 6144,
down 3072 -> 1024), 28 layers of distinct random weights (440 MB, so they stream from memory as in a
forward, not from cache), run at each token count with `int8_gemm` (src/ember/ops/csrc/int8_gemm.cpp)
and with what int8 layers use where the native kernel cannot run (`onednn::qlinear_pointwise` on CPUs with AMX
int8, else `torch._int_mm` and the weights' scales, as Int8Linear applies them), alternating; prints the medians,
the GOPS and the median of the paired ratios. The native kernel runs on AMX or AVX-512 VNNI, whichever it was
built for here.

    python benchmarks/experiments/int8_gemm.py
    python benchmarks/experiments/int8_gemm.py --tokens 20,168,512,2048 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ember.cli.runtime import maybe_reexec_with_allocator
from ember.config import NativeConfig
from ember.ops.native import build_kernels
from ember.ops.quant import int8_gemm, int8_mm, onednn_int8, pack_tiles

SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]  # (inputs, outputs) per layer


def forward(
    layers: list[tuple[torch.Tensor, ...]], xs: dict[int, torch.Tensor], x_scale: torch.Tensor, native: bool
) -> None:
    """Every layer's product on one kernel: the GEMMs of a forward (tokens only; nothing in between)."""
    for tiles, packed, scale in layers:
        x = xs[tiles.shape[1] * 64]  # by the layer's inputs
        if native:
            int8_gemm(x, tiles, scale, x_scale, None, torch.bfloat16, False)
        elif packed.dim() == 2 and packed.dtype == torch.int8:  # (K, N) for torch._int_mm
            (torch._int_mm(x, packed).float() * scale).to(torch.bfloat16)
        else:
            int8_mm(x, packed, scale, torch.bfloat16)


def main() -> None:
    maybe_reexec_with_allocator(sys.argv[1:], program=[sys.executable, sys.argv[0]])  # time on the server's allocator
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="20,168,512,2048")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if not any(k.name == "int8_gemm" and k.active for k in build_kernels(NativeConfig())):
        sys.exit("needs ember's native int8 kernel (AMX int8 or AVX-512 VNNI, g++)")
    peer = "oneDNN" if onednn_int8() else "_int_mm"
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        for k, n in SHAPES:
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            scale = torch.rand(n, generator=g) / 100
            other = torch.ops.onednn.qlinear_prepack(w, None) if peer == "oneDNN" else w.t().contiguous()
            layers.append((pack_tiles(w), other, scale))
    print(f"{'tokens':>6s} {'native ms':>10s} {'GOPS':>6s} {peer + ' ms':>10s} {'GOPS':>6s} {peer + ' / native':>16s}")
    for t in map(int, args.tokens.split(",")):
        xs = {k: torch.randint(-127, 128, (t, k), dtype=torch.int8, generator=g) for k, _ in SHAPES}
        x_scale = torch.rand(t, 1, generator=g)

        forward(layers, xs, x_scale, True), forward(layers, xs, x_scale, False)
        times: dict[str, list[float]] = {"native": [], "onednn": []}
        for i in range(args.rounds):
            for name in ("native", "onednn")[:: 1 if i % 2 else -1]:
                start = time.perf_counter()
                forward(layers, xs, x_scale, name == "native")
                times[name].append(time.perf_counter() - start)
        ops = 2 * t * args.layers * sum(k * n for k, n in SHAPES)
        a, b = (statistics.median(times[n]) for n in ("native", "onednn"))
        ratio = statistics.median(o / n for n, o in zip(times["native"], times["onednn"], strict=True))
        print(f"{t:6d} {a * 1e3:10.1f} {ops / a / 1e9:6.0f} {b * 1e3:10.1f} {ops / b / 1e9:6.0f} {ratio:16.2f}")


if __name__ == "__main__":
    main()
