"""ember on a real local Ray cluster: `EmberEmbedder` in `map_batches` with 2 actors of 1 CPU, and `ember embed
--ray ADDRESS` on the same cluster: every row embedded exactly once, vectors equal to the in-process Embedder's."""

import json
import os
import subprocess
import sys

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from checkpoints import build_bert
from corpus import SENTENCES
from ember import Embedder
from ember.errors import ConfigError
from ember.hardware import isa_tier, native_cpu_flags
from torch_ops import ThreadOps

ray = pytest.importorskip("ray")

from ember.ray import EmberEmbedder  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "EMBER_NATIVE_ATTENTION": "0", "EMBER_NATIVE_INT8": "0", "EMBER_NATIVE_ELEMENTWISE": "0",
       "EMBER_NATIVE_LINEAR": "0",
       "EMBER_NATIVE_LINEAR_F32": "0", "EMBER_NATIVE_LINEAR_BF16": "0"}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert") / "m", layers=1, hidden=32, max_position=64)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": ENV})
    yield
    ray.shutdown()


def _texts(n):
    return [f"{SENTENCES[i % len(SENTENCES)][:100]} {i}" for i in range(n)]


def test_two_actors_of_one_cpu_embed_every_row_once_as_the_embedder_does(cluster, model):
    texts = _texts(3000)
    rows = [{"id": i, "text": t} for i, t in enumerate(texts)]
    rows[7]["text"] = "   "  # a bad row is dropped, not fatal
    ds = ray.data.from_items(rows, override_num_blocks=12).map_batches(
        EmberEmbedder,
        fn_constructor_kwargs={"model": str(model), "dtype": "float32", "enforce_eager": True},
        concurrency=2,
        num_cpus=1,
        batch_size=200,
        batch_format="pyarrow",
    )
    table = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    ids = table.column("id").to_pylist()
    assert sorted(ids) == [i for i in range(3000) if i != 7]  # each row once
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    got = np.array(table.column("embedding").to_pylist())[np.argsort(ids)]
    expected = Embedder(str(model), dtype="float32", enforce_eager=True).embed(
        [t for i, t in enumerate(texts) if i != 7]
    )
    np.testing.assert_allclose(got, expected.vectors, atol=1e-5)
    assert sorted(zip(ids, table.column("tokens").to_pylist(), strict=True))[0][1] == expected.token_counts[0]


def test_each_actor_sizes_its_threads_to_the_cpus_ray_gave_it(cluster, model):
    actor = ray.remote(num_cpus=2)(EmberEmbedder).remote(str(model), dtype="float32", enforce_eager=True)
    assert ray.get(actor.info.remote())["threads"] == 2
    one = ray.remote(num_cpus=1)(EmberEmbedder)
    ray.kill(actor)
    assert ray.get(one.remote(str(model), dtype="float32", enforce_eager=True).info.remote())["threads"] == 1


@pytest.mark.skipif(not {"avx2", "fma"} <= native_cpu_flags(), reason="the cap needs a CPU that reaches AVX2")
def test_an_actor_capped_to_avx2_runs_as_an_avx2_cpu_and_embeds_the_same(cluster, model):
    """EMBER_MAX_ISA reaches the actors (`ember embed --ray` passes it as max_isa, with torch's limits in their
    environment): a capped actor reports the tier and its vectors equal an uncapped Embedder's."""
    capped = ray.remote(num_cpus=1)(EmberEmbedder).remote(str(model), dtype="float32", enforce_eager=True,
                                                         max_isa="avx2")  # fmt: skip
    assert ray.get(capped.info.remote())["isa"] == "avx2"
    texts = _texts(5)
    table = ray.get(capped.__call__.remote(pa.table({"text": texts})))
    want = Embedder(str(model), dtype="float32", enforce_eager=True).embed(texts).vectors
    np.testing.assert_allclose(np.array(table.column("embedding").to_pylist()), want, atol=1e-5)
    ray.kill(capped)
    above = ray.remote(num_cpus=1)(EmberEmbedder).remote(str(model), dtype="float32", max_isa="amx")
    if isa_tier(native_cpu_flags()) != "amx":  # a node below the cap refuses it rather than stop on SIGILL
        with pytest.raises(ray.exceptions.RayActorError, match="only reaches"):
            ray.get(above.info.remote())


