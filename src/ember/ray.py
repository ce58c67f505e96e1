"""ember on a Ray cluster: `EmberEmbedder`, a callable class for `ray.data.Dataset.map_batches`.

    ds = ray.data.read_parquet("s3://bucket/corpus/")
    ds = ds.map_batches(EmberEmbedder, fn_constructor_kwargs={"model": "Qwen/Qwen3-Embedding-0.6B"},
                        concurrency=8, num_cpus=4, batch_size=256, batch_format="pyarrow")
    ds.write_parquet("s3://bucket/vectors/")

Each actor loads the model once and sizes its threads to the CPUs Ray gave it (`num_cpus`), not to the node's
cores. Rows the model cannot take (null, blank, refused) are dropped from the output and logged with the reason:
one bad row never fails a block. Needs `pip install 'ember[ray]'`.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from ember.batch.backend import local, usable_texts
from ember.errors import ConfigError
from ember.offline import Embedder

__all__ = ["EmberEmbedder"]

log = logging.getLogger("ember.ray")


def _assigned_cpus() -> int | None:
    """The CPUs Ray reserved for this actor or task (None outside Ray)."""
    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None  # the driver, or outside Ray
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else None


class EmberEmbedder:
    """A callable class for `map_batches`: adds `embedding` (float32 vectors) and `tokens` to each batch.

    Batches may be pyarrow Tables (`batch_format="pyarrow"`: the embedding is a fixed_size_list<float32>, as
    `ember embed` writes it), pandas DataFrames, or dicts of numpy arrays (Ray's default: an (N, D) array).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        text_column: str = "text",
        output_column: str = "embedding",
        dimensions: int | None = None,
        normalize: bool | None = None,
        prompt_name: str | None = None,
        threads: int | None = None,
        **embedder_options: Any,
    ) -> None:
        self.text_column, self.output_column = text_column, output_column
        self.threads = threads or _assigned_cpus()
        self.embedder = Embedder(model, threads=self.threads, **embedder_options)
        self._embed = local(self.embedder, dimensions=dimensions, normalize=normalize, prompt_name=prompt_name)
        self.skipped: Counter[str] = Counter()

    def info(self) -> dict[str, Any]:
        """What this actor runs: the model, its vector width and the threads it uses."""
        return {"model": self.embedder.info.name, "dimension": self.embedder.info.dimension, "threads": self.threads}

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, pa.Table):
            return self._arrow(batch)
        if isinstance(batch, dict):
            table = self._arrow(pa.table({k: list(v) if np.ndim(v) > 1 else v for k, v in batch.items()}))
            out = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
            out[self.output_column] = _vectors(table.column(self.output_column))
            return out
        return self._arrow(pa.Table.from_pandas(batch, preserve_index=False)).to_pandas()

    def _arrow(self, table: pa.Table) -> pa.Table:
        if self.text_column not in table.column_names:
            raise ConfigError(f"the dataset has no column {self.text_column!r}; it has {table.column_names}")
        keep, texts, skipped = usable_texts(table.column(self.text_column).to_pylist())
        done = self._embed(texts) if texts else None
        if done is not None:
            skipped += Counter(done.refused.values())
        ok = [k for k in range(len(texts)) if done is None or k not in done.refused]
        if skipped:
            self.skipped += skipped
            log.warning("rows skipped in this block: %s", dict(skipped))
        kept = table.take(pa.array([keep[k] for k in ok], pa.int64()))
        dim = done.vectors.shape[1] if done is not None else 0
        vectors = done.vectors[ok] if done is not None else np.zeros((0, dim), np.float32)
        tokens = [done.tokens[k] for k in ok] if done is not None and done.tokens is not None else [None] * len(ok)
        flat = pa.array(np.ascontiguousarray(vectors, np.float32).reshape(-1), pa.float32())
        kept = kept.append_column(self.output_column, pa.FixedSizeListArray.from_arrays(flat, dim))
        return kept.append_column("tokens", pa.array(tokens, pa.int32()))


def _vectors(column: pa.ChunkedArray) -> np.ndarray:
    flat = column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(len(column), -1)
