"""`ember embed`'s memory over one long run: its resident set (and high-water mark) against the rows written, sampled
every 2 s, to tell a bound (a step while the first parts warm the caches, then flat) from growth with the corpus.

    PYTHONPATH=benchmarks python benchmarks/experiments/embed_rss.py --docs 50000 [--part-rows 2000] \
        [-- extra ember embed flags]

Documents have the `mixed` workload's lengths (benchmarks/indexing.py's corpus), truncated to the model's length.
Results: benchmarks/results/embed-rss-<docs>.json (the high-water mark at every 10,000 rows and the last sample).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import cpu_name
from indexing import corpus

ROOT = Path(__file__).resolve().parents[2]


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) // 1024
    return out


def rows_written(out: Path) -> int:
    manifest = out / "_manifest.jsonl"
    if not manifest.exists():
        return 0
    return sum(json.loads(line).get("rows", 0) for line in manifest.read_text().splitlines())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--part-rows", type=int, default=2000)
    ap.add_argument("extra", nargs="*", help="more `ember embed` flags (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src, out = work / "corpus.parquet", work / "out"
        corpus(src, args.docs, seed=3)
        cmd = [sys.executable, "-m", "ember.cli.main", "embed", str(src), "-o", str(out), "--truncate",
               "--id-column", "id", "--part-rows", str(args.part_rows), *args.extra]  # fmt: skip
        with open(work / "log", "w") as log:
            proc = subprocess.Popen(cmd, stderr=log, stdout=subprocess.DEVNULL)
        samples = []
        start = time.perf_counter()
        while proc.poll() is None:
            try:
                mem = memory(proc.pid)
            except (FileNotFoundError, ProcessLookupError):
                break
            samples.append({"seconds": round(time.perf_counter() - start, 1), "rows": rows_written(out), **mem})
            print(samples[-1], flush=True)
            time.sleep(2)
        if proc.wait() != 0:
            raise SystemExit((work / "log").read_text()[-3000:])
        shutil.rmtree(out)
    marks = {}
    for s in samples:
        if s["rows"] and s["rows"] % 10_000 == 0:
            marks.setdefault(s["rows"], s["VmHWM"])
    first = next((s["VmHWM"] for s in samples if s["rows"]), None)
    result = {"cpu": cpu_name(), "docs": args.docs, "part_rows": args.part_rows, "hwm_mib_after_first_part": first,
              "hwm_mib_at_rows": marks, "last": samples[-1] if samples else None}  # fmt: skip
    print(json.dumps(result, indent=2))
    path = ROOT / f"benchmarks/results/embed-rss-{args.docs}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
