"""Reading a corpus: JSONL, CSV/TSV, Parquet (files, directories of parts, globs) or plain text, in record batches.

Rows come in a fixed order (inputs in the order given, a directory's and a glob's files sorted), so a row's
number is the same on every run: that is what resume relies on. Memory stays flat: pyarrow reads in batches, and
a line of plain text or JSONL longer than `max_line_bytes` is skipped while it streams past, never held whole (it
still counts as a row, so row numbers do not move). A text column must hold text: bytes are decoded as UTF-8, and
a value that is not UTF-8 is refused and counted, never embedded as a repr.
"""

from __future__ import annotations

import glob
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from ember.errors import ConfigError, InputError

__all__ = [
    "MAX_LINE_BYTES",
    "NOT_UTF8",
    "TOO_LONG",
    "Source",
    "count_rows",
    "decode_text",
    "file_format",
    "input_files",
    "read_batches",
    "sources",
]

_FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}

MAX_LINE_BYTES = 16 << 20
"""A line of plain text or JSONL above this is skipped as it is read (the job may set a tighter bound from the
model's context: a text that long could never be used whole)."""

TOO_LONG = "\x00ember: line too long\x00"
NOT_UTF8 = "\x00ember: not UTF-8\x00"
"""Stand-ins the readers put in the text column of a row they could not read as text, so the row keeps its number
and is counted by reason (`backend.usable_texts`)."""


def input_files(inputs: list[str]) -> list[Path]:
    """Each INPUT as files: itself, a directory's files (sorted), or a glob's matches (sorted)."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith((".", "_")))
        elif path.is_file():
            files.append(path)
        else:
            matches = sorted(Path(p) for p in glob.glob(item) if Path(p).is_file())
            if not matches:
                raise ConfigError(f"input {item!r} is not a file, a directory or a glob that matches files")
            files += matches
    return files


def file_format(path: Path) -> str:
    """json, csv, tsv, parquet or text (anything else), from the file's suffix."""
    return _FORMATS.get(path.suffix.lower(), "text")


@dataclass(frozen=True)
class Source:
    """An input file as its first rows show it: its columns and their types."""

    path: Path
    schema: pa.Schema


def sources(files: list[Path], text_column: str, max_line_bytes: int = MAX_LINE_BYTES) -> list[Source]:
    """Each file's columns, read from its first rows only (Parquet: its footer), before any model is loaded."""
    found = []
    for path in files:
        try:
            if file_format(path) == "parquet":
                schema = pq.read_schema(path)
            else:
                first = next(_batches(path, text_column, 64, max_line_bytes), None)
                schema = first.schema if first is not None else pa.schema([(text_column, pa.string())])
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
            raise InputError(f"cannot read {path}: {e}", "input") from None
        found.append(Source(path, schema))
    return found


def count_rows(files: list[Path]) -> int:
    """Rows in the inputs: Parquet's footers, else newlines (a CSV value spanning lines counts twice: an estimate,
    for a progress bar's total only)."""
    total = 0
    for path in files:
        if file_format(path) == "parquet":
            total += pq.ParquetFile(path).metadata.num_rows
            continue
        lines, last = 0, b"\n"
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                lines += block.count(b"\n")
                last = block[-1:]
        total += lines + (last != b"\n") - (file_format(path) in ("csv", "tsv"))
    return max(total, 0)


