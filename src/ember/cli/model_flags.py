"""The model flags, declared once for `ember serve`, `ember doctor` and `ember embed` (and for each entry of
`ember serve --models FILE`): what to load and how, vLLM's names, defaults and help from ember.config.ModelConfig.

`model_config` builds the ModelConfig from parsed flags or from a mapping whose keys are the flags with
underscores (`max_model_len`, `hf_overrides` ...), so every command plans a model the same way.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from ember.cli.fields import add_field_flag
from ember.cli.runtime import parse_bytes
from ember.config import EngineConfig, ModelConfig, PoolerConfig, check_dtype, parse_json_object
from ember.errors import ConfigError

__all__ = [
    "MODEL_KEYS",
    "add_model_flags",
    "add_models_flag",
    "add_process_flags",
    "model_config",
    "model_configs",
    "parse_size",
    "read_models_file",
    "truncate",
]

MODEL_KEYS = (
    "model",
    "served_model_name",
    "revision",
    "download_dir",
    "dtype",
    "quantization",
    "quantization_calibration",
    "max_model_len",
    "hf_overrides",
    "pooler_config",
    "override_pooler_config",
    "max_num_batched_tokens",
    "max_queued_tokens",
    "memory_limit",
    "truncate",
)
"""Every model flag's name with underscores: the keys an entry of --models may have."""


def parse_size(value: str | int) -> int:
    """A count with vLLM's suffixes: k/m/g are powers of 1000, K/M/G powers of 1024 (`8k` = 8000, `8K` = 8192)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a count (e.g. 8192, 8k, 8K)") from None


def add_model_flags(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """The model flags; with `positional`, the model may also come first, as in `vllm serve MODEL`."""
    if positional:
        p.add_argument("model_tag", nargs="?", default=None, help="model: local directory or hub id")
    add_field_flag(p, "--model", ModelConfig, "model", shown="the bundled all-MiniLM-L6-v2")
    add_field_flag(
        p, "--served-model-name", ModelConfig, "served_name", nargs="+", shown="the model", dest="served_model_name"
    )
    add_field_flag(p, "--revision", ModelConfig, "revision", shown="main")
    add_field_flag(p, "--download-dir", ModelConfig, "download_dir", shown="the Hugging Face cache")
    add_field_flag(p, "--dtype", ModelConfig, "dtype")
    add_field_flag(p, ("--quantization", "-q"), ModelConfig, "quantization", choices=["int8"])
    add_field_flag(
        p, "--quantization-calibration", ModelConfig, "calibration", metavar="FILE", shown="ember's bundled sentences"
    )
    add_field_flag(p, "--max-model-len", ModelConfig, "max_model_len", type=parse_size, shown="the model's")
    add_field_flag(p, "--hf-overrides", ModelConfig, "hf_overrides", shown="none")
    add_field_flag(p, "--pooler-config", ModelConfig, "pooler", shown="from the checkpoint", dest="pooler_config")
    p.add_argument("--override-pooler-config", default=None, help="older name of --pooler-config")
    add_field_flag(p, "--max-num-batched-tokens", ModelConfig, "max_batch_tokens", type=parse_size)
    add_field_flag(p, "--max-queued-tokens", ModelConfig, "max_queued_tokens", type=parse_size)
    add_field_flag(p, "--memory-limit", ModelConfig, "memory_limit", shown="detected")
    add_field_flag(p, "--truncate", EngineConfig, "auto_truncate", action="store_true", default=False)


def add_process_flags(p: argparse.ArgumentParser) -> None:
    """How the process runs the model: threads, their binding, compiled regions, log level. serve, doctor and embed
    take the same ones."""
    threads = "compute threads (default: EMBER_THREADS, OMP_NUM_THREADS, else usable CPUs)"
    p.add_argument("--threads", type=int, default=None, help=threads)
    p.add_argument("--cpu-bind", default=None, help="auto, nobind or a CPU list like 0-3 (VLLM_CPU_OMP_THREADS_BIND)")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never torch.compile the fused elementwise regions (by default they are built in the background after "
        "start-up); ember's native kernels are governed by EMBER_NATIVE_* instead",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def add_models_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models",
        default=None,
        metavar="FILE",
        help="more models to serve beside the first (the positional one or the default): a YAML list, one mapping per "
        "model with the model flags' names in underscores (model, served_model_name, dtype, quantization, "
        "max_model_len, pooler_config, hf_overrides, revision, truncate ...)",
    )


def model_configs(args: argparse.Namespace) -> list[tuple[ModelConfig, bool, tuple[str, ...]]]:
    """Every model a command line asks for, in order: the flags' model, then --models' entries; each with whether
    it truncates and the extra names it is served under."""
    entries: list[argparse.Namespace | Mapping[str, Any]] = [args]
    # the memory is the server's: an entry without its own limit plans for the command line's
    entries += [
        {"memory_limit": args.memory_limit, **e} for e in (read_models_file(args.models) if args.models else [])
    ]
    out = []
    for i, entry in enumerate(entries):
        v = vars(entry) if isinstance(entry, argparse.Namespace) else entry
        try:
            out.append((model_config(entry), truncate(entry), tuple(_names(v)[1:])))
        except ConfigError as e:
            raise ConfigError(f"--models {args.models}, entry {i}: {e}" if i else str(e)) from None
    return out


def model_config(values: argparse.Namespace | Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig the model flags ask for (None or absent: the field's default). Values may be the flags' text
    or already typed (a YAML entry's numbers, mappings and lists)."""
    v = vars(values) if isinstance(values, argparse.Namespace) else dict(values)
    dtype = str(v.get("dtype") or ModelConfig.dtype)
    quantization: Literal["int8"] | None = None
    if v.get("quantization") or dtype == "int8":
        if (v.get("quantization") or "int8") != "int8":
            raise ConfigError(f"--quantization {v['quantization']!r} is not supported; ember offers int8")
        quantization = "int8"
    names = _names(v)
    defaults = ModelConfig()
    try:
        sizes = {
            key: parse_size(v[key])
            for key in ("max_model_len", "max_num_batched_tokens", "max_queued_tokens")
            if v.get(key) is not None
        }
    except argparse.ArgumentTypeError as e:
        raise ConfigError(str(e)) from None
    memory = v.get("memory_limit")
    return ModelConfig(
        v.get("model") or v.get("model_tag"),
        served_name=names[0] if names else None,
        revision=v.get("revision"),
        download_dir=v.get("download_dir"),
        dtype=check_dtype(ModelConfig.dtype if dtype == "int8" else dtype),
        quantization=quantization,
        calibration=v.get("quantization_calibration"),
        max_model_len=sizes.get("max_model_len"),
        hf_overrides=_mapping(v.get("hf_overrides"), "--hf-overrides"),
        pooler=PoolerConfig.parse(v.get("pooler_config") or v.get("override_pooler_config")),
        max_batch_tokens=sizes.get("max_num_batched_tokens", defaults.max_batch_tokens),
        max_queued_tokens=sizes.get("max_queued_tokens", defaults.max_queued_tokens),
        memory_limit=None if memory is None else memory if isinstance(memory, int) else parse_bytes(str(memory)),
    )


