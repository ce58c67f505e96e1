"""`ember doctor`: what ember will do on this machine, and why; non-zero on a misconfiguration."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ember.cli.model_flags import add_model_flags, add_models_flag, add_process_flags, model_configs
from ember.cli.runtime import maybe_reexec_with_allocator, native_config, prepare_process
from ember.errors import EmberError
from ember.hardware import (
    amx_granted,
    auto_dtype,
    bf16_outruns_float32,
    cpu_flags,
    cpu_model,
    has_fast_bf16,
    isa_tier,
    usable_cpu_flags,
)
from ember.resources import cpu_budget, memory_budget

__all__ = ["add_parser", "run"]

_ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "avx512_fp16")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor", allow_abbrev=False, help="report CPU, limits, threads, dtype and what a model needs here"
    )
    add_model_flags(p)  # every model flag `ember serve` takes, so doctor plans exactly what serve would
    add_models_flag(p)
    add_process_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def _machine() -> dict[str, Any]:
    import torch

    from ember.engine.cpu import gemm_gflops
    from ember.ops.fused import can_compile
    from ember.ops.native import build_kernels

    flags = cpu_flags()
    cpu, mem = cpu_budget(), memory_budget()
    # without bf16 matrix instructions torch's bf16 product is an emulation, far slower: a 2048 product would
    # keep doctor busy for minutes, and a small one shows the same rate
    bf16_size = 2048 if has_fast_bf16(flags) else 256
    gflops = {
        "float32": round(gemm_gflops(torch.float32, 2048)),
        "bfloat16": round(gemm_gflops(torch.bfloat16, bf16_size, repeats=1 if bf16_size < 2048 else 3)),
    }
    kernels = {k.name: ("active: " if k.active else "off: ") + k.detail for k in build_kernels(native_config())}
    kernels["fused"] = (
        "torch.compile in the background (a C++ compiler found)" if can_compile() else ("eager (no C++ compiler)")
    )
    return {
        "cpu": {
            "model": cpu_model(),
            "isa": {f: f in flags for f in _ISA},
            "tier": isa_tier(flags) + _tier_note(flags),
        },
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
        },
        "kernels": kernels,
        "auto_dtype": f"{auto_dtype(flags)} ({_dtype_reason(flags)})",
        "gemm_gflops": gflops,
    }


def _dtype_reason(flags: frozenset[str]) -> str:
    """Why --dtype auto is what it is on this CPU."""
    if bf16_outruns_float32(flags):
        return "from the CPU: bf16 matrix instructions that outrun float32's"
    if has_fast_bf16(flags):
        return "from the CPU: an Intel CPU without AMX runs bf16 products at half its float32 rate"
    return "from the CPU: no bf16 matrix instructions"


def _tier_note(flags: frozenset[str]) -> str:
    """Why the tier is below what the CPU reaches: a cap (EMBER_MAX_ISA), or AMX's tile state refused."""
    reach = usable_cpu_flags()
    if flags != reach:
        return f" (capped by EMBER_MAX_ISA; this process could reach {isa_tier(reach)})"
    if not amx_granted():
        return " (the CPU has AMX, but the OS refuses this process its tile state: AMX kernels stay off)"
    return ""


def _dtype_warning(gflops: dict[str, float]) -> str | None:
    """The probe only warns: --dtype auto is decided by the CPU flags, the same on every start."""
    if auto_dtype() == "bfloat16" and gflops["bfloat16"] < 1.2 * gflops["float32"]:
        return (
            f"the CPU lists bf16 instructions but bf16 GEMM measured no faster than float32 here "
            f"({gflops['bfloat16']:.0f} vs {gflops['float32']:.0f} GFLOPS; a busy machine measures low): "
            "--dtype float32 may be faster"
        )
    faster_bf16 = gflops["float32"] > 0 and gflops["bfloat16"] >= 1.5 * gflops["float32"]  # Graviton 3/4's BFMMLA
    if auto_dtype() == "float32" and faster_bf16:
        return (
            f"bf16 GEMM measured {gflops['bfloat16'] / gflops['float32']:.1f}x float32 here "
            f"({gflops['bfloat16']:.0f} vs {gflops['float32']:.0f} GFLOPS) though --dtype auto is float32 on this "
            "CPU: --dtype bfloat16 may be faster (check its vectors against float32's for your model)"
        )
    return None


def _models(args: argparse.Namespace, gflops: dict[str, float]) -> list[dict[str, Any]]:
    """The plan `ember serve` makes with these flags (and --models): one memory plan over every model."""
    from ember.engine.build import plan_models
    from ember.sizing import flops_per_token

    plans = plan_models([config for config, _, _ in model_configs(args)], native=native_config())
    out = []
    for p in plans:
        per_token = flops_per_token(p.hf_config, 512, p.cls.is_decoder)
        rate = gflops["bfloat16" if p.dtype.itemsize == 2 else "float32"]
        out.append(
            {
                "name": p.name,
                "path": str(p.path),
                "architecture": p.architecture,
                "task": p.cls.task,
                "dtype": str(p.dtype).removeprefix("torch.") + (" (int8 weights)" if p.config.quantization else ""),
                "max_model_len": p.max_model_len,
                "weights_bytes": p.memory.weights_bytes,
                "memory_plan": p.memory.describe(),
                "max_batch_tokens": p.memory.max_batch_tokens,
                "gflop_per_token_at_512": round(per_token / 1e9, 3),
                "compute_limit_tokens_per_s": round(rate * 1e9 / per_token),
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    problems: list[str] = []
    try:
        maybe_reexec_with_allocator(sys.argv[1:])
        plan = prepare_process(args.threads, args.cpu_bind)
        problems += plan.warnings
        from ember.engine.cpu import set_threads

        set_threads(plan.threads)
        report = _machine()
        report["threads"] = {"count": plan.threads, "reason": plan.reason, "bind": plan.bind}
        warning = _dtype_warning(report["gemm_gflops"])
        if warning:
            report["warnings"] = [warning]
        try:  # the same plan `ember serve` makes: what it would refuse, doctor reports as a problem
            models = _models(args, report["gemm_gflops"])
            report["model"] = models[0]  # the first (or only) model, where a single-model report has it
            if len(models) > 1:
                report["models"] = {m["name"]: m for m in models}
        except EmberError as e:
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
