"""Whole forwards with one native kernel on and off, in-process, two processes alternating.

A kernel switched at run time would recompile the compiled regions (benchmarks/NOTES.md: "two models, not
recompiles"), so each side is its own process: the Embedder built with the kernel on (or off), warmed, then each
batch timed three times; the sides alternate for --rounds rounds and the medians are printed with the ratio.

    python benchmarks/experiments/kernel_switch.py --kernel attention
    python benchmarks/experiments/kernel_switch.py --kernel int8_gemm --quantization int8 --rounds 2
    python benchmarks/experiments/kernel_switch.py --kernel linear --dtype float32  # bf16 weights against float32's
    python benchmarks/experiments/kernel_switch.py --kernel linear_f32 --dtype float32  # float32 product, oneDNN
    python benchmarks/experiments/kernel_switch.py --kernel quantization --dtype float32  # int8 against float32

`--kernel quantization` switches `--quantization int8` instead, every kernel as configured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BATCHES = {"1x20": (1, 20), "8x20": (8, 20), "4x500": (4, 500), "1x4000": (1, 4000)}  # texts x words
_WORDS = "alpha beta gamma delta river stone cloud market engine paper north quiet".split()


def _side(
    model: str, kernel: str, on: bool, quantization: str | None, dtype: str, batches: list[str]
) -> dict[str, float]:
    """One process's medians (seconds per batch), with `kernel` on or off."""
    from ember import Embedder
    from ember.cli.runtime import native_config

    if kernel == "quantization":
        native, quantization = native_config(), "int8" if on else None
    else:
        native = dataclasses.replace(native_config(), **{kernel: on})
    embedder = Embedder(model, dtype=dtype, quantization=quantization, native=native)  # type: ignore[arg-type]
    rng = random.Random(0)
    out = {}
    for name in batches:
        n, words = BATCHES[name]
        texts = [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(n)]
        embedder.embed(texts), embedder.embed(texts)  # warm: compiled regions, buffers
        times = []
        for _ in range(3):
            start = time.perf_counter()
            embedder.embed(texts)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    out["peak RSS GiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models/qwen3-emb-0.6b-random"))
    kernels = ["attention", "int8_gemm", "elementwise", "linear", "linear_f32", "quantization"]
    ap.add_argument("--kernel", default="attention", choices=kernels)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batches", default=",".join(BATCHES), help=f"of {', '.join(BATCHES)} (texts x words)")
    ap.add_argument("--quantization", default=None, choices=[None, "int8"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)  # a child process: "1" or "0"
    args = ap.parse_args()
    batches = args.batches.split(",")
    if args.side is not None:
        from ember.cli.runtime import maybe_reexec_with_allocator, prepare_process

        maybe_reexec_with_allocator(sys.argv[1:], program=[sys.executable, sys.argv[0]])  # the server's allocator
        prepare_process(None, None)
        print(json.dumps(_side(args.model, args.kernel, args.side == "1", args.quantization, args.dtype, batches)))
        return
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            cmd = [sys.executable, __file__, "--model", args.model, "--kernel", args.kernel, "--side", str(int(on))]
            cmd += ["--dtype", args.dtype, "--batches", args.batches]
            cmd += ["--quantization", args.quantization] if args.quantization else []
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[on].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}, {args.kernel} {'on' if on else 'off'}: {runs[on][-1]}", flush=True)
    print(f"{'batch (texts x words)':>22s} {'on s':>8s} {'off s':>8s} {'off / on':>9s}")
    for name in [*batches, "peak RSS GiB"]:
        on, off = (statistics.median(x[name] for x in runs[side]) for side in (True, False))
        print(f"{name:>22s} {on:8.3f} {off:8.3f} {off / on:9.2f}")


if __name__ == "__main__":
    main()
