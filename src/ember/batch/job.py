"""An indexing job: a corpus embedded in parts of fixed row ranges, each written whole, listed in a manifest.

Part k holds input rows [k x part_rows, (k + 1) x part_rows). A part is written to a temporary file and renamed,
then appended to `_manifest.jsonl` beside it; a restarted job skips the parts the manifest lists, so an interrupted
run (Ctrl-C, SIGTERM, a kill, a lost node) loses at most the part in flight and never writes a row twice. Signals
are the caller's (the CLI's): once `stop()` says so, the job ends after the part in flight. Rows the model cannot
take never stop the job; they are skipped and counted by reason (documented in docs/indexing.md).

Identical texts in a part are embedded once, and with a `VectorCache` a text embedded by an earlier run (same
model, same options) is not embedded again. The next part is read while the current one is embedded.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ember.batch.backend import Embed, Embedded, usable_texts
from ember.batch.cache import VectorCache
from ember.batch.files import input_files, read_batches
from ember.batch.npy import MANIFEST, assemble, assembled
from ember.errors import ConfigError, InputError

__all__ = ["EmbedJob", "JobSummary", "run_job"]


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
    format: str = "parquet"
    """parquet: the parts are the output; npy: embeddings.npy + ids.parquet, assembled from the parts at the end."""
    options: dict[str, Any] = field(default_factory=dict)
    """The model and embedding options: a job restarted with other options is refused (its parts would mix)."""


@dataclass
class JobSummary:
    documents: int = 0
    """Rows written."""
    embedded: int = 0
    """Distinct texts the model ran on (the rest were duplicates or in the cache)."""
    cached: int = 0
    tokens: int = 0
    """Tokens the model ran on."""
    seconds: float = 0.0
    parts_written: int = 0
    parts_skipped: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    interrupted: bool = False

    def line(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        state = "interrupted (run the same command again to continue)" if self.interrupted else "done"
        parts = self.parts_written or self.parts_skipped
        return (
            f"{state}: {self.documents} documents ({self.embedded} embedded, {self.cached} from the cache), "
            f"{self.tokens} tokens in {self.seconds:.1f} s ({rate:.0f} tokens/s); "
            + (f"parts written {self.parts_written}, already done {self.parts_skipped}; " if parts else "")
            + f"rows skipped: {why}"
        )


def _signature(job: EmbedJob) -> str:
    fields = {"inputs": list(job.inputs), "text_column": job.text_column, "id_column": job.id_column,
              "keep_columns": list(job.keep_columns), "part_rows": job.part_rows, "options": job.options,
              "format": job.format}  # fmt: skip
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _done_parts(out: Path, job: EmbedJob) -> set[int]:
    """Parts a previous run finished; refuses a manifest written by a different job unless --overwrite."""
    manifest = out / MANIFEST
    if job.overwrite:
        for f in [*out.glob("part-*.parquet"), out / "embeddings.npy", out / "ids.parquet"]:
            f.unlink(missing_ok=True)
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
        if "part" in entry:
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


@dataclass
class _Rows:
    """A part's texts embedded: which of them were kept, their vectors and tokens, and what was skipped."""

    kept: list[int]
    vectors: np.ndarray
    tokens: list[int | None]
    skipped: Counter[str]
    embedded: int = 0
    cached: int = 0
    model_tokens: int = 0


def _embed_rows(embed: Embed, texts: list[str], cache: VectorCache | None) -> _Rows:
    """Embed each distinct text once, and none the cache holds; a text the model refuses is skipped and counted."""
    distinct = list(dict.fromkeys(texts))
    hits = cache.get(distinct) if cache is not None else {}
    misses = [j for j in range(len(distinct)) if j not in hits]
    result = embed([distinct[j] for j in misses]) if misses else Embedded(np.zeros((0, 0), np.float32), [], 0)
    dim = result.vectors.shape[1] if len(result.vectors) else len(next(iter(hits.values()))[0]) if hits else 0
    vectors = np.zeros((len(distinct), dim), np.float32)
    tokens: list[int | None] = [None] * len(distinct)
    for j, (vector, count) in hits.items():
        vectors[j], tokens[j] = vector, count
    refused = {misses[k]: why for k, why in result.refused.items()}
    ok = [k for k in range(len(misses)) if k not in result.refused]
    for k in ok:
        vectors[misses[k]] = result.vectors[k]
        tokens[misses[k]] = result.tokens[k] if result.tokens is not None else None
    if cache is not None and ok:
        cache.put([distinct[misses[k]] for k in ok], result.vectors[ok], None if result.tokens is None else
                  [result.tokens[k] for k in ok])  # fmt: skip
    index = {t: j for j, t in enumerate(distinct)}
    rows_of = [index[t] for t in texts]
    kept = [i for i, j in enumerate(rows_of) if j not in refused]
    skipped = Counter(refused[j] for j in rows_of if j in refused)
    cached = sum(1 for i in kept if rows_of[i] in hits)
    return _Rows(kept, vectors[[rows_of[i] for i in kept]], [tokens[rows_of[i]] for i in kept], skipped,
                 len(misses), cached, result.total_tokens)  # fmt: skip


