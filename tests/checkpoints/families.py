"""Small random checkpoints of the other embedding families, built with their `transformers` configs and saved as
the hub's embedders are: Qwen2, Llama and Mistral decoders (gte-Qwen2, e5-mistral, Llama-based embedders), Gemma 3
as a bidirectional encoder (EmbeddingGemma) and ModernBERT (gte-modernbert, modernbert-embed).

The decoders share the real Qwen3 tokenizer, the encoders the real MiniLM WordPiece one (each vocabulary covers its
tokenizer); the architecture is what is under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from checkpoints.builders import _build_model, _save_model, _write_bert_tokenizer, build_bert, write_st_pooling
from checkpoints.qwen_tokenizer import QWEN3_EOS_ID, QWEN3_VOCAB_SIZE, build_qwen3_tokenizer

__all__ = [
    "E5_MISTRAL_7B_CONFIG",
    "NOMIC_BERT_CONFIG",
    "DecoderFamily",
    "build_bge_m3",
    "build_decoder",
    "build_gemma3",
    "build_modernbert",
    "build_nomic_bert",
    "build_splade",
    "write_shape_only_checkpoint",
]

#: config.json of intfloat/e5-mistral-7b-instruct.
E5_MISTRAL_7B_CONFIG: dict[str, Any] = {
    "architectures": ["MistralModel"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pad_token_id": 2, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "float16", "use_cache": False, "vocab_size": 32000,
}  # fmt: skip

#: config.json of nomic-ai/nomic-embed-text-v1.5 (remote code: NomicBertModel), sizes aside.
NOMIC_BERT_CONFIG: dict[str, Any] = {
    "activation_function": "swiglu", "architectures": ["NomicBertModel"],
    "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                 "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
    "bos_token_id": None, "causal": False, "dense_seq_output": True, "embd_pdrop": 0.0, "eos_token_id": None,
    "fused_bias_fc": True, "fused_dropout_add_ln": True, "initializer_range": 0.02, "layer_norm_epsilon": 1e-12,
    "max_trained_positions": 2048, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "model_type": "nomic_bert",
    "n_embd": 768, "n_head": 12, "n_inner": 3072, "n_layer": 12, "n_positions": 8192, "pad_vocab_size_multiple": 64,
    "parallel_block": False, "parallel_block_tied_norm": False, "prenorm": False, "qkv_proj_bias": False,
    "reorder_and_upcast_attn": False, "resid_pdrop": 0.0, "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
    "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True, "summary_activation": None,
    "summary_first_dropout": 0.0, "summary_proj_to_labels": True, "summary_type": "cls_index",
    "summary_use_proj": True, "torch_dtype": "float32", "transformers_version": "4.34.0", "type_vocab_size": 2,
    "use_cache": True, "use_flash_attn": True, "use_rms_norm": False, "use_xentropy": True, "vocab_size": 30528,
}  # fmt: skip

DecoderFamily = Literal["qwen2", "llama", "mistral"]

_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2Model"), "llama": ("LlamaConfig", "LlamaModel"),
            "mistral": ("MistralConfig", "MistralModel")}  # fmt: skip


def build_decoder(
    out_dir: Path,
    family: DecoderFamily,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 160,
    seed: int = 0,
    with_model_prefix: bool = True,
    st_pooling: str | None = "lasttoken",
    **config: Any,
) -> Path:
    """Write a small `family` decoder (random weights, real Qwen3 tokenizer) to `out_dir`: the `model.*` keys of a
    `*ForCausalLM` (gte-Qwen2, e5-mistral) or, without `with_model_prefix`, the bare keys of `*Model`. `config`
    adds config.json fields (`is_causal`, `sliding_window`, `rope_scaling`, `attention_bias`, ...)."""
    import transformers

    config_name, model_name = _CLASSES[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = {"qwen2": "Qwen2", "llama": "Llama", "mistral": "Mistral"}[family]
    arch = f"{prefix}ForCausalLM" if with_model_prefix else f"{prefix}Model"
    extra = {k: v for k, v in config.items() if k != "is_causal"}
    hf_config = getattr(transformers, config_name)(
        vocab_size=QWEN3_VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=4096,
        bos_token_id=QWEN3_EOS_ID, eos_token_id=QWEN3_EOS_ID, architectures=[arch], **extra,
    )  # fmt: skip
    model = _build_model(getattr(transformers, model_name), hf_config, seed)
    _save_model(model, out, prefix="model" if with_model_prefix else None, architectures=[arch])
    if "is_causal" in config:  # as gte-Qwen2's config.json carries it (transformers' classes ignore it)
        import json

        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "is_causal": config["is_causal"]}, indent=2))
    build_qwen3_tokenizer(out)
    if st_pooling is not None:
        write_st_pooling(out, st_pooling, normalize=True, hidden=hidden, max_seq_length=4096, seed=seed)
    return out


def build_gemma3(
    out_dir: Path, *, layers: int = 3, window: int = 16, seed: int = 0, dense_out: int | None = 48
) -> Path:
    """A small EmbeddingGemma: Gemma3TextModel with bidirectional attention, a global layer between sliding ones
    (`window` is config.json's sliding_window: +-window/2 positions), and sentence-transformers' mean pooling,
    Dense and Normalize modules."""
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_bert_tokenizer(out, 2048)
    types = ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=48, sliding_window=window, layer_types=types,
        use_bidirectional_attention=True, max_position_embeddings=2048, pad_token_id=0,
        architectures=["Gemma3TextModel"],
    )  # fmt: skip
    model = _build_model(transformers.Gemma3TextModel, config, seed)
    _save_model(model, out, prefix=None, architectures=["Gemma3TextModel"])
    write_st_pooling(out, "mean", normalize=True, hidden=64, dense_out=dense_out, max_seq_length=2048, seed=seed)
    return out


def build_modernbert(out_dir: Path, *, layers: int = 4, local_attention: int = 16, seed: int = 0,
                     st_pooling: str = "mean", heads: int = 4) -> Path:  # fmt: skip
    """A small ModernBERT saved as ModernBertForMaskedLM (`model.*` keys, the MLM head beside them), a global layer
    every third one, `local_attention` tokens in the local layers' windows (+-local_attention/2); 64 wide, so
    `heads` 2 gives heads of 32 (the native attention kernel's smallest)."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_bert_tokenizer(out, 8192)
    config = transformers.ModernBertConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=heads,
        local_attention=local_attention, global_attn_every_n_layers=3, pad_token_id=0, cls_token_id=101,
        sep_token_id=102, bos_token_id=101, eos_token_id=102, architectures=["ModernBertForMaskedLM"],
    )  # fmt: skip
    model = _build_model(transformers.ModernBertForMaskedLM, config, seed)
    with torch.no_grad():  # sharper attention than 0.02-scale noise gives, so a wrong window shows in the output
        for layer in model.model.layers:
            layer.attn.Wqkv.weight.mul_(8.0)
    model.save_pretrained(str(out))
    write_st_pooling(out, st_pooling, normalize=True, hidden=64, max_seq_length=8192, seed=seed)
    return out


def build_nomic_bert(
    out_dir: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, inner: int | None = None, seed: int = 0
) -> Path:
    """A small nomic-embed-text-v1.5: its config.json layout (remote code, which nothing here runs), its parameter
    names, random weights; the MiniLM WordPiece tokenizer, mean pooling and Normalize, and nomic's task prefixes
    as prompts. `inner`: the MLP width (default 3 x hidden; v1.5's is 4 x)."""
    import json

    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_bert_tokenizer(out, 2048)
    inner = inner or 3 * hidden
    config = {**NOMIC_BERT_CONFIG, "n_embd": hidden, "n_head": heads, "n_inner": inner, "n_layer": layers,
              "vocab_size": vocab}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        return mean + scale * torch.randn(*shape, generator=g)

    w: dict[str, torch.Tensor] = {
        "embeddings.word_embeddings.weight": rand(vocab, hidden),
        "embeddings.token_type_embeddings.weight": rand(2, hidden),
        "emb_ln.weight": rand(hidden, scale=0.1, mean=1.0), "emb_ln.bias": rand(hidden),
    }  # fmt: skip
    for i in range(layers):
        p = f"encoder.layers.{i}."
        w |= {
            # weights large enough that attention is sharp and the MLP moves the residual stream: a swapped
            # gate, a wrong rotary or norm order shows in the output
            p + "attn.Wqkv.weight": rand(3 * hidden, hidden, scale=0.2),
            p + "attn.out_proj.weight": rand(hidden, hidden, scale=0.2),
            p + "mlp.fc11.weight": rand(inner, hidden, scale=0.3),
            p + "mlp.fc12.weight": rand(inner, hidden, scale=0.3),
            p + "mlp.fc2.weight": rand(hidden, inner, scale=0.2),
            p + "norm1.weight": rand(hidden, scale=0.1, mean=1.0), p + "norm1.bias": rand(hidden),
            p + "norm2.weight": rand(hidden, scale=0.1, mean=1.0), p + "norm2.bias": rand(hidden),
        }  # fmt: skip
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    prompts = {"query": "search_query: ", "document": "search_document: "}
    write_st_pooling(out, "mean", normalize=True, hidden=hidden, prompts=prompts, max_seq_length=2048, seed=seed)
    return out


def write_shape_only_checkpoint(out_dir: Path, config: dict[str, Any]) -> Path:
    """config.json and a model.safetensors whose header lists a Llama-family model's tensors in bfloat16 and whose
    data is a hole (a sparse file: no disk used), for planning a 7B model's memory without its 14 GB."""
    import json
    import math
    import struct

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    shapes: dict[str, list[int]] = {"embed_tokens.weight": [v, h], "norm.weight": [h]}
    for n in range(config["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
                   p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, h],
                   p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
                   p + "mlp.down_proj.weight": [h, i], p + "input_layernorm.weight": [h],
                   p + "post_attention_layernorm.weight": [h]}  # fmt: skip
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return out


def build_splade(
    out_dir: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, seed: int = 0, strategy: str = "max"
) -> Path:
    """A small SPLADE model as sentence-transformers' SparseEncoder saves one (naver/splade-v3's layout): a
    BertForMaskedLM (`bert.*` and `cls.predictions.*`, decoder tied), MLMTransformer + SpladePooling modules."""
    import json

    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_bert_tokenizer(out, 512)
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=4 * hidden,
                                     architectures=["BertForMaskedLM"])  # fmt: skip
    model = _build_model(transformers.BertForMaskedLM, config, seed)
    model.save_pretrained(str(out))
    st = "sentence_transformers.sparse_encoder.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "MLMTransformer"},
               {"idx": 1, "name": "1", "path": "1_SpladePooling", "type": st + "SpladePooling"}]  # fmt: skip
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_SpladePooling").mkdir(exist_ok=True)
    pooling = {"pooling_strategy": strategy, "activation_function": "relu", "embedding_dimension": vocab}
    (out / "1_SpladePooling" / "config.json").write_text(json.dumps(pooling))
    st_config = {"model_type": "SparseEncoder", "prompts": {"query": "", "document": ""}, "default_prompt_name": None,
                 "similarity_fn_name": "dot"}  # fmt: skip
    (out / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return out


def build_bge_m3(out_dir: Path, *, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """A small BAAI/bge-m3 as the hub holds it: an XLM-RoBERTa encoder (XLMRobertaModel, CLS pooling + normalize)
    and, beside it, FlagEmbedding's two heads saved with torch.save: sparse_linear.pt (hidden -> 1) and
    colbert_linear.pt (hidden -> hidden)."""
    import torch

    out = build_bert(out_dir, kind="xlm-roberta", layers=layers, hidden=hidden, seed=seed, st_pooling="cls")
    gen = torch.Generator().manual_seed(seed + 1)
    for name, rows in (("sparse_linear", 1), ("colbert_linear", hidden)):
        state = {
            "weight": torch.randn(rows, hidden, generator=gen) * 0.2,
            "bias": torch.randn(rows, generator=gen) * 0.1,
        }
        torch.save(state, out / f"{name}.pt")
    return out
