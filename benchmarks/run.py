"""The benchmark suite: ember over HTTP beside the transformers reference, measured in the same run.

    python benchmarks/run.py                       # Qwen3-Embedding-0.6B-shaped model (built if missing)
    python benchmarks/run.py --model minilm        # the bundled all-MiniLM-L6-v2, sentence-transformers reference
    python benchmarks/run.py --peer-url URL        # also drive another OpenAI-compatible server (e.g. vLLM)
    python benchmarks/run.py --peer-url URL --peer-cmd "CMD"   # start it too: its time to ready and peak RSS

Never run it beside tests or another benchmark: on 2 cores, anything else running spoils the timing.
Prints a table (tokens/s, p50/p99, peak RSS, time to ready, ratio to the reference and to the compute
limit) and writes benchmarks/results/<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from harness import QWEN_DIR, ROOT, PeakRss, ensure_qwen3_model, launch, peak_rss, stop, use_server_allocator
from harness.reference import reference_tokens_per_s
from harness.roofline import compute_limit, workload_tokens_per_s

from ember.cli.bench import WORKLOADS, Result, run_workload

__all__ = ["QWEN_DIR", "ROOT", "drive", "launch", "peak_rss", "start_server", "stop"]


def start_server(model: str, extra: list[str], port: int = 18123) -> tuple[subprocess.Popen[bytes], float, float]:
    """ember serve: (process, seconds to ready, seconds until its fused kernels are compiled)."""
    cmd = [sys.executable, "-m", "ember.cli.main", "serve", model, "--port", str(port), "--host", "127.0.0.1", *extra]
    log = ROOT / "benchmarks/results/server.log"
    start = time.perf_counter()
    proc, ready = launch(cmd, f"http://127.0.0.1:{port}", log)
    while "fused kernels" not in log.read_text() and "--enforce-eager" not in extra:
        time.sleep(0.2)  # measure the steady state (ember serves eagerly meanwhile)
    return proc, ready, time.perf_counter() - start


def drive(url: str, model: str, keys: list[str]) -> dict[str, Result]:
    return {k: asyncio.run(run_workload(url, model, WORKLOADS[k])) for k in keys}


def main() -> None:
    use_server_allocator(__file__)  # in-process figures (the reference) on the allocator the server runs on
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3", help="qwen3 (0.6B-shaped, random weights) or minilm")
    ap.add_argument("--workloads", default="bulk,mixed,queries,long,chunked")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--peer-url", default=None, help="another OpenAI-compatible server to drive the same way")
    ap.add_argument("--peer-model", default=None)
    ap.add_argument(
        "--peer-cmd", default=None, help="shell command that starts the peer (timed to ready, RSS of its process tree)"
    )
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()
    keys = args.workloads.split(",")
    if args.model == "qwen3":
        ensure_qwen3_model()
        model, name = str(QWEN_DIR), "qwen3-0.6b"
        extra = ["--max-model-len", "8192", "--pooler-config", '{"enable_chunked_processing": true}']
    else:
        model, name = "sentence-transformers/all-MiniLM-L6-v2", "minilm"
        extra = ["--pooler-config", '{"enable_chunked_processing": true}']
        keys = [k for k in keys if k in ("bulk", "mixed", "queries")]
    limit = compute_limit(model, args.dtype)
    proc, ready, compiled = start_server(model, ["--dtype", args.dtype, *extra])
    print(f"ember ready in {ready:.1f} s, fused kernels compiled at {compiled:.1f} s", flush=True)
    try:
        with PeakRss(proc.pid) as sampled:
            ours = drive("http://127.0.0.1:18123", model, keys)
        rss = max(peak_rss(proc.pid), sampled.bytes)
    finally:
        stop(proc)
    peer, peer_mem = drive_peer(args, model, keys) if args.peer_url else ({}, {})
    ref = {} if args.no_reference else reference_tokens_per_s(model, args.dtype, keys, st=args.model == "minilm")
    window = 8192 if args.model == "qwen3" else 512  # the server's --max-model-len: longer inputs run as windows
    at = {k: workload_tokens_per_s(limit, model, WORKLOADS[k].lengths, ours[k].tokens, window) for k in keys}
    report(name, keys, ours, peer, ref, limit | {"per_workload": at}, ready, rss, args, peer_mem)


def drive_peer(args: argparse.Namespace, model: str, keys: list[str]) -> tuple[dict[str, Result], dict[str, float]]:
    """The same workloads against the peer; started (and measured) here when --peer-cmd is given."""
    if not args.peer_cmd:
        return drive(args.peer_url, args.peer_model or model, keys), {}
    proc, ready = launch(args.peer_cmd, args.peer_url, ROOT / "benchmarks/results/peer.log")
    try:
        with PeakRss(proc.pid) as peak:
            results = drive(args.peer_url, args.peer_model or model, keys)
    finally:
        stop(proc)
    return results, {"time_to_ready_s": ready, "peak_rss_bytes": peak.bytes}


def report(name, keys, ours, peer, ref, limit, ready, rss, args, peer_mem) -> None:
    print(
        f"\nmodel {name}, dtype {args.dtype}; compute limit {limit['tokens_per_s']:.0f} tok/s at 512 tokens "
        f"({limit['gflops']:.0f} GFLOPS, {limit['gflop_per_token']:.2f} GFLOP/token); "
        f"time to ready {ready:.1f} s; server peak RSS {rss / 2**30:.2f} GiB"
    )
    if peer_mem:
        print(
            f"peer: time to ready {peer_mem['time_to_ready_s']:.1f} s; "
            f"peak RSS of its processes {peer_mem['peak_rss_bytes'] / 2**30:.2f} GiB"
        )
    header = f"{'workload':55s} {'ember tok/s':>11s} {'p50 ms':>8s} {'p99 ms':>8s} {'ref tok/s':>10s} {'x ref':>6s}"
    header += f" {'x limit':>7s}"
    if peer:
        header += f" {'peer tok/s':>10s} {'p50':>7s} {'p99':>7s} {'x peer':>6s}"
    print(header)
    rows = []
    for k in keys:
        r = ours[k]
        ref_tps = ref.get(k)
        line = (
            f"{r.workload:55s} {r.tokens_per_s:11.1f} {r.p50_ms:8.0f} {r.p99_ms:8.0f} "
            f"{(ref_tps or 0):10.1f} {(r.tokens_per_s / ref_tps if ref_tps else 0):6.2f} "
            f"{r.tokens_per_s / limit['per_workload'][k]:7.2f}"  # FLOPs counted at the workload's own lengths
        )
        if peer:
            p = peer[k]
            line += f" {p.tokens_per_s:10.1f} {p.p50_ms:7.0f} {p.p99_ms:7.0f} {r.tokens_per_s / p.tokens_per_s:6.2f}"
        print(line)
        rows.append(
            {
                "key": k,
                "workload": r.workload,
                "tokens_per_s": r.tokens_per_s,
                "p50_ms": r.p50_ms,
                "p99_ms": r.p99_ms,
                "reference_tokens_per_s": ref_tps,
                "limit_tokens_per_s": limit["per_workload"][k],
                "peer_tokens_per_s": peer[k].tokens_per_s if peer else None,
                "peer_p50_ms": peer[k].p50_ms if peer else None,
                "peer_p99_ms": peer[k].p99_ms if peer else None,
            }
        )
    out = ROOT / "benchmarks" / "results" / f"{name}-{args.dtype}.json"
    out.write_text(
        json.dumps(
            {
                "model": name,
                "dtype": args.dtype,
                "limit": limit,
                "time_to_ready_s": ready,
                "peak_rss_bytes": rss,
                "peer": {"url": args.peer_url, "cmd": args.peer_cmd, **peer_mem} if peer else None,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