def _write_part(
    out: Path, job: EmbedJob, part: tuple[int, int, pa.Table], embed: Embed, cache: VectorCache | None
) -> _Rows:
    """Embed one part's rows and write them whole, then record the part in the manifest."""
    index, first, table = part
    keep, texts, skipped = usable_texts(table.column(job.text_column).to_pylist())
    done = _embed_rows(embed, texts, cache) if texts else _Rows([], np.zeros((0, 0), np.float32), [], Counter())
    done.skipped += skipped
    rows = pa.array([keep[i] for i in done.kept], pa.int64())
    if job.id_column:
        if job.id_column not in table.schema.names:
            raise InputError(f"the input has no column {job.id_column!r} (--id-column)")
        ids = table.column(job.id_column).take(rows)
    else:
        ids = pa.array([first + r for r in rows.to_pylist()], pa.int64())
    dim = done.vectors.shape[1] if len(rows) else 0
    columns = {
        "id": ids,
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(done.vectors.reshape(-1), pa.float32()), dim),
        "tokens": pa.array(done.tokens, pa.int32()),
    }
    for name in job.keep_columns:
        columns[name] = table.column(name).take(rows)
    path = out / f"part-{index:05d}.parquet"
    tmp = out / f".part-{index:05d}.parquet.tmp"
    pq.write_table(pa.table(columns), str(tmp))
    os.replace(tmp, path)  # whole or absent
    _record(out, {"part": index, "first_row": first, "rows": table.num_rows, "written": len(rows),
                  "skipped": dict(done.skipped), "signature": _signature(job)})  # fmt: skip
    return done


def _record(out: Path, entry: dict[str, Any]) -> None:
    with (out / MANIFEST).open("a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _prefetched(parts: Iterator[tuple[int, int, pa.Table]]) -> Iterator[tuple[int, int, pa.Table]]:
    """The next part read (and parsed) on a thread while the current one is embedded."""
    ahead: queue.Queue[Any] = queue.Queue(maxsize=1)
    end = object()
    closed = threading.Event()

    def read() -> None:
        try:
            for item in parts:
                while not closed.is_set():
                    try:
                        ahead.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if closed.is_set():
                    return
            ahead.put(end)
        except BaseException as e:  # handed to the job, raised there
            ahead.put(e)

    threading.Thread(target=read, name="ember-embed-reader", daemon=True).start()
    try:
        while (item := ahead.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        closed.set()


def run_job(
    job: EmbedJob,
    embed: Embed,
    progress: Callable[[int, int], None] | None = None,
    stop: Callable[[], bool] | None = None,
    cache: VectorCache | None = None,
) -> JobSummary:
    """Embed every row not done yet; `progress(rows, tokens)` after each part; when `stop()` turns true (a signal,
    at the CLI), the job ends after the part in flight. With `cache`, texts it holds are not embedded again."""
    out = Path(job.output)
    out.mkdir(parents=True, exist_ok=True)
    done = _done_parts(out, job)
    summary = JobSummary()
    start = time.perf_counter()
    if job.format == "npy" and assembled(out):
        return summary  # finished earlier: nothing left to do
    for part in _prefetched(_parts(job)):
        if part[0] in done:
            summary.parts_skipped += 1
            continue
        rows = _write_part(out, job, part, embed, cache)
        summary.documents += len(rows.kept)
        summary.embedded += rows.embedded
        summary.cached += rows.cached
        summary.tokens += rows.model_tokens
        summary.skipped += rows.skipped
        summary.parts_written += 1
        if progress is not None:
            progress(part[2].num_rows, rows.model_tokens)
        if stop is not None and stop():
            summary.interrupted = True
            break
    if job.format == "npy" and not summary.interrupted:
        assemble(out, _signature(job), _record)
    summary.seconds = time.perf_counter() - start
    return summary
