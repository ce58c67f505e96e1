"""Windows and truncation (pure), and chunked embedding on real tiny models, offline and over HTTP."""

import numpy as np
import pytest
from fastapi.testclient import TestClient

from checkpoints import build_bert, build_qwen3
from ember import Embedder
from ember.api.app import create_app
from ember.config import EngineConfig, ModelConfig, PoolerConfig, ServerConfig
from ember.engine.build import build_engine, load
from ember.engine.chunking import split_windows, truncate
from ember.types import Specials

BERT = Specials((101,), (102,))
QWEN = Specials((), (151643,))


def test_windows_are_wrapped_and_cover_the_content_once():
    ids = [101, *range(1, 11), 102]
    windows = split_windows(ids, 5, BERT)
    assert windows == [[101, 1, 2, 3, 102], [101, 4, 5, 6, 102], [101, 7, 8, 9, 102], [101, 10, 102]]
    qwen = split_windows([*range(1, 8), 151643], 4, QWEN)
    assert qwen == [[1, 2, 3, 151643], [4, 5, 6, 151643], [7, 151643]]
    assert all(w[-1] == 151643 for w in qwen)


def test_overlap_and_unwrapped_token_ids():
    assert split_windows(list(range(1, 9)), 4, BERT, overlap=2) == [[1, 2, 3, 4], [3, 4, 5, 6], [5, 6, 7, 8]]
    assert split_windows([101, 1, 2, 3, 4, 5, 102], 5, BERT, overlap=1) == [[101, 1, 2, 3, 102], [101, 3, 4, 5, 102]]


def test_truncation_keeps_specials_on_either_side():
    ids = [101, 1, 2, 3, 4, 5, 102]
    assert truncate(ids, 4, "right", BERT) == [101, 1, 2, 102]
    assert truncate(ids, 4, "left", BERT) == [101, 4, 5, 102]
    assert truncate([1, 2, 3, 4], 2, "right", BERT) == [1, 2]
    assert truncate(ids, 10, "right", BERT) == ids


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {
        "qwen3": build_qwen3(tmp_path_factory.mktemp("q")),
        "bert": build_bert(tmp_path_factory.mktemp("b")),
        "xlm-roberta": build_bert(tmp_path_factory.mktemp("x"), kind="xlm-roberta"),
    }


@pytest.mark.parametrize("arch", ["qwen3", "bert", "xlm-roberta"])
def test_merged_vector_is_the_normalised_token_weighted_mean_of_windows(models, arch):
    chunked = Embedder(
        str(models[arch]), dtype="float32", max_model_len=16, pooler_config={"enable_chunked_processing": True}
    )
    text = " ".join(f"word{i} and more" for i in range(20))
    ids = chunked.tokenizer.encode(text)
    merged, counts = chunked.embed([text])
    windows = split_windows(ids, 16, chunked.tokenizer.special_tokens)
    assert len(windows) > 2 and counts == [len(ids)] and all(len(w) <= 16 for w in windows)
    one_by_one, _ = chunked.embed(windows)  # each window alone, normalised by the model's head
    mean = (one_by_one * np.array([len(w) for w in windows])[:, None]).sum(0)
    np.testing.assert_allclose(merged[0], mean / np.linalg.norm(mean), atol=1e-5)
    specials = chunked.tokenizer.special_tokens
    assert all(tuple(w[: len(specials.prefix)]) == specials.prefix for w in windows)
    assert all(tuple(w[len(w) - len(specials.suffix) :]) == specials.suffix for w in windows)


def _client(path, chunked, max_len=16):
    pooler = PoolerConfig(enable_chunked_processing=chunked)
    loaded = load(ModelConfig(str(path), dtype="float32", max_model_len=max_len, pooler=pooler, max_batch_tokens=64))
    engine = build_engine(loaded, EngineConfig())
    return TestClient(create_app(engine, ServerConfig(served_model_names=("m",))), raise_server_exceptions=False)


@pytest.mark.parametrize("arch", ["qwen3", "bert", "xlm-roberta"])
def test_length_boundaries_over_http(models, arch):
    M = 16
    for chunked in (False, True):
        with _client(models[arch], chunked, M) as c:
            tok = c.post("/tokenize", json={"prompt": "x"}).json()["tokens"]
            prefix_len = 1 if arch != "qwen3" else 0
            for n in (M - 1, M, M + 1, 2 * M, 2 * M + 1):
                content = [tok[prefix_len]] * (n - (2 if arch != "qwen3" else 1))
                ids = [*tok[:prefix_len], *content, tok[-1]]
                assert len(ids) == n
                r = c.post("/v1/embeddings", json={"input": [ids]})
                if n <= M or chunked:
                    assert r.status_code == 200, (arch, chunked, n, r.text)
                    assert r.json()["usage"]["prompt_tokens"] == n
                    assert abs(np.linalg.norm(r.json()["data"][0]["embedding"]) - 1) < 1e-5
                else:
                    assert r.status_code == 400
                    msg = r.json()["error"]["message"]
                    assert msg.startswith(
                        f"This model's maximum context length is {M} tokens. However, you requested {n} tokens"
                    )


def test_auto_truncate_and_max_embed_len(models):
    text = " ".join(["word"] * 40)
    cut = Embedder(str(models["bert"]), dtype="float32", max_model_len=16, auto_truncate=True)
    vec, counts = cut.embed([text])
    assert counts == [16]
    explicit, _ = cut.embed([text], truncate_prompt_tokens=16)
    np.testing.assert_allclose(vec, explicit, atol=1e-6)
    capped = Embedder(
        str(models["bert"]),
        dtype="float32",
        max_model_len=16,
        pooler_config={"enable_chunked_processing": True, "max_embed_len": 32},
    )
    assert capped.embed([" ".join(["word"] * 30)]).token_counts == [32]
    with pytest.raises(Exception, match="maximum embedding input length is 32 tokens"):
        capped.embed([text])
