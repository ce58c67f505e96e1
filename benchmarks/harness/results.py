"""Where results go, and what every result file records beside its figures: the CPU, the commit, the command."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.machine import cpu_description

__all__ = ["RESULTS", "ROOT", "write_result"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def write_result(name: str, data: dict[str, Any]) -> Path:
    """benchmarks/results/<name>.json: `data` with the CPU, the commit and the command line that produced it."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    meta = {"cpu": cpu_description(), "commit": commit.stdout.strip(), "argv": sys.argv, "time": int(time.time())}
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps({**meta, **data}, indent=1))
    return out
