"""bge-m3's three outputs (dense, sparse lexical weights, ColBERT vectors) against FlagEmbedding's formulas on
`transformers`' XLMRobertaModel with the same tiny random weights, offline and over HTTP in vLLM's shapes."""

import json

import numpy as np
import pytest
import torch

from checkpoints.families import build_bge_m3
from corpus import SENTENCES
from ember import Embedder
from ember.engine.lexical import TokenWeights
from ember.errors import CheckpointError, InputError

TEXTS = [SENTENCES[0], "the cat and the hat and the cat", SENTENCES[7], SENTENCES[50]]


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    return build_bge_m3(tmp_path_factory.mktemp("bge-m3"))


@pytest.fixture(scope="module")
def embedder(m3_dir):
    return Embedder(str(m3_dir), dtype="float32", enforce_eager=True)


def reference(path, ids_list):
    """FlagEmbedding's BGE-M3 outputs per input (its M3Embedder.encode and _process_token_weights /
    _process_colbert_vecs): the normalised [CLS] state; per distinct token outside {cls, eos, pad, unk} with a
    weight > 0, its largest relu(sparse_linear(h)); normalize(colbert_linear(h[1:])). And vLLM's token_classify
    data: relu(sparse_linear(h)) without the first and last token."""
    import transformers

    model = transformers.XLMRobertaModel.from_pretrained(str(path), add_pooling_layer=False).eval()
    sparse = torch.load(path / "sparse_linear.pt", weights_only=True)
    colbert = torch.load(path / "colbert_linear.pt", weights_only=True)
    unused = {0, 1, 2, 3}  # <s>, <pad>, </s>, <unk> in XLM-R's vocabulary
    out = []
    with torch.no_grad():
        for ids in ids_list:
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # (T, H)
            weights = torch.relu(h @ sparse["weight"].T + sparse["bias"])[:, 0].numpy()
            lexical: dict[int, float] = {}
            for w, i in zip(weights, ids, strict=True):
                if i not in unused and w > 0 and w > lexical.get(i, 0):
                    lexical[i] = float(w)
            vecs = torch.nn.functional.normalize(h[1:] @ colbert["weight"].T + colbert["bias"], dim=-1).numpy()
            dense = torch.nn.functional.normalize(h[0], dim=-1).numpy()
            out.append(
                {"dense": dense, "lexical": lexical, "colbert": vecs, "per_token": weights[1:-1], "all": weights}
            )
    return out


def test_dense_sparse_and_colbert_equal_flagembedding_formulas(m3_dir, embedder):
    assert embedder.info.head.trim_specials and embedder.info.pooling.method == "CLS"
    ids = [embedder.tokenizer.encode(t) for t in TEXTS]
    ref = reference(m3_dir, ids)
    dense = embedder.embed(TEXTS).vectors
    lexical = embedder.lexical_weights(TEXTS)
    colbert = embedder.embed_tokens(TEXTS).vectors
    for i, r in enumerate(ref):
        np.testing.assert_allclose(dense[i], r["dense"], atol=1e-5)
        assert lexical[i].keys() == r["lexical"].keys() and lexical[i]
        np.testing.assert_allclose([lexical[i][k] for k in r["lexical"]], list(r["lexical"].values()), rtol=1e-4)
        assert colbert[i].shape == (len(ids[i]) - 1, embedder.info.dimension)  # the first token left out
        np.testing.assert_allclose(colbert[i], r["colbert"], atol=1e-5)
    repeated = lexical[1]  # "the" and "cat" occur more than once: one entry each, their largest weight
    assert len(repeated) < len(ids[1]) - 2


def test_an_input_alone_equals_the_same_input_in_a_batch(embedder):
    batch = embedder.lexical_weights(TEXTS)
    vecs = embedder.embed_tokens(TEXTS).vectors
    for i, text in enumerate(TEXTS):
        alone = embedder.lexical_weights([text])[0]
        assert alone.keys() == batch[i].keys()
        np.testing.assert_allclose(list(alone.values()), list(batch[i].values()), atol=1e-5)
        np.testing.assert_allclose(embedder.embed_tokens([text]).vectors[0], vecs[i], atol=1e-5)


