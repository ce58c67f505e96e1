"""An indexing job: a corpus embedded in parts of fixed row ranges, each written whole, listed in a manifest.

Part k holds input rows [k x part_rows, (k + 1) x part_rows). A part is written to a temporary file and renamed,
then appended to `_manifest.jsonl` beside it; a restarted job skips the parts the manifest lists, so an interrupted
run (Ctrl-C, SIGTERM, a kill, a lost node) loses at most the part in flight and never writes a row twice. Signals
are the caller's (the CLI's): once `stop()` says so, the job ends after the part in flight. Rows the model cannot
take never stop the job; they are skipped and counted by reason (documented in docs/indexing.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ember.batch.files import input_files, read_batches
from ember.errors import ConfigError, InputError

__all__ = ["EmbedJob", "JobSummary", "run_job"]


MANIFEST = "_manifest.jsonl"

Embed = Callable[[list[str]], tuple[np.ndarray, list[int]]]
"""Texts -> (vectors (N, D) float32, tokens per text); raises InputError when a text cannot be embedded."""


@dataclass(frozen=True)
class EmbedJob:
    """What to embed and where to write it (the CLI's `ember embed` flags)."""

    inputs: tuple[str, ...]
    output: str
    text_column: str = "text"
    id_column: str | None = None
    """Kept beside each vector; None: the row number in the input."""
    keep_columns: tuple[str, ...] = ()
    part_rows: int = 10_000
    overwrite: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    """The model and embedding options: a job restarted with other options is refused (its parts would mix)."""


@dataclass
class JobSummary:
    documents: int = 0
    tokens: int = 0
    seconds: float = 0.0
    parts_written: int = 0
    parts_skipped: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    interrupted: bool = False

    def line(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        state = "interrupted (run the same command again to continue)" if self.interrupted else "done"
        return (
            f"{state}: {self.documents} documents, {self.tokens} tokens in {self.seconds:.1f} s ({rate:.0f} tokens/s); "
            f"parts written {self.parts_written}, already done {self.parts_skipped}; rows skipped: {why}"
        )


def _signature(job: EmbedJob) -> str:
    fields = {"inputs": list(job.inputs), "text_column": job.text_column, "id_column": job.id_column,
              "keep_columns": list(job.keep_columns), "part_rows": job.part_rows, "options": job.options}  # fmt: skip
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _done_parts(out: Path, job: EmbedJob) -> set[int]:
    """Parts a previous run finished; refuses a manifest written by a different job unless --overwrite."""
    manifest = out / MANIFEST
    if job.overwrite:
        for f in out.glob("part-*.parquet"):
            f.unlink()
        manifest.unlink(missing_ok=True)
    if not manifest.exists():
        return set()
    done: set[int] = set()
    for line in manifest.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("signature") != _signature(job):
            raise ConfigError(
                f"{out} holds the output of a different job (other inputs, columns or model options): "
                "pass --overwrite to start over, or choose another output directory"
            )
        done.add(int(entry["part"]))
    return done


def _parts(job: EmbedJob) -> Iterator[tuple[int, int, pa.Table]]:
    """(part index, its first row number, its rows) in input order."""
    pending: list[pa.RecordBatch] = []
    rows = first = part = 0
    for _, batch in read_batches(input_files(list(job.inputs)), job.text_column, job.part_rows):
        if job.text_column not in batch.schema.names:
            raise InputError(
                f"the input has no column {job.text_column!r} (--text-column); it has {batch.schema.names}"
            )
        pending.append(batch)
        rows += batch.num_rows
        while rows >= job.part_rows:
            table = pa.Table.from_batches(_unify(pending)).combine_chunks()
            yield part, first, table.slice(0, job.part_rows)
            rest = table.slice(job.part_rows)
            pending, rows = ([rest.to_batches()[0]] if rest.num_rows else []), rest.num_rows
            first, part = first + job.part_rows, part + 1
    if rows:
        yield part, first, pa.Table.from_batches(_unify(pending)).combine_chunks()


def _unify(batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """Batches of files whose inferred schemas differ (an int id here, a string id there) as one schema."""
    schema = pa.unify_schemas([b.schema for b in batches], promote_options="permissive")
    return [pa.Table.from_batches([b]).cast(schema, safe=False).to_batches()[0] if b.schema != schema else b
            for b in batches]  # fmt: skip


def _clean(values: list[Any]) -> tuple[list[int], list[str], Counter[str]]:
    """Row positions to embed and their texts; nulls and blank texts are skipped and counted."""
    keep, texts, skipped = [], [], Counter[str]()
    for i, v in enumerate(values):
        if v is None:
            skipped["null text"] += 1
        elif not isinstance(v, str):
            keep.append(i)
            texts.append(str(v))
        elif not v.strip():
            skipped["empty or whitespace-only text"] += 1
        else:
            keep.append(i)
            texts.append(v)
    return keep, texts, skipped


def _embed_rows(embed: Embed, texts: list[str]) -> tuple[list[int], np.ndarray, list[int], Counter[str]]:
    """Embed distinct texts once; a text the model refuses (too long, no tokens) is skipped and counted."""
    distinct = list(dict.fromkeys(texts))
    try:
        vectors, tokens = embed(distinct)
    except InputError:  # find the rows at fault, one at a time (rare)
        ok, rows, tokens, skipped = [], [], [], Counter[str]()
        for j, text in enumerate(distinct):
            try:
                v, t = embed([text])
            except InputError as e:
                skipped["too long" if "context length" in str(e) or "input length" in str(e) else "refused"] += 1
                continue
            ok.append(j)
            rows.append(v[0])
            tokens += t
        vectors = np.stack(rows) if rows else np.zeros((0, 0), np.float32)
        index = {distinct[j]: k for k, j in enumerate(ok)}
        keep = [i for i, t in enumerate(texts) if t in index]
        return keep, vectors[[index[texts[i]] for i in keep]], [tokens[index[texts[i]]] for i in keep], skipped
    index = {t: j for j, t in enumerate(distinct)}
    rows_of = [index[t] for t in texts]
    return list(range(len(texts))), vectors[rows_of], [tokens[j] for j in rows_of], Counter()


def _write_part(
    out: Path, job: EmbedJob, part: int, first: int, table: pa.Table, embed: Embed
) -> tuple[int, int, Counter[str]]:
    """Embed one part's rows and write them whole, then record the part in the manifest."""
    keep, texts, skipped = _clean(table.column(job.text_column).to_pylist())
    kept: list[int] = []
    vectors, tokens = np.zeros((0, 0), np.float32), list[int]()
    if texts:
        kept, vectors, tokens, refused = _embed_rows(embed, texts)
        skipped += refused
    rows = [keep[i] for i in kept]
    if job.id_column:
        if job.id_column not in table.schema.names:
            raise InputError(f"the input has no column {job.id_column!r} (--id-column)")
        ids = table.column(job.id_column).take(pa.array(rows, pa.int64()))
    else:
        ids = pa.array([first + r for r in rows], pa.int64())
    dim = vectors.shape[1] if len(rows) else 0
    columns = {
        "id": ids,
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dim),
        "tokens": pa.array(tokens, pa.int32()),
    }
    for name in job.keep_columns:
        columns[name] = table.column(name).take(pa.array(rows, pa.int64()))
    path = out / f"part-{part:05d}.parquet"
    tmp = out / f".part-{part:05d}.parquet.tmp"
    pq.write_table(pa.table(columns), str(tmp))
    os.replace(tmp, path)  # whole or absent
    entry = {"part": part, "first_row": first, "rows": table.num_rows, "written": len(rows),
             "skipped": dict(skipped), "signature": _signature(job)}  # fmt: skip
    with (out / MANIFEST).open("a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return len(rows), sum(tokens), skipped


def run_job(
    job: EmbedJob,
    embed: Embed,
    progress: Callable[[int, int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> JobSummary:
    """Embed every row not done yet; `progress(rows, tokens)` after each part; when `stop()` turns true (a signal,
    at the CLI), the job ends after the part in flight."""
    out = Path(job.output)
    out.mkdir(parents=True, exist_ok=True)
    done = _done_parts(out, job)
    summary = JobSummary()
    start = time.perf_counter()
    for part, first, table in _parts(job):
        if part in done:
            summary.parts_skipped += 1
            continue
        written, tokens, skipped = _write_part(out, job, part, first, table, embed)
        summary.documents += written
        summary.tokens += tokens
        summary.skipped += skipped
        summary.parts_written += 1
        if progress is not None:
            progress(table.num_rows, tokens)
        if stop is not None and stop():
            summary.interrupted = True
            break
    summary.seconds = time.perf_counter() - start
    return summary
