"""The indexing job's defects that would lose or mix data, on a fake model (no weights): empty parts, rows that are
not text, a stop within a part, a changed input on resume, two jobs on one output, a cut manifest, ids of mixed
types or repeated, lines too long to read, a full disk, and the Ray pool that must leave Ray Data a CPU."""

import errno
import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from ember.batch import files as batch_files
from ember.batch.backend import Embedded, probe_dimension
from ember.batch.job import EmbedJob, run_job
from ember.batch.manifest import MANIFEST, lock_output
from ember.errors import ConfigError, InputError

DIM = 4


class FakeModel:
    """A vector per text from its bytes (so a text's vector says which text it was); counts the texts it ran on."""

    def __init__(self, refuse=()):
        self.seen: list[str] = []
        self.refuse = set(refuse)

    def vector(self, text):
        raw = text.encode()
        return np.array([len(raw), sum(raw) % 97, raw[0] if raw else 0, raw[-1] if raw else 0], np.float32)

    def __call__(self, texts):
        self.seen += texts
        refused = {i: "refused" for i, t in enumerate(texts) if t in self.refuse}
        vectors = np.stack([self.vector(t) for t in texts]) if texts else np.zeros((0, DIM), np.float32)
        return Embedded(vectors, [len(t.split()) for t in texts], sum(len(t.split()) for t in texts), refused,
                        {i: "this model scores pairs" for i in refused})  # fmt: skip


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def table(out):
    return pq.read_table(str(out)).sort_by("id").to_pydict()


def test_a_part_with_no_embeddable_row_is_written_with_the_models_width_and_the_job_goes_on(tmp_path):
    rows = [{"text": ""}, {"text": "  "}, {"text": None}, {"text": "a real row"}]
    job = EmbedJob((jsonl(tmp_path / "in.jsonl", rows),), str(tmp_path / "out"), part_rows=3)
    summary = run_job(job, FakeModel())
    assert summary.documents == 1 and summary.parts_written == 2
    got = pq.read_table(str(tmp_path / "out"))  # both parts open as one table
    assert got.schema.field("embedding").type == pa.list_(pa.float32(), DIM) and got.column("id").to_pylist() == [3]


def test_a_model_that_does_not_embed_is_refused_before_any_work_with_its_own_words(tmp_path):
    model = FakeModel(refuse={"ember"})
    with pytest.raises(ConfigError, match=r"does not embed text .this model scores pairs"):
        probe_dimension(model)
    job = EmbedJob((jsonl(tmp_path / "in.jsonl", [{"text": "x"}]),), str(tmp_path / "out"))
    with pytest.raises(ConfigError):
        run_job(job, model)
    assert not list((tmp_path / "out").glob("part-*"))


def test_text_columns_must_be_text_bytes_are_decoded_and_never_embedded_as_a_repr(tmp_path):
    pq.write_table(pa.table({"text": pa.array([b"good", b"\xff\xfe bad", None, b"caf\xc3\xa9"], pa.binary())}),
                   str(tmp_path / "a.parquet"))  # fmt: skip
    model = FakeModel()
    summary = run_job(EmbedJob((str(tmp_path / "a.parquet"),), str(tmp_path / "out")), model)
    assert sorted(set(model.seen) - {"ember"}) == ["café", "good"]
    assert summary.skipped == {"not UTF-8 text": 1, "null text": 1}
    got = table(tmp_path / "out")
    assert got["id"] == [0, 3] and got["embedding"][0] == model.vector("good").tolist()


def test_invalid_utf8_in_csv_or_jsonl_refuses_the_row_not_the_file(tmp_path):
    (tmp_path / "a.csv").write_bytes(b"text\ngood\n\xff\xfe bad\nfine\n")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "one"}\n{"text": "\xff\xfe"}\n{"text": "three"}\n')
    model = FakeModel()
    for name in ("a.csv", "b.jsonl"):
        summary = run_job(EmbedJob((str(tmp_path / name),), str(tmp_path / f"out-{name}")), model)
        assert summary.documents == 2 and summary.skipped == {"not UTF-8 text": 1}, name
    assert not [t for t in model.seen if "b'" in t or "\ufffd" in t]


def stop_after(calls):
    count = iter(range(10**9))
    return lambda: next(count) >= calls - 1