@pytest.mark.parametrize("overlap", [0, 8])
def test_a_long_input_in_chunks_gives_each_token_one_weight(m3_dir, overlap):
    """With chunked processing a document longer than the model gets sparse weights too: each window's tokens
    (specials out, the overlap taken from the earlier window) end to end, and lexical weights merged over them."""
    from fastapi.testclient import TestClient

    from ember.api.app import create_app
    from ember.config import EngineConfig, ModelConfig, PoolerConfig, ServerConfig
    from ember.engine.build import build_engine, load

    pooler = PoolerConfig(enable_chunked_processing=True, chunk_overlap=overlap)
    loaded = load(ModelConfig(str(m3_dir), dtype="float32", max_model_len=32, pooler=pooler))
    app = create_app(build_engine(loaded, EngineConfig()), ServerConfig(served_model_names=("bge-m3",)))
    text = " ".join(SENTENCES[:12])
    ids = loaded.tokenizer.encode(text)
    content, step = ids[1:-1], 30 - overlap
    windows = [ids[:1] + content[i : i + 30] + ids[-1:] for i in range(0, len(content) - overlap, step)]
    assert len(windows) > 3
    refs = reference(m3_dir, windows)
    with TestClient(app) as client:
        r = client.post("/pooling", json={"input": text, "task": "token_classify"})
        pairs = client.post("/embed_sparse", json={"inputs": text}).json()[0]
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    want = np.concatenate([ref["per_token"][overlap if j else 0 :] for j, ref in enumerate(refs)])
    assert len(item["data"]) == len(content)  # a weight per content token, each once
    np.testing.assert_allclose(item["data"], want, atol=1e-5)
    merged: dict[int, float] = {}  # FlagEmbedding's merge over `data`: each token id's largest weight
    for k, w in zip(content, want, strict=True):
        if k not in (0, 1, 2, 3) and w > 0:
            merged[k] = max(float(w), merged.get(k, 0.0))
    assert [e["token_id"] for e in item["sparse_embedding"]] == [p["index"] for p in pairs] == sorted(merged)
    np.testing.assert_allclose([p["value"] for p in pairs], [merged[k] for k in sorted(merged)], rtol=1e-4)


def test_bf16_stays_close_to_the_float32_reference(m3_dir):
    bf16 = Embedder(str(m3_dir), dtype="bfloat16", enforce_eager=True)
    ids = [bf16.tokenizer.encode(t) for t in TEXTS]
    ref = reference(m3_dir, ids)
    colbert = bf16.embed_tokens(TEXTS).vectors
    for i, r in enumerate(ref):
        cos = (colbert[i] * r["colbert"]).sum(1)  # both rows normalised
        assert cos.min() >= 0.999
        assert float(bf16.embed([TEXTS[i]]).vectors[0] @ r["dense"]) >= 0.999


def test_token_weights_merge_per_token_without_specials_or_zeros():
    weights = TokenWeights(np.array([5, 9, 5, 0, 7, 9]), np.array([0.2, 0.0, 0.5, 0.9, 0.3, 0.1], dtype=np.float32))
    ids, w = weights.lexical(frozenset({0}))
    assert ids.tolist() == [5, 7, 9] and w.tolist() == pytest.approx([0.5, 0.3, 0.1])
    assert weights.lexical()[0].tolist() == [0, 5, 7, 9]


