"""vLLM's wire encodings on /v1/embeddings and /pooling: embed_dtype and endianness for base64 and raw bodies
(`bytes` with its metadata header, `bytes_only`); a 400 naming the field, the bad value and the allowed ones for a
value outside an enumerated field's set; /pooling's `task`."""

import base64
import json
import sys

import numpy as np
import pytest
import torch

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
         "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # fmt: skip
WIDTH = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
TEXTS = ["hello world", "a somewhat longer sentence here", "x"]


def decode(raw: bytes, dtype: str, endianness: str) -> np.ndarray:
    """As a client does: the bytes as integers of the dtype's width in the stated order, reinterpreted."""
    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    ints = np.frombuffer(raw, f"{order}u{WIDTH[dtype]}").astype(f"=u{WIDTH[dtype]}")
    return torch.from_numpy(ints.copy()).view(TORCH[dtype]).float().numpy()


def expected(vector, dtype: str) -> np.ndarray:
    return torch.tensor(np.asarray(vector, np.float32)).to(TORCH[dtype]).float().numpy()


def floats(client, route="/v1/embeddings"):
    body = client.post(route, json={"input": TEXTS}).json()
    return [d["embedding" if route == "/v1/embeddings" else "data"] for d in body["data"]]


@pytest.mark.parametrize("endianness", ["native", "little", "big"])
@pytest.mark.parametrize("dtype", list(TORCH))
def test_base64_carries_each_dtype_in_the_byte_order_asked(client, dtype, endianness):
    ref = floats(client)
    r = client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64", "embed_dtype": dtype,
                                            "endianness": endianness})  # fmt: skip
    assert r.status_code == 200, r.text
    for d, vector in zip(r.json()["data"], ref, strict=True):
        raw = base64.b64decode(d["embedding"])
        assert len(raw) == WIDTH[dtype] * len(vector)
        np.testing.assert_array_equal(decode(raw, dtype, endianness), expected(vector, dtype))


def test_big_endian_float16_reads_back_with_numpys_big_endian_type(client):
    ref = floats(client)[0]
    r = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64", "embed_dtype": "float16",
                                            "endianness": "big"})  # fmt: skip
    got = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), ">f2")
    np.testing.assert_array_equal(got, np.asarray(ref, np.float32).astype(np.float16))
    if sys.byteorder == "little":  # the bytes really are swapped, not just labelled
        native = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64",
                                                     "embed_dtype": "float16"}).json()  # fmt: skip
        assert base64.b64decode(native["data"][0]["embedding"]) != base64.b64decode(r.json()["data"][0]["embedding"])


@pytest.mark.parametrize("route", ["/v1/embeddings", "/pooling"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e5m2"])
def test_bytes_body_with_vllms_metadata_header(client, route, dtype):
    ref = floats(client, route)
    r = client.post(route, json={"input": TEXTS, "encoding_format": "bytes", "embed_dtype": dtype,
                                 "endianness": "big"})  # fmt: skip
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    meta = json.loads(r.headers["metadata"])
    assert meta["model"] == "m" and meta["usage"]["prompt_tokens"] > 0 and meta["id"]
    assert [item["index"] for item in meta["data"]] == [0, 1, 2]
    assert meta["data"][-1]["end"] == len(r.content)
    for item, vector in zip(meta["data"], ref, strict=True):
        assert item["embed_dtype"] == dtype and item["endianness"] == "big" and item["shape"] == [len(vector)]
        got = decode(r.content[item["start"] : item["end"]], dtype, "big")
        np.testing.assert_array_equal(got, expected(vector, dtype))


def test_bytes_only_is_the_body_alone(client):
    ref = floats(client)
    r = client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "bytes_only"})
    assert r.status_code == 200 and "metadata" not in r.headers
    got = np.frombuffer(r.content, np.float32).reshape(len(TEXTS), -1)
    np.testing.assert_array_equal(got, np.asarray(ref, np.float32))


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("embed_dtype", "float64", "'fp8_e5m2'"),
        ("endianness", "middle", "'little'"),
        ("encoding_format", "npy", "'bytes_only'"),
        ("truncation_side", "middle", "'right'"),
    ],
)
def test_a_value_outside_an_enumerated_field_is_a_400_naming_it(client, field, value, allowed):
    r = client.post("/v1/embeddings", json={"input": "x", "encoding_format": "base64", field: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert repr(value) in error["message"] and allowed in error["message"]


def test_pooling_runs_the_embed_task_and_refuses_the_others_as_vllm_does(client):
    ref = floats(client, "/pooling")
    r = client.post("/pooling", json={"input": TEXTS, "task": "embed"})
    assert r.status_code == 200 and [d["data"] for d in r.json()["data"]] == ref
    for task in ("classify", "token_classify", "embed&token_classify"):
        r = client.post("/pooling", json={"input": TEXTS, "task": task})
        assert r.status_code == 400, task
        assert r.json()["error"]["message"] == f"Unsupported task: {task!r} Supported tasks: ('embed', 'token_embed')"
        assert r.json()["error"]["param"] == "task"
    r = client.post("/pooling", json={"input": TEXTS, "task": "nonsense"})  # not a vLLM task at all
    assert r.status_code == 400 and r.json()["error"]["param"] == "task" and "'token_embed'" in r.text


def test_token_embed_gives_each_token_its_normalised_vector(client, runner, tokenizer):
    r = client.post("/pooling", json={"input": TEXTS, "task": "token_embed"})
    assert r.status_code == 200, r.text
    body = r.json()
    for d, text in zip(body["data"], TEXTS, strict=True):
        ids = tokenizer.encode(text)
        states = runner.table[ids]
        want = states / np.linalg.norm(states, axis=1, keepdims=True)
        got = np.asarray(d["data"], np.float32)
        assert got.shape == (len(ids), runner.info.dimension)  # specials included, as vLLM
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t)) for t in TEXTS)
    # dimensions and normalize apply to every token's vector, as vLLM's token head does
    r = client.post("/pooling", json={"input": TEXTS[0], "task": "token_embed", "dimensions": 8, "normalize": False})
    ids = tokenizer.encode(TEXTS[0])
    np.testing.assert_allclose(np.asarray(r.json()["data"][0]["data"]), runner.table[ids][:, :8], rtol=1e-6)


