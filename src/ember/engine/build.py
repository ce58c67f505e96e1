"""The composition root: reads a checkpoint and wires tokenizer, model, pooler, runner and engine, in order.

1. `plan`: resolve the model, read config.json once (with --hf-overrides) and the sentence-transformers files,
   pick the architecture, pooling, dtype and max_model_len, and check it fits in memory, before any weight is
   read (`ember doctor` stops here, so it refuses exactly what `ember serve` refuses);
2. `load`: build the model on the meta device, stream the weights in, quantise and pack, then the tokenizer
   and the runner;
3. `build_engine`: the engine configuration from what the memory plan allows, and the async engine.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ember.config import EngineConfig, ModelConfig, NativeConfig
from ember.engine.calibration import Int8Cache, calibration_forward, calibration_texts
from ember.engine.cpu import torch_dtype
from ember.engine.engine import AsyncEngine
from ember.engine.runner import TorchRunner
from ember.engine.turns import Turns
from ember.errors import CheckpointError, ConfigError
from ember.models.base import Architecture
from ember.models.checkpoint import (
    DEFAULT_MODEL,
    checkpoint_matrices_bf16,
    iter_weights,
    parameter_count,
    read_config,
    release_mapped_pages,
    resolve_model,
)
from ember.models.heads import HeadContext
from ember.models.registry import model_class
from ember.models.st_modules import STModules, read_st_modules
from ember.ops.bf16_pairs import takes_pairs
from ember.ops.linear import hold_bf16, holdable, pack_linears, strip_f32, widen_bf16
from ember.ops.native import cache_dir, may_build
from ember.ops.quant import int8_targets, int_mm_fast, quantize_int8
from ember.ops.tokenwise import TOKEN_SLICE
from ember.resources import MemoryBudget, memory_budget
from ember.sizing import OUTPUT_VALUE_BYTES, MemoryPlan, SharedMemory, activation_bytes_per_token, plan_memory
from ember.tokenizer import Tokenizer
from ember.types import ModelInfo, PoolingSpec

__all__ = ["Loaded", "ModelPlan", "build_engine", "build_engines", "load", "plan", "plan_models"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPlan:
    """What loading a model will do, decided before any weight is read."""

    config: ModelConfig
    path: Path
    hf_config: dict[str, Any]
    """config.json with --hf-overrides merged in: read once, and everything below uses this."""
    architecture: str
    cls: type[Architecture]
    st: STModules
    pooling: PoolingSpec
    dtype: torch.dtype
    max_model_len: int
    memory: MemoryPlan
    strips: bool = False
    """float32 layers go to ember's float32 product (AMD without AVX-512, its kernel allowed and buildable)."""
    pairs: bool = False
    """bf16 layers go to ember's bf16 product (ember.ops.bf16_pairs.takes_pairs, its kernel allowed and buildable)."""
    holds_bf16: bool = False
    """float32 compute on a bf16 checkpoint whose matrices stay bf16 (hold_bf16), as the memory plan counts them."""

    @property
    def name(self) -> str:
        return self.config.served_name or self.config.model or DEFAULT_MODEL


@dataclass
class Loaded:
    """A model ready to embed: its tokenizer, its runner, what it is and the plan it was loaded by."""

    tokenizer: Tokenizer
    runner: TorchRunner
    info: ModelInfo
    plan: ModelPlan
    load_seconds: float

    @property
    def memory(self) -> MemoryPlan:
        return self.plan.memory


