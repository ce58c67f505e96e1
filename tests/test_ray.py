"""ember on a real local Ray cluster: `EmberEmbedder` in `map_batches` with 2 actors of 1 CPU: every row
embedded exactly once, vectors equal to the in-process Embedder's."""

import numpy as np
import pyarrow as pa
import pytest

from checkpoints import build_bert
from corpus import SENTENCES
from ember import Embedder

ray = pytest.importorskip("ray")

from ember.ray import EmberEmbedder  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "EMBER_NATIVE_ATTENTION": "0", "EMBER_NATIVE_INT8": "0", "EMBER_NATIVE_ELEMENTWISE": "0"}


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


def test_numpy_batches_get_an_n_by_d_array(model):
    embedder = EmberEmbedder(str(model), dtype="float32", enforce_eager=True)
    out = embedder({"id": np.arange(3), "text": np.array(["a b", "", "c d"], dtype=object)})
    assert out["embedding"].shape == (2, 32) and list(out["id"]) == [0, 2]
