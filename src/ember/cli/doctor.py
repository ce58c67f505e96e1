"""`ember doctor`: what ember will do on this machine, and why; non-zero on a misconfiguration."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from ember.cli.flags import parse_json_flag, parse_size
from ember.cli.runtime import maybe_reexec_with_allocator, parse_bytes, prepare_process
from ember.errors import ConfigError, EmberError
from ember.hardware import cpu_flags
from ember.resources import cpu_budget, memory_budget

__all__ = ["add_parser", "run"]

_ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "avx512_fp16")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor", allow_abbrev=False, help="report CPU, limits, threads, dtype and what a model needs here"
    )
    p.add_argument("model", nargs="?", default=None, help="model to size (default: the bundled MiniLM)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=parse_size, default=None)
    p.add_argument("--quantization", default=None, choices=["int8"])
    p.add_argument("--hf-overrides", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpu-bind", default=None)
    p.add_argument("--memory-limit", default=None)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _machine(threads: int) -> dict[str, Any]:
    import torch

    from ember.engine.build import auto_dtype, gemm_gflops
    from ember.ops.fused import can_compile

    flags = cpu_flags()
    cpu, mem = cpu_budget(), memory_budget()
    return {
        "cpu": {"model": _cpu_model(), "isa": {f: f in flags for f in _ISA}},
        "limits": {
            "affinity_cpus": cpu.affinity,
            "cpu_quota": cpu.quota,
            "cpuset_cpus": cpu.cpuset,
            "usable_cpus": cpu.usable,
            "cpu_source": cpu.source,
            "memory_limit_bytes": mem.limit_bytes,
            "memory_available_bytes": mem.available_bytes,
            "memory_source": mem.source,
        },
        "torch": {
            "version": torch.__version__,
            "onednn": torch.backends.mkldnn.is_available(),
            "mkl": torch.backends.mkl.is_available(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "allocator": os.environ.get("EMBER_ALLOCATOR_SET", "system malloc"),
            "fused_kernels": "compiled in the background (g++ found)" if can_compile() else "eager (no C++ compiler)",
        },
        "auto_dtype": str(auto_dtype()).removeprefix("torch."),
        "gemm_gflops": {
            "float32": round(gemm_gflops(torch.float32, 2048)),
            "bfloat16": round(gemm_gflops(torch.bfloat16, 2048)),
        },
    }


def _model(args: argparse.Namespace, gflops: dict[str, float]) -> dict[str, Any]:
    from ember.config import check_dtype
    from ember.engine.build import Limits, plan_model_memory, torch_dtype
    from ember.models.checkpoint import read_config, resolve_model
    from ember.models.st_modules import read_st_modules
    from ember.sizing import flops_per_token

    path = resolve_model(args.model)
    config = {**read_config(path), **(parse_json_flag(args.hf_overrides, "--hf-overrides") or {})}
    dtype = torch_dtype(check_dtype(args.dtype))
    limits = Limits(memory_limit=parse_bytes(args.memory_limit) if args.memory_limit else None)
    plan = plan_model_memory(
        path, config, dtype, limits, memory_budget(), args.max_model_len, read_st_modules(path).max_seq_length
    )
    causal = config.get("model_type") == "qwen3"
    per_token = flops_per_token(config, 512, causal)
    rate = gflops["bfloat16" if dtype.itemsize == 2 else "float32"]
    return {
        "path": str(path),
        "dtype": str(dtype).removeprefix("torch."),
        "weights_bytes": plan.weights_bytes,
        "memory_plan": plan.describe(),
        "max_batch_tokens": plan.max_batch_tokens,
        "gflop_per_token_at_512": round(per_token / 1e9, 3),
        "compute_limit_tokens_per_s": round(rate * 1e9 / per_token),
    }


def run(args: argparse.Namespace) -> int:
    problems: list[str] = []
    try:
        maybe_reexec_with_allocator(sys.argv[1:])
        plan = prepare_process(args.threads, args.cpu_bind)
        problems += plan.warnings
        from ember.engine.build import set_threads

        set_threads(plan.threads)
        report = _machine(plan.threads)
        report["threads"] = {"count": plan.threads, "reason": plan.reason, "bind": plan.bind}
        try:
            report["model"] = _model(args, report["gemm_gflops"])
        except ConfigError as e:
            problems.append(str(e))
    except EmberError as e:
        problems.append(str(e))
        report = {}
    report["problems"] = problems
    print(json.dumps(report, indent=2) if args.json else _text(report))
    return 1 if problems else 0


def _text(report: dict[str, Any], indent: str = "") -> str:
    lines = []
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines.append(_text(value, indent + "  "))
        elif isinstance(value, list) and key == "problems":
            lines += [f"{indent}PROBLEM: {p}" for p in value] or [f"{indent}no problems found"]
        else:
            lines.append(f"{indent}{key}: {value}")
    return "\n".join(lines)
