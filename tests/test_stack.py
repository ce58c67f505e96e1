"""Several models behind one `ember serve`: routing by `model` on every route, 404 and 400 per route, each model's
settings its own, one memory plan that names the model it refuses, and earliest-deadline turns across models."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from checkpoints.builders import build_bert, build_cross_encoder
from checkpoints.families import build_splade
from ember.config import EngineConfig, ModelConfig
from ember.engine.build import plan_models
from ember.engine.engine import AsyncEngine
from ember.engine.turns import Turns
from ember.errors import ConfigError
from ember.resources import MemoryBudget
from server import Server

ROUTES_WITH_MODEL = [
    ("/v1/embeddings", {"input": "x"}),
    ("/pooling", {"input": "x"}),
    ("/rerank", {"query": "q", "documents": ["d"]}),
    ("/v1/rerank", {"query": "q", "documents": ["d"]}),
    ("/v2/rerank", {"query": "q", "documents": ["d"]}),
    ("/score", {"text_1": "q", "text_2": "d"}),
    ("/v2/embed", {"texts": ["x"], "input_type": "search_document", "embedding_types": ["float"]}),
    ("/embed_sparse", {"inputs": "x"}),
    ("/invocations", {"input": "x"}),
    ("/tokenize", {"prompt": "x"}),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    embed = build_bert(root / "embed", max_position=64)
    rerank = build_cross_encoder(root / "rerank")
    sparse = build_splade(root / "sparse")
    models = root / "models.yaml"
    models.write_text(
        yaml.safe_dump(
            [
                {"model": str(rerank), "served_model_name": ["rerank", "ce"], "dtype": "float32"},
                {"model": str(sparse), "served_model_name": "sparse", "max_model_len": 32},
            ]
        )
    )
    args = [str(embed), "--served-model-name", "embed", "--max-model-len", "16", "--truncate", "--models", str(models)]
    srv = Server(args, root / "log")
    yield srv
    srv.stop()


def test_models_info_and_metrics_list_every_model_with_its_task(stack):
    listed = httpx.get(stack.url + "/v1/models").json()["data"]
    assert [(m["id"], m["task"]) for m in listed] == [
        ("embed", "embed"), ("rerank", "score"), ("ce", "score"), ("sparse", "embed")
    ]  # fmt: skip
    info = httpx.get(stack.url + "/info").json()
    assert info["model"] == "embed" and [m["model"] for m in info["models"]] == ["embed", "rerank", "sparse"]
    assert [m["outputs"] for m in info["models"]] == [
        ["embed", "token_embed"],
        ["classify"],
        ["embed", "token_classify"],
    ]
    assert info["models"][1]["dtype"] == "float32" and info["models"][2]["max_model_len"] == 32
    httpx.post(stack.url + "/rerank", json={"model": "ce", "query": "q", "documents": ["a", "b"]})
    metrics = httpx.get(stack.url + "/metrics").text
    for name in ("embed", "rerank", "sparse"):
        assert f'ember_queue_requests{{model_name="{name}"}}' in metrics
    assert 'ember_prompt_tokens_total{model_name="rerank"}' in metrics


def test_requests_route_by_model_and_a_request_without_one_goes_to_the_first(stack):
    first = httpx.post(stack.url + "/v1/embeddings", json={"input": "hello there"}).json()
    named = httpx.post(stack.url + "/v1/embeddings", json={"input": "hello there", "model": "embed"}).json()
    assert first["model"] == named["model"] == "embed" and first["data"] == named["data"]
    ranked = httpx.post(stack.url + "/rerank", json={"model": "ce", "query": "q", "documents": ["a", "b"]}).json()
    assert ranked["model"] == "rerank" and len(ranked["results"]) == 2
    sparse = httpx.post(stack.url + "/embed_sparse", json={"model": "sparse", "inputs": "hello"})
    assert sparse.status_code == 200 and sparse.json()[0]
    tokens = httpx.post(stack.url + "/tokenize", json={"model": "sparse", "prompt": "hello"}).json()
    assert tokens["max_model_len"] == 32
    cosine = httpx.post(stack.url + "/score", json={"model": "embed", "text_1": "a", "text_2": "a"}).json()
    assert cosine["model"] == "embed" and cosine["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("route,body", ROUTES_WITH_MODEL)
def test_an_unknown_model_is_404_on_every_route(stack, route, body):
    r = httpx.post(stack.url + route, json={**body, "model": "nope"})
    error = r.json()["error"]  # TEI's routes answer in TEI's body: the message is `error` itself
    assert r.status_code == 404 and (error if route == "/embed_sparse" else error["message"]) == (
        "The model `nope` does not exist."
    )


def test_a_model_that_cannot_do_the_task_is_400_naming_what_it_can(stack):
    r = httpx.post(stack.url + "/v1/embeddings", json={"model": "rerank", "input": "x"})
    assert r.status_code == 400 and "'rerank'" in r.json()["error"]["message"]
    assert "use /rerank or /score" in r.json()["error"]["message"]
    r = httpx.post(stack.url + "/embed_sparse", json={"model": "embed", "inputs": "x"})
    assert r.status_code == 424 and "'embed'" in r.json()["error"]  # TEI's status for a model that cannot
    r = httpx.post(stack.url + "/pooling", json={"model": "sparse", "input": "x", "task": "token_embed"})
    assert r.status_code == 400 and "('embed', 'token_classify')" in r.json()["error"]["message"]


def test_each_models_settings_stay_its_own(stack):
    long = " ".join(["word"] * 40)
    cut = httpx.post(stack.url + "/v1/embeddings", json={"model": "embed", "input": long})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 16  # --truncate, --max-model-len 16
    refused = httpx.post(stack.url + "/embed_sparse", json={"model": "sparse", "inputs": long})
    assert (
        refused.status_code == 422
    )  # TEI's route: its status for invalid input. Its entry has neither: 32 tokens at most, refused rather than cut


def test_one_memory_plan_over_the_models_names_the_one_that_does_not_fit(tmp_path):
    a, b = build_bert(tmp_path / "a", hidden=256, layers=4), build_bert(tmp_path / "b", hidden=256, layers=4)
    configs = [ModelConfig(str(a), served_name="a"), ModelConfig(str(b), served_name="b")]
    alone = plan_models(configs[:1], MemoryBudget(None, 2**31, 2**34, "test"))[0].memory
    need = 450 * 2**20 + alone.weights_bytes + alone.fixed_bytes  # runtime, weights and buffers of one
    budget = int((need + alone.per_token_bytes * 512 * 1.5) / 0.9)  # room for one model's batch, not two models
    memory = MemoryBudget(None, budget, 2**34, "test")
    assert len(plan_models(configs[:1], memory)) == 1
    with pytest.raises(ConfigError, match=r"^model [ab]: the model does not fit.*the other models"):
        plan_models(configs, memory)
    roomy = plan_models(configs, MemoryBudget(None, 2**32, 2**34, "test"))
    assert all(p.memory.others_bytes == alone.weights_bytes + alone.fixed_bytes for p in roomy)
    single = plan_models(configs[:1], MemoryBudget(None, 2**32, 2**34, "test"))[0].memory
    assert roomy[0].memory.max_queued_vectors < single.max_queued_vectors  # the answers' memory is shared


def test_turns_go_to_the_earliest_deadline_then_first_asked():
    async def scenario():
        turns, order = Turns(), []
        await turns.acquire(0.0)  # a batch runs

        async def wait(name, deadline):
            await turns.acquire(deadline)
            order.append(name)
            turns.release()

        tasks = [asyncio.create_task(wait(n, d)) for n, d in (("late", 9.0), ("soon", 1.0), ("also-soon", 1.0))]
        await asyncio.sleep(0)
        assert turns.waiting == 3
        turns.release()
        await asyncio.gather(*tasks)
        return order, turns.held

    assert asyncio.run(scenario()) == (["soon", "also-soon", "late"], False)


def test_no_model_takes_two_turns_in_a_row_while_another_waits():
    """An overdue flood (every deadline in the past) on model A would win every turn by deadline alone; B's batch
    goes after A's running one."""

    async def scenario():
        turns, order = Turns(), []
        a, b = object(), object()
        await turns.acquire(0.0, a)  # A's batch runs

        async def wait(name, owner, deadline):
            await turns.acquire(deadline, owner)
            order.append(name)
            turns.release()

        tasks = [asyncio.create_task(wait("a2", a, 1.0)), asyncio.create_task(wait("b", b, 5.0))]
        await asyncio.sleep(0)
        turns.release()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["b", "a2"]


