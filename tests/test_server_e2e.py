"""`ember serve` as a real process, driven by the clients teams use: OpenAI SDK, LiteLLM, LangChain, LlamaIndex."""

from __future__ import annotations

import base64
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from checkpoints import build_bert, build_qwen3
from corpus import SENTENCES
from ember import Embedder
from server import Server

KEY = "test-key"
NAME = "tiny-bert"


def cos(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert"), layers=2, hidden=64)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    args = [
        str(model_dir),
        "--served-model-name",
        NAME,
        "alias",
        "--api-key",
        KEY,
        "--dtype",
        "float32",
        "--hf-overrides",
        '{"is_matryoshka": true}',
        "--max-model-len",
        "64",
    ]
    srv = Server(args, log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    return Embedder(str(model_dir), dtype="float32", max_model_len=64, hf_overrides={"is_matryoshka": True})


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_openai_sdk_default_call_decodes_base64(client, offline):
    r = client.embeddings.create(model=NAME, input=["hello there", "general kenobi"])
    expected, counts = offline.embed(["hello there", "general kenobi"])
    assert [d.index for d in r.data] == [0, 1]
    for d, e in zip(r.data, expected, strict=True):
        assert cos(d.embedding, e) >= 0.99999
    assert r.usage.prompt_tokens == sum(counts) == r.usage.total_tokens and r.model == NAME


def test_openai_sdk_float_dimensions_tokens_and_a_batch_of_100(client, offline):
    r = client.embeddings.create(model=NAME, input="float please", encoding_format="float")
    assert cos(r.data[0].embedding, offline.embed(["float please"]).vectors[0]) >= 0.99999
    r = client.embeddings.create(model=NAME, input="short", dimensions=16)
    assert len(r.data[0].embedding) == 16 and abs(np.linalg.norm(r.data[0].embedding) - 1) < 1e-5
    ids = offline.tokenizer.encode("token ids in")
    r = client.embeddings.create(model=NAME, input=[ids])
    assert r.usage.prompt_tokens == len(ids)
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(100)]
    r = client.embeddings.create(model="alias", input=texts, extra_body={"truncate_prompt_tokens": -1})
    expected, counts = offline.embed(texts, truncate_prompt_tokens=-1)
    assert len(r.data) == 100 and r.usage.prompt_tokens == sum(counts)
    assert min(cos(d.embedding, e) for d, e in zip(r.data, expected, strict=True)) >= 0.99999


def test_openai_sdk_errors_are_its_exception_types(server, client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 64 tokens"):
        client.embeddings.create(model=NAME, input=[[5] * 65])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.embeddings.create(model=NAME, input="x")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=NAME, input=[])
    assert client.embeddings.create(model=NAME, input=[[5] * 64]).usage.prompt_tokens == 64


def test_encoding_format_null_and_raw_http(server, offline):
    r = httpx.post(
        server.url + "/v1/embeddings",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": NAME, "input": "null format", "encoding_format": None},
    )
    assert r.status_code == 200
    assert cos(r.json()["data"][0]["embedding"], offline.embed(["null format"]).vectors[0]) >= 0.99999
    r = httpx.post(
        server.url + "/v1/embeddings",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": NAME, "input": "b64", "encoding_format": "base64"},
    )
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert cos(vec, offline.embed(["b64"]).vectors[0]) >= 0.99999


def test_litellm_openai_and_hosted_vllm_prefixes(server, offline):
    import litellm

    expected = offline.embed(["litellm text"]).vectors[0]
    for prefix in ("openai/", "hosted_vllm/"):
        r = litellm.embedding(model=prefix + NAME, input=["litellm text"], api_base=server.url + "/v1", api_key=KEY)
        assert cos(r.data[0]["embedding"], expected) >= 0.99999
        assert r.usage.prompt_tokens == offline.embed(["litellm text"]).token_counts[0]


def test_langchain_openai_embeddings(server, offline):
    import langchain_openai as lc

    emb = lc.OpenAIEmbeddings(model=NAME, base_url=server.url + "/v1", api_key=KEY, check_embedding_ctx_length=False)
    docs = emb.embed_documents(["doc one", "doc two"])
    query = emb.embed_query("a query")
    expected = offline.embed(["doc one", "doc two", "a query"]).vectors
    assert min(cos(a, b) for a, b in zip([*docs, query], expected, strict=True)) >= 0.99999


