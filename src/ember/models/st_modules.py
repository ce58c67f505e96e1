"""Reading a sentence-transformers model directory: modules, pooling, prompts, max length.

Also decides the pooling a model runs with: an explicit override, else the
sentence-transformers Pooling module, else the architecture's usual default.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.config import PoolerConfig
from ember.errors import CheckpointError, UnsupportedModelError
from ember.types import PoolingSpec, PoolingType

__all__ = ["STModules", "read_st_modules", "resolve_pooling"]

log = logging.getLogger(__name__)

_MODES: dict[str, PoolingType] = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class STModules:
    """What the sentence-transformers files of a checkpoint say."""

    pooling: PoolingType | None = None
    normalize: bool = False
    dense_dirs: tuple[Path, ...] = ()
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    present: bool = False
    pooling_error: str | None = None
    """Why the Pooling module cannot run as written (max, weightedmean, ...); an override can replace it."""
    splade_strategy: str | None = None
    """A SparseEncoder's SpladePooling: max or sum over the tokens (pooling is then SPLADE)."""


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {file}: {e}") from None


def read_st_modules(path: Path) -> STModules:
    """Parse modules.json and friends; an empty STModules when there are none."""
    extras = _read_extras(path)
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return STModules(**extras)
    pooling: PoolingType | None = None
    pooling_error = None
    normalize = False
    dense: list[Path] = []
    splade = None
    for module in _read_json(modules_file):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        where = path / module.get("path", "")
        if kind in ("Transformer", "MLMTransformer"):
            continue
        if kind == "SpladePooling":
            pooling, splade = "SPLADE", _splade_strategy(where / "config.json")
        elif kind == "Pooling":
            try:
                pooling = _pooling_mode(where / "config.json")
            except UnsupportedModelError as e:
                pooling_error = str(e)
        elif kind == "Normalize":
            normalize = True
        elif kind == "Dense":
            dense.append(where)
        else:
            raise UnsupportedModelError(
                f"{modules_file}: sentence-transformers module {module.get('type')!r} is not supported "
                "(ember runs Transformer, Pooling, Dense and Normalize, and MLMTransformer + SpladePooling)"
            )
    return STModules(
        pooling=pooling,
        normalize=normalize,
        dense_dirs=tuple(dense),
        present=True,
        pooling_error=pooling_error,
        splade_strategy=splade,
        **extras,
    )


def _splade_strategy(file: Path) -> str:
    cfg = _read_json(file) if file.is_file() else {}
    strategy, act = cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu")
    if strategy not in ("max", "sum") or act != "relu":
        raise UnsupportedModelError(
            f"{file}: SpladePooling with pooling_strategy {strategy!r} and activation_function {act!r} is not "
            "supported (max or sum, relu)"
        )
    return str(strategy)


def _pooling_mode(file: Path) -> PoolingType:
    cfg = _read_json(file)
    mode = cfg.get("pooling_mode")
    if mode is None:  # legacy boolean form; sentence-transformers defaults to mean when none is set
        active = [name for key, name in _LEGACY_KEYS.items() if cfg.get(key)]
        mode = active if len(active) != 1 else active[0]
        mode = mode or "mean"
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _MODES:
        raise UnsupportedModelError(
            f"{file}: pooling mode {mode!r} is not supported; ember supports cls, mean and lasttoken "
            '(override with --pooler-config \'{"pooling_type": "MEAN"}\' if you accept the difference)'
        )
    if cfg.get("include_prompt") is False:
        log.warning("%s: include_prompt=false is not honoured; prompt tokens are pooled too", file)
    return _MODES[mode]


def _read_extras(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    st_config = path / "config_sentence_transformers.json"
    if st_config.is_file():
        data = _read_json(st_config)
        out["prompts"] = {k: v for k, v in (data.get("prompts") or {}).items() if isinstance(v, str)}
        name = data.get("default_prompt_name")
        out["default_prompt_name"] = name if name in out["prompts"] else None
    bert_config = path / "sentence_bert_config.json"
    if bert_config.is_file():
        max_len = _read_json(bert_config).get("max_seq_length")
        out["max_seq_length"] = max_len if isinstance(max_len, int) and max_len > 0 else None
    return out


def resolve_pooling(st: STModules, override: PoolerConfig, is_decoder: bool) -> PoolingSpec:
    """The pooling to run: the override, else sentence-transformers, else the usual default."""
    if override.pooling_type is not None:
        normalize = override.normalize if override.normalize is not None else (st.normalize or not st.present)
        return PoolingSpec(override.pooling_type, normalize, "override")
    if st.pooling_error is not None:
        raise UnsupportedModelError(st.pooling_error)
    if st.pooling is not None:
        normalize = override.normalize if override.normalize is not None else st.normalize
        return PoolingSpec(st.pooling, normalize, "modules.json")
    method: PoolingType = "LAST" if is_decoder else "CLS"
    log.warning(
        "no sentence-transformers pooling config: using %s pooling with normalisation (set --pooler-config to choose)",
        method,
    )
    normalize = override.normalize if override.normalize is not None else True
    return PoolingSpec(method, normalize, "default")
