"""An indexing job: a corpus embedded in parts of fixed row ranges, each written as it is finished, in a manifest.

Part k holds input rows [k x part_rows, (k + 1) x part_rows). The model takes a part a slice at a time (a few
seconds of work each), so progress moves by rows and a stop (Ctrl-C, SIGTERM: the caller's `stop()`) ends the job
within a slice: the rows finished so far are written as a segment of the part (`part-00003_004096.parquet` holds
part 3 from its row 4,096), and a restarted job goes on from there. Every file is written under a temporary name,
renamed when whole, then listed in the manifest (`manifest.py`) with a hash of the rows it covers as read; a
restarted job checks those hashes against the input as it reads it again, so a changed input is refused, never
mixed with the old vectors. No row is written twice or left out, whatever stops the job.

Rows the model cannot take never stop the job: they are skipped and counted by reason (docs/indexing.md). Identical
texts in a part are embedded once, and with a `VectorCache` a text embedded by an earlier run (same model, same
options) is not embedded again. The next part is read while the current one is embedded.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
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

from ember.batch.backend import Embed, probe_dimension, usable_texts
from ember.batch.cache import VectorCache
from ember.batch.files import MAX_LINE_BYTES
from ember.batch.inputs import Inputs, check_inputs, digest, duplicate_ids, input_ids, parts
from ember.batch.manifest import MANIFEST, Manifest, lock_output
from ember.batch.npy import assemble
from ember.batch.rows import Memo, Rows, Slices, embed_rows, fit_texts
from ember.errors import ConfigError, InputError

__all__ = ["EmbedJob", "Inputs", "JobSummary", "check_inputs", "run_job"]

log = logging.getLogger("ember.embed")


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
    max_text_bytes: int = MAX_LINE_BYTES
    """A text longer than this could never be used whole: with options["truncate"] it is cut to this length,
    else skipped as too long before it is tokenized (a line of text or JSONL is skipped as it is read)."""
    unique_ids: bool = False
    """Refuse the job, before any work, when --id-column holds a value twice (else duplicates are reported)."""


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
    duplicate_ids: int = 0
    """Rows whose id an earlier row of the output already has (--id-column)."""
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
            + (f"; {self.duplicate_ids} rows repeat an earlier row's id" if self.duplicate_ids else "")
        )


def _signature(job: EmbedJob) -> str:
    fields = {
        "inputs": list(job.inputs),
        "text_column": job.text_column,
        "id_column": job.id_column,
        "keep_columns": list(job.keep_columns),
        "part_rows": job.part_rows,
        "options": job.options,
        "format": job.format,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _check_unchanged(manifest: Manifest, part: tuple[int, int, pa.Table], job: EmbedJob) -> None:
    index, first, table = part
    for segment in manifest.parts.get(index, []):
        end = segment.offset + segment.rows
        if end > table.num_rows or (segment.digest and segment.digest != digest(table, job, segment.offset, end)):
            raise ConfigError(
                f"the input changed since rows {first + segment.offset}-{first + end - 1} were embedded into "
                f"{job.output}: pass --overwrite to start over, or write to another output directory"
            )


@dataclass
class _Run:
    """What one call of `run_job` works with."""

    job: EmbedJob
    out: Path
    manifest: Manifest
    embed: Embed
    cache: VectorCache | None
    dim: int
    progress: Callable[[int, int], None] | None
    stop: Callable[[], bool] | None
    summary: JobSummary
    slices: Slices = field(default_factory=Slices)

    def asked_to_stop(self) -> bool:
        return self.stop is not None and self.stop()


def _write_part(run: _Run, part: tuple[int, int, pa.Table]) -> bool:
    """Embed a part's rows not yet written, a slice at a time, and write them as one file; True when a stop cut
    the part short."""
    index, table = part[0], part[2]
    offset = pos = run.manifest.covered(index)
    memo: Memo = {}
    kept: list[int] = []
    vectors: list[np.ndarray] = []
    tokens: list[int | None] = []
    skipped: Counter[str] = Counter()
    stopped = False
    while pos < table.num_rows and not stopped:
        rows = table.slice(pos, run.slices.rows)
        start = time.perf_counter()
        keep, texts, why = usable_texts(rows.column(run.job.text_column).to_pylist())
        fit, texts = fit_texts(run.job, texts, why)
        done = embed_rows(run.embed, texts, run.cache, memo, run.dim)
        run.slices.observe(rows.num_rows, time.perf_counter() - start)
        kept += [pos + keep[fit[k]] for k in done.kept]
        vectors.append(done.vectors)
        tokens += done.tokens
        skipped += why + done.skipped
        _count(run.summary, done)
        pos += rows.num_rows
        if run.progress is not None:
            run.progress(rows.num_rows, done.model_tokens)
        stopped = run.asked_to_stop()
    _write_file(run, part, offset, pos, kept, np.concatenate(vectors) if vectors else None, tokens, skipped)
    return stopped


def _count(summary: JobSummary, done: Rows) -> None:
    summary.documents += len(done.kept)
    summary.embedded += done.embedded
    summary.cached += done.cached
    summary.tokens += done.model_tokens


def _write_file(
    run: _Run,
    part: tuple[int, int, pa.Table],
    offset: int,
    end: int,
    kept: list[int],
    vectors: np.ndarray | None,
    tokens: list[int | None],
    skipped: Counter[str],
) -> None:
    """Rows [offset, end) of a part as one Parquet file (whole or absent), then its line in the manifest."""
    index, first, table = part
    job, rows = run.job, pa.array(kept, pa.int64())
    flat = vectors.reshape(-1) if vectors is not None else np.zeros(0, np.float32)
    columns = {
        "id": table.column(job.id_column).take(rows)
        if job.id_column
        else pa.array([first + r for r in kept], pa.int64()),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), run.dim),
        "tokens": pa.array(tokens, pa.int32()),
    }
    for name in job.keep_columns:
        columns[name] = table.column(name).take(rows)
    name = f"part-{index:05d}" + (f"_{offset:06d}" if offset else "")
    path, tmp = run.out / f"{name}.parquet", run.out / f".{name}.parquet.tmp"
    try:
        pq.write_table(pa.table(columns), str(tmp))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)  # whole or absent
    run.manifest.record(
        {
            "part": index,
            "offset": offset,
            "first_row": first + offset,
            "rows": end - offset,
            "written": len(kept),
            "skipped": dict(skipped),
            "digest": digest(table, job, offset, end),
        }
    )
    run.summary.skipped += skipped
    run.summary.parts_written += 1


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


@contextlib.contextmanager
def _output_errors(out: Path) -> Iterator[None]:
    """A full disk or a read-only output as one line naming the directory, not a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM):
            raise
        advice = "free space and" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "fix its permissions and"
        raise ConfigError(
            f"cannot write to {out}: {e.strerror}; the parts already written are kept: {advice} run "
            "the same command again"
        ) from None


