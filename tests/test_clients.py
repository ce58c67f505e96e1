"""docs/clients.md, run: every client's snippet against a real `ember serve`, vectors checked against `ember.Embedder`.

The calls and arguments are the page's; only the URL, key, model directory, Matryoshka width (16 here, the tiny
model is 64 wide) and the query prompt differ: the tiny model's `query` prompt is "query: " instead of Qwen3's
instruction, so the clients that prepend the instruction themselves prepend "query: ".

The LiteLLM proxy test is marked slow and needs `litellm[proxy]` in this environment, or
EMBER_TEST_LITELLM_PROXY=/path/to/bin/litellm of another virtualenv that has it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from checkpoints import build_bert
from ember import Embedder
from server import Server, litellm_proxy

# Before any client is imported: LiteLLM would fetch its price map from GitHub at import, Haystack and Chroma
# would send telemetry.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")

DOC = Path(__file__).resolve().parents[1] / "docs" / "clients.md"
NAME = "qwen3-embedding"  # the served name the page uses
KEY = "ember-test-key"
DIMS = 16
QUERY_PROMPT = "query: "  # the tiny model's prompt "query" (Qwen3's is "Instruct: ...\nQuery:")
DOCS = ["first document", "second document"]
QUERY = "how do I reset my password"


def cos(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_same(got, expected):
    got, expected = list(got), list(expected)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert len(g) == len(e)
        assert cos(g, e) >= 0.99999


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_bert(tmp_path_factory.mktemp("bert"), layers=2, hidden=64)
    st_config = path / "config_sentence_transformers.json"
    config = json.loads(st_config.read_text()) if st_config.is_file() else {}
    config["prompts"] = {"query": QUERY_PROMPT}
    st_config.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    args = [str(model_dir), "--served-model-name", NAME, "--api-key", KEY, "--dtype", "float32"]
    args += ["--hf-overrides", '{"is_matryoshka": true}', "--max-model-len", "64"]
    srv = Server(args, log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def url(server):
    return server.url + "/v1"


@pytest.fixture(scope="module")
def offline(model_dir):
    return Embedder(str(model_dir), dtype="float32", max_model_len=64, hf_overrides={"is_matryoshka": True})


@pytest.fixture(scope="module")
def expected(offline):
    """The offline vectors of some texts (a str: a one-item list)."""

    def vectors(texts, **kwargs):
        return list(offline.embed([texts] if isinstance(texts, str) else list(texts), **kwargs).vectors)

    return vectors


@pytest.fixture(scope="module")
def assert_query(expected):
    """`vector` is the query embedded with the "query" prompt: equal to embedding "query: " + text, not the text."""

    def check(vector, text=QUERY, **kwargs):
        assert_same([vector], expected(QUERY_PROMPT + text, **kwargs))
        assert_same([vector], expected(text, prompt_name="query", **kwargs))
        assert cos(vector, expected(text, **kwargs)[0]) < 0.999  # the prompt does change the vector

    return check


def doc_block(lang: str) -> str:
    """The first ```lang code block of docs/clients.md."""
    match = re.search(rf"^```{lang}\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.S | re.M)
    assert match, f"no {lang} block in {DOC}"
    return match.group(1)


def test_the_page_snippets_compile_and_use_qwen3s_query_prompt():
    import ast

    try:
        from checkpoints.builders import QWEN3_QUERY_PROMPT
    except ImportError:
        from ember.testing.checkpoints import QWEN3_QUERY_PROMPT
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) >= 8
    prompts = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "QUERY_PROMPT" for t in node.targets):
                prompts.append(ast.literal_eval(node.value))
    assert len(prompts) == 3 and set(prompts) == {QWEN3_QUERY_PROMPT}


def capture(bodies: list):
    """An httpx.Client that records each request's JSON body."""
    return httpx.Client(event_hooks={"request": [lambda request: bodies.append(json.loads(request.content))]})


# --------------------------------------------------------------------------- OpenAI SDK