def test_a_stop_within_a_part_keeps_the_rows_done_and_the_rerun_writes_each_row_once(tmp_path):
    texts = [f"text number {i}" for i in range(100)]
    source = jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    job = EmbedJob((source,), str(tmp_path / "out"), part_rows=60)
    first = run_job(job, FakeModel(), stop=stop_after(1))
    assert first.interrupted and 0 < first.documents < 60  # stopped inside part 0, its done rows written
    model = FakeModel()
    rest = run_job(job, model)
    assert not rest.interrupted and first.documents + rest.documents == 100
    got = table(tmp_path / "out")
    assert got["id"] == list(range(100))
    assert got["embedding"] == [FakeModel().vector(t).tolist() for t in texts]
    assert not {t for t in model.seen if t != "ember"} & set(texts[: first.documents])  # nothing embedded twice
    names = sorted(p.name for p in (tmp_path / "out").glob("part-*"))
    assert names[0] == "part-00000.parquet" and names[1].startswith("part-00000_")


def test_a_changed_input_is_refused_on_resume_never_mixed(tmp_path):
    rows = [{"text": f"row {i}"} for i in range(30)]
    source = tmp_path / "in.jsonl"
    job = EmbedJob((jsonl(source, rows),), str(tmp_path / "out"), part_rows=10)
    run_job(job, FakeModel(), stop=stop_after(1))
    jsonl(source, [{"text": "inserted at the top"}, *rows])
    with pytest.raises(ConfigError, match="input changed since rows 0-"):
        run_job(job, FakeModel())
    assert run_job(EmbedJob(job.inputs, job.output, part_rows=10, overwrite=True), FakeModel()).documents == 31


def test_rows_appended_to_a_finished_input_are_embedded_on_the_next_run(tmp_path):
    source = tmp_path / "in.jsonl"
    job = EmbedJob((jsonl(source, [{"text": f"row {i}"} for i in range(5)]),), str(tmp_path / "out"), part_rows=10)
    run_job(job, FakeModel())
    jsonl(source, [{"text": f"row {i}"} for i in range(8)])
    assert run_job(job, FakeModel()).documents == 3
    assert table(tmp_path / "out")["id"] == list(range(8))