def test_the_heads_load_by_vllms_architecture_name_and_missing_files_are_named(m3_dir, tmp_path):
    import shutil

    copy = tmp_path / "m3"
    shutil.copytree(m3_dir, copy)
    (copy / "colbert_linear.pt").unlink()
    plain = Embedder(str(copy), dtype="float32", enforce_eager=True)  # no heads beside it: a dense XLM-R model
    assert "token_classify" not in plain.info.head.outputs
    with pytest.raises(InputError, match="does not give token_classify; it gives embed, token_embed"):
        plain.lexical_weights(["a text"])
    overrides = {"architectures": ["BgeM3EmbeddingModel"]}
    with pytest.raises(CheckpointError, match=r"colbert_linear\.pt is missing"):
        Embedder(str(copy), dtype="float32", enforce_eager=True, hf_overrides=overrides)
    (copy / "colbert_linear.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        Embedder(str(copy), dtype="float32", enforce_eager=True, hf_overrides=overrides)


@pytest.fixture(scope="module")
def client(m3_dir):
    from fastapi.testclient import TestClient

    from ember.api.app import create_app
    from ember.config import EngineConfig, ModelConfig, ServerConfig
    from ember.engine.build import build_engine, load

    loaded = load(ModelConfig(str(m3_dir), dtype="float32", max_model_len=128))
    app = create_app(build_engine(loaded, EngineConfig()), ServerConfig(served_model_names=("bge-m3",)))
    with TestClient(app, raise_server_exceptions=False) as c:
        c.tokenizer = loaded.tokenizer  # type: ignore[attr-defined]
        yield c


def test_pooling_token_classify_has_vllms_shapes(m3_dir, client):
    ids = [client.tokenizer.encode(t) for t in TEXTS[:2]]
    ref = reference(m3_dir, ids)
    r = client.post("/pooling", json={"input": TEXTS[:2], "task": "token_classify", "return_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)),
                             "completion_tokens": 0, "prompt_tokens_details": None}  # fmt: skip
    for item, want, seq in zip(body["data"], ref, ids, strict=True):
        assert item["object"] == "pooling"
        np.testing.assert_allclose(item["data"], want["per_token"], atol=1e-5)  # a weight per token, BOS/EOS out
        entries = item["sparse_embedding"]
        assert [e["token_id"] for e in entries] == sorted(want["lexical"])
        np.testing.assert_allclose([e["weight"] for e in entries], [want["lexical"][k] for k in sorted(want["lexical"])],
                                   rtol=1e-4)  # fmt: skip
        for e in entries:
            assert e["token"] == client.tokenizer.token_text(e["token_id"]) and e["token"]
        assert len(item["data"]) == len(seq) - 2
    top = client.post("/pooling", json={"input": TEXTS[0], "task": "token_classify", "top_k": 3}).json()["data"][0]
    best = sorted(ref[0]["lexical"], key=lambda k: -ref[0]["lexical"][k])[:3]
    assert [e["token_id"] for e in top["sparse_embedding"]] == sorted(best)
    assert all(e["token"] is None for e in top["sparse_embedding"])


def test_pooling_token_embed_gives_colbert_vectors_and_embed_sparse_teis_shape(m3_dir, client):
    ids = client.tokenizer.encode(TEXTS[1])
    ref = reference(m3_dir, [ids])[0]
    r = client.post("/pooling", json={"input": TEXTS[1], "task": "token_embed"})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["data"][0]["data"]), ref["colbert"], atol=1e-5)
    r = client.post("/embed_sparse", json={"inputs": [TEXTS[1]]})
    assert r.status_code == 200, r.text
    [pairs] = r.json()
    assert [p["index"] for p in pairs] == sorted(ref["lexical"])
    np.testing.assert_allclose([p["value"] for p in pairs], [ref["lexical"][k] for k in sorted(ref["lexical"])],
                               rtol=1e-4)  # fmt: skip
    dense = client.post("/v1/embeddings", json={"input": TEXTS[1]}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(dense, ref["dense"], atol=1e-5)


def test_without_special_tokens_every_token_keeps_its_weight(m3_dir, client):
    ids = client.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    r = client.post("/pooling", json={"input": TEXTS[0], "task": "token_classify", "add_special_tokens": False})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["data"][0]["data"], reference(m3_dir, [ids])[0]["all"], atol=1e-5)


def test_requests_of_each_output_at_once_each_get_their_own(m3_dir, embedder):
    """Three requests in flight together (the engine batches them as one): a pooled vector, token vectors and
    token weights each come back as the offline Embedder gives them alone."""
    import asyncio

    from ember.config import EngineConfig, ModelConfig
    from ember.engine.build import build_engine, load
    from ember.engine.engine import EmbedParams

    engine = build_engine(load(ModelConfig(str(m3_dir), dtype="float32")), EngineConfig())

    async def main():
        await engine.start()
        try:
            outputs = ("embed", "token_embed", "token_classify")
            calls = [engine.embed(TEXTS, EmbedParams(output=o)) for o in outputs]
            return await asyncio.gather(*calls)
        finally:
            await engine.stop(1.0)

    dense, tokens, weights = asyncio.run(main())
    np.testing.assert_allclose(np.stack(dense.vectors), embedder.embed(TEXTS).vectors, atol=1e-5)
    for got, want in zip(tokens.vectors, embedder.embed_tokens(TEXTS).vectors, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for got, want in zip(weights.vectors, embedder.lexical_weights(TEXTS), strict=True):
        ids, w = got.lexical(embedder.tokenizer.special_ids)
        assert ids.tolist() == sorted(want) and w.tolist() == pytest.approx([want[k] for k in sorted(want)], abs=1e-5)


def test_pooling_token_classify_refuses_what_it_cannot_encode(client):
    r = client.post("/pooling", json={"input": "a", "task": "token_classify", "encoding_format": "base64"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
    r = client.post("/pooling", json={"input": "a", "task": "token_classify", "embed_dtype": "float16"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "embed_dtype"
    r = client.post("/pooling", json={"input": "a", "task": "embed", "top_k": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    r = client.post("/pooling", json={"input": "a", "task": "plugin"})
    assert r.status_code == 400
    assert "Supported tasks: ('embed', 'token_embed', 'token_classify')" in r.json()["error"]["message"]


def test_the_token_text_keeps_a_sentencepiece_leading_space(client):
    tok = client.tokenizer
    ids = tok.encode("the cat", add_special_tokens=False)
    texts = [tok.token_text(i) for i in ids]
    assert "".join(texts) == " the cat" and texts[0].startswith(" ")
    assert json.loads(json.dumps(texts)) == texts
