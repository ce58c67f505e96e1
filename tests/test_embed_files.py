"""`ember embed` over files: formats and columns, the output schema read back, bad rows, dedupe, the cache, the
npy output, resume after the process is killed mid-run, and `--url` against real servers answering 429."""

import json
import os
import signal
import subprocess
import sys
import time

import duckdb
import httpx
import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from checkpoints import build_bert
from corpus import SENTENCES
from ember import Embedder
from ember.batch.backend import Embedded
from ember.batch.cache import VectorCache
from ember.batch.job import EmbedJob, run_job
from ember.errors import ConfigError, InputError
from server import Server

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBER_NATIVE_ATTENTION": "0", "EMBER_NATIVE_INT8": "0",
       "EMBER_NATIVE_ELEMENTWISE": "0", "EMBER_NATIVE_LINEAR": "0",
       "EMBER_NATIVE_LINEAR_F32": "0", "EMBER_NATIVE_LINEAR_BF16": "0"}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert") / "m", layers=1, hidden=32, max_position=64)


@pytest.fixture(scope="module")
def embedder(model):
    return Embedder(str(model), dtype="float32", enforce_eager=True)


def ember_embed(model, *argv, wait=True):
    cmd = [sys.executable, "-m", "ember.cli.main", "embed", *argv, "--model", str(model), "--dtype", "float32",
           "--enforce-eager"]  # fmt: skip
    if not wait:
        return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


def read(out):
    return pq.read_table(str(out)).sort_by("id").to_pydict()


