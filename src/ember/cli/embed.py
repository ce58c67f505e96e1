"""`ember embed INPUT... -o OUTPUT`: embed a corpus of files into Parquet parts, with progress and resume.

The model runs in this process, or on running servers (`--url`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from ember.cli.model_flags import add_model_flags, add_process_flags, model_config, truncate
from ember.cli.runtime import isa_env, max_isa, maybe_reexec_with_allocator, native_config, prepare_process
from ember.config import RAY_BATCH_SIZE, REMOTE_BATCH_SIZE
from ember.errors import EmberError

__all__ = ["add_parser", "ray_settings", "run"]

log = logging.getLogger("ember.embed")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("embed", allow_abbrev=False, help="embed files (JSONL, CSV/TSV, Parquet, text) into Parquet")
    p.add_argument("inputs", nargs="+", help="files, directories of parts, or globs")
    p.add_argument("-o", "--output", required=True, help="output directory (Parquet parts and a manifest)")
    p.add_argument("--text-column", default="text", help="the column holding the text (default: text)")
    p.add_argument("--id-column", default=None, help="a column kept as `id` (default: the row number)")
    p.add_argument("--keep-columns", nargs="+", default=[], help="other input columns copied to the output")
    p.add_argument("--prompt-name", default=None, help="a prompt of the model's, e.g. query (Qwen3)")
    p.add_argument("--dimensions", type=int, default=None, help="Matryoshka truncation")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None, help="L2-normalise")
    add_model_flags(p, positional=False)  # every model flag `ember serve` takes (--truncate: cut, not skipped)
    p.add_argument("--part-rows", type=int, default=10_000, help="rows per output part (the unit of resume)")
    p.add_argument("--format", default="parquet", choices=["parquet", "npy"], help="npy: embeddings.npy + ids.parquet")
    p.add_argument("--overwrite", action="store_true", help="start over, deleting the parts of an earlier run")
    p.add_argument(
        "--unique-ids",
        action="store_true",
        help="refuse an input whose --id-column repeats a value "
        "(checked before any work; without it, repeats are counted and reported)",
    )
    p.add_argument("--cache", default=None, metavar="DIR", help="keep vectors by text: unchanged texts are not re-run")
    p.add_argument("--url", action="append", default=[], help="embed on this running server (repeat to spread)")
    p.add_argument("--api-key", default=None, help="bearer token for --url (default: $EMBER_API_KEY, $OPENAI_API_KEY)")
    batch = f"texts per --url request ({REMOTE_BATCH_SIZE}) or --ray batch ({RAY_BATCH_SIZE})"
    p.add_argument("--batch-size", type=int, default=None, help=batch)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per --url")
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="on a Ray cluster (ADDRESS, $RAY_ADDRESS, or a new local one); needs --id-column",
    )
    p.add_argument("--actors", type=int, default=None, help="with --ray: model copies (default: as the CPUs hold)")
    p.add_argument("--cpus-per-actor", type=int, default=None, help="with --ray: threads each (min(4, CPUs))")
    add_process_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to --url otherwise
    try:
        maybe_reexec_with_allocator(sys.argv[1:])
        if args.ray is not None:
            return _on_ray(args)  # threads are the actors' to size, not this driver's
        return _embed(args, prepare_process(args.threads, args.cpu_bind).threads)
    except EmberError as e:
        print(f"ember embed: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "ember embed: stopped at once; the rows written so far are kept: run the same command again to continue",
            file=sys.stderr,
        )
        return 130


def _options(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "model",
        "dtype",
        "quantization",
        "max_model_len",
        "pooler_config",
        "hf_overrides",
        "prompt_name",
        "dimensions",
        "normalize",
        "truncate",
    )
    options = {k: getattr(args, k) for k in keys}
    # what else changes the vectors, in the signature only when given (a job started without them resumes)
    options |= {k: getattr(args, k) for k in ("revision", "override_pooler_config") if getattr(args, k) is not None}
    return options


def _backend(args: argparse.Namespace, threads: int) -> tuple[Any, str, Any, int | None]:
    """(what embeds, the model's identity for the cache, what to close, the longest text worth reading in bytes, None
    when the model does not say): in-process, or the --url servers."""
    from ember.batch.backend import local
    from ember.batch.cache import model_fingerprint

    params = _params(args)
    if args.url:
        from ember.batch.remote import RemoteEmbedder

        key = args.api_key or os.environ.get("EMBER_API_KEY") or os.environ.get("OPENAI_API_KEY")
        remote = RemoteEmbedder(
            args.url,
            args.model,
            api_key=key,
            batch_size=args.batch_size or REMOTE_BATCH_SIZE,
            concurrency=args.concurrency,
            **params,
        )
        return remote, remote.model, remote.close, None
    from ember.offline import Embedder

    embedder = Embedder(threads=threads, native=native_config(), **_model_options(args))
    if embedder.info.task != "embed":
        info = embedder.info
        raise EmberError(
            f"{info.name} is a {info.task} model ({info.architecture}): ember embed needs an embedding model (--model)"
        )
    return local(embedder, **params), model_fingerprint(embedder.path), None, _longest_text(embedder)


BYTES_PER_TOKEN = 32
"""Bytes of text one token covers, at most, in practice (a long word, a run of spaces): a text longer than the
model's usable tokens times this could never be used whole."""


