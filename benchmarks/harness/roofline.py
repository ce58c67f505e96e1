"""The compute limit: measured GEMM throughput on the current threads, over the model's FLOPs per token."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from ember.engine.cpu import best_seconds, gemm_gflops, set_threads
from ember.models.checkpoint import read_config, resolve_model
from ember.ops.quant import Int8Linear, int8_mm, int_mm_fast
from ember.resources import cpu_budget
from ember.sizing import flops_per_token


def compute_limit(model: str, dtype: str, seq_len: int = 512) -> dict[str, float]:
    set_threads(cpu_budget().usable)
    config = read_config(resolve_model(model))
    if dtype == "int8" and int_mm_fast():  # --quantization int8: the int8 matmul
        gflops = max(int8_gops(2048, repeats=5) for _ in range(3))
    elif dtype == "int8":  # no int8 matrix instructions: int8 layers multiply their int8 values in float32
        gflops = max(gemm_gflops(torch.float32, 2048, repeats=5) for _ in range(3))
    else:
        gflops = max(
            gemm_gflops(torch.bfloat16 if dtype == "bfloat16" else torch.float32, 2048, repeats=5) for _ in range(3)
        )
    per_token = flops_per_token(config, seq_len, causal=config.get("model_type") == "qwen3")
    return {"gflops": gflops, "gflop_per_token": per_token / 1e9, "tokens_per_s": gflops * 1e9 / per_token}


def workload_tokens_per_s(
    limit: dict[str, float], model: str, lengths: Sequence[int], tokens: int, window: int | None = None
) -> float:
    """The limit in tokens/s for a workload of inputs of these lengths, at the GEMM rate `limit` was probed at.

    Attention's FLOPs per token grow with the sequence a token is in, so they are counted at the workload's own
    lengths (each scaled so they sum to `tokens`, the count its usage reported): a ~19-token query's token is 6%
    fewer FLOPs than a 512-token document's in the 0.6B shape, and an 8,000-token document's twice as many.
    Token-weighted, a sequence of L tokens has L of them, each attending to L/2 keys on average when causal. With
    `window` (the server's --max-model-len under chunked processing) a longer input counts as its windows."""
    config = read_config(resolve_model(model))
    scale = tokens / sum(lengths)
    scaled = [n * scale for n in lengths]
    if window:
        scaled = [min(window, n - start) for n in scaled for start in range(0, math.ceil(n), window)]
    seq_len = sum(n * n for n in scaled) / sum(scaled)
    per_token = flops_per_token(config, seq_len, causal=config.get("model_type") == "qwen3")
    return limit["gflops"] * 1e9 / per_token


def int8_gops(size: int, repeats: int) -> float:
    """The int8 GEMM rate ember's Int8Linear runs at (best of `repeats`), in G int-ops/s."""
    layer = Int8Linear(torch.nn.Linear(size, size, bias=False), torch.bfloat16)
    xq = torch.randint(-127, 128, (size, size), dtype=torch.int8)
    mm = (
        (lambda: int8_mm(xq, layer.qweight, layer.scale, torch.bfloat16))
        if layer.onednn
        else (lambda: torch._int_mm(xq, layer.qweight))
    )
    return 2 * size**3 / best_seconds(mm, repeats) / 1e9


if __name__ == "__main__":
    from ember.cli.runtime import cap_isa, max_isa

    cap_isa(max_isa())  # EMBER_MAX_ISA as the server applies it: under a cap, int8 runs what that tier's CPU would
    print(
        compute_limit(
            sys.argv[1] if len(sys.argv) > 1 else "sentence-transformers/all-MiniLM-L6-v2",
            sys.argv[2] if len(sys.argv) > 2 else "bfloat16",
            int(sys.argv[3]) if len(sys.argv) > 3 else 512,  # the sequence length attention's FLOPs are counted at
        )
    )