def read_batches(
    files: list[Path], text_column: str, rows: int, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[tuple[Path, pa.RecordBatch]]:
    """(file, batch of at most `rows` rows) for every file in order; plain text is one document per line, in a
    column named `text_column`. A file that cannot be parsed is an InputError naming it (and the row, where the
    reader says)."""
    for path in files:
        try:
            for batch in _batches(path, text_column, rows, max_line_bytes):
                yield path, batch
        except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read {path}: {e}", "input") from None


def _batches(path: Path, text_column: str, rows: int, max_line_bytes: int) -> Iterator[pa.RecordBatch]:
    kind = file_format(path)
    if kind == "text":
        yield from _text_lines(path, text_column, rows, max_line_bytes)
        return
    if kind == "parquet":
        # Row group by row group. pyarrow.dataset's scanner reads ahead while its consumer works, whatever its
        # readahead settings: beside a model it held most of a 20,000-row file decoded (75 MiB of a 21 MB file,
        # measured), so memory grew with the file; this reader holds the row group it is in.
        with pq.ParquetFile(path) as f:
            yield from f.iter_batches(batch_size=rows)
        return
    if kind == "json":
        yield from _json_lines(path, text_column, rows, max_line_bytes)
        return
    options = pa_csv.ParseOptions(delimiter="\t" if kind == "tsv" else ",", newlines_in_values=True)
    with pa_csv.open_csv(str(path), parse_options=options) as reader:
        for batch in reader:
            yield from pa.Table.from_batches([batch]).to_batches(max_chunksize=rows)


def _lines(f: BinaryIO, max_line_bytes: int) -> Iterator[bytes | None]:
    """Each line without its end; None for a line longer than `max_line_bytes`, skipped without holding it."""
    while raw := f.readline(max_line_bytes + 1):
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield None
            continue
        yield raw.rstrip(b"\r\n")


def _text_lines(path: Path, column: str, rows: int, max_line_bytes: int) -> Iterator[pa.RecordBatch]:
    """One document per line; bytes that are not UTF-8 are replaced (U+FFFD), never fatal."""
    lines: list[str] = []
    with path.open("rb") as f:
        for raw in _lines(f, max_line_bytes):
            lines.append(TOO_LONG if raw is None else raw.decode("utf-8", errors="replace"))
            if len(lines) == rows:
                yield pa.record_batch({column: pa.array(lines, pa.string())})
                lines = []
    if lines:
        yield pa.record_batch({column: pa.array(lines, pa.string())})


_JSON_BLOCK = 4 << 20


def _json_lines(path: Path, column: str, rows: int, max_line_bytes: int) -> Iterator[pa.RecordBatch]:
    """JSONL in blocks of whole lines parsed by pyarrow, the first block's schema held for the rest. A line that is
    too long or not UTF-8 becomes a row holding only a stand-in text; a line that is not JSON is an error naming
    its line number."""
    schema: pa.Schema | None = None
    block: list[bytes] = []
    size = first_line = 0
    line_no = 0

    def parse() -> Iterator[pa.RecordBatch]:
        nonlocal schema
        options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer")
        data = b"\n".join(block) + b"\n"
        reading = pa_json.ReadOptions(block_size=max(1 << 20, len(data) + 1))  # a line never straddles two blocks
        try:
            table = pa_json.read_json(io.BytesIO(data), read_options=reading, parse_options=options)
        except pa.ArrowInvalid as e:
            raise InputError(f"cannot read {path} (lines {first_line + 1}-{line_no}): {e}", "input") from None
        if schema is None:  # types the first block settled (a column null so far is still open)
            schema = pa.schema([f for f in table.schema if f.type != pa.null()])
        yield from table.to_batches(max_chunksize=rows)

    with path.open("rb") as f:
        for raw in _lines(f, max_line_bytes):
            line_no += 1
            if raw is not None and not raw.strip():
                continue  # a blank line is no row
            if raw is None:
                raw = _stand_in(column, TOO_LONG)
            else:
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    raw = _stand_in(column, NOT_UTF8)
            if not block:
                first_line = line_no - 1
            block.append(raw)
            size += len(raw)
            if size >= _JSON_BLOCK:
                yield from parse()
                block, size = [], 0
        if block:
            yield from parse()


def _stand_in(column: str, text: str) -> bytes:
    return json.dumps({column: text}).encode()


def decode_text(value: Any) -> str | None:
    """A text column's value as text: str as is, UTF-8 bytes decoded, None for bytes that are not UTF-8."""
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else str(value)
