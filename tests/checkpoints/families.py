"""Small random checkpoints of the other embedding families: Qwen2, Llama and Mistral decoders (gte-Qwen2, e5-mistral,
Llama-based embedders), built with their `transformers` configs and saved as the hub's embedders are.

The decoders share the real Qwen3 tokenizer (their vocabulary covers it); the architecture is what is under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from checkpoints.builders import _build_model, _save_model, write_st_pooling
from checkpoints.qwen_tokenizer import QWEN3_EOS_ID, QWEN3_VOCAB_SIZE, build_qwen3_tokenizer

__all__ = ["DecoderFamily", "build_decoder"]

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
