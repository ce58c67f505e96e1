"""A million short rows through `ember embed`, killed with SIGKILL at random moments and run again until it
finishes: every row written exactly once, and the peak RSS of each run against the corpus's size.

    python benchmarks/bulk_resume.py                         # 1,000,000 rows, 3 kills, the bundled MiniLM
    python benchmarks/bulk_resume.py --rows 100000 --kills 2 --model models/some-model

The corpus is generated (JSONL, one `{"id", "text"}` per line, 4 to 24 words from a fixed vocabulary, a fixed seed).
Each run but the last is killed at a uniform moment from 30 s to --kill-within seconds after it starts (model
loading, a part half written, a manifest line being appended: wherever it falls); the last goes to the end.
Checked at the end: the output's ids are exactly the corpus's, none missing, none twice, and each row's vector
equals a fresh embedding of its text (a sample of 200).
Results: benchmarks/results/bulk-resume-<rows>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import PeakRss, cpu_name, row_cosines, write_result

WORDS = (
    "index vector query document search embed rank model server memory cluster shard replica token batch "
    "latency throughput cache disk network kernel thread core socket request answer score recall precision"
).split()


def corpus(path: Path, rows: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(rows):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
            f.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")


def run(cmd: list[str], kill_after: float | None) -> tuple[int, float, int]:
    """One `ember embed` run: (exit code, seconds, peak RSS in bytes), SIGKILLed after `kill_after` seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    with PeakRss(proc.pid, interval=0.1) as peak:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode not in (0, -signal.SIGKILL):
        sys.exit(f"ember embed failed ({proc.returncode}):\n{proc.stderr.read().decode()[-2000:]}")
    return proc.returncode, time.monotonic() - start, peak.bytes


def check(out: Path, source: Path, model: str | None, sample: int) -> dict[str, int | float]:
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(out, columns=["id", "embedding"])
    ids = table.column("id").to_pylist()
    with source.open() as f:
        rows = [json.loads(line) for line in f]
    want = {r["id"] for r in rows}
    seen = set(ids)
    from ember import Embedder

    picks = random.Random(0).sample(range(len(ids)), min(sample, len(ids)))
    texts = {r["id"]: r["text"] for r in rows}
    fresh = Embedder(model).embed([texts[ids[i]] for i in picks]).vectors
    got = np.stack([np.asarray(table.column("embedding")[i].as_py(), np.float32) for i in picks])
    cosine = row_cosines(fresh, got)
    return {
        "rows_out": len(ids),
        "duplicates": len(ids) - len(seen),
        "missing": len(want - seen),
        "unexpected": len(seen - want),
        "min_sample_cosine": float(cosine.min()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--model", default=None, help="default: the bundled all-MiniLM-L6-v2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-within", type=float, default=600, help="each kill at a uniform moment of 30 s to this")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "corpus.jsonl", Path(tmp) / "vectors"
        corpus(source, args.rows, args.seed)
        cmd = [sys.executable, "-m", "ember.cli.main", "embed", str(source), "-o", str(out), "--id-column", "id"]
        if args.model:
            cmd += ["--model", args.model]
        runs = []
        for k in range(args.kills + 1):
            last = k == args.kills
            code, seconds, rss = run(cmd, None if last else rng.uniform(30, args.kill_within))
            runs.append({"killed": code != 0, "seconds": round(seconds, 1), "peak_rss_mib": round(rss / 2**20)})
            state = "killed" if code else "finished"
            print(f"run {k + 1}: {state} after {seconds:.0f} s, peak RSS {rss / 2**20:.0f} MiB", flush=True)
            if code == 0:
                break
        total = sum(r["seconds"] for r in runs)
        result = {"rows": args.rows, "kills": sum(r["killed"] for r in runs), "runs": runs, "seconds": round(total)}
        result |= check(out, source, args.model, 200)
        result["rows_per_s_overall"] = round(args.rows / total)
    print(json.dumps(result, indent=1))
    path = write_result(f"bulk-resume-{args.rows}", {"machine": cpu_name(), **result})
    print(f"wrote {path}")


def _manifest(out: Path) -> list[str]:
    path = out / "_manifest.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


if __name__ == "__main__":
    main()