def test_openai_sdk(url, expected, assert_query):
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=KEY)

    docs = client.embeddings.create(model=NAME, input=DOCS)
    doc_vectors = [d.embedding for d in docs.data]
    assert_same(doc_vectors, expected(DOCS))
    assert isinstance(doc_vectors[0], list) and isinstance(doc_vectors[0][0], float)  # base64, decoded by the SDK

    query = client.embeddings.create(model=NAME, input=QUERY, extra_body={"prompt_name": "query"})
    assert_query(query.data[0].embedding)

    short = client.embeddings.create(model=NAME, input="first document", dimensions=DIMS)
    assert len(short.data[0].embedding) == DIMS
    assert_same([short.data[0].embedding], expected("first document", dimensions=DIMS))

    floats = client.embeddings.create(model=NAME, input=DOCS, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], doc_vectors, rtol=1e-6, atol=1e-7)


def test_cohere_sdk_v2(server, expected, assert_query):
    cohere = pytest.importorskip("cohere")

    client = cohere.ClientV2(api_key=KEY, base_url=server.url)
    docs = client.embed(model=NAME, texts=DOCS, input_type="search_document", embedding_types=["float", "int8",
                        "ubinary"])  # fmt: skip
    assert_same(docs.embeddings.float_, expected(DOCS))
    for codes, vector in zip(docs.embeddings.int8, expected(DOCS), strict=True):  # the vector, scaled and rounded
        assert max(map(abs, codes)) == 127 and cos(codes, vector) > 0.999
    assert len(docs.embeddings.ubinary[0]) * 8 == len(docs.embeddings.float_[0])
    assert docs.meta.billed_units.input_tokens > 0
    query = client.embed(model=NAME, texts=[QUERY], input_type="search_query", embedding_types=["float"])
    assert_query(query.embeddings.float_[0])  # search_query: the model's "query" prompt
    short = client.embed(model=NAME, texts=DOCS, input_type="search_document", embedding_types=["float"],
                         output_dimension=DIMS)  # fmt: skip
    assert_same(short.embeddings.float_, expected(DOCS, dimensions=DIMS))


# --------------------------------------------------------------------------- LiteLLM


def test_litellm_library(url, expected, assert_query, monkeypatch):
    import litellm

    docs = litellm.embedding(model=f"hosted_vllm/{NAME}", input=DOCS, api_base=url, api_key=KEY)
    assert_same([d["embedding"] for d in docs.data], expected(DOCS))

    query = litellm.embedding(
        model=f"hosted_vllm/{NAME}",
        input=[QUERY],
        api_base=url,
        api_key=KEY,
        prompt_name="query",
        dimensions=DIMS,
    )
    assert len(query.data[0]["embedding"]) == DIMS
    assert_query(query.data[0]["embedding"], dimensions=DIMS)

    # openai/: plain calls and prompt_name work; dimensions is refused, or silently dropped with drop_params.
    plain = litellm.embedding(model=f"openai/{NAME}", input=DOCS, api_base=url, api_key=KEY)
    assert_same([d["embedding"] for d in plain.data], expected(DOCS))
    query = litellm.embedding(model=f"openai/{NAME}", input=[QUERY], api_base=url, api_key=KEY, prompt_name="query")
    assert_query(query.data[0]["embedding"])
    with pytest.raises(litellm.UnsupportedParamsError):
        litellm.embedding(model=f"openai/{NAME}", input=[QUERY], api_base=url, api_key=KEY, dimensions=DIMS)
    monkeypatch.setattr(litellm, "drop_params", True)
    dropped = litellm.embedding(model=f"openai/{NAME}", input=[QUERY], api_base=url, api_key=KEY, dimensions=DIMS)
    assert len(dropped.data[0]["embedding"]) == 64


def test_litellm_proxy_config_routes_to_ember(url, expected, assert_query, monkeypatch):
    """The page's config.yaml, loaded as the proxy loads model_list: a litellm Router (no proxy extras needed)."""
    import litellm
    import yaml

    config = yaml.safe_load(doc_block("yaml"))
    assert config["general_settings"] == {"master_key": "os.environ/LITELLM_MASTER_KEY"}
    [deployment] = config["model_list"]
    assert deployment["model_name"] == NAME and deployment["model_info"] == {"mode": "embedding"}
    assert deployment["litellm_params"]["model"] == f"hosted_vllm/{NAME}"
    monkeypatch.setenv("EMBER_API_BASE", url)
    monkeypatch.setenv("EMBER_API_KEY", KEY)

    router = litellm.Router(model_list=config["model_list"])
    docs = router.embedding(model=NAME, input=DOCS)
    assert_same([d["embedding"] for d in docs.data], expected(DOCS))
    query = router.embedding(model=NAME, input=[QUERY], prompt_name="query", dimensions=DIMS)
    assert_query(query.data[0]["embedding"], dimensions=DIMS)