def run_job(
    job: EmbedJob,
    embed: Embed,
    progress: Callable[[int, int], None] | None = None,
    stop: Callable[[], bool] | None = None,
    cache: VectorCache | None = None,
    inputs: Inputs | None = None,
) -> JobSummary:
    """Embed every row not done yet; `progress(rows, tokens)` after each slice; when `stop()` turns true (a signal,
    at the CLI), the job ends after the slice in flight. With `cache`, texts it holds are not embedded again."""
    inputs = inputs or check_inputs(job)
    out = Path(job.output)
    start = time.perf_counter()
    with _output_errors(out):
        out.mkdir(parents=True, exist_ok=True)
        with lock_output(out):
            if job.overwrite:
                for f in [*out.glob("part-*.parquet"), out / "embeddings.npy", out / "ids.parquet", out / MANIFEST]:
                    f.unlink(missing_ok=True)
            manifest = Manifest.read(out, _signature(job))
            summary = JobSummary()
            if job.format == "npy" and manifest.assembled:
                return summary  # finished earlier: nothing left to do
            if job.unique_ids and job.id_column:
                count, example = duplicate_ids(input_ids(job, inputs))
                if count:
                    raise InputError(f"--unique-ids: {count} rows repeat an earlier row's id (e.g. {example!r})")
            run = _Run(job, out, manifest, embed, cache, probe_dimension(embed), progress, stop, summary)
            _run_parts(run, inputs)
            summary.seconds = time.perf_counter() - start
    return summary


def _run_parts(run: _Run, inputs: Inputs) -> None:
    summary, job = run.summary, run.job
    for part in _prefetched(parts(job, inputs)):
        _check_unchanged(run.manifest, part, job)
        if run.manifest.covered(part[0]) >= part[2].num_rows:
            summary.parts_skipped += 1
            if run.progress is not None:
                run.progress(part[2].num_rows, 0)
            continue
        if _write_part(run, part):
            summary.interrupted = True
            return
    files = sorted(run.out.glob("part-*.parquet"))
    if job.id_column:
        summary.duplicate_ids = duplicate_ids(pq.read_table(f, columns=["id"]) for f in files)[0]
        if summary.duplicate_ids:
            log.warning(
                "%d rows repeat an earlier row's id (--unique-ids refuses such an input)", summary.duplicate_ids
            )
    if job.format == "npy":
        assemble(run.out, run.dim, run.manifest.record)
