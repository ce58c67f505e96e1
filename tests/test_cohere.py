"""Cohere's `POST /v2/embed` on a fake runner: the response shape, each embedding type decoded back, input_type
mapped to the model's prompts, truncation and max_tokens, Matryoshka output_dimension, and clear 400s."""

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

from ember.api.app import create_app
from ember.api.cohere import typed_embeddings
from ember.config import EngineConfig, ServerConfig
from ember.engine.engine import AsyncEngine

TEXTS = ["hello world", "a somewhat longer sentence here", "x"]


def openai(client, texts=TEXTS, **extra):
    body = client.post("/v1/embeddings", json={"input": texts, **extra}).json()
    return np.array([d["embedding"] for d in body["data"]], np.float32)


def cohere(client, **body):
    r = client.post("/v2/embed", json={"model": "m", "texts": TEXTS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_response_has_cohere_v2s_shape_and_openais_vectors(client):
    body = cohere(client)
    assert body["response_type"] == "embeddings_by_type" and body["id"].startswith("embd-")
    assert body["texts"] == TEXTS and body["meta"]["api_version"] == {"version": "2"}
    usage = client.post("/v1/embeddings", json={"input": TEXTS}).json()["usage"]["prompt_tokens"]
    assert body["meta"]["billed_units"]["input_tokens"] == usage == body["meta"]["tokens"]["input_tokens"]
    assert list(body["embeddings"]) == ["float"]
    np.testing.assert_array_equal(np.array(body["embeddings"]["float"], np.float32), openai(client))


def test_every_embedding_type_decodes_to_the_float_vector(client):
    ref = openai(client)
    got = cohere(client, embedding_types=["float", "base64", "binary", "ubinary", "int8", "uint8"])["embeddings"]
    assert set(got) == {"float", "base64", "binary", "ubinary", "int8", "uint8"}
    decoded = np.array([np.frombuffer(base64.b64decode(s), "<f4") for s in got["base64"]])
    np.testing.assert_array_equal(decoded, ref)
    bits = np.unpackbits(np.array(got["ubinary"], np.uint8), axis=-1)
    assert (bits == (ref >= 0)).all()
    assert (np.array(got["binary"]) == np.array(got["ubinary"]) - 128).all()
    int8 = np.array(got["int8"], np.float32)
    assert np.abs(int8).max(axis=1).tolist() == [127.0] * len(TEXTS) and int8.min() >= -127
    assert (np.array(got["uint8"]) == int8 + 128).all()
    cos = (int8 * ref).sum(1) / np.linalg.norm(int8, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.999  # rounding only


def test_int8_codes_do_not_depend_on_the_batch(client):
    alone = cohere(client, texts=["x"], embedding_types=["int8"])["embeddings"]["int8"][0]
    assert cohere(client, embedding_types=["int8"])["embeddings"]["int8"][2] == alone


def test_input_type_picks_the_models_prompt(client):
    query = np.array(cohere(client, input_type="search_query")["embeddings"]["float"], np.float32)
    np.testing.assert_array_equal(query, openai(client, prompt_name="query"))
    named = np.array(cohere(client, input_type="query")["embeddings"]["float"], np.float32)
    np.testing.assert_array_equal(named, query)
    for kind in ("search_document", "classification", "clustering"):  # the fake model has no prompt for these
        bare = np.array(cohere(client, input_type=kind)["embeddings"]["float"], np.float32)
        np.testing.assert_array_equal(bare, openai(client))
    assert not np.array_equal(query, openai(client))
    r = client.post("/v2/embed", json={"texts": TEXTS, "input_type": "poetry"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_type"
    assert r.json()["error"]["message"].startswith("Unsupported input_type 'poetry'. Supported values: ")


def test_output_dimension_truncation_and_max_tokens(client):
    short = cohere(client, output_dimension=8)["embeddings"]["float"]
    np.testing.assert_array_equal(np.array(short, np.float32), openai(client, dimensions=8))
    long_text = " ".join(f"word{i}" for i in range(40))
    end = cohere(client, texts=[long_text], max_tokens=5)
    assert end["meta"]["billed_units"]["input_tokens"] == 5
    np.testing.assert_array_equal(np.array(end["embeddings"]["float"], np.float32),
                                  openai(client, [long_text], truncate_prompt_tokens=5, truncation_side="right"))  # fmt: skip
    assert not np.array_equal(np.array(end["embeddings"]["float"], np.float32),
                              openai(client, [long_text], truncate_prompt_tokens=5, truncation_side="left"))  # fmt: skip
    start = cohere(client, texts=[long_text], max_tokens=5, truncate="START")["embeddings"]["float"][0]
    np.testing.assert_array_equal(np.array([start], np.float32), openai(client, [long_text], truncate_prompt_tokens=5,
                                                                        truncation_side="left"))  # fmt: skip
    medium = " ".join(f"word{i}" for i in range(5))  # over max_tokens, within the model's context
    r = client.post("/v2/embed", json={"texts": [medium], "truncate": "NONE", "max_tokens": 5})
    assert r.status_code == 400 and "exceeds max_tokens=5 with truncate=NONE" in r.json()["error"]["message"]
    r = client.post("/v2/embed", json={"texts": [long_text], "truncate": "NONE"})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"texts": []}, "texts"),
        ({"texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "a"}]}]}, "texts"),
        ({"images": ["data:image/png;base64,AAAA"]}, "images"),
        ({"texts": ["a"], "embedding_types": ["float64"]}, "embedding_types"),
        ({"texts": ["a"], "truncate": "MIDDLE"}, "truncate"),
        ({"texts": ["a"], "embedding_types": ["ubinary"], "output_dimension": 12}, "embedding_types"),
        ({"inputs": [{"content": [{"type": "text"}]}]}, "inputs"),
    ],
)
def test_bad_requests_are_clear_400s(client, body, param):
    r = client.post("/v2/embed", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_inputs_with_text_content_are_embedded_like_texts(client):
    inputs = [{"content": [{"type": "text", "text": t}]} for t in TEXTS]
    body = client.post("/v2/embed", json={"inputs": inputs}).json()
    np.testing.assert_array_equal(np.array(body["embeddings"]["float"], np.float32), openai(client))


def test_binary_types_need_a_width_that_is_a_multiple_of_8():
    with pytest.raises(Exception, match="multiple of 8"):
        typed_embeddings(np.ones((1, 12), np.float32), ["ubinary"])


def test_a_model_whose_default_prompt_is_the_query_one_embeds_documents_bare(runner, tokenizer):
    import dataclasses

    runner.info = dataclasses.replace(runner.info, default_prompt_name="query")
    engine = AsyncEngine(runner, tokenizer, EngineConfig(), None)
    with TestClient(create_app(engine, ServerConfig(served_model_names=("m",)))) as c:
        default = openai(c)  # the query prompt, by default
        document = np.array(cohere(c, input_type="search_document")["embeddings"]["float"], np.float32)
        assert not np.array_equal(document, default)
        bare = c.post("/v1/embeddings", json={"input": [f"{t}" for t in TEXTS], "prompt_name": "query"}).json()
        assert np.array_equal(default, np.array([d["embedding"] for d in bare["data"]], np.float32))
        r = c.post("/v1/embeddings", json={"input": TEXTS, "prompt_name": ""})
        assert r.status_code == 400 and "prompt_name" in r.json()["error"]["message"]  # "" is no prompt name
