"""Reading a corpus: JSONL, CSV/TSV, Parquet (files, directories of parts, globs) or plain text, in record batches.

Rows come in a fixed order (inputs in the order given, a directory's and a glob's files sorted), so a row's
number is the same on every run: that is what resume relies on. Memory stays flat: pyarrow reads in batches.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from ember.errors import ConfigError, InputError

__all__ = ["file_format", "input_files", "read_batches"]

_FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}


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


def read_batches(files: list[Path], text_column: str, rows: int) -> Iterator[tuple[Path, pa.RecordBatch]]:
    """(file, batch of at most `rows` rows) for every file in order; plain text is one document per line, in a
    column named `text_column`. A file that cannot be parsed is an InputError naming it (and the row, where the
    reader says)."""
    for path in files:
        try:
            for batch in _batches(path, text_column, rows):
                yield path, batch
        except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read {path}: {e}", "input") from None


def _batches(path: Path, text_column: str, rows: int) -> Iterator[pa.RecordBatch]:
    kind = file_format(path)
    if kind == "text":
        yield from _text_lines(path, text_column, rows)
        return
    if kind == "parquet":
        # Row group by row group. pyarrow.dataset's scanner reads ahead while its consumer works, whatever its
        # readahead settings: beside a model it held most of a 20,000-row file decoded (75 MiB of a 21 MB file,
        # measured), so memory grew with the file; this reader holds the row group it is in.
        with pq.ParquetFile(path) as f:
            yield from f.iter_batches(batch_size=rows)
        return
    if kind == "json":
        with pa_json.open_json(str(path), read_options=pa_json.ReadOptions(block_size=1 << 22)) as reader:
            for batch in reader:
                yield from pa.Table.from_batches([batch]).to_batches(max_chunksize=rows)
        return
    options = pa_csv.ParseOptions(delimiter="\t" if kind == "tsv" else ",", newlines_in_values=True)
    with pa_csv.open_csv(str(path), parse_options=options) as reader:
        for batch in reader:
            yield from pa.Table.from_batches([batch]).to_batches(max_chunksize=rows)


def _text_lines(path: Path, column: str, rows: int) -> Iterator[pa.RecordBatch]:
    """One document per line; bytes that are not UTF-8 are replaced (U+FFFD), never fatal."""
    lines: list[str] = []
    with path.open("rb") as f:
        for raw in f:
            lines.append(raw.rstrip(b"\r\n").decode("utf-8", errors="replace"))
            if len(lines) == rows:
                yield pa.record_batch({column: pa.array(lines, pa.string())})
                lines = []
    if lines:
        yield pa.record_batch({column: pa.array(lines, pa.string())})