def plan(
    config: ModelConfig,
    memory: MemoryBudget | None = None,
    shared: SharedMemory | None = None,
    native: NativeConfig | None = None,
) -> ModelPlan:
    """Decide everything about loading `config.model` and check it fits (beside the `shared` neighbours of a
    server running several models, with the `native` kernels allowed), reading no weight."""
    path = resolve_model(config.model, config.revision, config.download_dir)
    hf_config = {**read_config(path), **(config.hf_overrides or {})}
    st = read_st_modules(path)
    arch, cls = model_class(hf_config, st)
    hf_config = cls.standard_config(hf_config)
    pooling = cls.head_pooling(st, config.pooler)
    dtype = torch_dtype(config.dtype)
    with torch.device("meta"):
        shape = cls.from_config(hf_config)  # weightless: sizes, positions and the int8 layers' count
    max_model_len = _max_model_len(shape.max_positions, st.max_seq_length, config.max_model_len)
    size = dtype.itemsize
    weights = parameter_count(path) * size
    # with int8 the quantised matrices take one byte, the rest the compute dtype
    q8 = sum(int(m.weight.numel()) for m in int8_targets(shape, cls.int8_layers).values())
    int8_weights = weights - q8 * (size - 1)
    if config.quantization == "int8":
        weights = int8_weights
    native = native or NativeConfig()
    strips = strip_f32() and may_build("linear_f32", native)
    pairs = not config.quantization and takes_pairs(dtype, shape) and may_build("linear_bf16", native)  # int8: few left
    holds = _holds_bf16(dtype, config, native, strips)
    if holds and checkpoint_matrices_bf16(path):  # the held matrices take two bytes, not four
        weights -= 2 * sum(int(m.weight.numel()) for m in holdable(shape, strips).values())
    intermediate = hf_config.get("intermediate_size", 4 * shape.hidden_size)
    answer_width, head_bytes = cls.head_memory(hf_config)
    memory_plan = plan_memory(
        memory or memory_budget(),
        weights_bytes=weights,
        per_token_bytes=activation_bytes_per_token(hf_config, size),
        fixed_bytes=TOKEN_SLICE * size * 3 * intermediate + head_bytes,
        max_model_len=max_model_len,
        batch_tokens=config.max_batch_tokens,
        queued_tokens=config.max_queued_tokens,
        limit_override=config.memory_limit,
        dtype_bytes=size,
        dimension=answer_width,
        int8_weights_bytes=None if config.quantization else int8_weights,
        shared=shared,
    )
    return ModelPlan(
        config, path, hf_config, arch, cls, st, pooling, dtype, max_model_len, memory_plan, strips, pairs, holds
    )


def plan_models(
    configs: list[ModelConfig], memory: MemoryBudget | None = None, native: NativeConfig | None = None
) -> list[ModelPlan]:
    """One memory plan over the models one server runs (with the `native` kernels allowed): each fits beside the
    others' weights, the largest batch of any (one runs at a time) and an equal share of the queue memory; a refusal
    names the model."""
    memory = memory or memory_budget()
    alone = [_named(c, memory, native=native) for c in configs]
    if len(alone) == 1:
        return alone
    held = [p.memory.weights_bytes + p.memory.fixed_bytes for p in alone]
    batch = max(max(p.memory.max_batch_tokens, p.max_model_len) * p.memory.per_token_bytes for p in alone)
    share = 1 / len(configs)
    others = [SharedMemory(sum(held) - held[i], batch, share) for i in range(len(configs))]
    return [_named(c, memory, others[i], native) for i, c in enumerate(configs)]


def _named(
    config: ModelConfig, memory: MemoryBudget, shared: SharedMemory | None = None, native: NativeConfig | None = None
) -> ModelPlan:
    """plan(), its refusal naming the model."""
    try:
        return plan(config, memory, shared, native)
    except ConfigError as e:
        raise ConfigError(f"model {config.served_name or config.model or DEFAULT_MODEL}: {e}") from None


def _quantize(
    net: Architecture,
    p: ModelPlan,
    tokenizer: Tokenizer,
    calibration: str | None,
    native: NativeConfig,
    from_bf16: bool = False,
) -> None:
    """The model's int8 layers, rounded against the calibration text (GPTQ) unless it is `none`: the first time
    for a model and text by a float forward over it, then from the cache. `from_bf16`: the float32 model's matrices
    are still the checkpoint's bf16 (_int8_from_checkpoint), widened by that forward as it goes."""
    texts = calibration_texts(calibration)
    if texts is None:
        quantize_int8(net, p.dtype, p.cls.int8_layers, p.cls.swiglu_layers)
        return
    cache = Int8Cache(cache_dir(native), p.path, p.dtype, texts)
    start, hit = time.perf_counter(), cache.complete
    run = None
    if not hit:
        run, tokens = calibration_forward(net, tokenizer, texts, p.max_model_len, widen=from_bf16)
        log.info(
            "int8: rounding the weights against %d tokens of calibration text (GPTQ), once: cached in %s",
            tokens,
            cache.dir,
        )
    quantize_int8(
        net,
        p.dtype,
        p.cls.int8_layers,
        p.cls.swiglu_layers,
        calibrate=run,
        known=cache.known,
        keep=cache.keep,
    )
    cache.finish()
    how = "read from the cache" if hit and cache.complete else "calibrated"
    log.info("int8 weights %s in %.1fs", how, time.perf_counter() - start)


