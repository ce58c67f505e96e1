"""An indexing job's inputs: checked before any model loads, then read as fixed parts of rows with their hashes.

Every column a flag names is checked in every file (from its first rows; Parquet: its footer), ids are written as
one type across files, and a part's rows are hashed as read (text and id) so a resumed job can tell an input that
changed since it was written.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from ember.batch.files import Source, input_files, read_batches, sources
from ember.errors import InputError

if TYPE_CHECKING:
    from ember.batch.job import EmbedJob

__all__ = ["Inputs", "check_inputs", "digest", "duplicate_ids", "input_ids", "parts"]

log = logging.getLogger("ember.embed")


@dataclass(frozen=True)
class Inputs:
    """The input files, checked: every named column is in every file; ids are written as one type."""

    files: list[Path]
    id_type: pa.DataType | None


def check_inputs(job: EmbedJob) -> Inputs:
    """Every file's columns (from its first rows; Parquet: its footer), before a model is loaded: a column missing
    anywhere is refused with the columns that exist. Ids of mixed types across files are written as strings."""
    files = input_files(list(job.inputs))
    found = sources(files, job.text_column, job.max_text_bytes)
    named = [(job.text_column, "--text-column"), (job.id_column, "--id-column")]
    named += [(c, "--keep-columns") for c in job.keep_columns]
    for source in found:
        for column, flag in named:
            if column and column not in source.schema.names:
                raise InputError(
                    f"{source.path} has no column {column!r} ({flag}); its columns: {', '.join(source.schema.names)}",
                    "input",
                )
    return Inputs(files, _id_type(found, job.id_column))


def _id_type(found: list[Source], column: str | None) -> pa.DataType | None:
    if column is None:
        return None
    types = {s.path: s.schema.field(column).type for s in found}
    distinct = {t for t in types.values() if t != pa.null()}
    if len(distinct) <= 1:
        return next(iter(distinct), pa.string())
    if all(pa.types.is_integer(t) for t in distinct):
        return pa.int64()
    log.warning(
        "--id-column %r holds %s: every id is written as a string",
        column,
        ", ".join(f"{t} in {p.name}" for p, t in list(types.items())[:4]),
    )
    return pa.string()


def parts(job: EmbedJob, inputs: Inputs) -> Iterator[tuple[int, int, pa.Table]]:
    """(part index, its first row number, its rows) in input order."""
    pending: list[pa.RecordBatch] = []
    rows = first = part = 0
    for _, batch in read_batches(inputs.files, job.text_column, job.part_rows, job.max_text_bytes):
        pending.append(_with_id_type(batch, job.id_column, inputs.id_type))
        rows += batch.num_rows
        while rows >= job.part_rows:
            table = pa.Table.from_batches(_unify(pending)).combine_chunks()
            yield part, first, table.slice(0, job.part_rows)
            rest = table.slice(job.part_rows)
            pending, rows = ([rest.to_batches()[0]] if rest.num_rows else []), rest.num_rows
            first, part = first + job.part_rows, part + 1
    if rows:
        yield part, first, pa.Table.from_batches(_unify(pending)).combine_chunks()


def _with_id_type(batch: pa.RecordBatch, column: str | None, kind: pa.DataType | None) -> pa.RecordBatch:
    if column is None or kind is None or batch.schema.field(column).type == kind:
        return batch
    at = batch.schema.get_field_index(column)
    return batch.set_column(at, pa.field(column, kind), pc.cast(batch.column(at), kind))


def _unify(batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """Batches of files whose inferred schemas differ (a column null in one file, text in another) as one schema."""
    schema = pa.unify_schemas([b.schema for b in batches], promote_options="permissive")
    return [
        pa.Table.from_batches([b]).cast(schema, safe=False).to_batches()[0] if b.schema != schema else b
        for b in batches
    ]


def digest(table: pa.Table, job: EmbedJob, start: int, stop: int) -> str:
    """A hash of rows [start, stop) as read: their text and id, so a changed input is noticed on resume."""
    h = hashlib.sha256()
    for name in (job.text_column, job.id_column):
        if name:
            for value in table.column(name).slice(start, stop - start).to_pylist():
                h.update(repr(value).encode("utf-8", "surrogatepass") + b"\x1f")
    return h.hexdigest()[:24]


def duplicate_ids(tables: Iterator[pa.Table]) -> tuple[int, Any]:
    """(rows whose id an earlier row has, one such id) over the `id` column of the tables."""
    ids = [t.column("id") for t in tables]
    if not ids:
        return 0, None
    counts = pc.value_counts(pa.chunked_array([c for a in ids for c in a.chunks], ids[0].type).combine_chunks())
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    extra = int(pc.sum(repeated.field("counts")).as_py() or 0) - len(repeated)
    return extra, repeated.field("values")[0].as_py() if len(repeated) else None


def input_ids(job: EmbedJob, inputs: Inputs) -> Iterator[pa.Table]:
    for part in parts(job, inputs):
        yield pa.table({"id": part[2].column(job.id_column)})