def _longest_text(embedder: Any) -> int | None:
    pooler = embedder.preprocessor.pooler
    tokens = embedder.info.max_model_len
    if pooler.enable_chunked_processing:
        if pooler.max_embed_len is None:
            return None
        tokens = pooler.max_embed_len
    return max(1 << 16, tokens * BYTES_PER_TOKEN)


def _params(args: argparse.Namespace) -> dict[str, Any]:
    """What changes each vector, whatever embeds it."""
    return {"dimensions": args.dimensions, "normalize": args.normalize, "prompt_name": args.prompt_name}


def _model_options(args: argparse.Namespace) -> dict[str, Any]:
    """`ember.Embedder`'s keywords for how the model is loaded and run (here, or in each Ray actor): the model flags'
    ModelConfig, as `ember serve` builds it."""
    return {"config": model_config(args), "auto_truncate": truncate(args), "enforce_eager": args.enforce_eager}


def _job(args: argparse.Namespace, max_text_bytes: int | None = None) -> Any:
    from ember.batch.files import MAX_LINE_BYTES
    from ember.batch.job import EmbedJob

    return EmbedJob(
        tuple(args.inputs),
        args.output,
        args.text_column,
        args.id_column,
        tuple(args.keep_columns),
        args.part_rows,
        args.overwrite,
        args.format,
        _options(args),
        min(MAX_LINE_BYTES, max_text_bytes or MAX_LINE_BYTES),
        args.unique_ids,
    )


def _embed(args: argparse.Namespace, threads: int) -> int:
    from ember.batch.cache import VectorCache
    from ember.batch.inputs import check_inputs
    from ember.batch.job import run_job

    inputs = check_inputs(_job(args))  # every named column, before a model is loaded
    embed, identity, close, longest = _backend(args, threads)
    job = _job(args, longest)
    cache = VectorCache(args.cache, identity, _options(args)) if args.cache else None
    try:
        with _Progress(inputs.files) as progress, _Stop() as stop:
            summary = run_job(job, embed, progress, stop.asked, cache, inputs)
    finally:
        if close is not None:
            close()
        if cache is not None:
            cache.close()
    if args.url:
        log.info("requests sent again after a 429/503 or a lost connection: %d", embed.retries)
    return _report(summary)