def _say_int8_path(native: NativeConfig) -> None:
    """On CPUs without int8 matrix instructions, which way the int8 layers multiply (docs/performance.md)."""
    if int_mm_fast():
        return
    if may_build("linear_f32", native):
        log.info(
            "--quantization int8: this CPU has no int8 matrix instructions (VNNI or AMX), so int8 layers multiply "
            "their int8 values in float32, on ember's float32 product: a quarter of float32's weight memory at "
            "about its speed (docs/performance.md)"
        )
    else:
        log.warning(
            "--quantization int8: this CPU has no int8 matrix instructions (VNNI or AMX), and ember's float32 "
            "product cannot be built here, so int8 layers convert their weights to float32 on every call: the "
            "weights take one byte, but --dtype float32 is several times faster (docs/performance.md)"
        )


def _max_model_len(positions: int, st_max: int | None, asked: int | None) -> int:
    if asked is not None:
        if asked > positions:
            raise ConfigError(f"--max-model-len {asked} is greater than the model's {positions} position embeddings")
        return asked
    return min(positions, st_max) if st_max else positions


def load(
    config: ModelConfig,
    native: NativeConfig | None = None,
    memory: MemoryBudget | None = None,
    *,
    planned: ModelPlan | None = None,
) -> Loaded:
    """Load `config.model` (local directory, hub id, or None for the bundled default), by `planned` when it was
    planned already (plan_models)."""
    start = time.perf_counter()
    native = native or NativeConfig()
    p = planned or plan(config, memory, native=native)
    score = p.cls.task == "score"
    # decoders pooled on the last token end each input with EOS; a reranker's prompt ends as it is
    tokenizer = Tokenizer.from_dir(p.path, p.hf_config, ensure_eos=p.pooling.method == "LAST" and not score)
    p = replace(p, hf_config=p.cls.with_tokenizer(p.hf_config, tokenizer))
    direct = _int8_from_checkpoint(config, p)
    net = _load_weights(p, keep_bf16=p.holds_bf16 or direct, strips=p.strips, hold=not direct)
    release_mapped_pages(p.path)  # the pages of tensors the model copied (cast, merged) are dead
    if config.quantization == "int8":
        _quantize(net, p, tokenizer, config.calibration, native, from_bf16=direct)
        if direct:
            widen_bf16(net)  # what was not quantised
        _say_int8_path(native)
    if pack_linears(net, p.dtype, p.strips, p.pairs, p.cls.swiglu_layers) or config.quantization:
        release_mapped_pages(p.path)  # and those of the matrices packed or made int8
    head = net.head(HeadContext(p.hf_config, p.path, p.st, p.pooling))
    dims = p.hf_config.get("matryoshka_dimensions")
    info = ModelInfo(
        name=p.name,
        architecture=p.architecture,
        dimension=head.dimension,
        max_model_len=p.max_model_len,
        dtype=str(p.dtype).removeprefix("torch.") + (" (int8 weights)" if config.quantization else ""),
        pooling=p.pooling,
        is_matryoshka=bool(p.hf_config.get("is_matryoshka") or dims),
        matryoshka_dimensions=tuple(dims) if dims else None,
        prompts=p.st.prompts,
        default_prompt_name=p.st.default_prompt_name,
        vocab_size=tokenizer.vocab_size,
        head=head.spec,
    )
    seconds = time.perf_counter() - start
    log.info(
        "loaded %s (%s, %s, pooling %s%s from %s, max_model_len %d) in %.1fs",
        info.name,
        p.architecture,
        info.dtype,
        p.pooling.method,
        " + normalize" if p.pooling.normalize else "",
        p.pooling.source,
        info.max_model_len,
        seconds,
    )
    log.info("%s", p.memory.describe())
    return Loaded(tokenizer, TorchRunner(net, head, info, native), info, p, seconds)