def truncate(values: argparse.Namespace | Mapping[str, Any]) -> bool:
    """--truncate: over-long inputs cut to max-model-len instead of refused (a YAML entry's true or false)."""
    v = vars(values) if isinstance(values, argparse.Namespace) else values
    value = v.get("truncate")
    if not isinstance(value, bool | None):
        raise ConfigError(f"truncate must be true or false, got {value!r}")
    return bool(value)


def _names(v: Mapping[str, Any]) -> list[str]:
    """served_model_name: a name or a list of names."""
    names = v.get("served_model_name")
    names = [names] if isinstance(names, str) else names
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) and n for n in names)):
        raise ConfigError(f"served_model_name must be a name or a list of names, got {v.get('served_model_name')!r}")
    return list(names or [])


def _mapping(raw: str | Mapping[str, Any] | None, flag: str) -> dict[str, Any] | None:
    if raw is None or raw == "":
        return None
    if isinstance(raw, Mapping):
        return dict(raw)
    return parse_json_object(str(raw), flag)


def read_models_file(path: str) -> list[dict[str, Any]]:
    """`--models FILE`: a YAML list, one mapping per model, whose keys are the model flags with underscores
    (`model` required); each is checked here, so a typo stops the start naming the entry and the key."""
    try:
        entries = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--models {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--models {path} is not valid YAML: {e}") from None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"--models {path} must be a YAML list with one entry per model, e.g. - model: BAAI/bge-m3")
    for i, entry in enumerate(entries, 1):
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise ConfigError(f"--models {path}, entry {i}: a mapping with `model` (a local directory or hub id)")
        unknown = sorted(set(entry) - set(MODEL_KEYS))
        if unknown:
            raise ConfigError(f"--models {path}, entry {i}: unknown key(s) {unknown}; known: {', '.join(MODEL_KEYS)}")
    return entries
