"""The composition root: reads a checkpoint and wires tokenizer, model, pooler and runner.

Order matters and is kept in one place: resolve the model, read its config and
sentence-transformers files, decide pooling and dtype, build the model on the meta
device, stream the weights in, then build the tokenizer and the runner.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ember.config import DType, EngineConfig, PoolerConfig
from ember.engine.engine import AsyncEngine
from ember.engine.inputs import check_dimensions
from ember.errors import CheckpointError, ConfigError, InputError
from ember.hardware import has_fast_bf16
from ember.models.checkpoint import (
    DEFAULT_MODEL,
    iter_weights,
    parameter_count,
    read_config,
    release_mapped_pages,
    resolve_model,
)
from ember.models.dense import Dense
from ember.models.registry import model_class
from ember.models.st_modules import read_st_modules, resolve_pooling
from ember.ops.linear import pack_linears
from ember.ops.quant import int8_targets, quantize_int8
from ember.ops.tokenwise import TOKEN_SLICE
from ember.resources import MemoryBudget, memory_budget
from ember.sizing import MemoryPlan, activation_bytes_per_token, plan_memory
from ember.tokenizer import Tokenizer
from ember.types import ModelInfo

__all__ = [
    "Limits",
    "Loaded",
    "auto_dtype",
    "best_seconds",
    "build_engine",
    "gemm_gflops",
    "load",
    "plan_model_memory",
    "set_threads",
    "torch_dtype",
]

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """A model ready to embed: its tokenizer, its runner, what it is and the memory it planned for."""

    tokenizer: Tokenizer
    runner: Any  # TorchRunner; Any keeps this record importable without the runner's type
    info: ModelInfo
    path: Path
    load_seconds: float
    memory: MemoryPlan


@dataclass(frozen=True)
class Limits:
    """What the operator asked for, before it is fitted into memory."""

    batch_tokens: int = 2048
    queued_tokens: int = 1_000_000
    memory_limit: int | None = None
    """Bytes to plan for instead of the detected cgroup limit or available memory (--memory-limit)."""


KERNEL_CACHE = 256
"""oneDNN primitives kept (ONEDNN_PRIMITIVE_CACHE_CAPACITY): one per GEMM shape, 5-13 ms to build.
Batches run at rounded token counts (runner.padded_tokens), so a model meets at most ~60 row counts
per GEMM up to the 2,048-token slice: 256 holds them for 4 GEMM shapes (server peak RSS unchanged,
1.43 GiB over the int8 workloads). Unbounded (oneDNN's default 1,024) with unrounded batches, a
server grew by ~600 MB; bounded to 32, most batches rebuilt their kernels (docs/benchmarks.md)."""


def set_threads(threads: int) -> None:
    """Size torch's intra-op pool (OMP, MKL, oneDNN follow it), keep inter-op work on one thread,
    and bound oneDNN's per-shape kernel cache (read at the first matmul; an operator's value wins)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(KERNEL_CACHE))
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # settable only before the first parallel region
        torch.set_num_interop_threads(1)


