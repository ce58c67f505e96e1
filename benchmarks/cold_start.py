"""Cold start of the container image: time to ready and time to full speed, for the three ways a pod can start.

- baked: the production image (deploy/docker/Dockerfile): kernels prebuilt in the image, no compiler;
- compiler: the Dockerfile's build stage (`--target build`: g++ present) with an empty kernel cache, as a pod with
  a compiler and no baked cache starts: it serves at once and builds the kernels and fused regions beside serving;
- none: the production image with its kernel cache hidden (EMBER_CACHE_DIR pointed elsewhere): no compiler, no
  kernels, torch's ops only.

Each variant (the model's files read once before, so all start from the page cache): `podman run` (or docker) with
the model mounted read-only, 2 CPUs, a read-only root and a /tmp tmpfs;
time to `/health` 200, time until `/info` shows every kernel that will become active, then the median latency of a
request of 16 texts of ~256 tokens. Never run beside tests or another benchmark.

    podman build --format docker -f deploy/docker/Dockerfile -t ember:latest .
    podman build --format docker -f deploy/docker/Dockerfile --target build -t ember:build .
    python benchmarks/cold_start.py --image ember:latest --build-image ember:build \\
        --model models/qwen3-emb-0.6b-random --engine podman [--engine-args "--runtime runc"]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from ember.cli.bench import make_texts

PORT = 8011


def run_variant(name: str, image: str, env: dict[str, str], args: argparse.Namespace) -> dict[str, object]:
    container = f"ember-cold-{name}"
    subprocess.run([args.engine, "rm", "-f", container], capture_output=True)
    cmd = [args.engine, "run", "-d", "--name", container, *shlex.split(args.engine_args), "--cpus", "2",
           "--read-only", "--tmpfs", "/tmp", "--user", "10001", "-p", f"{PORT}:8000",
           "-v", f"{Path(args.model).resolve()}:/models/m:ro", "--entrypoint", "ember"]  # fmt: skip
    for key, value in env.items():
        cmd += ["-e", f"{key}={value}"]
    cmd += [image, "serve", "/models/m", "--host", "0.0.0.0", "--port", "8000", "--dtype", args.dtype]
    start = time.monotonic()
    subprocess.run(cmd, check=True, capture_output=True)
    base = f"http://127.0.0.1:{PORT}"
    try:
        ready = _wait(lambda: httpx.get(base + "/health", timeout=1).status_code == 200, start, 300)
        settled = _wait(lambda: _settled(httpx.get(base + "/info", timeout=5).json()), start, 600)
        kernels = httpx.get(base + "/info", timeout=5).json().get("kernels", {})
        texts = make_texts((256,) * 16, seed=3)
        latencies = []
        for _ in range(args.requests):
            t0 = time.monotonic()
            r = httpx.post(base + "/v1/embeddings", json={"input": texts}, timeout=300)
            r.raise_for_status()
            latencies.append(time.monotonic() - t0)
        return {"variant": name, "ready_s": round(ready, 1), "full_speed_s": round(settled, 1),
                "request_s": round(statistics.median(latencies), 2),
                "kernels": {k: v.get("detail") for k, v in kernels.items()}}  # fmt: skip
    finally:
        subprocess.run([args.engine, "rm", "-f", container], capture_output=True)


def _settled(info: dict) -> bool:
    """No kernel is still being built (a build in the background says so in its detail)."""
    return not any("building" in str(k.get("detail", "")) for k in info.get("kernels", {}).values())


def _wait(check, start: float, limit: float) -> float:
    while time.monotonic() - start < limit:
        try:
            if check():
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"not reached in {limit} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", required=True)
    ap.add_argument("--build-image", required=True, help="the Dockerfile's build stage (has g++)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine", default="podman")
    ap.add_argument("--engine-args", default="")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    variants = [
        ("baked", args.image, {}),
        ("compiler", args.build_image, {"EMBER_CACHE_DIR": "/tmp/ember-cache", "PATH": "/opt/venv/bin:/usr/bin:/bin"}),
        ("none", args.image, {"EMBER_CACHE_DIR": "/tmp/no-kernels"}),
    ]
    for file in Path(args.model).rglob("*"):  # the weights in the page cache, as on a node that has the model
        if file.is_file():
            file.read_bytes()
    rows = []
    for name, image, env in variants:
        row = run_variant(name, image, env, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'variant':<10}{'ready s':>9}{'full speed s':>14}{'request s':>11}")
    for r in rows:
        print(f"{r['variant']:<10}{r['ready_s']:>9}{r['full_speed_s']:>14}{r['request_s']:>11}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
