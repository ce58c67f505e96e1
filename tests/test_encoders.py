"""EmbeddingGemma (Gemma 3, bidirectional, sliding-window layers) and ModernBERT (local/global attention) against
sentence-transformers on the same tiny random weights, with inputs longer than the local windows."""

import numpy as np
import pytest

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
