"""ember's models against the reference implementation on the same (tiny, random) weights."""

import numpy as np
import pytest
import torch

from checkpoints import build_bert, build_qwen3
from corpus import SENTENCES
from ember import Embedder
from parity import cos, st_reference

TEXTS = [*SENTENCES[:12], SENTENCES[50]]  # short and long, mixed


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    return Embedder(str(qwen3_dir), dtype="float32")


def test_qwen3_matches_sentence_transformers_in_float32(qwen3, qwen3_dir):
    ours, counts = qwen3.embed(TEXTS)
    ref = st_reference(qwen3_dir, TEXTS)
    assert cos(ours, ref).min() >= 0.99999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    assert counts == [len(tok(t)["input_ids"]) for t in TEXTS]


def test_qwen3_appends_endoftext_and_pools_it(qwen3, qwen3_dir):
    ids = qwen3.tokenizer.encode("hello world")
    assert ids[-1] == 151643 and ids.count(151643) == 1
    # token ids are used as given: no second <|endoftext|>
    by_ids, counts = qwen3.embed([ids])
    by_text, _ = qwen3.embed(["hello world"])
    assert counts == [len(ids)] and cos(by_ids, by_text)[0] > 0.999999
    # LAST pooling reads the <|endoftext|> state: the reference, pooled by hand from transformers
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    assert cos(by_text[0], hidden) >= 0.99999


def test_qwen3_long_input_runs_in_token_slices_and_matches(qwen3, qwen3_dir):
    text = " ".join(SENTENCES) * 3  # ~2,700 tokens: more than one 2,048-token slice
    ours, counts = qwen3.embed([text])
    assert counts[0] > 2048
    assert cos(ours, st_reference(qwen3_dir, [text])).min() >= 0.99999


def test_qwen3_prompts_by_name(qwen3, qwen3_dir):
    ours, counts = qwen3.embed(["what is ember?"], prompt_name="query")
    ref = st_reference(qwen3_dir, ["what is ember?"], prompt_name="query")
    assert cos(ours, ref).min() >= 0.99999
    assert counts[0] > len(qwen3.tokenizer.encode("what is ember?"))


@pytest.mark.parametrize(("dtype", "bar"), [("float32", 0.99999), ("bfloat16", 0.999)])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["fused", "eager"])
def test_qwen3_fused_and_eager_kernels_match_the_reference(qwen3_dir, dtype, bar, enforce_eager):
    embedder = Embedder(str(qwen3_dir), dtype=dtype, enforce_eager=enforce_eager)
    assert embedder._loaded.runner.compiled is not enforce_eager
    ours, _ = embedder.embed(TEXTS)
    assert cos(ours, st_reference(qwen3_dir, TEXTS)).min() >= bar


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_fused_kernels_take_any_token_count_without_recompiling(qwen3_dir, quantization):
    """Compiled once at start-up for any token count: a new batch shape must never compile again
    (a recompile costs seconds in the serving path)."""
    embedder = Embedder(str(qwen3_dir), dtype="bfloat16", quantization=quantization)
    assert embedder._loaded.runner.compiled
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (2, 9, 70, 301):
            embedder.embed([" ".join(["word"] * n), "short one"])


def test_qwen3_causal_lm_checkpoint_with_model_prefix(tmp_path, qwen3):
    path = build_qwen3(tmp_path, with_model_prefix=True)
    ours, _ = Embedder(str(path), dtype="float32").embed(TEXTS[:3])
    expected, _ = qwen3.embed(TEXTS[:3])  # same seed, same weights, other key layout
    assert cos(ours, expected).min() >= 0.999999


def test_batch_invariance_and_packed_equals_padded(qwen3):
    batch, _ = qwen3.embed(TEXTS)
    alone = np.stack([qwen3.embed([t]).vectors[0] for t in TEXTS])
    assert cos(batch, alone).min() >= 0.99999


@pytest.mark.parametrize(
    "kw",
    [
        {"kind": "bert", "st_pooling": "mean"},
        {"kind": "bert", "st_pooling": "cls", "pooling_format": "compact", "with_model_prefix": True},
        {"kind": "bert", "st_pooling": "mean", "dense_out": 24},
        {"kind": "bert", "st_pooling": "mean", "normalize": False},
        {"kind": "xlm-roberta", "st_pooling": "mean"},
        {"kind": "xlm-roberta", "st_pooling": "cls", "with_model_prefix": True, "dense_out": 16},
    ],
    ids=["bert-mean", "bert-cls-compact-prefixed", "bert-dense", "bert-no-normalize", "xlmr-mean", "xlmr-cls-dense"],
)
def test_encoders_match_sentence_transformers(tmp_path, kw):
    path = build_bert(tmp_path, **kw)
    embedder = Embedder(str(path), dtype="float32")
    ours, _ = embedder.embed(TEXTS)
    ref = st_reference(path, TEXTS)
    assert ours.shape == ref.shape
    assert cos(ours, ref).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-4)
    alone = np.stack([embedder.embed([t]).vectors[0] for t in TEXTS])
    assert cos(ours, alone).min() >= 0.99999
    bf16, _ = Embedder(str(path), dtype="bfloat16").embed(TEXTS)
    assert cos(bf16, ref).min() >= 0.999
    eager, _ = Embedder(str(path), dtype="float32", enforce_eager=True).embed(TEXTS)
    assert cos(eager, ref).min() >= 0.99999


def test_matryoshka_dimensions_truncate_before_normalising(tmp_path):
    path = build_bert(tmp_path)
    full = Embedder(str(path), dtype="float32")
    with pytest.raises(Exception, match="does not support Matryoshka"):
        full.embed(["x"], dimensions=8)
    mrl = Embedder(str(path), dtype="float32", hf_overrides={"is_matryoshka": True})
    short, _ = mrl.embed(["some text"], dimensions=8)
    long, _ = mrl.embed(["some text"], normalize=False)
    expected = long[0, :8] / np.linalg.norm(long[0, :8])
    np.testing.assert_allclose(short[0], expected, atol=1e-6)


@pytest.mark.parametrize("kind", ["qwen3", "bert"])
def test_batches_run_at_rounded_token_counts_and_the_filler_changes_nothing(tmp_path, kind):
    from ember.engine.runner import _positions, padded_tokens
    from ember.ops.pooling import pool

    sizes = (1, 15, 16, 17, 18, 33, 100, 511, 512, 513, 2047)
    assert [padded_tokens(n) for n in sizes] == [1, 15, 16, 18, 18, 36, 104, 512, 512, 576, 2048]
    path = build_qwen3(tmp_path) if kind == "qwen3" else build_bert(tmp_path)
    runner = Embedder(str(path), dtype="float32")._loaded.runner
    batch = [[5, 6, 7], list(range(10, 30))]  # 23 tokens: run as 24, with a filler sequence of 1
    seen = []
    hook = runner.model.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    try:
        runner.pads = True  # layers on oneDNN (ember.ops.linear.per_row_kernels)
        ours = runner.run(batch)
        runner.pads = False  # ember's own products: a batch runs at its own count
        unpadded = runner.run(batch)
    finally:
        hook.remove()
    assert seen == [24, 23]
    np.testing.assert_allclose(unpadded, ours, rtol=1e-5, atol=1e-6)
    with torch.inference_mode():  # the same batch without a filler
        ids = torch.tensor([t for seq in batch for t in seq])
        hidden = runner.model(ids, _positions([3, 20]), [3, 20])
        expected = pool(hidden, [3, 20], runner.info.pooling.method).numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)
