"""Overload soak: open-loop arrivals at a multiple of the server's measured capacity for a while, as a burst of
real traffic would come; what clients get and what the server does with its memory and its health probe.

    python benchmarks/soak.py                                   # the bundled MiniLM, 10x capacity for 120 s
    python benchmarks/soak.py --model models/qwen3-emb-0.6b-random --dtype bfloat16
    python benchmarks/soak.py --src /tmp/ember-old/src          # another checkout's code, for before/after

Each request carries 8 texts of ~60 words (new texts every request) and gives up after --client-timeout seconds,
as a client with a deadline does. Capacity is measured first (closed loop, 4 clients, 15 s); arrivals then follow a
Poisson process at --load x capacity for --seconds. Reported: counts of 200, 429, other 4xx, 5xx and client
timeouts; p50/p99 latency of the 200s; the `Retry-After` values seen; /health latency (p50, max; sampled every
0.5 s); the server's RSS idle before, at peak and 15 s after the load; and how many of the model's tokens went to
requests whose client had already given up (the model's batch tokens against the tokens of the 200s).
The load generator runs on the same machine: on 2 cores it competes with the server (say so beside the figures).
Results: benchmarks/results/soak-<model>.json (--tag appends to the name).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from harness import ROOT, cpu_name, launch, stop

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak tree near the "
         "river bank where children play and fishermen mend their nets before the evening storm").split()  # fmt: skip


def texts(rng: random.Random, n: int = 8, words: int = 60) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + f" {rng.random()}" for _ in range(n)]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def capacity(url: str, seconds: float, rng: random.Random) -> float:
    """Requests per second with 4 closed-loop clients."""
    done = 0
    end = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < end:
            r = await http.post(url + "/v1/embeddings", json={"input": texts(rng)}, timeout=120)
            done += r.status_code == 200

    start = time.monotonic()
    async with httpx.AsyncClient() as http:
        await asyncio.gather(*(client(http) for _ in range(4)))
    return done / (time.monotonic() - start)


async def soak(url: str, pid: int, rate: float, seconds: float, timeout: float, rng: random.Random) -> dict:
    outcomes: list[tuple[str, float, int]] = []  # (kind, seconds, usage tokens)
    retry_after: list[int] = []
    health: list[float] = []
    peak = 0
    stop_at = time.monotonic() + seconds

    async def one(http: httpx.AsyncClient) -> None:
        start = time.monotonic()
        try:
            r = await http.post(url + "/v1/embeddings", json={"input": texts(rng)}, timeout=timeout)
        except httpx.TimeoutException:
            outcomes.append(("timeout", time.monotonic() - start, 0))
            return
        except httpx.HTTPError:
            outcomes.append(("error", time.monotonic() - start, 0))
            return
        kind = "200" if r.status_code == 200 else "429" if r.status_code == 429 else f"{r.status_code // 100}xx"
        if r.status_code == 429 and r.headers.get("retry-after"):
            retry_after.append(int(r.headers["retry-after"]))
        tokens = r.json()["usage"]["prompt_tokens"] if r.status_code == 200 else 0
        outcomes.append((kind, time.monotonic() - start, tokens))

    async def probe(http: httpx.AsyncClient) -> None:
        nonlocal peak
        while time.monotonic() < stop_at + timeout:
            start = time.monotonic()
            try:
                await http.get(url + "/health", timeout=30)
                health.append(time.monotonic() - start)
            except httpx.HTTPError:
                health.append(30.0)
            peak = max(peak, rss(pid))
            await asyncio.sleep(0.5)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(limits=limits) as http, httpx.AsyncClient() as probes:
        prober = asyncio.create_task(probe(probes))
        tasks = []
        while time.monotonic() < stop_at:
            tasks.append(asyncio.create_task(one(http)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        prober.cancel()
    ok = sorted(s for kind, s, _ in outcomes if kind == "200")
    counts: dict[str, int] = {}
    for kind, _, _ in outcomes:
        counts[kind] = counts.get(kind, 0) + 1
    return {
        "requests": len(outcomes),
        "counts": counts,
        "ok_p50_s": round(statistics.median(ok), 3) if ok else None,
        "ok_p99_s": round(ok[int(0.99 * (len(ok) - 1))], 3) if ok else None,
        "retry_after_s": _spread(retry_after),
        "health_p50_s": round(statistics.median(health), 3),
        "health_max_s": round(max(health), 3),
        "peak_rss_mib": round(peak / 2**20),
        "answered_tokens": sum(t for _, _, t in outcomes),
    }


def _spread(values: list[int]) -> dict[str, float] | None:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local model directory (default: the bundled MiniLM)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load", type=float, default=10.0, help="arrival rate as a multiple of the capacity")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--client-timeout", type=float, default=30.0)
    ap.add_argument("--src", default=None, help="run the server from this source tree (before/after comparisons)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--port", type=int, default=18321)
    args = ap.parse_args()

    url = f"http://127.0.0.1:{args.port}"
    if args.src:
        os.environ["PYTHONPATH"] = args.src  # the server (not this script) imports ember from there
    cmd = [sys.executable, "-m", "ember.cli.main", "serve", *([args.model] if args.model else []), "--dtype",
           args.dtype, "--port", str(args.port)]  # fmt: skip
    log = ROOT / "benchmarks" / "results" / "soak-server.log"
    proc, _ = launch(cmd, url, log)
    rng = random.Random(0)
    try:
        time.sleep(20)  # let the background kernel builds finish before measuring
        idle = rss(proc.pid)
        cap = asyncio.run(capacity(url, 15.0, rng))
        tokens_before = metric(url, "ember_batch_tokens_sum")
        result = asyncio.run(soak(url, proc.pid, cap * args.load, args.seconds, args.client_timeout, rng))
        computed = metric(url, "ember_batch_tokens_sum") - tokens_before
        time.sleep(15)
        after = rss(proc.pid)
        health_after = httpx.get(url + "/health", timeout=10).status_code
    finally:
        stop(proc)
    out = {
        "model": args.model or "sentence-transformers/all-MiniLM-L6-v2 (bundled)",
        "source": args.src or "this checkout",
        "cpu": cpu_name(),
        "capacity_rps": round(cap, 2),
        "arrival_rps": round(cap * args.load, 2),
        "seconds": args.seconds,
        "client_timeout_s": args.client_timeout,
        **result,
        "computed_tokens": int(computed),
        "tokens_for_clients_gone": int(computed - result["answered_tokens"]),
        "idle_rss_mib": round(idle / 2**20),
        "rss_15s_after_mib": round(after / 2**20),
        "health_after": health_after,
    }
    print(json.dumps(out, indent=2))
    name = Path(args.model).name if args.model else "minilm"
    path = ROOT / "benchmarks" / "results" / f"soak-{name}{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
