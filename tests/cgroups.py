"""Real cgroup v1 groups for tests that run a child process under a CPU quota or memory limit."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def real_v1_cgroup(controller: str, settings: dict[str, str]) -> Iterator[Path]:
    """A fresh v1 cgroup under this machine's `controller` mount; skips where one cannot be made."""
    base = Path("/sys/fs/cgroup")
    if os.geteuid() != 0:
        pytest.skip("creating a cgroup needs root")
    if (base / "cgroup.controllers").is_file():
        pytest.skip("cgroup v2 (unified) host: this test creates v1 cgroups; v2 needs a delegated subtree")
    mount = next((base / name for name in (controller, f"{controller},cpuacct") if (base / name).is_dir()), None)
    if mount is None:
        pytest.skip(f"no cgroup v1 {controller} hierarchy under {base}")
    path = mount / f"ember-test-{os.getpid()}"
    try:
        path.mkdir()
    except OSError as error:
        pytest.skip(f"cannot create {path}: {error}")
    try:
        for name, value in settings.items():
            try:
                (path / name).write_text(value)
            except OSError as error:
                pytest.skip(f"cannot write {path / name}: {error}")
        yield path
    finally:
        path.rmdir()


def run_in_cgroup(cgroup: Path, code: str) -> str:
    """Run `python -c code` with the child joined to `cgroup` before it execs."""

    def join() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    result = subprocess.run([sys.executable, "-c", code], preexec_fn=join, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def join_cgroup(cgroup: Path):
    """A preexec_fn that moves the child into `cgroup` before it execs."""

    def join() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    return join
