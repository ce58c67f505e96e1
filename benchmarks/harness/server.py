"""Starting, stopping and pausing servers under test: ember (or a peer) in its own process group, ready when its
/health answers, settled when /info shows no kernel still building."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from harness.memory import tree_pids

__all__ = ["ember_command", "frozen", "launch", "settled", "stop"]


def ember_command(model: str | None, port: int, *extra: str) -> list[str]:
    """`ember serve` on 127.0.0.1:`port` with this interpreter (so the installed ember is the one measured)."""
    model_args = [model] if model else []
    cmd = [sys.executable, "-m", "ember.cli.main", "serve", *model_args, "--host", "127.0.0.1", "--port", str(port)]
    return [*cmd, *extra]


def launch(
    cmd: list[str] | str, url: str, log_path: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], float]:
    """Start a server (in its own process group) and wait for its /health: (process, seconds to ready)."""
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            shell=isinstance(cmd, str),
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - start
        except httpx.HTTPError:
            time.sleep(0.1)


def settled(url: str, timeout: float = 600.0) -> None:
    """Wait until an ember server has no kernel still building (/info), so its steady state is what is measured."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = httpx.get(f"{url}/info", timeout=5).json()
        kernels = [k for m in info.get("models", [info]) for k in m.get("kernels", {}).values()]
        if kernels and not any("building" in k["detail"] for k in kernels):
            return
        time.sleep(0.5)
    raise SystemExit(f"{url}: kernels still building after {timeout:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL after 60 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def frozen(pid: int | None) -> Iterator[None]:
    """SIGSTOP a server's whole process tree for the block (None: do nothing): an idle neighbour's background
    threads otherwise take CPU from the server being measured."""
    pids = tree_pids(pid) if pid else []
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in pids:
            os.kill(p, signal.SIGCONT)
