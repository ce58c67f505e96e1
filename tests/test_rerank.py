"""Score models against their references on the same weights: cross-encoders against sentence-transformers'
CrossEncoder, Qwen3-Reranker against transformers; pairs alone equal pairs in a large request; truncation."""

import math

import numpy as np
import pytest
import torch

from checkpoints import build_bert, build_cross_encoder, build_qwen3_reranker
from corpus import DOCUMENTS, QUERIES
from ember import Reranker
from ember.errors import InputError
from ember.models.checkpoint import iter_weights

RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
PAIRS = [(q, d) for q in QUERIES[:3] for d in DOCUMENTS[:6]]


def _cross_encoder(path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    return {
        "bert": build_cross_encoder(root / "bert", kind="bert"),
        "bert-identity": build_cross_encoder(
            root / "bert-id", kind="bert", seed=1, activation_fn="torch.nn.modules.linear.Identity"
        ),
        "bert-2": build_cross_encoder(root / "bert-2", kind="bert", labels=2, seed=2),
        "xlm-roberta": build_cross_encoder(root / "xlmr", kind="xlm-roberta", seed=3),
        "roberta": build_cross_encoder(root / "roberta", kind="roberta", seed=4),
        "qwen3": build_qwen3_reranker(root / "qwen3", seed=5),
        "qwen3-tied": build_qwen3_reranker(root / "qwen3-tied", tie_word_embeddings=True, seed=6),
    }


@pytest.mark.parametrize("kind", ["bert", "bert-identity", "xlm-roberta", "roberta"])
def test_cross_encoders_equal_sentence_transformers(dirs, kind):
    ours = Reranker(str(dirs[kind]), dtype="float32", enforce_eager=True)
    expected = _cross_encoder(dirs[kind]).predict(PAIRS)
    got = np.array(ours.score(PAIRS))
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert np.argsort(-got).tolist() == np.argsort(-expected).tolist()
    assert ours.info.head.activation == ("identity" if kind == "bert-identity" else "sigmoid")  # ms-marco: raw logits


def test_two_labels_are_softmax_and_the_relevant_class_is_the_last(dirs):
    ours = Reranker(str(dirs["bert-2"]), dtype="float32", enforce_eager=True)
    logits = _cross_encoder(dirs["bert-2"]).predict(PAIRS, activation_fn=torch.nn.Identity())  # (N, 2)
    np.testing.assert_allclose(ours.score(PAIRS, use_activation=False), logits[:, -1], atol=1e-5)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    np.testing.assert_allclose(ours.score(PAIRS), probs[:, -1], atol=1e-5)


_QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
_QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
_QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def _qwen3_reference(path, pairs, instruction=None):
    """The official recipe (Qwen3-Reranker's model card): prefix + instruct/query/document + suffix, P(yes) against
    P(no) at the last token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    scores = []
    for q, d in pairs:
        instruct = instruction or _QWEN3_INSTRUCTION
        text = f"{_QWEN3_PREFIX}<Instruct>: {instruct}\n<Query>: {q}\n<Document>: {d}{_QWEN3_SUFFIX}"
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            last = model(ids).logits[0, -1]
        scores.append(torch.softmax(last[[no, yes]].double(), 0)[1].item())
    return np.array(scores)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-tied"])
def test_qwen3_reranker_equals_transformers(dirs, kind):
    ours = Reranker(str(dirs[kind]), dtype="float32", hf_overrides=RERANKER_OVERRIDES, enforce_eager=True)
    pairs = PAIRS[:8]
    np.testing.assert_allclose(ours.score(pairs), _qwen3_reference(dirs[kind], pairs), atol=1e-5)
    instruction = "Given a question, find the passage that answers it"
    np.testing.assert_allclose(
        ours.score(pairs[:3], instruction=instruction), _qwen3_reference(dirs[kind], pairs[:3], instruction), atol=1e-5
    )
    assert ours.info.task == "score" and ours.info.head.num_labels == 1


def test_qwen3_reranker_in_bfloat16_stays_close(dirs):
    ours = Reranker(str(dirs["qwen3"]), dtype="bfloat16", hf_overrides=RERANKER_OVERRIDES, enforce_eager=True)
    np.testing.assert_allclose(ours.score(PAIRS[:6]), _qwen3_reference(dirs["qwen3"], PAIRS[:6]), atol=1e-2)


def test_only_the_two_rows_of_the_lm_head_are_read(dirs):
    path = dirs["qwen3"]
    rows = dict(iter_weights(path, {"lm_head.weight": [7, 3]}))["lm_head.weight"]
    full = dict(iter_weights(path))["lm_head.weight"]
    assert rows.shape == (2, full.shape[1]) and torch.equal(rows, full[[7, 3]])


@pytest.mark.parametrize("kind", ["bert", "qwen3"])
def test_a_pair_alone_equals_the_same_pair_in_a_200_document_request(dirs, kind):
    overrides = RERANKER_OVERRIDES if kind == "qwen3" else None
    ours = Reranker(str(dirs[kind]), dtype="float32", hf_overrides=overrides, max_batch_tokens=1024, enforce_eager=True)
    documents = [DOCUMENTS[i % len(DOCUMENTS)] + f" (copy {i})" for i in range(200)]
    ranked = dict(ours.rerank(QUERIES[0], documents))
    for i in (0, 57, 199):
        assert math.isclose(ours.score([(QUERIES[0], documents[i])])[0], ranked[i], abs_tol=1e-6)


def test_rerank_sorts_best_first_and_cuts_to_top_n(dirs):
    ours = Reranker(str(dirs["bert"]), dtype="float32", enforce_eager=True)
    docs = DOCUMENTS[:6]
    ranked = ours.rerank(QUERIES[0], docs, top_n=3)
    scores = ours.score([(QUERIES[0], d) for d in docs])
    assert [i for i, _ in ranked] == sorted(range(len(docs)), key=lambda i: -scores[i])[:3]
    assert [s for _, s in ranked] == sorted(scores, reverse=True)[:3]


def test_too_long_pairs_are_refused_or_cut_from_the_document(dirs):
    ours = Reranker(str(dirs["bert"]), dtype="float32", max_model_len=32, enforce_eager=True)
    long_doc = " ".join(["word"] * 100)
    with pytest.raises(InputError, match="maximum context length is 32 tokens"):
        ours.score([("a short query", long_doc)])
    cut = ours.score([("a short query", long_doc)], truncate_prompt_tokens=-1)
    query_ids = ours.tokenizer.encode("a short query", add_special_tokens=False)
    doc_ids = ours.tokenizer.encode(long_doc, add_special_tokens=False)[: 32 - 3 - len(query_ids)]
    expected = ours.score([("a short query", ours.tokenizer.decode(doc_ids))])
    assert math.isclose(cut[0], expected[0], abs_tol=1e-6)


def test_an_embedding_model_scores_by_cosine(tmp_path):
    path = build_bert(tmp_path / "emb", layers=1, hidden=32)
    ours = Reranker(str(path), dtype="float32", enforce_eager=True)
    from ember import Embedder

    vectors = Embedder(str(path), dtype="float32", enforce_eager=True).embed(["a query", "a document"]).vectors
    assert math.isclose(ours.score([("a query", "a document")])[0], float(vectors[0] @ vectors[1]), abs_tol=1e-6)