def _batches_before(runner_b_shared: bool, tokenizer) -> int:
    """A flood of long requests on engine A, then one short query: on engine A itself, or on engine B sharing A's
    model thread. The tokens computed (by any model) from the query's arrival until its answer: the work it waited
    for and its own batch's."""
    from fakes import FakeRunner

    log: list[int] = []  # tokens of each batch, in the order they ran
    a = FakeRunner(tokenizer.vocab_size)
    b = FakeRunner(tokenizer.vocab_size)
    run_a, run_b = a.run, b.run
    a.run = lambda batch, *x, **k: (log.append(sum(map(len, batch))), run_a(batch, *x, **k))[1]
    b.run = lambda batch, *x, **k: (log.append(sum(map(len, batch))), run_b(batch, *x, **k))[1]
    thread, turns = ThreadPoolExecutor(1), Turns()
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, batch_wait_seconds=0, max_queue_seconds=1e6)
    ea = AsyncEngine(a, tokenizer, config, model_thread=thread, turns=turns)
    eb = AsyncEngine(b, tokenizer, config, model_thread=thread, turns=turns)
    query_engine = eb if runner_b_shared else ea
    flood = [" ".join(["word"] * 28)] * 24

    async def scenario() -> int:
        await ea.start()
        await eb.start()
        a.gate.clear()  # the flood's first batch holds the model thread until released
        log.clear()
        tasks = [asyncio.create_task(ea.embed([t])) for t in flood]
        while not log:  # the first flood batch is on the thread
            await asyncio.sleep(0.01)
        query = asyncio.create_task(query_engine.embed(["short query"]))
        await asyncio.sleep(0.05)
        before = len(log)
        a.gate.set()
        await query
        ran = sum(log[before - 1 :])  # the batch running when it arrived, and every one since
        await asyncio.gather(*tasks)
        await ea.stop(1)
        await eb.stop(1)
        return ran

    try:
        return asyncio.run(scenario())
    finally:
        thread.shutdown()