def test_llamaindex_openai_like_embedding(server, offline):
    import llama_index.embeddings.openai_like as mod

    emb = mod.OpenAILikeEmbedding(model_name=NAME, api_base=server.url + "/v1", api_key=KEY)
    vec = emb.get_text_embedding("llama text")
    assert cos(vec, offline.embed(["llama text"]).vectors[0]) >= 0.99999


def test_32_concurrent_clients_get_the_offline_vectors(server, offline):
    texts = [SENTENCES[i % len(SENTENCES)] * (1 + i % 3) for i in range(96)]
    requests = [texts[i : i + 3] for i in range(0, 96, 3)]  # 32 requests of 3 inputs

    def call(batch):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        r = c.embeddings.create(model=NAME, input=batch, extra_body={"truncate_prompt_tokens": -1})
        return [d.embedding for d in r.data], r.usage.prompt_tokens

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(call, requests))
    vectors = [v for vs, _ in results for v in vs]
    expected, counts = offline.embed(texts, truncate_prompt_tokens=-1)
    assert min(cos(a, b) for a, b in zip(vectors, expected, strict=True)) >= 0.99999
    assert sum(n for _, n in results) == sum(counts)
    metrics = httpx.get(server.url + "/metrics").text
    assert "ember_batch_sequences_count" in metrics


def test_sigterm_finishes_in_flight_requests_and_exits_0(model_dir, tmp_path):
    srv = Server([str(model_dir), "--dtype", "float32", "--shutdown-grace", "20"], tmp_path / "log")
    results = []

    def slow_request():
        texts = ["x " * 400] * 64
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": texts, "truncate_prompt_tokens": -1}, timeout=60)
        results.append(r.status_code)

    t = threading.Thread(target=slow_request)
    t.start()
    time.sleep(0.3)
    srv.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert srv.proc.wait(60) == 0
    assert results == [200]


def test_sigterm_keeps_answering_new_connections_503_while_it_drains(tmp_path):
    """After SIGTERM the server still accepts connections until its admitted work is answered: a client that
    connects during the drain (as Kubernetes still sends them for a few seconds) gets an OpenAI-shaped 503, not a
    dropped connection, and the request in flight still gets its 200."""
    srv = Server(["--dtype", "float32", "--shutdown-grace", "60"], tmp_path / "log")  # the bundled MiniLM
    results = []

    def slow_request():  # seconds of work on 2 cores
        texts = [f"document {j} " + "word " * 240 for j in range(128)]
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": texts}, timeout=120)
        results.append(r.status_code)

    t = threading.Thread(target=slow_request)
    t.start()
    deadline = time.monotonic() + 30
    while _metric(srv.url, "ember_running_batch_tokens") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # until the slow request is on the model thread
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    late = httpx.post(srv.url + "/v1/embeddings", json={"input": "a late query"}, timeout=30)
    t.join(120)
    assert srv.proc.wait(60) == 0
    assert late.status_code == 503 and late.json()["error"]["type"] == "ServiceUnavailableError", late.text
    assert results == [200]


def test_bundled_default_model_serves_with_no_model_named(tmp_path):
    srv = Server([], tmp_path / "log")
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["sentence-transformers/all-MiniLM-L6-v2"]
        r = c.embeddings.create(model="sentence-transformers/all-MiniLM-L6-v2", input=["Hello world."])
        assert len(r.data[0].embedding) == 384
    finally:
        assert srv.stop() == 0