def test_token_embed_bytes_carry_each_inputs_shape(client, tokenizer):
    ref = client.post("/pooling", json={"input": TEXTS, "task": "token_embed"}).json()["data"]
    r = client.post("/pooling", json={"input": TEXTS, "task": "token_embed", "encoding_format": "bytes"})
    meta = json.loads(r.headers["metadata"])
    for item, d in zip(meta["data"], ref, strict=True):
        want = np.asarray(d["data"], np.float32)
        assert item["shape"] == list(want.shape)
        got = np.frombuffer(r.content[item["start"] : item["end"]], np.float32).reshape(item["shape"])
        np.testing.assert_array_equal(got, want)


def test_token_embed_is_never_chunked_and_is_truncated_when_asked(client, runner):
    long_text = "word " * 200  # beyond the fake's 32-token context
    r = client.post("/pooling", json={"input": long_text, "task": "token_embed"})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = client.post("/pooling", json={"input": long_text, "task": "token_embed", "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and np.asarray(r.json()["data"][0]["data"]).shape == (10, runner.info.dimension)


def test_pooler_config_task_sets_the_default(runner, tokenizer):
    from fastapi.testclient import TestClient

    from ember.api.app import create_app
    from ember.config import EngineConfig, PoolerConfig, ServerConfig
    from ember.engine.engine import AsyncEngine

    engine = AsyncEngine(runner, tokenizer, EngineConfig(), PoolerConfig.parse('{"task": "token_embed"}'))
    with TestClient(create_app(engine, ServerConfig(served_model_names=("m",)))) as c:
        data = c.post("/pooling", json={"input": "hello world"}).json()["data"][0]["data"]
        assert np.asarray(data).ndim == 2
        assert np.asarray(c.post("/pooling", json={"input": "hi", "task": "embed"}).json()["data"][0]["data"]).ndim == 1
        vector = c.post("/v1/embeddings", json={"input": "hello world"}).json()["data"][0]["embedding"]
        assert np.asarray(vector).ndim == 1  # /v1/embeddings is always one vector per input


def test_truncation_beyond_the_context_gets_vllms_words(client):
    r = client.post("/v1/embeddings", json={"input": "x", "truncate_prompt_tokens": 1000})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller truncation size."
    )


@pytest.mark.parametrize("kind", ["int8", "uint8", "binary", "ubinary"])
def test_compact_types_on_openai_embeddings_are_cohere_codes_as_ints_base64_or_bytes(client, kind):
    from ember.api.cohere import typed_embeddings

    ref = np.asarray(floats(client), np.float32)
    want = np.asarray(typed_embeddings(ref, [kind])[kind])
    r = client.post("/v1/embeddings", json={"input": TEXTS, "embedding_type": kind})
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal([d["embedding"] for d in r.json()["data"]], want)
    byte = np.int8 if kind in ("int8", "binary") else np.uint8
    r = client.post("/v1/embeddings", json={"input": TEXTS, "embedding_type": kind, "encoding_format": "base64"})
    got = [np.frombuffer(base64.b64decode(d["embedding"]), byte) for d in r.json()["data"]]
    np.testing.assert_array_equal(got, want)
    r = client.post("/v1/embeddings", json={"input": TEXTS, "embedding_type": kind, "encoding_format": "bytes"})
    meta = json.loads(r.headers["metadata"])
    assert [item["shape"] for item in meta["data"]] == [[want.shape[1]]] * len(TEXTS)
    assert meta["data"][0]["embed_dtype"] == np.dtype(byte).name
    np.testing.assert_array_equal(np.frombuffer(r.content, byte).reshape(want.shape), want)


def test_int8_codes_keep_the_direction_and_binary_the_signs(client):
    ref = np.asarray(floats(client), np.float32)
    codes = client.post("/v1/embeddings", json={"input": TEXTS, "embedding_type": "int8"}).json()["data"]
    for code, vector in zip(codes, ref, strict=True):
        decoded = np.asarray(code["embedding"], np.float32)
        assert decoded @ vector / (np.linalg.norm(decoded) * np.linalg.norm(vector)) > 0.999
    bits = client.post("/v1/embeddings", json={"input": TEXTS, "embedding_type": "ubinary"}).json()["data"]
    for code, vector in zip(bits, ref, strict=True):
        np.testing.assert_array_equal(np.unpackbits(np.asarray(code["embedding"], np.uint8)), vector >= 0)


def test_compact_types_refuse_what_does_not_apply(client):
    r = client.post("/v1/embeddings", json={"input": "x", "embedding_type": "int8", "embed_dtype": "float16"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "embed_dtype"
    r = client.post("/v1/embeddings", json={"input": "x", "embedding_type": "binary", "dimensions": 12})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "Embedding dimension must be a multiple of 8 for binary embedding types, but got 12."
    )
    r = client.post("/v1/embeddings", json={"input": "x", "embedding_type": "int4"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "embedding_type"
