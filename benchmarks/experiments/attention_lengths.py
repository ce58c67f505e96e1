"""Packed causal attention with and without rounding lengths up to a multiple of 16, turn about.

torch's CPU flash attention is much slower on some lengths that are not a multiple of 16; ember pads
such a sequence with the tokens after it (see src/ember/ops/attention.py). This times
`varlen_attention` on the 0.6B model's head layout (16 query heads, 8 key/value heads of 128, bf16,
views of one packed q/k/v buffer) with the padding on and off, alternating, and prints medians.
Each length is followed by a 64-token sequence, so there are tokens to pad with.

    python benchmarks/experiments/attention_lengths.py
    python benchmarks/experiments/attention_lengths.py --lengths 301,501,1001 --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ember.cli.runtime import maybe_reexec_with_allocator
from ember.ops import attention


def main() -> None:
    maybe_reexec_with_allocator(sys.argv[1:], program=[sys.executable, sys.argv[0]])  # time on the server's allocator
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="151,201,300,301,333,451,499,515,613,1001,1201")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    heads, kv_heads, dim = 16, 8, 128
    align_from = attention._ALIGN_FROM
    print(f"{'lengths':>12s} {'padded ms':>10s} {'as is ms':>9s} {'as is / padded':>15s}")
    for n in map(int, args.lengths.split(",")):
        lens = [n, 64]
        qkv = torch.randn(sum(lens), heads + 2 * kv_heads, dim).bfloat16()
        q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for padded in (True, False):
                attention._ALIGN_FROM = align_from if padded else 1 << 30
                attention._plan.cache_clear()
                attention.varlen_attention(q, k, v, lens, causal=True)  # warm: plan and kernel
                start = time.perf_counter()
                attention.varlen_attention(q, k, v, lens, causal=True)
                times[padded].append(time.perf_counter() - start)
        attention._ALIGN_FROM = align_from
        on, off = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        print(f"{lens!s:>12s} {on:10.2f} {off:9.2f} {off / on:15.2f}")


if __name__ == "__main__":
    main()