def test_a_flood_on_one_model_delays_another_no_more_than_the_same_flood_on_its_own_model(tokenizer):
    same = _batches_before(False, tokenizer)
    other = _batches_before(True, tokenizer)
    assert other <= same  # the other model's query waits behind no more of the flood than its own model's would


def test_doctor_plans_every_model_of_the_models_file_and_names_the_one_refused(tmp_path):
    import json
    import subprocess
    import sys

    ce = build_cross_encoder(tmp_path / "ce")
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump([{"model": str(ce), "served_model_name": "rerank"}]))
    too_long = [{"model": str(ce), "served_model_name": "rerank", "max_model_len": 100_000}]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(too_long))

    def doctor(models):
        cmd = [sys.executable, "-m", "ember.cli.main", "doctor", "--json", "--models", str(tmp_path / models)]
        return subprocess.run(cmd, capture_output=True, text=True)

    ok, bad = doctor("ok.yaml"), doctor("bad.yaml")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    models = json.loads(ok.stdout)["models"]
    assert list(models) == ["sentence-transformers/all-MiniLM-L6-v2", "rerank"]
    assert models["rerank"]["task"] == "score" and "other models" in models["rerank"]["memory_plan"]
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["problems"][0].startswith("model rerank: --max-model-len 100000 is greater")


def test_a_models_file_is_checked_entry_by_entry(tmp_path):
    from ember.cli.flags import add_serve_flags
    from ember.cli.model_flags import model_configs

    def configs(entries, *flags):
        (tmp_path / "m.yaml").write_text(yaml.safe_dump(entries))
        p = __import__("argparse").ArgumentParser()
        add_serve_flags(p)
        return model_configs(p.parse_args([*flags, "--models", str(tmp_path / "m.yaml")]))

    inherited = configs([{"model": "b"}, {"model": "c", "memory_limit": "1Gi"}], "--memory-limit", "3Gi")
    assert [c.memory_limit for c, _, _ in inherited] == [3 * 2**30, 3 * 2**30, 2**30]  # the server's memory
    for bad, message in (
        ({"model": "b", "max_model_len": "abc"}, "entry 1: 'abc' is not a count"),
        ({"model": "b", "truncate": "false"}, "entry 1: truncate must be true or false"),
        ({"model": "b", "served_model_name": 5}, "entry 1: served_model_name must be a name"),
        ({"model": "b", "max_model_length": 5}, "entry 1: unknown key"),
    ):
        with pytest.raises(ConfigError, match=message):
            configs([bad])
