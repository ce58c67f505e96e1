"""ember and another server (vLLM) both up, driven turn about: A B, B A, A B ... per workload.

Each round sends new texts (both servers get the same ones): vLLM's prefix cache would otherwise answer a
repeated round from its cache (measured: 686 -> 1,119 tok/s on the second bulk round).
On a shared 2-vCPU VM the host's speed moves 2-3x between minutes, more than the gap between two
servers measured one after the other. Alternating the order each round and taking medians of the
per-round ratios cancels that drift. Only one server works at a time; the idle one waits.

    python benchmarks/interleaved.py [--dtype int8] [--workloads query:3,queries:3,bulk:2,long:2]

The peer is vLLM's CPU build started by benchmarks/serve_vllm.sh, computing on the same cores as ember (pass
--peer-cmd/--peer-url/--peer-model for another server, VLLM_BIND=auto for vLLM's own one-core default on 2 vCPUs).
infinity: --peer-cmd "sh benchmarks/serve_infinity.sh" --warm (--warm: each workload's first requests, unmeasured,
to both servers first; infinity compiles a graph the first time it sees a shape). Before the rounds, the same
texts go to both servers and the lowest cosine between their vectors is reported: both compute the same embedding.

--tier avx512_bf16|avx512|avx2 runs both servers as on a CPU of that tier: ember with EMBER_MAX_ISA, both with
oneDNN, MKL and ATen capped (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS, ATEN_CPU_CAPABILITY), and vLLM's own
kernel library and attention picked for the tier (serve_vllm.sh, harness/vllm_tier), so an AMX Xeon measures what
an AMD EPYC or an AVX2-only Xeon would. The compute limit (benchmarks/harness/roofline.py: the GEMM
rate over the model's FLOPs per token) is probed under the same cap before the servers start, between every two
rounds with both servers frozen, and after they stop; the model's FLOPs per token are counted at each workload's own
sequence lengths (attention's share grows with them). Each round's ember rate is taken as a fraction of the higher
of the two probes either side of it, and a workload's fraction is the median over its rounds: the host's speed
moves by a third within a run, so one probe for the whole run read ember at 0.82 or 1.07 of the limit in the same
run. The fraction against the highest probe of the run is kept beside it. For the one-query workload the inverse
of the fraction is a request's mean time over the GEMM floor (the query's FLOPs at the probed rate).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from harness import QWEN_DIR, ROOT, PeakRss, cpu_description, frozen, launch, row_cosines, stop
from harness.roofline import workload_tokens_per_s
from run import start_server

from ember.cli.bench import WORKLOADS, Result, Workload, make_texts, run_workload


def _compute_limit(model: str, dtype: str) -> dict[str, float]:
    """benchmarks/harness/roofline.py on the model, in its own process (under the tier's cap when one is set)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/harness/roofline.py"), model, dtype],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def _warm(servers: dict[str, tuple[str, str]], keys: list[str]) -> None:
    """Each planned workload's requests to each server, unmeasured, on texts no round sends: as many of its first
    requests, in flight together, as fit in 8,192 tokens, and at least one (a bulk request, 8 concurrent queries, the
    8k or 12k document). A peer that compiles a graph the first time it sees a shape (infinity's torch.compile) pays
    for it here rather than in its first round."""
    for key in keys:
        w = WORKLOADS[key]
        n = w.per_request * w.concurrency
        while n > w.per_request and sum(w.lengths[:n]) > 8192:
            n -= w.per_request
        first = Workload(w.name, w.lengths[:n], w.per_request, w.concurrency)
        for url, model in servers.values():
            asyncio.run(run_workload(url, model, first, round=-1))


def _agreement(servers: dict[str, tuple[str, str]]) -> float:
    """The lowest cosine between ember's and the peer's vectors of the same texts (20, 100 and 200 tokens): that
    both compute the same embedding (the model's own pooling, its normalisation)."""
    import httpx

    texts = make_texts((20, 100, 200), seed=7)  # within every model's own length (MiniLM truncates at 256)
    vectors = []
    for url, model in servers.values():
        reply = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": texts}, timeout=600)
        reply.raise_for_status()
        rows = sorted(reply.json()["data"], key=lambda d: d["index"])
        vectors.append([r["embedding"] for r in rows])
    return float(row_cosines(*vectors).min())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(QWEN_DIR), help="ember's model: a local directory or a hub id")
    ap.add_argument("--max-model-len", default="8192", help="ember's --max-model-len (512 for BERT-sized models)")
    ap.add_argument("--peer-url", default="http://127.0.0.1:8100")
    ap.add_argument("--peer-model", default="qwen3-emb-0.6b-random")
    ap.add_argument(
        "--peer-cmd",
        default="sh benchmarks/serve_vllm.sh",
        help="starts the peer (default: vLLM computing on ember's cores; VLLM_BIND=auto for its default)",
    )
    ap.add_argument("--workloads", default="bulk:3,queries:3,mixed:2", help="key:rounds, comma-separated")
    ap.add_argument("--freeze-idle", action="store_true", help="SIGSTOP the server not being measured")
    ap.add_argument("--dtype", default="bfloat16", help="ember's --dtype (int8: int8 weights, bf16 compute)")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/interleaved-DTYPE.json)")
    ap.add_argument("--tier", default=None, help="cap both servers to an ISA tier: avx512_bf16, avx512, avx2")
    ap.add_argument("--warm", action="store_true", help="each workload's first requests, unmeasured, first")
    args = ap.parse_args()
    if args.tier:
        from ember.cli.runtime import isa_env

        os.environ["EMBER_MAX_ISA"] = args.tier  # inherited by both servers and the probe
        os.environ.update(isa_env(args.tier))  # oneDNN, MKL, ATen and inductor's cache, for the peer too
    before = _compute_limit(args.model, args.dtype)
    print(f"compute limit: {before['tokens_per_s']:.0f} tok/s ({before['gflops']:.0f} G(FL)OPS)", flush=True)
    plan = [(k, int(n)) for k, n in (item.split(":") for item in args.workloads.split(","))]
    extra = [
        "--dtype",
        args.dtype,
        "--max-model-len",
        args.max_model_len,
        "--pooler-config",
        '{"enable_chunked_processing": true}',
        "--embedding-cache-size",
        "0",
    ]  # every round's texts are new: the cache would only cost
    ours, ours_ready, ours_kernels = start_server(args.model, extra)
    try:
        peer, peer_ready = launch(args.peer_cmd, args.peer_url, ROOT / "benchmarks/results/peer.log")
    except BaseException:
        stop(ours)  # a peer that fails to start must not leave ember holding the port
        raise
    servers = {"ember": ("http://127.0.0.1:18123", args.model), "peer": (args.peer_url, args.peer_model)}
    results: dict[str, dict[str, list[Result]]] = {k: {"ember": [], "peer": []} for k, _ in plan}
    probes: dict[str, list[dict[str, float]]] = {k: [] for k, _ in plan}  # before each round of a workload
    try:
        agreement = _agreement(servers)
        print(f"lowest cosine between ember's and the peer's vectors: {agreement:.6f}", flush=True)
        if args.warm:
            _warm(servers, [k for k, _ in plan])
        with PeakRss(ours.pid) as ours_rss, PeakRss(peer.pid) as peer_rss:
            for key, rounds in plan:
                for r in range(rounds):
                    with frozen(ours.pid), frozen(peer.pid):  # neither server takes CPU from the probe
                        probes[key].append(_compute_limit(args.model, args.dtype))
                    order = ["ember", "peer"] if r % 2 == 0 else ["peer", "ember"]
                    for who in order:
                        url, model = servers[who]
                        idle = (peer if who == "ember" else ours).pid if args.freeze_idle else None
                        with frozen(idle):
                            res = asyncio.run(run_workload(url, model, WORKLOADS[key], round=r))  # new texts per round
                        results[key][who].append(res)
                        print(
                            f"{key} round {r + 1} {who}: {res.seconds:.1f} s, {res.tokens} tokens by its usage, "
                            f"p50 {res.p50_ms:.0f} ms",
                            flush=True,
                        )
    finally:
        stop(ours)
        stop(peer)
    after = _compute_limit(args.model, args.dtype)
    every = [before, *(p for ps in probes.values() for p in ps), after]  # each probe once
    for (key, _), (next_key, _) in zip(plan, [*plan[1:], (None, 0)], strict=True):
        probes[key].append(probes[next_key][0] if next_key else after)  # the probe after a workload's last round
    limit = max(every, key=lambda x: x["gflops"])
    low = min(p["gflops"] for p in every)
    print(f"compute limit probed {len(every)} times: {low:.0f} - {limit['gflops']:.0f} G(FL)OPS")
    rss = ours_rss.bytes / 2**30
    print(f"\nember: ready {ours_ready:.1f} s (fused kernels at {ours_kernels:.1f} s), peak RSS {rss:.2f} GiB")
    print(f"peer:  ready {peer_ready:.1f} s, peak RSS of its processes {peer_rss.bytes / 2**30:.2f} GiB")
    print(f"{'workload':55s} {'ember tok/s':>11s} {'peer tok/s':>10s} {'ratio (median of rounds)':>25s}")
    rows = []
    for key, _ in plan:
        e, p = results[key]["ember"], results[key]["peer"]
        # both were sent the same texts in a round: the ratio is the peer's time over ember's, and the peer's rate
        # is counted in ember's tokens (infinity's usage counts characters)
        ratios = [b.seconds / a.seconds for a, b in zip(e, p, strict=True)]
        peer_rates = [a.tokens / b.seconds for a, b in zip(e, p, strict=True)]
        near = [max(a, b, key=lambda x: x["gflops"]) for a, b in itertools.pairwise(probes[key])]
        lengths = WORKLOADS[key].lengths
        fractions = [
            x.tokens_per_s / workload_tokens_per_s(lim, args.model, lengths, x.tokens, int(args.max_model_len))
            for x, lim in zip(e, near, strict=True)
        ]
        highest = workload_tokens_per_s(limit, args.model, lengths, e[0].tokens, int(args.max_model_len))
        row = {
            "key": key,
            "ember_fraction_of_limit": statistics.median(fractions),  # each round against the probes either side
            "ember_fractions_of_limit": fractions,
            "ember_fraction_of_highest_limit": statistics.median(x.tokens_per_s for x in e) / highest,
            "limit_tokens_per_s_at_highest": highest,  # at the workload's own lengths
            "probes_gflops": [x["gflops"] for x in probes[key]],
            "ember_tokens_per_s": [x.tokens_per_s for x in e],
            "peer_tokens_per_s": peer_rates,
            "peer_usage_over_ember_usage": [b.tokens / a.tokens for a, b in zip(e, p, strict=True)],  # 1: same counts
            "ember_p50_ms": [x.p50_ms for x in e],
            "peer_p50_ms": [x.p50_ms for x in p],
            "ember_p99_ms": [x.p99_ms for x in e],
            "peer_p99_ms": [x.p99_ms for x in p],
            "ratios": ratios,
            "ember_retries": [x.retries for x in e],  # requests sent again after a 429 (admission control)
            "peer_retries": [x.retries for x in p],
        }
        rows.append(row)
        print(
            f"{WORKLOADS[key].name:55s} {statistics.median(row['ember_tokens_per_s']):11.0f} "
            f"{statistics.median(row['peer_tokens_per_s']):10.0f} {statistics.median(ratios):25.2f}  "
            f"p50 {statistics.median(row['ember_p50_ms']):.0f} vs {statistics.median(row['peer_p50_ms']):.0f} ms, "
            f"ember at {row['ember_fraction_of_limit']:.2f} of the limit "
            f"({row['ember_fraction_of_highest_limit']:.2f} of the run's highest)"
        )
    out = Path(args.out) if args.out else ROOT / f"benchmarks/results/interleaved-{args.dtype}.json"
    out.write_text(
        json.dumps(
            {
                "cpu": cpu_description(),
                "tier": args.tier or "uncapped",
                "compute_limit": limit,
                "compute_limit_probes_gflops": [x["gflops"] for x in every],
                "ember": {
                    "dtype": args.dtype,
                    "ready_s": ours_ready,
                    "kernels_s": ours_kernels,
                    "peak_rss_bytes": ours_rss.bytes,
                },
                "peer": {"cmd": args.peer_cmd, "ready_s": peer_ready, "peak_rss_bytes": peer_rss.bytes},
                "lowest_cosine_to_peer": agreement,
                "warmed": args.warm,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
