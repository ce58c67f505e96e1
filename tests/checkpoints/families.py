"""Small random checkpoints of the other embedding families, built with their `transformers` configs and saved as
the hub's embedders are: Qwen2, Llama and Mistral decoders (gte-Qwen2, e5-mistral, Llama-based embedders), Gemma 3
as a bidirectional encoder (EmbeddingGemma) and ModernBERT (gte-modernbert, modernbert-embed).

The decoders share the real Qwen3 tokenizer, the encoders the real MiniLM WordPiece one (each vocabulary covers its
tokenizer); the architecture is what is under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from checkpoints.builders import _build_model, _save_model, _write_bert_tokenizer, write_st_pooling
from checkpoints.qwen_tokenizer import QWEN3_EOS_ID, QWEN3_VOCAB_SIZE, build_qwen3_tokenizer

__all__ = ["DecoderFamily", "build_decoder", "build_gemma3", "build_modernbert"]

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
                     st_pooling: str = "mean") -> Path:  # fmt: skip
    """A small ModernBERT saved as ModernBertForMaskedLM (`model.*` keys, the MLM head beside them), a global layer
    every third one, `local_attention` tokens in the local layers' windows (+-local_attention/2)."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_bert_tokenizer(out, 8192)
    config = transformers.ModernBertConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
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