def test_every_format_gives_the_embedders_vectors_with_ids_tokens_and_kept_columns(tmp_path, model, embedder):
    texts = SENTENCES[:12]
    rows = [{"text": t, "doc": f"d{i}", "lang": "en"} for i, t in enumerate(texts)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    pa_csv.write_csv(pa.Table.from_pylist(rows[4:8]), str(tmp_path / "b.csv"))
    pq.write_table(pa.Table.from_pylist(rows[8:]), str(tmp_path / "c.parquet"))
    out = tmp_path / "out"
    done = ember_embed(model, str(tmp_path / "a.jsonl"), str(tmp_path / "b.csv"), str(tmp_path / "*.parquet"),
                       "-o", str(out), "--id-column", "doc", "--keep-columns", "lang", "--part-rows", "5")  # fmt: skip
    assert done.returncode == 0, done.stderr
    table = pq.read_table(str(out))
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    assert table.schema.field("tokens").type == pa.int32() and table.column("lang").to_pylist() == ["en"] * 12
    got = dict(zip(table.column("id").to_pylist(), np.array(table.column("embedding").to_pylist()), strict=True))
    expected = embedder.embed(texts)
    for i in range(len(texts)):
        np.testing.assert_allclose(got[f"d{i}"], expected.vectors[i], atol=1e-5)
    assert table.column("tokens").to_pylist() == expected.token_counts
    assert duckdb.sql(f"select count(*), min(len(embedding)) from '{out}/*.parquet'").fetchall() == [(12, 32)]
    assert json.loads(done.stdout)["documents"] == 12 and len(list(out.glob("part-*.parquet"))) == 3


def test_plain_text_is_a_document_per_line_and_bad_rows_are_counted_not_fatal(tmp_path, model, embedder):
    lines = [b"first line", b"", b"   ", "caf\xe9 au lait".encode("latin-1"), b"word " * 200, b"last line"]
    (tmp_path / "docs.txt").write_bytes(b"\n".join(lines) + b"\n")
    done = ember_embed(model, str(tmp_path / "docs.txt"), "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["skipped"] == {"empty or whitespace-only text": 2, "too long": 1} and report["documents"] == 3
    table = read(tmp_path / "out")
    assert table["id"] == [0, 3, 5]  # row numbers of the input
    np.testing.assert_allclose(table["embedding"][1], embedder.embed("caf\ufffd au lait").vectors[0], atol=1e-5)
    truncated = ember_embed(model, str(tmp_path / "docs.txt"), "-o", str(tmp_path / "cut"), "--truncate")
    assert json.loads(truncated.stdout)["skipped"] == {"empty or whitespace-only text": 2}
    assert read(tmp_path / "cut")["tokens"][2] == 64


def test_a_malformed_file_or_a_missing_column_is_one_clear_error(tmp_path, model):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    bad = ember_embed(model, str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "o1"))
    assert bad.returncode == 2 and f"cannot read {tmp_path / 'bad.jsonl'}" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stderr.strip().splitlines()[-1].startswith("ember embed: cannot read")
    (tmp_path / "other.jsonl").write_text('{"body": "x"}\n')
    missing = ember_embed(model, str(tmp_path / "other.jsonl"), "-o", str(tmp_path / "o2"))
    assert missing.returncode == 2 and "no column 'text'" in missing.stderr


def test_identical_texts_are_embedded_once(tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a", "b", "a", "a", "c"]))
    seen = []

    def embed(texts):
        seen.extend(texts)
        return Embedded(np.ones((len(texts), 4), np.float32) * np.arange(len(texts))[:, None], [1] * len(texts), 3)

    summary = run_job(EmbedJob((str(tmp_path / "in.jsonl"),), str(tmp_path / "out")), embed)
    assert seen[0] == "ember" and sorted(seen[1:]) == ["a", "b", "c"] and summary.documents == 5  # after the probe
    vectors = read(tmp_path / "out")["embedding"]
    assert vectors[0] == vectors[2] == vectors[3] != vectors[1]


def test_a_different_job_in_the_same_output_is_refused_unless_overwritten(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    embed = lambda texts: Embedded(np.zeros((len(texts), 2), np.float32), [1] * len(texts), len(texts))  # noqa: E731
    run_job(EmbedJob((str(tmp_path / "in.jsonl"),), str(tmp_path / "out")), embed)
    other = EmbedJob((str(tmp_path / "in.jsonl"),), str(tmp_path / "out"), options={"dimensions": 8})
    with pytest.raises(ConfigError, match="--overwrite"):
        run_job(other, embed)
    assert run_job(EmbedJob(other.inputs, other.output, options=other.options, overwrite=True), embed).documents == 1
    with pytest.raises(InputError):
        run_job(EmbedJob((str(tmp_path / "in.jsonl"),), str(tmp_path / "o2"), text_column="body"), embed)


def _manifest_parts(out):
    path = out / "_manifest.jsonl"
    return [json.loads(line)["part"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_run_stopped_midway_resumes_with_no_row_missing_or_repeated(tmp_path, model, sig):
    texts = [f"{SENTENCES[i % len(SENTENCES)]} number {i}" for i in range(3000)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    args = (str(tmp_path / "in.jsonl"), "-o", str(out), "--part-rows", "100", "--truncate")
    proc = ember_embed(model, *args, wait=False)
    for _ in range(6000):  # until some parts are done, then stop it in the middle of the run
        if len(_manifest_parts(out)) >= 3 or proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.send_signal(sig)
    proc.wait(120)
    first = _manifest_parts(out)
    assert 3 <= len(first) < 30, "the run was not stopped midway"
    if sig == signal.SIGTERM:  # the slice in flight is finished and written, then it stops, saying how to go on
        assert proc.returncode == 130 and "run the same command again" in proc.stderr.read()
    done = ember_embed(model, *args)
    assert done.returncode == 0, done.stderr
    assert sorted(set(_manifest_parts(out))) == list(range(30))
    covered = sum(json.loads(line)["rows"] for line in (out / "_manifest.jsonl").read_text().splitlines())
    assert covered == 3000  # no row range written twice
    ids = pq.read_table(str(out)).column("id").to_pylist()
    assert sorted(ids) == list(range(3000))
    assert not list(out.glob(".*.tmp")) or sig == signal.SIGKILL


def _corpus(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def test_the_cache_embeds_only_texts_it_has_not_seen_under_the_same_model_and_options(tmp_path):
    seen = []

    def embed(texts):
        if texts != ["ember"]:  # the job's probe for the width
            seen.extend(texts)
        return Embedded(np.array([[len(t), 1.0] for t in texts], np.float32), [len(t) for t in texts], 0)

    texts = [f"document {i}" for i in range(50)]
    first = run_job(EmbedJob((_corpus(tmp_path / "a.jsonl", texts),), str(tmp_path / "o1"), part_rows=20), embed,
                    cache=VectorCache(tmp_path / "cache", "model-a", {"dimensions": None}))  # fmt: skip
    assert first.embedded == 50 and first.cached == 0 and len(seen) == 50
    changed = texts[:45] + [f"edited {i}" for i in range(5)]
    seen.clear()
    again = run_job(EmbedJob((_corpus(tmp_path / "b.jsonl", changed),), str(tmp_path / "o2"), part_rows=20), embed,
                    cache=VectorCache(tmp_path / "cache", "model-a", {"dimensions": None}))  # fmt: skip
    assert sorted(seen) == sorted(changed[45:]) and again.cached == 45 and again.documents == 50
    table = read(tmp_path / "o2")
    assert table["embedding"][3] == [len(texts[3]), 1.0] and table["tokens"][3] == len(texts[3])
    seen.clear()
    other = VectorCache(tmp_path / "cache", "model-a", {"dimensions": 8})  # other options: other vectors
    assert run_job(EmbedJob((str(tmp_path / "b.jsonl"),), str(tmp_path / "o3")), embed, cache=other).cached == 0
    assert len(seen) == 50


def test_a_second_cli_run_over_an_unchanged_corpus_embeds_nothing(tmp_path, model, embedder):
    src = _corpus(tmp_path / "in.jsonl", SENTENCES[:10])
    args = (src, "--cache", str(tmp_path / "cache"), "--part-rows", "4")
    first = json.loads(ember_embed(model, *args, "-o", str(tmp_path / "o1")).stdout)
    second = ember_embed(model, *args, "-o", str(tmp_path / "o2"))
    assert first["embedded"] == 10 and json.loads(second.stdout) | {"seconds": 0} == first | {
        "embedded": 0, "cached": 10, "tokens": 0, "seconds": 0}  # fmt: skip
    assert read(tmp_path / "o1") == read(tmp_path / "o2")


def test_npy_output_is_the_embedders_vectors_in_row_order_with_ids_beside(tmp_path, model, embedder):
    texts = SENTENCES[:9]
    src = _corpus(tmp_path / "in.jsonl", [*texts[:4], "  ", *texts[4:]])
    out = tmp_path / "out"
    done = ember_embed(model, src, "-o", str(out), "--format", "npy", "--part-rows", "3")
    assert done.returncode == 0, done.stderr
    vectors = np.load(out / "embeddings.npy")
    ids = pq.read_table(str(out / "ids.parquet")).to_pydict()
    assert vectors.dtype == np.float32 and vectors.shape == (9, 32) and ids["id"] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    np.testing.assert_allclose(vectors, embedder.embed(texts).vectors, atol=1e-5)
    assert ids["tokens"] == embedder.embed(texts).token_counts and not list(out.glob("part-*"))
    again = ember_embed(model, src, "-o", str(out), "--format", "npy", "--part-rows", "3")
    assert again.returncode == 0 and json.loads(again.stdout)["documents"] == 0  # done already: nothing re-run
    np.testing.assert_array_equal(np.load(out / "embeddings.npy"), vectors)


def _rejected(server):
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ember_requests_total{") and 'status="429"' in line)  # fmt: skip


def test_url_spreads_over_servers_retries_429s_and_refuses_only_the_bad_row(tmp_path, model, embedder):
    texts = [f"{SENTENCES[i % len(SENTENCES)][:100]} {i}" for i in range(300)]
    src = _corpus(tmp_path / "in.jsonl", [*texts[:150], "word " * 200, *texts[150:]])  # row 150: too long
    flags = ["--dtype", "float32", "--max-queued-requests", "1", "--max-num-seqs", "4"]
    servers = [Server([str(model), *flags], tmp_path / f"s{i}.log") for i in range(2)]
    try:
        cmd = [sys.executable, "-m", "ember.cli.main", "embed", src, "-o", str(tmp_path / "out"), "--batch-size", "4",
               "--concurrency", "6", *[a for s in servers for a in ("--url", s.url)]]  # fmt: skip
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        rejected = [_rejected(s) for s in servers]
    finally:
        for s in servers:
            s.stop()
    assert all(r > 0 for r in rejected), "no 429 was answered: the retry path was not exercised"
    report = json.loads(done.stdout)
    assert report["documents"] == 300 and report["skipped"] == {"too long": 1}, report
    table = read(tmp_path / "out")
    assert table["id"] == list(range(150)) + list(range(151, 301)) and set(table["tokens"]) == {None}
    np.testing.assert_allclose(np.array(table["embedding"]), embedder.embed(texts).vectors, atol=1e-5)
    assert report["tokens"] == sum(embedder.embed(texts).token_counts)


def test_local_embeds_in_slices_with_every_row_where_one_call_puts_it(embedder, monkeypatch):
    from ember.batch import backend

    texts = [f"{SENTENCES[i % len(SENTENCES)][:80]} {i}" for i in range(10)]
    texts[7] = "word " * 200  # too long for the 64-position model: refused, its neighbours kept
    whole = backend.local(embedder)(texts)
    monkeypatch.setattr(backend, "CHUNK", 3)
    sliced = backend.local(embedder)(texts)
    assert sliced.refused == whole.refused == {7: "too long"}
    np.testing.assert_allclose(sliced.vectors, whole.vectors, atol=1e-6)
    assert sliced.tokens == whole.tokens and sliced.total_tokens == whole.total_tokens


def test_a_corpus_of_empty_rows_finishes_and_a_reranker_is_refused_before_any_work(tmp_path, model):
    from checkpoints import build_cross_encoder

    (tmp_path / "e.jsonl").write_text('{"text": ""}\n')
    done = ember_embed(model, str(tmp_path / "e.jsonl"), "-o", str(tmp_path / "out"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert json.loads(done.stdout)["skipped"] == {"empty or whitespace-only text": 1}
    assert pq.read_table(str(tmp_path / "out")).schema.field("embedding").type == pa.list_(pa.float32(), 32)
    reranker = build_cross_encoder(tmp_path / "ce", layers=1, hidden=32)
    (tmp_path / "in.jsonl").write_text('{"text": "a document"}\n')
    refused = ember_embed(reranker, str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o2"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("ember embed: ") and "embedding model" in refused.stderr
    assert not list((tmp_path / "o2").glob("part-*"))