def _metric(url, name):
    text = httpx.get(url + "/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith((name + " ", name + "{"))))


def test_a_disconnected_client_s_work_is_dropped_before_it_is_computed(model_dir, tmp_path):
    import json
    import socket

    # one huge batch keeps the model busy for a while, so the second request stays queued
    srv = Server(
        [
            str(model_dir),
            "--dtype",
            "float32",
            "--max-model-len",
            "64",
            "--max-num-batched-tokens",
            "300000",
            "--max-num-seqs",
            "8192",
            "--max-inputs-per-request",
            "4096",
        ],
        tmp_path / "log",
    )
    try:
        usage = []

        def busy():
            body = {"input": [[5] * 64] * 4096}
            usage.append(httpx.post(srv.url + "/v1/embeddings", timeout=60, json=body).json()["usage"]["prompt_tokens"])

        t = threading.Thread(target=busy)
        t.start()
        deadline = time.monotonic() + 30
        while _metric(srv.url, "ember_running_batch_tokens") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the busy batch is on the model thread
        body = json.dumps({"input": [[7] * 30]}).encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(0.1)  # read and queued behind the running batch; then the client goes away
        t.join(60)
        time.sleep(0.3)
        log = srv.log.read_text()
        assert '"POST /v1/embeddings" 499' in log, log
        # the model ran exactly the busy request's tokens: the 30 tokens of the client that left never ran
        assert _metric(srv.url, "ember_batch_tokens_sum") == usage[0]
    finally:
        srv.stop()


def test_the_server_compiles_fused_kernels_in_the_background_and_answers_the_same(tmp_path):
    path = build_qwen3(tmp_path / "qwen3")
    texts = [SENTENCES[0], SENTENCES[50] * 4, "a", *SENTENCES[1:6]]  # short, long (own attention call), 1 token
    eager, _ = Embedder(str(path), dtype="float32", enforce_eager=True).embed(texts)
    srv = Server([str(path), "--dtype", "float32"], tmp_path / "log", compile=True)
    try:
        deadline = time.monotonic() + 180
        while "fused kernels compiled" not in srv.log.read_text():
            assert time.monotonic() < deadline and "could not be compiled" not in srv.log.read_text()
            time.sleep(0.5)
        data = httpx.post(srv.url + "/v1/embeddings", json={"input": texts}, timeout=60).json()["data"]
    finally:
        srv.stop()
    assert min(cos(d["embedding"], e) for d, e in zip(data, eager, strict=True)) >= 0.99999


def test_ember_bench_sends_the_key_and_skips_workloads_the_model_cannot_take(server):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "ember.cli.main", "bench", "--url", server.url, "--api-key", KEY,
         "--workloads", "long,queries"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == f"skipped long: its inputs reach 8000 tokens, over {NAME}'s max_model_len 64"
    assert lines[1].startswith("queries:") and "tok/s" in lines[1]


def test_bench_workload_counts_usage_and_stops_on_a_refused_request(server):
    import asyncio

    from ember.cli.bench import WORKLOADS, BenchError, Workload, run_workload

    w = WORKLOADS["queries"]
    small = Workload(w.name, w.lengths[:12], w.per_request, 4)
    result = asyncio.run(run_workload(server.url, NAME, small, KEY))
    assert result.requests == 12 and result.retries == 0
    tokens = sum(
        httpx.post(server.url + "/v1/embeddings", json={"model": NAME, "input": t},
                   headers={"Authorization": f"Bearer {KEY}"}).json()["usage"]["prompt_tokens"]
        for t in small.texts()
    )  # fmt: skip
    assert result.tokens == tokens
    with pytest.raises(BenchError, match="the server answered 401"):
        asyncio.run(run_workload(server.url, NAME, small, "not-the-key"))


def test_sigterm_drain_keeps_its_grace_and_answers_the_rest_503(tmp_path):
    """More queued work than the grace can finish: the process exits within grace + 2 s, every client gets a
    200 or an OpenAI-shaped 503 (no plain 500, no traceback), and the work nobody will receive is dropped."""
    grace = 4.0
    srv = Server(
        ["--dtype", "float32", "--shutdown-grace", str(grace), "--max-queue-seconds", "1000"], tmp_path / "log"
    )  # the bundled MiniLM; all 40 admitted, so the drain has work to cut short
    statuses, bodies = [], []

    def client(i):
        texts = [f"document {i}-{j} " + "word " * 240 for j in range(16)]
        try:
            r = httpx.post(srv.url + "/v1/embeddings", json={"input": texts}, timeout=60)
            statuses.append(r.status_code)
            bodies.append(r.json())
        except httpx.HTTPError as e:  # a connection closed by the exiting server
            statuses.append(type(e).__name__)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while _metric(srv.url, "ember_queue_requests") < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0
    elapsed = time.monotonic() - start
    for t in threads:
        t.join(30)
    assert elapsed <= grace + 2 + 1, elapsed  # + 1 s for the interpreter to go
    assert 503 in statuses and set(statuses) <= {200, 503}, statuses
    for status, body in zip(statuses, bodies, strict=False):
        if status == 503:
            assert body["error"]["type"] == "ServiceUnavailableError"
    log = srv.log.read_text()
    assert "Traceback" not in log and "answered 503" in log, log