@pytest.mark.slow
def test_litellm_proxy_end_to_end(url, expected, assert_query, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(doc_block("yaml"))
    master = "sk-proxy-test"
    env = {"EMBER_API_BASE": url, "EMBER_API_KEY": KEY, "LITELLM_MASTER_KEY": master}
    with litellm_proxy(config, env, tmp_path / "proxy.log") as base:
        auth = {"Authorization": f"Bearer {master}"}

        # the page's curl
        body = {"model": NAME, "input": [QUERY], "prompt_name": "query"}
        r = httpx.post(base + "/v1/embeddings", headers=auth, json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert_query(r.json()["data"][0]["embedding"])

        # the page's OpenAI SDK call to the proxy
        proxy = openai.OpenAI(base_url=base + "/v1", api_key=master)
        query = proxy.embeddings.create(
            model=NAME,
            input=QUERY,
            extra_body={"prompt_name": "query"},
            dimensions=DIMS,
        )
        assert_query(query.data[0].embedding, dimensions=DIMS)
        docs = proxy.embeddings.create(model=NAME, input=DOCS)
        assert_same([d.embedding for d in docs.data], expected(DOCS))

        health = httpx.get(base + "/health", headers=auth, timeout=60).json()
        assert health["healthy_count"] == 1 and health["unhealthy_count"] == 0, health
        r = httpx.post(base + "/v1/embeddings", headers={"Authorization": "Bearer sk-other"}, json=body, timeout=30)
        assert r.status_code == 400 and "No connected db" in r.text


# --------------------------------------------------------------------------- LangChain


def test_langchain(url, expected, assert_query):
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=NAME,
        base_url=url,
        api_key=KEY,
        check_embedding_ctx_length=False,
    )
    doc_vectors = embeddings.embed_documents(DOCS)
    query_vector = embeddings.embed_query(QUERY, extra_body={"prompt_name": "query"})
    assert_same(doc_vectors, expected(DOCS))
    assert_query(query_vector)
    assert_same([embeddings.embed_query(QUERY)], expected(QUERY))  # no prompt unless asked

    class QueryPromptEmbeddings(OpenAIEmbeddings):
        """Sends prompt_name="query" with queries; documents go without a prompt."""

        def embed_query(self, text: str, **kwargs) -> list[float]:
            return super().embed_query(text, extra_body={"prompt_name": "query"}, **kwargs)

        async def aembed_query(self, text: str, **kwargs) -> list[float]:
            return await super().aembed_query(text, extra_body={"prompt_name": "query"}, **kwargs)

    store = InMemoryVectorStore(
        embedding=QueryPromptEmbeddings(
            model=NAME,
            base_url=url,
            api_key=KEY,
            check_embedding_ctx_length=False,
        )
    )
    store.add_texts(DOCS)
    hits = store.similarity_search_with_score(QUERY, k=2)
    query_with_prompt = expected(QUERY_PROMPT + QUERY)[0]
    for doc, score in hits:
        assert score == pytest.approx(cos(query_with_prompt, expected(doc.page_content)[0]), abs=1e-5)
    assert {doc.page_content for doc, _ in hits} == set(DOCS)

    import asyncio

    assert_query(asyncio.run(store.embedding.aembed_query(QUERY)))
    query_only = OpenAIEmbeddings(
        model=NAME,
        base_url=url,
        api_key=KEY,
        check_embedding_ctx_length=False,
        model_kwargs={"extra_body": {"prompt_name": "query"}},
    )
    assert_query(query_only.embed_query(QUERY))
    assert_query(query_only.embed_documents([QUERY])[0])  # model_kwargs reach documents too
    short = OpenAIEmbeddings(model=NAME, base_url=url, api_key=KEY, check_embedding_ctx_length=False, dimensions=DIMS)
    assert_same([short.embed_query(QUERY)], expected(QUERY, dimensions=DIMS))


def test_langchain_without_the_flag_sends_tiktoken_ids(url, expected, monkeypatch):
    """Without check_embedding_ctx_length=False, LangChain sends cl100k_base token ids: ember embeds them as its own."""
    import llama_index.core
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    # The real cl100k_base, from the copy llama-index-core ships (tiktoken would download it otherwise).
    cache = Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"
    if not (cache / "9b5ad71b2ce5302211f9c61530b329a4922fc6a4").is_file():
        pytest.skip("llama-index-core's bundled cl100k_base is missing")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    ids = tiktoken.get_encoding("cl100k_base").encode_ordinary(QUERY)

    bodies: list = []
    embeddings = OpenAIEmbeddings(model=NAME, base_url=url, api_key=KEY, http_client=capture(bodies))
    vector = embeddings.embed_query(QUERY)
    assert bodies[0]["input"] == [ids]  # token ids, not the text
    assert max(ids) < 30522  # all inside the BERT vocabulary: accepted, embedded as BERT ids
    assert_same([vector], expected([ids]))
    assert cos(vector, expected(QUERY)[0]) < 0.99  # silently not the text's embedding

    with pytest.raises(openai.BadRequestError):  # an id past the vocabulary: 400
        embeddings.embed_query("reimbursement policy")


# --------------------------------------------------------------------------- LlamaIndex


def test_llamaindex(url, expected, assert_query):
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    embed_model = OpenAILikeEmbedding(
        model_name=NAME,
        api_base=url,
        api_key=KEY,
        embed_batch_size=64,
    )
    query_model = OpenAILikeEmbedding(
        model_name=NAME,
        api_base=url,
        api_key=KEY,
        additional_kwargs={"extra_body": {"prompt_name": "query"}},
    )
    doc_vectors = embed_model.get_text_embedding_batch(DOCS)
    query_vector = query_model.get_query_embedding(QUERY)
    assert_same(doc_vectors, expected(DOCS))
    assert_query(query_vector)
    assert_same([embed_model.get_query_embedding(QUERY)], expected(QUERY))

    index = VectorStoreIndex([TextNode(text=DOCS[0]), TextNode(text=DOCS[1])], embed_model=embed_model)
    hits = index.as_retriever(embed_model=query_model, similarity_top_k=2).retrieve(QUERY)
    query_with_prompt = expected(QUERY_PROMPT + QUERY)[0]
    assert {h.node.get_content() for h in hits} == set(DOCS)
    for h in hits:
        assert h.score == pytest.approx(cos(query_with_prompt, expected(h.node.get_content())[0]), abs=1e-5)

    bodies: list = []
    spy = OpenAILikeEmbedding(model_name=NAME, api_base=url, api_key=KEY, http_client=capture(bodies))
    spy.get_text_embedding("line one\nline two")
    assert bodies[0]["input"] == ["line one line two"]  # newlines become spaces
    short = OpenAILikeEmbedding(model_name=NAME, api_base=url, api_key=KEY, dimensions=DIMS)
    assert_same([short.get_text_embedding(QUERY)], expected(QUERY, dimensions=DIMS))


# --------------------------------------------------------------------------- Haystack


def test_haystack(url, expected, assert_query, monkeypatch):
    pytest.importorskip("haystack", reason="haystack-ai is not installed")
    from haystack import Document
    from haystack.components.embedders import OpenAIDocumentEmbedder, OpenAITextEmbedder
    from haystack.utils import Secret

    doc_embedder = OpenAIDocumentEmbedder(
        api_key=Secret.from_token(KEY),
        model=NAME,
        api_base_url=url,
        raise_on_failure=True,
    )
    query_embedder = OpenAITextEmbedder(
        api_key=Secret.from_token(KEY),
        model=NAME,
        api_base_url=url,
        prefix=QUERY_PROMPT,
    )
    docs = doc_embedder.run([Document(content=DOCS[0]), Document(content=DOCS[1])])["documents"]
    query_vector = query_embedder.run(QUERY)["embedding"]
    assert_same([d.embedding for d in docs], expected(DOCS))
    assert_query(query_vector)  # prefix= gives exactly the prompt_name vector

    with pytest.raises(ValueError, match="token-based secret"):
        query_embedder.to_dict()
    monkeypatch.setenv("EMBER_API_KEY", KEY)
    from_env = OpenAITextEmbedder(api_key=Secret.from_env_var("EMBER_API_KEY"), model=NAME, api_base_url=url)
    assert from_env.to_dict()["init_parameters"]["api_key"]["env_vars"] == ["EMBER_API_KEY"]
    assert_same([from_env.run(QUERY)["embedding"]], expected(QUERY))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert_same([OpenAITextEmbedder(model=NAME, api_base_url=url).run(QUERY)["embedding"]], expected(QUERY))
    short = OpenAITextEmbedder(api_key=Secret.from_token(KEY), model=NAME, api_base_url=url, dimensions=DIMS)
    assert_same([short.run(QUERY)["embedding"]], expected(QUERY, dimensions=DIMS))

    failing = OpenAIDocumentEmbedder(api_key=Secret.from_token("wrong"), model=NAME, api_base_url=url, max_retries=0)
    [unembedded] = failing.run([Document(content=DOCS[0])])["documents"]
    assert unembedded.embedding is None  # the default raise_on_failure=False: logged, not raised


# --------------------------------------------------------------------------- Chroma


def test_chroma(url, expected, assert_query, monkeypatch, tmp_path):
    pytest.importorskip("chromadb", reason="chromadb is not installed")
    import chromadb
    from chromadb.utils.embedding_functions import OpenAIEmbeddingFunction

    monkeypatch.setenv("EMBER_API_KEY", KEY)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)

    class EmberEmbeddingFunction(OpenAIEmbeddingFunction):
        def embed_query(self, input):
            return self([QUERY_PROMPT + text for text in input])

    embedding_function = EmberEmbeddingFunction(
        api_key_env_var="EMBER_API_KEY",
        api_base=url,
        model_name=NAME,
    )
    client = chromadb.PersistentClient(path=str(tmp_path / "chroma"))
    collection = client.get_or_create_collection("docs", embedding_function=embedding_function)
    collection.add(ids=["1", "2"], documents=DOCS)
    hits = collection.query(query_texts=[QUERY], n_results=2)

    stored = collection.get(ids=["1", "2"], include=["embeddings"])["embeddings"]
    assert_same(stored, expected(DOCS))
    assert_query(embedding_function.embed_query([QUERY])[0])
    query_with_prompt = expected(QUERY_PROMPT + QUERY)[0]
    distances = dict(zip(hits["ids"][0], hits["distances"][0], strict=True))
    for i, text in zip(("1", "2"), DOCS, strict=True):  # cosine space: 1 - cos(query with prompt, document)
        assert distances[i] == pytest.approx(1 - cos(query_with_prompt, expected(text)[0]), abs=1e-5)

    # Reopened without embedding_function=: Chroma rebuilds a plain OpenAIEmbeddingFunction, no query prompt.
    reopened = chromadb.PersistentClient(path=str(tmp_path / "chroma")).get_collection("docs")
    plain = reopened.query(query_texts=[QUERY], n_results=2)
    plain_distances = dict(zip(plain["ids"][0], plain["distances"][0], strict=True))
    assert plain_distances["1"] == pytest.approx(1 - cos(expected(QUERY)[0], expected(DOCS[0])[0]), abs=1e-5)

    # dimensions is dropped for model names without "text-embedding-3"
    wide = EmberEmbeddingFunction(api_key_env_var="EMBER_API_KEY", api_base=url, model_name=NAME, dimensions=DIMS)
    assert len(wide([QUERY])[0]) == 64

    # OPENAI_API_KEY in the environment wins over api_key_env_var
    monkeypatch.setenv("OPENAI_API_KEY", "sk-an-openai-key")
    shadowed = EmberEmbeddingFunction(api_key_env_var="EMBER_API_KEY", api_base=url, model_name=NAME)
    with pytest.raises(openai.AuthenticationError):
        shadowed([QUERY])