def ray_settings(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The actors' EmberEmbedder keywords and the workers' environment: the operator's EMBER_* and HF_* settings,
    and with EMBER_MAX_ISA the cap (each actor caps itself as `ember serve` does) and torch's limits for it."""
    embedder = {**_params(args), **_model_options(args)}
    env = {k: v for k, v in os.environ.items() if k.startswith(("EMBER_", "HF_"))}
    tier = max_isa()
    if tier is not None:
        embedder["max_isa"] = tier
        env.update(isa_env(tier))
    return embedder, env


def _on_ray(args: argparse.Namespace) -> int:
    """The same job on a Ray cluster: `ember.ray.run_on_ray` with this command's model options."""
    if args.url or args.cache:
        raise EmberError("--ray loads the model on the cluster's actors: it takes neither --url nor --cache")
    try:
        from ember.ray import run_on_ray
    except ImportError:
        raise EmberError("--ray needs Ray: pip install 'ember[ray]'") from None
    if args.ray and _looks_like_input(args.ray):
        raise EmberError(
            f"--ray took {args.ray!r} as the cluster's address: put --ray after the inputs, or name the "
            "address (--ray auto, --ray HOST:PORT, --ray ray://HOST:10001)"
        )
    embedder, env = ray_settings(args)
    try:
        summary = run_on_ray(
            _job(args),
            embedder,
            address=args.ray,
            env=env,
            actors=args.actors,
            cpus_per_actor=args.cpus_per_actor,
            batch_size=args.batch_size or RAY_BATCH_SIZE,
        )
    except EmberError:
        raise
    except Exception as e:  # Ray's own failures (no cluster at that address, a task that failed for good)
        log.debug("the Ray job failed", exc_info=True)
        raise EmberError(f"the Ray job failed: {type(e).__name__}: {e}") from e
    return _report(summary)


def _looks_like_input(value: str) -> bool:
    """A path, glob or data URI rather than a Ray address (auto, HOST:PORT, ray://...)."""
    import glob
    from pathlib import Path

    from ember.batch.files import file_format

    data = file_format(Path(value)) != "text"
    return value.startswith(("s3:", "gs:", "file:", "/", ".")) or data or bool(glob.glob(value))


def _report(summary: Any) -> int:
    """The summary line on stderr, the same as JSON on stdout; exit status 130 when interrupted."""
    print(summary.line(), file=sys.stderr)
    print(
        json.dumps(
            {
                "documents": summary.documents,
                "embedded": summary.embedded,
                "cached": summary.cached,
                "tokens": summary.tokens,
                "seconds": round(summary.seconds, 3),
                "skipped": dict(summary.skipped),
                "interrupted": summary.interrupted,
            }
        )
    )
    return 130 if summary.interrupted else 0


class _Stop:
    """SIGINT/SIGTERM: finish the slice in flight (seconds of work), write what is done, then stop (a second SIGINT
    stops at once; the slice in flight is then lost, never half-written)."""

    def __init__(self) -> None:
        self.signalled = False

    def __enter__(self) -> _Stop:
        self._old = {s: signal.signal(s, self._ask) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _ask(self, sig: int, frame: Any) -> None:
        if self.signalled and sig == signal.SIGINT:
            raise KeyboardInterrupt
        self.signalled = True
        log.warning("stopping after the rows in flight, keeping every row done (Ctrl-C again to stop at once)")

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def asked(self) -> bool:
        return self.signalled


class _Progress:
    """A tqdm bar (rows of the total, tokens/s, ETA) on a terminal; a log line every 10 s otherwise. The total is
    counted on a thread (Parquet footers, newlines) while the job starts."""

    def __init__(self, files: list[Any]) -> None:
        self.files = files
        self.total: int | None = None

    def __enter__(self) -> _Progress:
        import threading

        from tqdm import tqdm

        self.bar = tqdm(unit=" rows", dynamic_ncols=True) if sys.stderr.isatty() else None
        self.rows = self.tokens = 0
        self.start = self.last = time.perf_counter()
        threading.Thread(target=self._count, name="ember-embed-count", daemon=True).start()
        return self

    def _count(self) -> None:
        from ember.batch.files import count_rows

        try:
            self.total = count_rows(self.files)
        except OSError:
            return
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def __call__(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens
        elapsed = max(1e-9, time.perf_counter() - self.start)
        rate = self.tokens / elapsed
        if self.bar is not None:
            self.bar.update(rows)
            self.bar.set_postfix_str(f"{rate:.0f} tokens/s")
        elif time.perf_counter() - self.last >= 10:
            self.last = time.perf_counter()
            of = f" of {self.total}" if self.total else ""
            left = (self.total - self.rows) / (self.rows / elapsed) if self.total and self.rows else None
            eta = f", about {left:.0f} s left" if left is not None and left > 0 else ""
            log.info("%d rows%s, %d tokens, %.0f tokens/s%s", self.rows, of, self.tokens, rate, eta)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
