"""Qwen2, Llama and Mistral embedders (gte-Qwen2, e5-mistral, Llama-based) against transformers and
sentence-transformers on the same tiny random weights."""

import numpy as np
import pytest
import torch

from checkpoints import build_qwen3
from checkpoints.families import build_decoder
from corpus import SENTENCES
from ember import Embedder
from ember.config import ModelConfig
from ember.engine.build import plan
from ember.errors import UnsupportedModelError
from parity import cos, st_reference

TEXTS = [*SENTENCES[:10], SENTENCES[50]]  # short and long, mixed

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so the test's positions reach the smoothed frequencies
}
FAMILIES = {
    "qwen2": {"rope_theta": 1e6},  # q/k/v biases
    "llama": {"rope_scaling": LLAMA3_SCALING, "rope_theta": 5e5},
    "mistral": {"sliding_window": 2048},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    family = request.param
    return family, build_decoder(tmp_path_factory.mktemp(family), family, **FAMILIES[family])


def test_matches_sentence_transformers_in_float32_and_bfloat16(family_dir):
    _, path = family_dir
    ref = st_reference(path, TEXTS)
    ours, counts = Embedder(str(path), dtype="float32", enforce_eager=True).embed(TEXTS)
    assert cos(ours, ref).min() >= 0.99999
    assert all(n > 0 for n in counts)
    half, _ = Embedder(str(path), dtype="bfloat16", enforce_eager=True).embed(TEXTS)
    assert cos(half, ref).min() >= 0.999


def test_a_text_alone_equals_the_same_text_in_a_batch(family_dir):
    _, path = family_dir
    embedder = Embedder(str(path), dtype="float32", enforce_eager=True)
    batch = embedder.embed(TEXTS).vectors
    alone = np.stack([embedder.embed([t]).vectors[0] for t in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=2e-6)


def test_int8_weights_stay_close(family_dir):
    _, path = family_dir
    ref = Embedder(str(path), dtype="float32", enforce_eager=True).embed(TEXTS).vectors
    q8 = Embedder(str(path), dtype="bfloat16", quantization="int8", enforce_eager=True).embed(TEXTS).vectors
    assert cos(q8, ref).min() >= 0.99


def test_bidirectional_when_config_says_is_causal_false(tmp_path):
    """gte-Qwen2's config.json says `is_causal: false` (vLLM reads it, and --hf-overrides can set it): every token
    sees the whole input. The reference is transformers' Qwen2 given a full (non-causal) attention mask."""
    from transformers import AutoModel

    path = build_decoder(tmp_path, "qwen2", is_causal=False, st_pooling=None)
    embedder = Embedder(str(path), dtype="float32", enforce_eager=True)
    ids = [embedder.tokenizer.encode(t) for t in TEXTS[:4]]
    ours = embedder.embed(ids).vectors
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    for row, seq in zip(ours, ids, strict=True):
        full = torch.zeros(1, 1, len(seq), len(seq))  # additive mask: nothing hidden
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([seq]), attention_mask=full).last_hidden_state[0, -1]
        ref = torch.nn.functional.normalize(hidden, dim=-1).numpy()
        assert cos(row, ref) >= 0.99999
    causal = (
        Embedder(str(path), dtype="float32", enforce_eager=True, hf_overrides={"is_causal": True}).embed(ids).vectors
    )
    assert cos(causal, ours).min() < 0.999  # the override is honoured both ways


def test_mistral_sliding_window_bounds_the_model_length(tmp_path):
    path = build_decoder(tmp_path, "mistral", sliding_window=512)
    assert plan(ModelConfig(str(path))).max_model_len == 512
    embedder = Embedder(str(path), dtype="float32", enforce_eager=True)
    text = " ".join(SENTENCES[:80])
    with pytest.raises(Exception, match="512"):
        embedder.embed([text], truncate_prompt_tokens=None)
    assert embedder.embed([text], truncate_prompt_tokens=512).token_counts[0] == 512


def test_unsupported_rope_scaling_is_refused_by_name(tmp_path):
    path = build_decoder(tmp_path, "llama", st_pooling=None)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        plan(ModelConfig(str(path), hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))


def test_the_compiled_fused_kernels_match_eager(tmp_path):
    """The fused regions (RMSNorm, rotary without q/k norms, SwiGLU) compiled by torch.compile, as `ember serve`
    runs them, give what the eager functions give."""
    path = build_decoder(tmp_path, "qwen2")
    eager = Embedder(str(path), dtype="bfloat16", enforce_eager=True).embed(TEXTS).vectors
    fused = Embedder(str(path), dtype="bfloat16")
    assert cos(fused.embed(TEXTS).vectors, eager).min() >= 0.9999


@pytest.mark.parametrize("dtype,floor", [("float32", 0.99999), ("bfloat16", 0.999)])
def test_the_last_layer_runs_its_mlp_on_each_sequences_last_token_alone(tmp_path, dtype, floor):
    """Pooled on the last token, a batch takes only each sequence's last row through the final layer's output
    projection and MLP, and gives what the whole last layer gives; with shared prefixes too."""
    path = build_qwen3(tmp_path / "q", layers=3, seed=8)
    emb = Embedder(str(path), dtype=dtype, enforce_eager=True)
    runner = emb._loaded.runner
    assert runner.last_rows
    instruct = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
    batch = [emb.tokenizer.encode(t) for t in TEXTS[:4]]
    batch += [emb.tokenizer.encode(instruct + t) for t in TEXTS[4:7]]  # an instruction shared by three
    rows = {}
    hooks = [
        runner.model.layers[i].mlp.down_proj.register_forward_hook(
            lambda _m, args, _o, i=i: rows.setdefault(i, []).append(args[0].shape[0])
        )
        for i in (0, 2)
    ]
    try:
        for share in (False, True):
            runner.share_prefixes = share
            rows.clear()
            runner.last_rows = True
            some = runner.run(batch)
            assert rows[2] == [len(batch)]  # one row per sequence through the last layer's MLP
            assert rows[0][0] > 4 * len(batch)  # every token through the others
            runner.last_rows = False
            every = runner.run(batch)
            assert cos(some, every).min() >= floor
    finally:
        for hook in hooks:
            hook.remove()
