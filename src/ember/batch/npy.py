"""`--format npy`: the finished parts gathered into `embeddings.npy` (float32, N x D) and `ids.parquet`.

Row i of `ids.parquet` (id, tokens and any kept columns) is row i of `embeddings.npy`. The parts stay the unit of
resume while the job runs; once every part is done they are copied, one at a time (memory stays flat), into the
two files, written under temporary names and renamed, recorded in the manifest, and only then deleted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["assemble"]


def assemble(out: Path, dim: int, record: Callable[[dict[str, Any]], None]) -> None:
    """Gather the parts (in name order: part, then offset) into the two files, record it, then delete the parts."""
    parts = sorted(out.glob("part-*.parquet"))
    files = [pq.ParquetFile(p) for p in parts]
    rows = sum(f.metadata.num_rows for f in files)
    tmp_vectors, tmp_ids = out / ".embeddings.npy.tmp", out / ".ids.parquet.tmp"
    vectors = np.lib.format.open_memmap(tmp_vectors, mode="w+", dtype=np.float32, shape=(rows, dim))
    writer: pq.ParquetWriter | None = None
    at = 0
    for f in files:
        table = f.read()
        n = table.num_rows
        if not n:  # a part whose rows were all skipped
            continue
        flat = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        vectors[at : at + n] = flat.reshape(n, dim)
        at += n
        rest = table.drop_columns(["embedding"])
        if writer is None:
            writer = pq.ParquetWriter(str(tmp_ids), rest.schema)
        writer.write_table(rest.cast(writer.schema) if rest.schema != writer.schema else rest)
    vectors.flush()
    del vectors
    if writer is None:
        pq.write_table(pa.table({"id": pa.array([], pa.int64()), "tokens": pa.array([], pa.int32())}), str(tmp_ids))
    else:
        writer.close()
    os.replace(tmp_vectors, out / "embeddings.npy")
    os.replace(tmp_ids, out / "ids.parquet")
    record({"assembled": True, "rows": rows, "dimension": dim})
    for p in parts:
        p.unlink()
