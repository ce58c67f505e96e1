"""NomicBert (nomic-embed-text-v1.5) against a reference written from nomic's own modelling code (which ships as
remote code, so neither transformers nor sentence-transformers can run it here), on the same tiny random weights."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import ember.ops.bf16_pairs as pairs_mod
from checkpoints.families import build_nomic_bert
from corpus import SENTENCES
from ember import Embedder
from ember.config import ModelConfig, NativeConfig
from ember.engine.build import plan
from ember.errors import UnsupportedModelError
from ember.ops.bf16_pairs import PairLinear
from ember.ops.linear import onednn_bf16
from ember.ops.native import build_kernels, linear_bf16_kernel

TEXTS = [*SENTENCES[:8], SENTENCES[50]]


def reference(path, ids):
    """nomic's NomicBertModel forward for one unpadded input (modeling_hf_nomic_bert.py), then mean pooling and
    L2 normalisation (the checkpoint's sentence-transformers modules)."""
    cfg = json.loads((path / "config.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    H, heads = cfg["n_embd"], cfg["n_head"]
    D = H // heads
    x = torch.tensor(ids)
    h = w["embeddings.word_embeddings.weight"][x] + w["embeddings.token_type_embeddings.weight"][0]
    h = F.layer_norm(h, (H,), w["emb_ln.weight"], w["emb_ln.bias"], cfg["layer_norm_epsilon"])
    inv_freq = 1.0 / (cfg["rotary_emb_base"] ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(len(ids)).float(), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()

    def rotary(t):  # (L, heads, D), GPT-NeoX halves, not interleaved
        t1, t2 = t[..., : D // 2], t[..., D // 2 :]
        c, s = cos[:, None], sin[:, None]
        return torch.cat((t1 * c - t2 * s, t2 * c + t1 * s), -1)

    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}."
        q, k, v = (h @ w[p + "attn.Wqkv.weight"].T).view(len(ids), 3, heads, D).unbind(1)
        q, k = rotary(q), rotary(k)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / D**0.5, -1)
        a = torch.einsum("hqk,khd->qhd", att, v).reshape(len(ids), H) @ w[p + "attn.out_proj.weight"].T
        h = F.layer_norm(a + h, (H,), w[p + "norm1.weight"], w[p + "norm1.bias"], cfg["layer_norm_epsilon"])
        m = (h @ w[p + "mlp.fc11.weight"].T) * F.silu(h @ w[p + "mlp.fc12.weight"].T)
        h = F.layer_norm(m @ w[p + "mlp.fc2.weight"].T + h, (H,), w[p + "norm2.weight"], w[p + "norm2.bias"],
                         cfg["layer_norm_epsilon"])  # fmt: skip
    return F.normalize(h.mean(0), dim=-1).numpy()


@pytest.fixture(scope="module")
def nomic_dir(tmp_path_factory):
    return build_nomic_bert(tmp_path_factory.mktemp("nomic"))


def test_matches_nomics_formulas_and_is_batch_invariant(nomic_dir):
    embedder = Embedder(str(nomic_dir), dtype="float32", enforce_eager=True)
    ids = [embedder.tokenizer.encode(t) for t in TEXTS]
    ours = embedder.embed(ids).vectors
    ref = np.stack([reference(nomic_dir, seq) for seq in ids])
    assert (ours * ref).sum(1).min() >= 0.99999
    alone = np.stack([embedder.embed([seq]).vectors[0] for seq in ids])
    np.testing.assert_allclose(ours, alone, atol=2e-6)
    half = Embedder(str(nomic_dir), dtype="bfloat16", enforce_eager=True).embed(ids).vectors
    assert (half * ref).sum(1).min() >= 0.999


def test_task_prefixes_are_prompts_and_the_length_is_the_trained_one(nomic_dir):
    embedder = Embedder(str(nomic_dir), dtype="float32", enforce_eager=True)
    query = embedder.embed(["what is ember?"], prompt_name="query")
    by_hand = embedder.embed(["search_query: what is ember?"])
    np.testing.assert_allclose(query.vectors, by_hand.vectors, atol=1e-6)
    assert embedder.info.max_model_len == 2048  # max_trained_positions, not n_positions (8192)


def test_remote_code_config_variants_are_refused_by_name(nomic_dir):
    with pytest.raises(UnsupportedModelError, match="prenorm"):
        plan(ModelConfig(str(nomic_dir), hf_overrides={"prenorm": True}))
    with pytest.raises(UnsupportedModelError, match="activation_function 'gelu'"):
        plan(ModelConfig(str(nomic_dir), hf_overrides={"activation_function": "gelu"}))


def test_its_swiglu_runs_in_the_products_epilogue_where_the_kernels_do(nomic_dir, monkeypatch):
    """fc1 is a SwiGLU's (gate, up) pair: in int8, and in bf16 on ember's bf16 product (as on AMD Zen 4/5), the layer
    writes silu(gate) * up from its product's epilogue, and the vectors still follow nomic's formulas."""
    tokenizer = Embedder(str(nomic_dir), dtype="float32", enforce_eager=True).tokenizer
    ids = [tokenizer.encode(t) for t in TEXTS]
    ref = np.stack([reference(nomic_dir, seq) for seq in ids])

    def swiglu_layers(embedder: Embedder) -> list[torch.nn.Module]:
        return [m for name, m in embedder._loaded.runner.model.named_modules() if name.endswith("mlp.fc1")]

    q8 = Embedder(str(nomic_dir), dtype="bfloat16", quantization="int8", enforce_eager=True)
    assert swiglu_layers(q8) and all(m.glu for m in swiglu_layers(q8))
    assert (q8.embed(ids).vectors * ref).sum(1).min() >= 0.99
    build_kernels(NativeConfig())
    if linear_bf16_kernel() is None or not onednn_bf16():
        pytest.skip("ember's bf16 product does not run here (it needs AVX-512 BF16 and a compiler)")
    monkeypatch.setattr(pairs_mod, "pair_bf16", lambda: True)
    monkeypatch.setattr(pairs_mod, "streams_weights", lambda _: True)  # the test model's are a few KB
    bf16 = Embedder(str(nomic_dir), dtype="bfloat16", enforce_eager=True)
    assert all(isinstance(m, PairLinear) and m.glu for m in swiglu_layers(bf16))
    assert (bf16.embed(ids).vectors * ref).sum(1).min() >= 0.999
