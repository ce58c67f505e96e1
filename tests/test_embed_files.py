"""`ember embed` over files: formats and columns, the output schema read back, bad rows, dedupe, and resume after
the process is killed mid-run."""

import json
import os
import signal
import subprocess
import sys
import time

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from checkpoints import build_bert
from corpus import SENTENCES
from ember import Embedder
from ember.batch.job import EmbedJob, run_job
from ember.errors import ConfigError, InputError

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBER_NATIVE_ATTENTION": "0", "EMBER_NATIVE_INT8": "0",
       "EMBER_NATIVE_ELEMENTWISE": "0"}  # fmt: skip


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
        return np.ones((len(texts), 4), np.float32) * np.arange(len(texts))[:, None], [1] * len(texts)

    summary = run_job(EmbedJob((str(tmp_path / "in.jsonl"),), str(tmp_path / "out")), embed)
    assert sorted(seen) == ["a", "b", "c"] and summary.documents == 5
    vectors = read(tmp_path / "out")["embedding"]
    assert vectors[0] == vectors[2] == vectors[3] != vectors[1]


def test_a_different_job_in_the_same_output_is_refused_unless_overwritten(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    embed = lambda texts: (np.zeros((len(texts), 2), np.float32), [1] * len(texts))  # noqa: E731
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
    if sig == signal.SIGTERM:  # the part in flight is finished, then it stops, saying how to go on
        assert proc.returncode == 130 and "run the same command again" in proc.stderr.read()
    done = ember_embed(model, *args)
    assert done.returncode == 0, done.stderr
    parts = _manifest_parts(out)
    assert sorted(parts) == list(range(30)) and len(parts) == 30  # none written twice
    ids = pq.read_table(str(out)).column("id").to_pylist()
    assert sorted(ids) == list(range(3000))
    assert not list(out.glob(".*.tmp")) or sig == signal.SIGKILL
