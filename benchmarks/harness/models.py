"""The models benchmarks run: the Qwen3-Embedding-0.6B shape with random weights (built once), the tests' tiny
checkpoint builders, and the allocator `ember serve` runs on."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from harness.results import ROOT

__all__ = ["QWEN_DIR", "checkpoints", "ensure_qwen3_model", "use_server_allocator"]

QWEN_DIR = ROOT / "models" / "qwen3-emb-0.6b-random"


def ensure_qwen3_model(path: Path = QWEN_DIR) -> Path:
    """The Qwen3-Embedding-0.6B-shaped model with random weights, built by harness.qwen3_model if missing."""
    if not (path / "model.safetensors").exists():
        from harness.qwen3_model import main

        main(["--out", str(path)])
    return path


def checkpoints() -> ModuleType:
    """tests/checkpoints (its builders write real checkpoints of a given shape): the one place benchmarks reach into
    tests/. Loaded from its file as the package `checkpoints` (so `checkpoints.families` imports after it), without
    adding tests/ to the import path."""
    if "checkpoints" in sys.modules:
        return sys.modules["checkpoints"]
    package = ROOT / "tests" / "checkpoints"
    spec = importlib.util.spec_from_file_location(
        "checkpoints", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["checkpoints"] = module
    spec.loader.exec_module(module)
    return module


def use_server_allocator(script: str) -> None:
    """Re-run this script under the allocator `ember serve` preloads (tcmalloc), so in-process figures are on it."""
    from ember.cli.runtime import maybe_reexec_with_allocator

    maybe_reexec_with_allocator(sys.argv[1:], program=[sys.executable, script])
