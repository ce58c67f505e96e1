"""int8 weights rounded against calibration text (GPTQ): the rounding itself, the calibration at load, its cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpoints import build_bert, build_qwen3
from corpus import SENTENCES
from ember import Embedder
from ember.cli.main import build_parser
from ember.cli.model_flags import model_config
from ember.config import NativeConfig
from ember.engine.calibration import calibration_texts
from ember.errors import ConfigError
from ember.ops import quant
from ember.ops.gptq import gptq_int8, round_int8
from ember.ops.quant import Int8Linear


def _output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> float:
    return float((x @ (w - q.float() * scale[:, None]).T).norm())


def test_gptq_with_uncorrelated_inputs_rounds_as_plain_rounding():
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    h = torch.diag(torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5)
    q, scale = gptq_int8(w, h)
    want_q, want_scale = round_int8(w)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("seed", [0, 1])
def test_gptq_cuts_the_layers_output_error_on_correlated_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 256, generator=g) @ torch.randn(256, 256, generator=g)  # inputs along a few directions
    w = torch.randn(384, 256, generator=g)
    q, scale = gptq_int8(w, x.T @ x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(scale, round_int8(w)[1])  # the same scales: only which int8 value each weight takes moves
    assert _output_error(x, w, q, scale) < 0.8 * _output_error(x, w, *round_int8(w))  # measured ~0.68


def _int8_weights(e: Embedder) -> dict[str, torch.Tensor]:
    return {n: m.qweight.clone() for n, m in e._loaded.runner.model.named_modules() if isinstance(m, Int8Linear)}


@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_calibration_rounds_every_int8_layer_once_then_reads_the_cache(family, tmp_path, monkeypatch):
    path = str(
        build_bert(tmp_path / "m", layers=2, hidden=128, intermediate=512)
        if family == "bert"
        else build_qwen3(tmp_path / "m", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32)
    )
    native = NativeConfig(cache_dir=str(tmp_path / "cache"))
    kw = {"dtype": "float32", "quantization": "int8", "enforce_eager": True, "native": native}
    calls: list[int] = []
    real = quant.gptq_int8
    monkeypatch.setattr(quant, "gptq_int8", lambda w, h: calls.append(1) or real(w, h))
    first = Embedder(path, **kw)
    layers = _int8_weights(first)
    assert len(calls) == len(layers) > 0  # every int8 layer met the calibration text in its forward
    plain = Embedder(path, calibration="none", **kw)
    assert any(not torch.equal(layers[n], w) for n, w in _int8_weights(plain).items())
    (entry,) = (tmp_path / "cache" / "int8").iterdir()
    assert (entry / "complete").exists() and len(list(entry.glob("*.safetensors"))) == len(layers)

    monkeypatch.setattr(quant, "gptq_int8", lambda w, h: pytest.fail("calibrated again instead of reading the cache"))
    again = Embedder(path, **kw)
    assert all(torch.equal(layers[n], w) for n, w in _int8_weights(again).items())
    np.testing.assert_array_equal(first.embed(SENTENCES).vectors, again.embed(SENTENCES).vectors)


def test_plain_rounding_writes_no_cache(tmp_path):
    path = str(build_bert(tmp_path / "m", layers=1, hidden=64, intermediate=256))
    native = NativeConfig(cache_dir=str(tmp_path / "cache"))
    Embedder(path, quantization="int8", calibration="none", enforce_eager=True, native=native)
    assert not (tmp_path / "cache" / "int8").exists()


def test_calibration_text_comes_from_the_bundled_file_or_the_operators(tmp_path):
    bundled = calibration_texts(None)
    assert bundled is not None and len(bundled) >= 100 and all(t.strip() for t in bundled)
    assert calibration_texts("none") is None and calibration_texts("NONE") is None
    own = tmp_path / "texts.txt"
    own.write_text("first text\n\nsecond text\n")
    assert calibration_texts(str(own)) == ["first text", "second text"]
    (tmp_path / "empty.txt").write_text("\n \n")
    for bad in (tmp_path / "empty.txt", tmp_path / "missing.txt"):
        with pytest.raises(ConfigError, match="--quantization-calibration"):
            calibration_texts(str(bad))


def test_the_calibration_flag_reaches_the_model_config():
    args = build_parser().parse_args(["serve", "-q", "int8", "--quantization-calibration", "my-texts.txt"])
    assert model_config(args).calibration == "my-texts.txt"
    assert model_config(build_parser().parse_args(["serve"])).calibration is None
    assert model_config({"quantization": "int8", "quantization_calibration": "none"}).calibration == "none"


def test_calibrated_int8_is_closer_to_float32_than_plain_rounding_on_real_weights(tmp_path):
    """The bundled all-MiniLM-L6-v2 (real weights), the test corpus (not the calibration text): mean cosine
    distance to float32 1.43e-4 calibrated against 1.78e-4 plain (float32 activations)."""
    from corpus import DOCUMENTS, QUERIES

    texts = SENTENCES + QUERIES + DOCUMENTS
    ref = Embedder(dtype="float32").embed(texts).vectors
    native = NativeConfig(cache_dir=str(tmp_path))
    distance = {
        how: float(
            np.mean(
                1 - (ref * Embedder(quantization="int8", calibration=how, native=native).embed(texts).vectors).sum(1)
            )
        )
        for how in (None, "none")
    }
    assert distance[None] < 0.9 * distance["none"], distance
