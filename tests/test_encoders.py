"""EmbeddingGemma (Gemma 3, bidirectional, sliding-window layers) and ModernBERT (local/global attention) against
sentence-transformers on the same tiny random weights, with inputs longer than the local windows."""

import numpy as np
import pytest
import torch

from checkpoints.families import build_gemma3, build_modernbert
from corpus import SENTENCES
from ember import Embedder
from parity import cos, st_reference

# short inputs (inside every window) and long ones (many windows), mixed in one batch
TEXTS = [*SENTENCES[:6], " ".join(SENTENCES[6:12]), SENTENCES[50], " ".join(SENTENCES[20:40])]

BUILDERS = {"gemma3": build_gemma3, "modernbert": build_modernbert}


@pytest.fixture(scope="module", params=list(BUILDERS))
def encoder_dir(request, tmp_path_factory):
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


def test_matches_sentence_transformers_in_float32_and_bfloat16(encoder_dir):
    ref = st_reference(encoder_dir, TEXTS)
    embedder = Embedder(str(encoder_dir), dtype="float32", enforce_eager=True)
    ours, counts = embedder.embed(TEXTS)
    assert max(counts) > 200  # beyond the local windows (16 tokens) many times over
    assert cos(ours, ref).min() >= 0.99999
    half, _ = Embedder(str(encoder_dir), dtype="bfloat16", enforce_eager=True).embed(TEXTS)
    assert cos(half, ref).min() >= 0.999


def test_a_text_alone_equals_the_same_text_in_a_batch(encoder_dir):
    embedder = Embedder(str(encoder_dir), dtype="float32", enforce_eager=True)
    batch = embedder.embed(TEXTS).vectors
    alone = np.stack([embedder.embed([t]).vectors[0] for t in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=2e-6)


def test_int8_weights_stay_close(encoder_dir):
    ref = Embedder(str(encoder_dir), dtype="float32", enforce_eager=True).embed(TEXTS).vectors
    q8 = Embedder(str(encoder_dir), dtype="bfloat16", quantization="int8", enforce_eager=True).embed(TEXTS).vectors
    assert cos(q8, ref).min() >= 0.99


def test_modernbert_cls_pooling_as_gte_modernbert(tmp_path):
    path = build_modernbert(tmp_path, st_pooling="cls")
    ours = Embedder(str(path), dtype="float32", enforce_eager=True).embed(TEXTS).vectors
    assert cos(ours, st_reference(path, TEXTS)).min() >= 0.99999


@pytest.mark.parametrize("family", ["gemma3", "modernbert"])
def test_the_local_layers_on_the_native_kernel_match_sentence_transformers(tmp_path, monkeypatch, family):
    """With ember's attention kernel loaded, the local layers run on it (one call per layer, with the window) and
    the embeddings still match sentence-transformers'."""
    from ember.cli.runtime import native_config
    from ember.ops import native, window

    native.build_kernels(native_config())
    if native.attention_kernel() is None:
        pytest.skip("the native attention kernel cannot run on this machine")
    path = build_gemma3(tmp_path) if family == "gemma3" else build_modernbert(tmp_path, heads=2)  # heads of 32
    windows = []
    native_attention = window.native_attention

    def spy(q, k, v, seqlens, causal, window=None):
        out = native_attention(q, k, v, seqlens, causal, window)
        windows.append(window if out is not None else None)  # None: the kernel declined
        return out

    monkeypatch.setattr(window, "native_attention", spy)
    ref = st_reference(path, TEXTS)
    for dtype in native.native_attention_dtypes():
        windows.clear()
        ours = Embedder(str(path), dtype=str(dtype).removeprefix("torch."), enforce_eager=True).embed(TEXTS).vectors
        assert windows and all(w == 8 for w in windows)  # +-8 positions: the checkpoints' 16-token windows
        assert cos(ours, ref).min() >= (0.99999 if dtype == torch.float32 else 0.999)