def test_ember_embed_ray_hands_the_cap_to_its_actors(monkeypatch, model, tmp_path):
    from ember import hardware
    from ember.cli.embed import ray_settings
    from ember.cli.main import build_parser

    monkeypatch.setattr(hardware, "native_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512bw"}))
    for var in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "EMBER_MAX_ISA"):
        monkeypatch.delenv(var, raising=False)
    args = build_parser().parse_args(["embed", "in.jsonl", "-o", str(tmp_path), "--model", str(model), "--ray"])
    embedder, env = ray_settings(args)
    assert "max_isa" not in embedder and "ONEDNN_MAX_CPU_ISA" not in env
    monkeypatch.setenv("EMBER_MAX_ISA", "avx2")
    embedder, env = ray_settings(args)
    assert embedder["max_isa"] == "avx2" and embedder["config"].model == str(model) and env["EMBER_MAX_ISA"] == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")  # the operator's own setting is kept
    assert ray_settings(args)[1]["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"
    monkeypatch.setenv("EMBER_MAX_ISA", "amx")
    with pytest.raises(ConfigError, match="only reaches avx512"):
        ray_settings(args)


def test_numpy_batches_get_an_n_by_d_array(model):
    embedder = EmberEmbedder(str(model), dtype="float32", enforce_eager=True)
    out = embedder({"id": np.arange(3), "text": np.array(["a b", "", "c d"], dtype=object)})
    assert out["embedding"].shape == (2, 32) and list(out["id"]) == [0, 2]
    empty = embedder({"id": np.arange(2), "text": np.array(["", "  "], dtype=object)})  # a block of bad rows only
    assert empty["embedding"].shape == (0, 32)
    too_long = embedder(pa.table({"id": [1], "text": ["word " * 200]}))
    assert too_long.num_rows == 0 and too_long.schema.field("embedding").type == pa.list_(pa.float32(), 32)


def _cli(model, address, *argv):
    cmd = [sys.executable, "-m", "ember.cli.main", "embed", *argv, "--model", str(model), "--dtype", "float32",
           "--enforce-eager", "--ray", address, "--log-level", "warning"]  # fmt: skip
    return subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=300)


def test_ember_embed_ray_writes_every_row_once_with_the_embedders_vectors(cluster, model, tmp_path):
    texts = _texts(2400)
    src = tmp_path / "corpus"
    src.mkdir()
    for k in range(3):  # three JSONL files, a blank row among them; ids that look like numbers stay strings
        rows = [{"doc": f"{i:06d}", "text": "" if i == 11 else texts[i], "url": f"u{i}"}
                for i in range(k * 800, (k + 1) * 800)]  # fmt: skip
        (src / f"part-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    address = ray.get_runtime_context().gcs_address
    argv = [str(src), "-o", str(tmp_path / "out"), "--id-column", "doc", "--keep-columns", "url", "--actors", "2",
            "--cpus-per-actor", "1", "--part-rows", "500"]  # fmt: skip
    done = _cli(model, address, *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["documents"] == 2399 and sum(summary["skipped"].values()) == 1
    table = pq.read_table(tmp_path / "out")
    assert table.schema.names == ["id", "embedding", "tokens", "url"]
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    ids = table.column("id").to_pylist()
    assert sorted(ids) == [f"{i:06d}" for i in range(2400) if i != 11]  # each row once, ids as written
    order = [int(i) for i in ids]
    expected = Embedder(str(model), dtype="float32", enforce_eager=True).embed([texts[i] for i in order])
    np.testing.assert_allclose(np.array(table.column("embedding").to_pylist()), expected.vectors, atol=1e-5)
    assert table.column("tokens").to_pylist() == expected.token_counts
    assert summary["tokens"] == sum(expected.token_counts)
    assert table.column("url").to_pylist() == [f"u{i}" for i in order]
    assert duckdb.sql(f"select count(*) from '{tmp_path / 'out'}/*.parquet'").fetchall() == [(2399,)]

    again = _cli(model, address, *argv)
    assert again.returncode == 2 and "--overwrite" in again.stderr  # never mixed with an earlier run's rows
    over = _cli(model, address, *argv, "--overwrite")
    assert over.returncode == 0, over.stderr[-3000:]
    assert pq.read_table(tmp_path / "out").num_rows == 2399  # replaced, not added to


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["{src}", "-o", "{out}"], "--id-column"),
        (["{src}", "-o", "{out}", "--id-column", "doc", "--keep-columns", "doc"], "--keep-columns"),
        (["{src_dir}", "-o", "{src_dir}/vectors", "--id-column", "doc"], "overlaps the inputs"),
        (["{src}", "-o", "{theirs}", "--id-column", "doc", "--overwrite"], "did not write"),
    ],
)
def test_ember_embed_ray_refuses_before_touching_a_cluster(model, tmp_path, argv, needle):
    src = tmp_path / "in" / "a.jsonl"
    src.parent.mkdir()
    src.write_text('{"doc": "a", "text": "a"}\n')
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    pq.write_table(pa.table({"x": [1]}), theirs / "data.parquet")  # a user's own file: never deleted
    fill = {"src": str(src), "out": str(tmp_path / "out"), "src_dir": str(src.parent), "theirs": str(theirs)}
    done = _cli(model, "127.0.0.1:1", *[a.format(**fill) for a in argv])
    assert done.returncode == 2 and needle in done.stderr, done.stderr[-2000:]
    assert (theirs / "data.parquet").exists()


def test_ray_taking_an_input_as_its_address_is_named(model, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"doc": "a", "text": "a"}\n')
    cmd = [sys.executable, "-m", "ember.cli.main", "embed", str(tmp_path / "a.jsonl"), "--ray",
           str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "out"), "--id-column", "doc"]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--ray took" in done.stderr


def test_an_actor_runs_its_model_on_one_thread_of_its_own(model):
    """Ray runs an actor's __init__ and __call__ on different threads, and OpenMP keeps a pool of workers for every
    thread that ran parallel work: with two pools the workers sleep between kernels. Loading and embedding both run
    on the actor's own model thread, so no torch operator runs on the thread that builds or calls it."""
    with ThreadOps() as caller:
        embedder = EmberEmbedder(str(model), dtype="float32", enforce_eager=True)
        out = embedder(pa.table({"text": ["one text", "another"]}))
    assert caller.ops == []
    assert out.column("embedding").type.list_size == embedder.dimension and out.num_rows == 2
