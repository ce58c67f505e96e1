"""ember beside the other CPU paths teams weigh, in-process, on the same model, texts and cores, in the same run.

    python benchmarks/cpu_paths.py                                   # the bundled all-MiniLM-L6-v2
    python benchmarks/cpu_paths.py --paths ember,st,st-onnx --rounds 5
    python benchmarks/cpu_paths.py --model models/qwen3-emb-0.6b-random --passages 16 --paths ember,st,llama.cpp-f32

The other paths run under --peers-python, a venv with their libraries (CPU torch kept; see docs/performance.md):

    python3.11 -m venv .peers-venv && .peers-venv/bin/pip install torch==2.13.0
    .peers-venv/bin/pip freeze | grep '^torch==' > /tmp/torch-cpu.txt
    .peers-venv/bin/pip install "sentence-transformers[onnx,openvino]" llama-cpp-python gguf sentencepiece \
        -c /tmp/torch-cpu.txt

llama.cpp's paths convert the model with its convert_hf_to_gguf.py (--llama-convert, from llama.cpp's source or
llama-cpp-python's sdist, `vendor/llama.cpp/`).

Each path runs in its own process (benchmarks/harness/cpu_path.py), one at a time, ember under the allocator its
server preloads (tcmalloc), the others under their own (OpenVINO aborts under a preloaded tcmalloc), with
`--threads` compute threads; the order alternates round by round and each figure is the median over rounds, its
ratio to ember's the median of the rounds' ratios. Measured per path: load time (the path's imports included;
torch's only for ember), one short query at a time (p50 of `--queries` distinct ones, each a list of one text, the
path's whole call), and `--passages` passages of ~200 tokens in batches of `--batch` (tokens/s, counted with the
model's tokenizer, special tokens included). Every path's vectors for a few texts are compared with ember's float32
ones (the lowest cosine): they must be the same model. Writes benchmarks/results/cpu-paths-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import ROOT, row_cosines, write_result
from quantized_recall import stdlib_sentences
from tokenizers import Tokenizer

from ember.models.checkpoint import resolve_model

WORKER = Path(__file__).resolve().parent / "harness" / "cpu_path.py"
ALL_PATHS = "ember,ember-int8,st,st-onnx,st-onnx-int8,st-openvino,llama.cpp-f32,llama.cpp-q8"


def texts(model: Path, queries: int, passages: int, words: int) -> tuple[list[str], list[str], list[int]]:
    """Held-apart short queries and ~`words`-word passages of real English, and the passages' token counts."""
    sentences = stdlib_sentences()
    random.Random(0).shuffle(sentences)
    qs, rest = sentences[:queries], sentences[queries:]
    out, current = [], []
    for s in rest:
        current.append(s)
        if sum(len(c.split()) for c in current) >= words:
            out.append(" ".join(current))
            current = []
        if len(out) == passages:
            break
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    counts = [len(tok.encode(p).ids) for p in out]
    return qs, out, counts


def run_path(python: str, path: str, model: Path, job: Path, env: dict[str, str]) -> dict:
    done = subprocess.run(
        [python, str(WORKER), path, str(model), str(job)], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median_ratio(rows: list[dict], ref: list[dict], key: str, invert: bool = False) -> float:
    """The median over rounds of a path's figure over ember's in the same round (ember's over the path's: invert)."""
    pairs = zip(rows, ref, strict=True)
    ratios = [e[key] / r[key] if invert else r[key] / e[key] for r, e in pairs]
    return round(statistics.median(ratios), 3)


def summarise(rounds: list[dict[str, dict]], paths: list[str], tokens: int) -> dict[str, dict]:
    """Medians over rounds per path; ratios to ember per round, then their median; lowest cosine to ember."""
    out = {}
    ref = [r["ember"] for r in rounds]
    for p in paths:
        rows = [r[p] for r in rounds]
        cosine = row_cosines(ref[0]["check"], rows[0]["check"])
        out[p] = {
            "load_s": round(statistics.median(r["load_s"] for r in rows), 2),
            "query_p50_ms": round(statistics.median(r["query_p50_ms"] for r in rows), 2),
            "bulk_tokens_per_s": round(statistics.median(tokens / r["bulk_s"] for r in rows), 1),
            "query_p50_vs_ember": _median_ratio(rows, ref, "query_p50_ms"),
            "bulk_vs_ember": _median_ratio(rows, ref, "bulk_s", invert=True),
            "min_cosine_to_ember": round(float(cosine.min()), 6),
            "rounds": [{k: round(v, 4) for k, v in r.items() if k not in ("check", "path")} for r in rows],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local model directory (default: the bundled MiniLM)")
    ap.add_argument("--paths", default=ALL_PATHS, help=f"comma-separated, ember first (of {ALL_PATHS})")
    ap.add_argument("--peers-python", default=str(ROOT / ".peers-venv/bin/python"))
    ap.add_argument("--llama-convert", default=None, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--queries", type=int, default=105, help="short queries, the first 5 to warm up")
    ap.add_argument("--passages", type=int, default=256)
    ap.add_argument("--words", type=int, default=150, help="words per passage (~200 tokens)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-batch", type=int, default=512, help="llama.cpp's context and micro-batch, in tokens")
    args = ap.parse_args()
    model = resolve_model(args.model)
    paths = args.paths.split(",")
    if paths[0] != "ember":
        paths = ["ember", *[p for p in paths if p != "ember"]]
    qs, passages, counts = texts(model, args.queries, args.passages, args.words)
    print(f"{len(qs)} queries, {len(passages)} passages of {min(counts)}-{max(counts)} tokens", flush=True)
    env = dict(os.environ)
    if args.llama_convert:
        env["LLAMA_CPP_CONVERT"] = args.llama_convert
    job = {"queries": qs, "passages": passages, "check": qs[:12] + passages[:4], "batch": args.batch,
           "threads": args.threads, "llama_batch": args.llama_batch}  # fmt: skip
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        for r in range(args.rounds):
            got = {}
            for p in paths if r % 2 == 0 else paths[::-1]:
                python = sys.executable if p.startswith("ember") else args.peers_python
                got[p] = run_path(python, p, model, job_file, env)
                query, rate, load = got[p]["query_p50_ms"], sum(counts) / got[p]["bulk_s"], got[p]["load_s"]
                line = f"round {r + 1} {p}: query p50 {query:.1f} ms, bulk {rate:.0f} tok/s, load {load:.1f} s"
                print(line, flush=True)
            rounds.append(got)
    summary = summarise(rounds, paths, sum(counts))
    print(json.dumps({p: {k: v for k, v in s.items() if k != "rounds"} for p, s in summary.items()}, indent=1))
    name = Path(args.model).name if args.model else "minilm"
    setup = {"threads": args.threads, "batch": args.batch, "queries": len(qs) - 5, "passages": len(passages),
             "passage_tokens": sum(counts)}  # fmt: skip
    print(write_result(f"cpu-paths-{name}", {"model": str(model), "setup": setup, "paths": summary}))


if __name__ == "__main__":
    main()
