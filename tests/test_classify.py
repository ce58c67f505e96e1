"""vLLM's /classify (and /pooling task classify) on tiny random sequence classifiers of two families, against
transformers' text-classification pipeline on the same weights."""

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from checkpoints import build_bert, build_cross_encoder
from corpus import DOCUMENTS
from ember.api.app import create_app
from ember.config import EngineConfig, ModelConfig, ServerConfig
from ember.engine.build import build_engine, load

SENTIMENT = {0: "negative", 1: "neutral", 2: "positive"}
TOPICS = {0: "sports", 1: "politics", 2: "science", 3: "music"}


def _client(path, max_len=64):
    loaded = load(ModelConfig(str(path), dtype="float32", max_model_len=max_len))
    engine = build_engine(loaded, EngineConfig())
    return TestClient(create_app(engine, ServerConfig(served_model_names=("clf",))), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def sentiment_dir(tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp("s") / "m", kind="bert", labels=3, id2label=SENTIMENT)


@pytest.fixture(scope="module")
def topics_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "m"
    return build_cross_encoder(
        path, kind="xlm-roberta", labels=4, id2label=TOPICS, problem_type="multi_label_classification"
    )


@pytest.fixture(scope="module")
def sentiment(sentiment_dir):
    with _client(sentiment_dir) as c:
        yield c


def _pipeline(path):
    import transformers

    return transformers.pipeline("text-classification", model=str(path), top_k=None, device="cpu")


def _expected(pipe, text):
    """The pipeline's score per label, in the model's label order."""
    out = pipe(text)
    out = out[0] if out and isinstance(out[0], list) else out
    by_label = {x["label"]: x["score"] for x in out}
    labels = pipe.model.config.id2label
    return np.array([by_label[labels[i]] for i in range(len(labels))])


@pytest.mark.parametrize("which", ["sentiment", "topics"])
def test_classify_matches_transformers_pipeline(which, sentiment_dir, topics_dir):
    path = sentiment_dir if which == "sentiment" else topics_dir
    names = SENTIMENT if which == "sentiment" else TOPICS
    pipe = _pipeline(path)
    texts = DOCUMENTS[:5]
    with _client(path) as client:
        r = client.post("/classify", json={"model": "clf", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "clf" and body["id"].startswith("classify-")
    tokens = sum(len(pipe.tokenizer(t)["input_ids"]) for t in texts)
    assert body["usage"]["prompt_tokens"] == tokens == body["usage"]["total_tokens"]
    for i, item in enumerate(body["data"]):
        want = _expected(pipe, texts[i])
        assert item["index"] == i and item["num_classes"] == len(names)
        np.testing.assert_allclose(item["probs"], want, atol=1e-5)
        assert item["label"] == names[int(np.argmax(want))]
    probs = np.array([item["probs"] for item in body["data"]])
    if which == "sentiment":  # softmax: each row sums to one
        np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-6)
    else:  # multi-label: sigmoid of each logit, rows free
        assert not np.allclose(probs.sum(1), 1.0, atol=1e-3)


def test_raw_logits_alone_equals_in_batch_and_v1_path(sentiment, sentiment_dir):
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(sentiment_dir)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(sentiment_dir))
    text = DOCUMENTS[3]
    with torch.no_grad():
        want = model(**tok(text, return_tensors="pt")).logits[0].numpy()
    alone = sentiment.post("/v1/classify", json={"input": text, "use_activation": False}).json()["data"][0]
    np.testing.assert_allclose(alone["probs"], want, atol=1e-5)
    batch = sentiment.post("/classify", json={"input": DOCUMENTS[:6], "use_activation": False}).json()["data"]
    np.testing.assert_allclose(batch[3]["probs"], alone["probs"], atol=1e-6)


def test_pooling_task_classify_and_default_task(sentiment):
    text = DOCUMENTS[0]
    want = sentiment.post("/classify", json={"input": text}).json()["data"][0]["probs"]
    for body in ({"input": text, "task": "classify"}, {"input": text}):
        r = sentiment.post("/pooling", json=body)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["data"][0]["data"], want, atol=1e-7)
    refused = sentiment.post("/pooling", json={"input": text, "task": "embed"})
    assert refused.status_code == 400 and "classify" in refused.json()["error"]["message"]


def test_long_input_refused_unless_truncated_and_bad_input(sentiment):
    long = " ".join(DOCUMENTS) * 3
    r = sentiment.post("/classify", json={"input": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    cut = sentiment.post("/classify", json={"input": long, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 64
    for bad in ({"input": []}, {"input": [""]}, {"input": 3}, {"input": "x", "truncation_side": "middle"}):
        got = sentiment.post("/classify", json=bad)
        assert got.status_code == 400 and "error" in got.json(), (bad, got.text)


def test_embedding_model_refuses_classify(tmp_path):
    with _client(build_bert(tmp_path / "e")) as client:
        r = client.post("/classify", json={"input": "hello"})
    assert r.status_code == 400
    assert "classify" in r.json()["error"]["message"]
