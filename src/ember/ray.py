"""ember on a Ray cluster: `EmberEmbedder`, a callable class for `ray.data.Dataset.map_batches`, and `run_on_ray`,
the `ember embed --ray` job built from it.

    ds = ray.data.read_parquet("s3://bucket/corpus/")
    ds = ds.map_batches(EmberEmbedder, fn_constructor_kwargs={"model": "Qwen/Qwen3-Embedding-0.6B"},
                        concurrency=8, num_cpus=4, batch_size=256, batch_format="pyarrow")
    ds.write_parquet("s3://bucket/vectors/")

Each actor loads the model once and sizes its threads to the CPUs Ray gave it (`num_cpus`), not to the node's
cores. Rows the model cannot take (null, blank, refused) are dropped from the output and logged with the reason:
one bad row never fails a block. Needs `pip install 'ember[ray]'`.

Every stage but the actors reserves no CPU (`num_cpus=0`), and the actor pool starts with one actor and grows to
its size: Ray Data's file listing needs a free CPU when the job starts, and a pool that took every CPU at once
would leave it waiting forever.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.dataset as pa_ds
import pyarrow.fs as pa_fs
import ray

from ember.batch.backend import local, usable_texts
from ember.batch.files import file_format, input_files
from ember.batch.job import EmbedJob, JobSummary
from ember.config import RAY_BATCH_SIZE
from ember.errors import ConfigError
from ember.hardware import check_tier, isa_tier, limit_isa
from ember.offline import Embedder
from ember.resources import cpu_budget

__all__ = ["EmberEmbedder", "run_on_ray"]

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
    `max_isa` (a tier of ember.hardware.ISA_TIERS) runs the actor as a CPU of that tier would, as EMBER_MAX_ISA does
    `ember serve`, and is refused on a node whose CPU is below it; torch's own limits (ONEDNN_MAX_CPU_ISA,
    MKL_ENABLE_INSTRUCTIONS, ATEN_CPU_CAPABILITY, a TORCHINDUCTOR_CACHE_DIR of the tier's own) belong in the
    workers' runtime_env, as `ember embed --ray` sets them (ember.cli.runtime.isa_env).
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
        max_isa: str | None = None,
        **embedder_options: Any,
    ) -> None:
        if max_isa is not None:  # before the model is built: its kernels are chosen from the capped flags
            limit_isa(check_tier(max_isa))  # this node's CPU may be below the driver's: refused, never SIGILL
        self.text_column, self.output_column = text_column, output_column
        self.threads = threads or _assigned_cpus()
        # All of the actor's model work runs on one thread of its own. OpenMP keeps a pool of workers for every
        # thread that ran parallel work, and Ray runs __init__ and __call__ on different threads: with two pools
        # (more pooled workers than CPUs) the workers sleep between kernels instead of spinning.
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="ember-model")
        self.embedder = self._model_thread.submit(Embedder, model, threads=self.threads, **embedder_options).result()
        self._embed = local(self.embedder, dimensions=dimensions, normalize=normalize, prompt_name=prompt_name)
        width = self._model_thread.submit(self._embed, ["width"]).result()
        self.dimension = width.vectors.shape[1]  # as the options make it, for blocks all dropped
        self.skipped: Counter[str] = Counter()

    def info(self) -> dict[str, Any]:
        """What this actor runs: the model, its vector width, the threads it uses and its instruction-set tier."""
        info = self.embedder.info
        return {"model": info.name, "dimension": info.dimension, "threads": self.threads, "isa": isa_tier()}

    def __call__(self, batch: Any) -> Any:
        return self._model_thread.submit(self._call, batch).result()

    def _call(self, batch: Any) -> Any:
        if isinstance(batch, pa.Table):
            return self._arrow(batch)
        if isinstance(batch, dict):
            table = self._arrow(pa.table({k: list(v) if np.ndim(v) > 1 else v for k, v in batch.items()}))
            out = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
            out[self.output_column] = _vectors(table.column(self.output_column), self.dimension)
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
        dim = self.dimension  # also when every row of the block was dropped
        vectors = done.vectors[ok] if done is not None else np.zeros((0, dim), np.float32)
        tokens = [done.tokens[k] for k in ok] if done is not None and done.tokens is not None else [None] * len(ok)
        flat = pa.array(np.ascontiguousarray(vectors, np.float32).reshape(-1), pa.float32())
        kept = kept.append_column(self.output_column, pa.FixedSizeListArray.from_arrays(flat, dim))
        return kept.append_column("tokens", pa.array(tokens, pa.int32()))


def _vectors(column: pa.ChunkedArray, dimension: int) -> np.ndarray:
    flat = column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(len(column), dimension)


NO_CPU: dict[str, Any] = {"num_cpus": 0}
"""Reading, column selection and writing: cheap beside the model, and never waiting for a CPU an actor holds."""

BLOCK_BYTES = (16 << 10, 256 << 10)
"""Input blocks of 16-256 KiB of text (some 4,000-65,000 tokens), not Ray's default of up to 128 MiB: a block is
what one actor takes at a time, so small blocks spread a corpus over every actor and show progress as it goes."""


def run_on_ray(
    job: EmbedJob,
    embedder: dict[str, Any],
    *,
    address: str | None = None,
    env: dict[str, str] | None = None,
    actors: int | None = None,
    cpus_per_actor: int | None = None,
    batch_size: int = RAY_BATCH_SIZE,
) -> JobSummary:
    """`ember embed --ray`: read the inputs with Ray Data, embed them on a pool of `EmberEmbedder` actors
    (`embedder`: their constructor's keywords) and write Parquet into `job.output`. The cluster: the one this
    process is connected to, else `ray.init(address)` (None: $RAY_ADDRESS or a new local one) with `env` set in
    its workers. Rows need ids (`job.id_column`): they are read in parallel, so row numbers mean nothing.
    Default: actors of min(4, the largest node's CPUs) CPUs each, as many as the nodes hold."""
    if not job.id_column:
        raise ConfigError("--ray needs --id-column: rows are read in parallel, so their numbers are not stable ids")
    if job.format != "parquet":
        raise ConfigError("--ray writes Parquet; --format npy is for one machine")
    clash = sorted({job.id_column, "id", "embedding", "tokens"} & set(job.keep_columns))
    if clash:
        raise ConfigError(f"--keep-columns {clash}: the output has them already (id, embedding, tokens)")
    output = _Output.check(job)
    connect = not ray.is_initialized()
    if connect:
        ray.init(address=address or None, runtime_env={"env_vars": env or {}}, **_local_cluster(address))
    try:
        return _run(job, embedder, output, actors, cpus_per_actor, batch_size)
    finally:
        if connect:
            ray.shutdown()


def _run(
    job: EmbedJob,
    embedder: dict[str, Any],
    output: _Output,
    actors: int | None,
    cpus_per_actor: int | None,
    batch_size: int,
) -> JobSummary:
    start = time.perf_counter()
    context = ray.data.DataContext.get_current()
    sizes = context.target_min_block_size, context.target_max_block_size
    context.target_min_block_size, context.target_max_block_size = BLOCK_BYTES
    try:
        source = _read(job)  # the dataset keeps a copy of the context as it is now
    finally:
        context.target_min_block_size, context.target_max_block_size = sizes
    per_actor, pool = _pool(cpus_per_actor, actors)
    output.replace(job)  # the inputs are readable: now an earlier run's files may go
    fs, root = output.fs, output.root
    rows_in = source.count()
    log.info("embedding %d rows on up to %d actor(s) of %d CPU(s)", rows_in, pool, per_actor)
    out = source.map_batches(
        EmberEmbedder,
        fn_constructor_kwargs={"text_column": job.text_column, **embedder},
        concurrency=(1, pool),
        num_cpus=per_actor,
        batch_size=batch_size,
        batch_format="pyarrow",
    )
    out = out.select_columns(["id", "embedding", "tokens", *job.keep_columns], num_cpus=0)
    out.write_parquet(root, filesystem=fs, min_rows_per_file=job.part_rows, ray_remote_args=NO_CPU)
    files = _parquet_files(fs, root)
    written = pa_ds.dataset(files, filesystem=fs, format="parquet") if files else None
    summary = JobSummary(documents=written.count_rows() if written else 0, seconds=time.perf_counter() - start)
    summary.embedded = summary.documents
    if written is not None:
        summary.tokens = int(pc.sum(written.to_table(columns=["tokens"]).column("tokens")).as_py() or 0)
    if rows_in > summary.documents:
        summary.skipped["null, blank or refused (the actors' log says which and why)"] = rows_in - summary.documents
    return summary


def _local_cluster(address: str | None) -> dict[str, Any]:
    """A local cluster started here gets one logical CPU beyond the container's: Ray Data's own small tasks (the
    file listing) need a free CPU to start, and the actors would otherwise hold every one (a deadlock on machines
    of 4 CPUs or fewer)."""
    if address or os.environ.get("RAY_ADDRESS"):
        return {}
    cpus = cpu_budget().usable
    log.info("starting a local Ray cluster: %d CPU(s) for the actors, one more for Ray Data's own tasks", cpus)
    return {"num_cpus": cpus + 1}


def _pool(cpus_per_actor: int | None, actors: int | None) -> tuple[int, int]:
    """(CPUs per actor, actors): an actor must fit on one node; by default min(4, the largest node's CPUs) each,
    as many as the nodes hold. The pool starts with one actor and grows, so it is that first actor that must leave
    Ray Data a CPU for its file listing (holding every CPU, the job waited forever)."""
    nodes = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    largest = max(nodes, default=0)
    per_actor = cpus_per_actor or max(1, min(4, largest))
    if per_actor > largest:
        raise ConfigError(f"--cpus-per-actor {per_actor}: no node of this cluster has that many CPUs ({largest})")
    pool = actors or max(1, sum(n // per_actor for n in nodes))
    if per_actor >= sum(nodes):  # the pool's first actor would hold every CPU: the file listing never starts
        if cpus_per_actor is not None:
            raise ConfigError(
                f"--cpus-per-actor {per_actor} would hold every CPU of the cluster ({sum(nodes)}), and "
                "Ray Data's file listing needs one: ask for fewer"
            )
        per_actor -= 1
    return per_actor, pool


MARKER = "_ember_ray.json"
"""Written into the output by `--ray`: `--overwrite` deletes Parquet files only where it finds it."""


def _parquet_files(fs: pa_fs.FileSystem, root: str) -> list[str]:
    return [path for path in _files(fs, root) if path.endswith(".parquet")]


def _files(fs: pa_fs.FileSystem, root: str) -> list[str]:
    return sorted(
        i.path for i in fs.get_file_info(pa_fs.FileSelector(root, allow_not_found=True, recursive=True)) if i.is_file
    )


def _overlap(out: Path, source: Path) -> bool:
    """True when an input lies in the output, or the output in an input directory (a rerun would read it)."""
    return out == source or out in source.parents or (source.is_dir() and out.is_relative_to(source))


@dataclass
class _Output:
    """The output directory: its filesystem, path, and the Parquet files an earlier `--ray` run left there."""

    fs: pa_fs.FileSystem
    root: str
    earlier: list[str]

    @classmethod
    def check(cls, job: EmbedJob) -> _Output:
        """Refused: a directory overlapping the inputs, one holding files ember did not write, or an earlier
        run's output without `overwrite`."""
        output = job.output
        fs, root = pa_fs.FileSystem.from_uri(output if "://" in output else os.path.abspath(output))
        if "://" not in output and any(_overlap(Path(root), Path(i).resolve()) for i in job.inputs if "://" not in i):
            raise ConfigError(f"{output} overlaps the inputs: choose another output directory")
        found = _files(fs, root)
        ours = [path for path in found if path.endswith(".parquet")]
        marked = any(path.endswith("/" + MARKER) for path in found)
        if len(ours) + marked < len(found) or (ours and not marked):
            raise ConfigError(f"{output} holds files ember did not write: choose an empty output directory")
        if ours and not job.overwrite:
            raise ConfigError(f"{output} holds the output of an earlier run: pass --overwrite to replace it")
        return cls(fs, root, ours)

    def replace(self, job: EmbedJob) -> None:
        """Delete the earlier run's Parquet files (nothing else) and mark the directory as this job's."""
        for path in self.earlier:
            self.fs.delete_file(path)
        self.fs.create_dir(self.root, recursive=True)
        with self.fs.open_output_stream(f"{self.root}/{MARKER}") as f:
            f.write(json.dumps({"inputs": list(job.inputs), "options": job.options}, default=str).encode())


def _read(job: EmbedJob) -> ray.data.Dataset:
    """The inputs as one dataset of the id (renamed `id`), text and kept columns; one format per job."""
    paths = [p for item in job.inputs for p in ([item] if "://" in item else map(str, input_files([item])))]
    kinds = {"parquet" if "://" in p and file_format(Path(p)) == "text" else file_format(Path(p)) for p in paths}
    if len(kinds) > 1:
        raise ConfigError(f"--ray reads one input format per job; these inputs are {sorted(kinds)}")
    kind = kinds.pop()
    if kind == "text":
        raise ConfigError("--ray needs an id per row, which plain text has not: use JSONL, CSV or Parquet")
    if kind == "parquet":
        source = ray.data.read_parquet(paths, num_cpus=0)
    elif kind == "json":  # pyarrow's reader, as on one machine: string ids stay strings
        source = ray.data.read_json(paths, num_cpus=0, file_extensions=None)
    else:
        options = pa_csv.ParseOptions(delimiter="\t" if kind == "tsv" else ",", newlines_in_values=True)
        source = ray.data.read_csv(paths, parse_options=options, num_cpus=0, file_extensions=None)
    wanted = list(dict.fromkeys([job.id_column or "id", job.text_column, *job.keep_columns]))
    missing = [c for c in wanted if c not in source.schema().names]
    if missing:
        raise ConfigError(f"the input has no column(s) {missing}; it has {source.schema().names}")
    source = source.select_columns(wanted, num_cpus=0)
    if job.id_column not in (None, "id"):
        source = source.rename_columns({job.id_column: "id"}, num_cpus=0)
    return source