def _holds_bf16(dtype: torch.dtype, config: ModelConfig, native: NativeConfig, strips: bool) -> bool:
    """float32 on a checkpoint's bf16 matrices: kept bf16 where ember's bf16-weight product will run (half the
    memory, and faster on small batches), or ember's float32 product on bf16 strips (`strips`: half the memory, as
    fast from 15 rows up, twice at one row); the layers go back to float32 if their kernel does not load
    (TorchRunner.load_kernels)."""
    held = (strips and native.enabled("linear")) or may_build("linear", native)  # EMBER_NATIVE_LINEAR=0: neither
    return dtype == torch.float32 and not config.quantization and held


def _int8_from_checkpoint(config: ModelConfig, p: ModelPlan) -> bool:
    """Whether a float32 model's int8 layers are quantised straight from its checkpoint's bf16 matrices, without
    widening the model to float32 first (start-up then peaks near the int8 model's size, not float32's; a
    calibrating forward widens each matrix only as its layer runs: ember.engine.calibration)."""
    return config.quantization == "int8" and p.dtype == torch.float32


def _load_weights(p: ModelPlan, keep_bf16: bool = False, strips: bool = False, hold: bool = True) -> Architecture:
    """Build the model on the meta device, then assign each checkpoint tensor, cast once; with keep_bf16, bf16
    matrices stay bf16 (for ember.ops.linear.hold_bf16, on StripLinear with `strips`; without `hold`, as they are,
    for the caller to quantise and widen). (The model's load hooks may merge checkpoint tensors, e.g. q/k/v into one
    matrix.)"""
    with torch.device("meta"):
        net = p.cls.from_config(p.hf_config)
    expected = {k: v.shape for k, v in net.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(p.path, p.cls.checkpoint_rows(p.hf_config)):
        key = p.cls.checkpoint_key(name)
        if key is None:
            continue
        if key in expected and tensor.shape != expected[key]:
            raise CheckpointError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected[key])}"
            )
        keep = keep_bf16 and tensor.dtype == torch.bfloat16 and tensor.dim() == 2
        state[key] = tensor if keep else tensor.to(p.dtype)
    name = p.cls.__name__
    try:
        result = net.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shapes that disagree after the model's hooks merged tensors
        raise CheckpointError(f"weights in {p.path} do not match {name}: {e}") from None
    missing, unexpected = sorted(result.missing_keys), sorted(result.unexpected_keys)
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {p.path} do not match {name}: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    held = hold_bf16(net, strips) if keep_bf16 and hold else 0
    if held:
        log.info("float32 compute; %d linear layers hold their bf16 checkpoint weights", held)
    return net.eval().requires_grad_(False)


def build_engines(models: list[tuple[Loaded, EngineConfig]], *, tokenizer_threads: int = 1) -> list[AsyncEngine]:
    """The engines of a server's models: several share one model thread (its OpenMP pool is the only compute pool)
    and take turns on it by earliest deadline (ember.engine.turns)."""
    if len(models) == 1:
        loaded, config = models[0]
        return [build_engine(loaded, config, tokenizer_threads=tokenizer_threads)]
    thread, turns = ThreadPoolExecutor(1, thread_name_prefix="ember-model"), Turns()
    return [
        build_engine(loaded, config, tokenizer_threads=tokenizer_threads, model_thread=thread, turns=turns)
        for loaded, config in models
    ]


def build_engine(
    loaded: Loaded,
    config: EngineConfig | None = None,
    *,
    tokenizer_threads: int = 1,
    model_thread: ThreadPoolExecutor | None = None,
    turns: Turns | None = None,
) -> AsyncEngine:
    """The async engine over a loaded model, its batch and queue budgets those the memory plan allows (it warms
    the model up on its own thread when started)."""
    config = config or EngineConfig()
    answers, cache_bytes = loaded.memory.max_queued_vectors, config.cache_bytes
    if answers is not None and cache_bytes:  # the cache is memory the answers' budget gives up
        vector = max(1, loaded.info.dimension * OUTPUT_VALUE_BYTES)
        cache_bytes = min(cache_bytes, answers * vector // 4)
        answers -= cache_bytes // vector
    config = replace(
        config,
        max_num_batched_tokens=loaded.memory.max_batch_tokens,
        max_queued_tokens=loaded.memory.max_queued_tokens,
        max_queued_vectors=answers,
        cache_bytes=cache_bytes,
    )
    pooler = loaded.plan.config.pooler
    return AsyncEngine(
        loaded.runner,
        loaded.tokenizer,
        config,
        pooler,
        tokenizer_threads=tokenizer_threads,
        model_thread=model_thread,
        turns=turns,
    )