def gemm_gflops(dtype: torch.dtype, size: int = 1024, repeats: int = 3) -> float:
    """Measured matrix-multiply throughput for `dtype` on the current threads (best of `repeats`)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / best_seconds(lambda: a @ b, repeats) / 1e9


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run`, after one untimed call (kernel selection)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


@functools.lru_cache(maxsize=1)
def auto_dtype() -> torch.dtype:
    """bfloat16 where the CPU has bf16 matrix instructions and a quick GEMM probe confirms them."""
    if not has_fast_bf16():
        return torch.float32
    bf16, fp32 = gemm_gflops(torch.bfloat16, 512), gemm_gflops(torch.float32, 512)
    if bf16 < 1.2 * fp32:
        log.warning(
            "CPU lists bf16 instructions but bf16 GEMM is not faster (%.0f vs %.0f GFLOPS): float32", bf16, fp32
        )
        return torch.float32
    return torch.bfloat16


def torch_dtype(dtype: DType) -> torch.dtype:
    """The compute dtype: `auto` is bfloat16 where the CPU has fast bf16 matrix instructions."""
    if dtype == "auto":
        return auto_dtype()
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def load(
    model: str | None = None,
    *,
    dtype: DType = "auto",
    max_model_len: int | None = None,
    pooler: PoolerConfig | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    served_name: str | None = None,
    hf_overrides: dict[str, Any] | None = None,
    limits: Limits | None = None,
    memory: MemoryBudget | None = None,
    quantization: str | None = None,
) -> Loaded:
    """Load `model` (local directory, hub id, or None for the bundled default)."""
    from ember.engine.runner import TorchRunner

    start = time.perf_counter()
    path = resolve_model(model, revision, download_dir)
    config = {**read_config(path), **(hf_overrides or {})}
    arch, cls = model_class(config)
    st = read_st_modules(path)
    pooling = resolve_pooling(st, pooler or PoolerConfig(), is_decoder=getattr(cls, "is_decoder", False))
    dt = torch_dtype(dtype)
    if quantization not in (None, "int8"):
        raise ConfigError(f"--quantization {quantization!r} is not supported; ember offers int8")
    st_max = st.max_seq_length
    plan = plan_model_memory(
        path, config, dt, limits or Limits(), memory or memory_budget(), max_model_len, st_max, quantization
    )
    net = _load_weights(cls, config, path, dt)
    release_mapped_pages(path)  # the pages of tensors the model copied (cast, merged) are dead
    if quantization == "int8":
        quantize_int8(net, dt, cls.int8_layers, getattr(cls, "int8_glu_layers", None))  # type: ignore[attr-defined]
    if pack_linears(net, dt) or quantization:
        release_mapped_pages(path)  # and those of the matrices packed or made int8
    dense = [Dense.load(d) for d in st.dense_dirs]
    tokenizer = Tokenizer.from_dir(path, ensure_eos=pooling.method == "LAST")
    dims = config.get("matryoshka_dimensions")
    info = ModelInfo(
        name=served_name or model or DEFAULT_MODEL,
        architecture=arch,
        dimension=dense[-1].linear.out_features if dense else net.hidden_size,
        max_model_len=_max_model_len(net.max_positions, st.max_seq_length, max_model_len),
        dtype=str(dt).removeprefix("torch.") + (" (int8 weights)" if quantization else ""),
        pooling=pooling,
        is_matryoshka=bool(config.get("is_matryoshka") or dims),
        matryoshka_dimensions=tuple(dims) if dims else None,
        prompts=st.prompts,
        default_prompt_name=st.default_prompt_name,
        vocab_size=tokenizer.vocab_size,
    )
    try:
        check_dimensions(info, (pooler or PoolerConfig()).dimensions)
    except InputError as e:
        raise ConfigError(f"--pooler-config dimensions: {e}") from None
    seconds = time.perf_counter() - start
    log.info(
        "loaded %s (%s, %s, pooling %s%s from %s, max_model_len %d) in %.1fs",
        info.name, arch, info.dtype, pooling.method, " + normalize" if pooling.normalize else "",
        pooling.source, info.max_model_len, seconds,
    )  # fmt: skip
    log.info("%s", plan.describe())
    return Loaded(tokenizer, TorchRunner(net, info, dense), info, path, seconds, plan)


def plan_model_memory(
    path: Path,
    config: dict[str, Any],
    dtype: torch.dtype,
    limits: Limits,
    memory: MemoryBudget,
    max_model_len: int | None,
    st_max: int | None,
    quantization: str | None = None,
) -> MemoryPlan:
    """Check the model fits before reading any weight, and size the token budgets to the memory."""
    size = dtype.itemsize
    positions = config.get("max_position_embeddings", 512)
    longest = max_model_len or min(positions, st_max or positions)
    params = parameter_count(path)
    weights = params * size
    if quantization == "int8":  # the quantised matrices at one byte, the rest in the compute dtype
        q8 = int8_parameter_count(config)
        weights = (params - q8) * size + q8
    return plan_memory(
        memory,
        weights_bytes=weights,
        per_token_bytes=activation_bytes_per_token(config, size),
        fixed_bytes=TOKEN_SLICE * size * 3 * config.get("intermediate_size", 4 * config["hidden_size"]),
        max_model_len=longest,
        batch_tokens=limits.batch_tokens,
        queued_tokens=limits.queued_tokens,
        limit_override=limits.memory_limit,
        dtype_bytes=size,
    )


def int8_parameter_count(config: dict[str, Any]) -> int:
    """Weights that --quantization int8 stores at one byte: the layers the model's int8_layers names,
    counted on a weightless (meta) instance."""
    _, cls = model_class(config)
    with torch.device("meta"):
        net = cls.from_config(config)  # type: ignore[attr-defined]
    pattern: str = cls.int8_layers  # type: ignore[attr-defined]
    return sum(int(m.weight.numel()) for m in int8_targets(net, pattern).values())


def _max_model_len(positions: int, st_max: int | None, asked: int | None) -> int:
    if asked is not None:
        if asked < 1:
            raise ConfigError(f"--max-model-len must be positive, got {asked}")
        if asked > positions:
            raise ConfigError(f"--max-model-len {asked} is greater than the model's {positions} position embeddings")
        return asked
    return min(positions, st_max) if st_max else positions


def _load_weights(cls: type[nn.Module], config: dict[str, Any], path: Path, dtype: torch.dtype) -> Any:
    """Build the model on the meta device, then assign each checkpoint tensor, cast once.
    (The model's load hooks may merge checkpoint tensors, e.g. q/k/v into one matrix.)"""
    with torch.device("meta"):
        net = cls.from_config(config)  # type: ignore[attr-defined]
    expected = {k: v.shape for k, v in net.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(path):
        key = cls.checkpoint_key(name)  # type: ignore[attr-defined]
        if key is None:
            continue
        if key in expected and tensor.shape != expected[key]:
            raise CheckpointError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected[key])}"
            )
        state[key] = tensor.to(dtype)
    try:
        result = net.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shapes that disagree after the model's hooks merged tensors
        raise CheckpointError(f"weights in {path} do not match {cls.__name__}: {e}") from None
    missing, unexpected = sorted(result.missing_keys), sorted(result.unexpected_keys)
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {path} do not match {cls.__name__}: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    return net.eval().requires_grad_(False)


def build_engine(loaded: Loaded, config: EngineConfig, pooler: PoolerConfig, tokenizer_threads: int = 1) -> AsyncEngine:
    """The async engine over a loaded model (it warms the model up on its own thread when started)."""
    return AsyncEngine(loaded.runner, loaded.tokenizer, config, pooler, tokenizer_threads=tokenizer_threads)
