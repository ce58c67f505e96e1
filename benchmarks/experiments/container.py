"""ember inside a container's limits: auto threads under a 1-CPU quota, and peak RSS for 8k-token documents.

    PYTHONPATH=benchmarks python benchmarks/experiments/container.py
    # needs root and cgroup v1 (as on the CI machines); prints a table

1. A cgroup with a 1-CPU quota on this 2-CPU machine: `ember serve` with auto threads (it sees the quota and runs 1)
   against `--threads 2` (threads = all visible CPUs, what torch picks by itself), same workload, tokens/s ratio.
2. A memory cgroup: the Qwen3-0.6B-shaped model in bf16 serving 8,000-token documents, peak RSS against the budget.
Never run beside tests or another benchmark.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
from harness import QWEN_DIR, peak_rss

from ember.cli.bench import WORKLOADS, run_workload

ROOT = Path(__file__).resolve().parents[2]

PORT = 18321


def cgroup(controller: str, settings: dict[str, str]) -> Path:
    path = Path("/sys/fs/cgroup") / controller / f"ember-bench-{os.getpid()}"
    path.mkdir(exist_ok=True)
    for name, value in settings.items():
        (path / name).write_text(value)
    return path


def serve_in(group: Path, args: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ember.cli.main", "serve", str(QWEN_DIR), "--port", str(PORT), *args]
    log = open(ROOT / "benchmarks/results/container-server.log", "ab")  # noqa: SIM115 (lives as long as the server)
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=log, preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid()))
    )
    while True:
        if proc.poll() is not None:
            raise SystemExit("ember serve exited; see benchmarks/results/container-server.log")
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)


def measure(group: Path, args: list[str], workload: str, count: int) -> tuple[float, int]:
    proc = serve_in(group, ["--dtype", "bfloat16", *args])
    try:
        w = WORKLOADS[workload]
        w = replace(w, lengths=w.lengths[:count])
        result = asyncio.run(run_workload(f"http://127.0.0.1:{PORT}", str(QWEN_DIR), w))
        return result.tokens_per_s, peak_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    cpu = cgroup("cpu", {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"})
    try:
        auto, _ = measure(cpu, [], "bulk", 16)
        forced, _ = measure(cpu, ["--threads", "2"], "bulk", 16)
    finally:
        cpu.rmdir()
    limit = 3 * 2**30
    mem = cgroup("memory", {"memory.limit_in_bytes": str(limit)})
    try:
        long_tps, rss = measure(mem, ["--max-model-len", "8192"], "long", 1)
        oom = "oom_kill 0" not in (mem / "memory.oom_control").read_text()
    finally:
        mem.rmdir()
    print("1-CPU quota on 2 CPUs, 16 x 512-token docs (bulk):")
    print(f"  auto threads (1):  {auto:7.1f} tok/s")
    print(f"  --threads 2:       {forced:7.1f} tok/s   auto / forced = {auto / forced:.2f}")
    print(
        f"memory cgroup {limit / 2**30:.0f} GiB, one 8,000-token document: {long_tps:.1f} tok/s, "
        f"server peak RSS {rss / 2**30:.2f} GiB, OOM kill: {oom}"
    )


if __name__ == "__main__":
    main()