def test_an_output_is_written_by_one_job_at_a_time(tmp_path):
    job = EmbedJob((jsonl(tmp_path / "in.jsonl", [{"text": "a"}]),), str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    with lock_output(tmp_path / "out"), pytest.raises(ConfigError, match="being written by another ember embed"):
        run_job(job, FakeModel())
    assert run_job(job, FakeModel()).documents == 1  # released


def test_a_cut_manifest_line_is_dropped_and_the_job_resumes(tmp_path):
    job = EmbedJob((jsonl(tmp_path / "in.jsonl", [{"text": f"r{i}"} for i in range(20)]),), str(tmp_path / "out"),
                   part_rows=10)  # fmt: skip
    run_job(job, FakeModel(), stop=stop_after(1))
    manifest = tmp_path / "out" / MANIFEST
    manifest.write_bytes(manifest.read_bytes() + b'{"part": 1, "offs')  # a kill during the next append
    assert run_job(job, FakeModel()).documents == 10
    assert table(tmp_path / "out")["id"] == list(range(20))
    assert all(json.loads(line) for line in manifest.read_text().splitlines())


def test_ids_of_mixed_types_across_files_are_written_as_one_type(tmp_path):
    jsonl(tmp_path / "a.jsonl", [{"text": "a", "doc": 1}, {"text": "b", "doc": 2}])
    pa_csv.write_csv(pa.table({"text": ["c"], "doc": ["x-3"]}), str(tmp_path / "b.csv"))
    job = EmbedJob((str(tmp_path / "a.jsonl"), str(tmp_path / "b.csv")), str(tmp_path / "out"), id_column="doc",
                   part_rows=2)  # fmt: skip
    run_job(job, FakeModel())
    got = pq.read_table(str(tmp_path / "out"))
    assert got.schema.field("id").type == pa.string() and sorted(got.column("id").to_pylist()) == ["1", "2", "x-3"]


def test_repeated_ids_are_reported_and_refused_before_any_work_when_asked(tmp_path):
    source = jsonl(tmp_path / "in.jsonl", [{"text": t, "doc": d} for t, d in [("a", 1), ("b", 2), ("c", 1)]])
    summary = run_job(EmbedJob((source,), str(tmp_path / "out"), id_column="doc"), FakeModel())
    assert summary.duplicate_ids == 1 and "1 rows repeat an earlier row's id" in summary.line()
    model = FakeModel()
    with pytest.raises(InputError, match=r"unique-ids: 1 rows repeat .* 1"):
        run_job(EmbedJob((source,), str(tmp_path / "o2"), id_column="doc", unique_ids=True), model)
    assert model.seen == []


def test_every_named_column_is_checked_in_every_file_before_any_work(tmp_path):
    jsonl(tmp_path / "a.jsonl", [{"text": "a", "doc": 1}])
    jsonl(tmp_path / "b.jsonl", [{"text": "b", "dc": 2}])
    model = FakeModel()
    job = EmbedJob((str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")), str(tmp_path / "out"), id_column="doc")
    with pytest.raises(InputError, match=r"b.jsonl has no column 'doc' \(--id-column\); its columns: text, dc"):
        run_job(job, model)
    assert model.seen == []


def test_a_line_too_long_to_use_is_skipped_while_it_streams_never_held_whole(tmp_path):
    huge = b"word " * (2 << 20)  # 10 MiB on one line
    (tmp_path / "in.txt").write_bytes(b"short one\n" + huge + b"\nshort two\n")
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "short one"}\n{"text": "' + huge + b'"}\n{"text": "short two"}\n')
    for name in ("in.txt", "in.jsonl"):
        tracemalloc.start()
        summary = run_job(EmbedJob((str(tmp_path / name),), str(tmp_path / f"out-{name}"), max_text_bytes=1 << 16),
                          FakeModel())  # fmt: skip
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert summary.skipped == {"line too long to read": 1} and summary.documents == 2, name
        assert peak < 4 << 20, f"{name}: {peak} bytes held"
        assert table(tmp_path / f"out-{name}")["id"] == [0, 2]


def test_a_text_value_too_long_to_use_is_cut_with_truncation_or_skipped(tmp_path):
    pq.write_table(pa.table({"text": ["short", "é" * 5000]}), str(tmp_path / "a.parquet"))
    model = FakeModel()
    skipped = run_job(EmbedJob((str(tmp_path / "a.parquet"),), str(tmp_path / "o1"), max_text_bytes=1000), model)
    assert skipped.skipped == {"too long": 1}
    cut = run_job(EmbedJob((str(tmp_path / "a.parquet"),), str(tmp_path / "o2"), max_text_bytes=1001,
                           options={"truncate": True}), model)  # fmt: skip
    assert cut.documents == 2 and "é" * 500 in model.seen  # cut at a character boundary within the bound


def test_a_full_disk_is_one_clear_error_and_keeps_the_parts_written(tmp_path, monkeypatch):
    job = EmbedJob((jsonl(tmp_path / "in.jsonl", [{"text": f"r{i}"} for i in range(20)]),), str(tmp_path / "out"),
                   part_rows=10)  # fmt: skip
    real = pq.write_table
    calls = iter(range(100))

    def write(table, where, **kw):
        if next(calls) >= 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(table, where, **kw)

    monkeypatch.setattr(pq, "write_table", write)
    with pytest.raises(ConfigError, match=r"No space left on device.*parts already written are kept"):
        run_job(job, FakeModel())
    assert [p.name for p in (tmp_path / "out").glob("*.parquet*")] == ["part-00000.parquet"]
    monkeypatch.setattr(pq, "write_table", real)
    assert run_job(job, FakeModel()).documents == 10


def test_lines_are_read_within_the_bound(tmp_path):
    (tmp_path / "f").write_bytes(b"a\n" + b"x" * 100 + b"\nb")
    with (tmp_path / "f").open("rb") as f:
        assert list(batch_files._lines(f, 10)) == [b"a", None, b"b"]


def test_ray_leaves_ray_data_a_cpu_on_small_clusters(monkeypatch):
    ray = pytest.importorskip("ray")
    from ember import ray as ember_ray

    def nodes(cpus):
        monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": c}} for c in cpus])

    nodes([2])
    assert ember_ray._pool(None, None) == (1, 1)
    nodes([3])  # a local cluster of 2 CPUs started by ember embed --ray: one logical CPU more
    assert ember_ray._pool(None, None) == (2, 1)
    nodes([8, 8])
    assert ember_ray._pool(None, None) == (4, 4)  # the pool starts with one actor: the listing gets its CPU
    nodes([2])
    assert ember_ray._pool(1, 2) == (1, 2)  # as asked: the first actor leaves a CPU
    with pytest.raises(ConfigError, match="Ray Data's file listing needs one"):
        ember_ray._pool(2, 1)


def test_a_jsonl_line_of_several_mebibytes_within_the_bound_is_read(tmp_path):
    big = "word " * (600_000)  # 3 MB on one line: more than pyarrow's default 1 MiB block
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": big}) + "\n")
    model = FakeModel()
    summary = run_job(EmbedJob((str(tmp_path / "in.jsonl"),), str(tmp_path / "out"), max_text_bytes=8 << 20), model)
    assert summary.documents == 2 and big in model.seen
