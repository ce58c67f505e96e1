"""Starting `ember serve` as a real subprocess for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def closed_by_server(s: socket.socket, within: float) -> bool:
    """Whether the server closes `s` within `within` seconds (anything it sends first is read and dropped)."""
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self, args: list[str], log: Path, timeout: float = 90.0, preexec_fn=None, compile=False, env=None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        cmd = [sys.executable, "-m", "ember.cli.main", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        if not compile:  # the background builds would only compete with the test for the CPUs
            cmd.append("--enforce-eager")
            for switch in (
                "EMBER_NATIVE_ATTENTION",
                "EMBER_NATIVE_INT8",
                "EMBER_NATIVE_ELEMENTWISE",
                "EMBER_NATIVE_LINEAR",
                "EMBER_NATIVE_LINEAR_F32",
                "EMBER_NATIVE_LINEAR_BF16",
            ):
                env.setdefault(switch, "0")
        self.log = log
        self.proc = subprocess.Popen(
            cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, preexec_fn=preexec_fn
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ember serve exited with {self.proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ember serve did not become healthy:\n{log.read_text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def litellm_proxy_command() -> list[str]:
    """`litellm` with the proxy extras: $EMBER_TEST_LITELLM_PROXY (a separate virtualenv's bin/litellm, as .ci/run
    makes, since litellm[proxy]'s pins would hold back this environment's fastapi and uvicorn), or this env's; the
    calling test is skipped when there is neither."""
    import importlib.util
    import os
    import sys

    import pytest

    if os.environ.get("EMBER_TEST_LITELLM_PROXY"):
        return [os.environ["EMBER_TEST_LITELLM_PROXY"]]
    if importlib.util.find_spec("apscheduler") is None or importlib.util.find_spec("litellm") is None:
        pytest.skip("litellm[proxy] is not installed (or set EMBER_TEST_LITELLM_PROXY to a litellm executable)")
    return [sys.executable, "-m", "litellm.proxy.proxy_cli"]


@contextlib.contextmanager
def litellm_proxy(config: Path, env: dict[str, str], log: Path) -> Iterator[str]:
    """The LiteLLM proxy (litellm_proxy_command) on `config` with `env`, its output in `log`: yields its base URL once
    it is live, and stops it on exit."""
    port = free_port()
    cmd = [*litellm_proxy_command(), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **env}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(base + "/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
