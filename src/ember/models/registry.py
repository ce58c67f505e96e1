"""Which model class runs which checkpoint architecture."""

from __future__ import annotations

from typing import Any

from ember.errors import UnsupportedModelError
from ember.models.base import Architecture
from ember.models.bert import BertModel
from ember.models.classifier import (
    BertForSequenceClassification,
    DecoderForSequenceClassification,
    RobertaForSequenceClassification,
)
from ember.models.gemma3 import Gemma3Model
from ember.models.llama import LlamaModel
from ember.models.modernbert import ModernBertModel
from ember.models.nomic_bert import NomicBertModel
from ember.models.splade import SpladeModel
from ember.models.st_modules import STModules

__all__ = ["ARCHITECTURES", "model_class"]

_DECODERS = ("Qwen3", "Qwen2", "Llama", "Mistral")

ARCHITECTURES: dict[str, type[Architecture]] = {
    **{f"{family}{kind}": LlamaModel for family in _DECODERS for kind in ("Model", "ForCausalLM")},
    "Gemma3TextModel": Gemma3Model,
    "Gemma3ForCausalLM": Gemma3Model,
    "ModernBertModel": ModernBertModel,
    "ModernBertForMaskedLM": ModernBertModel,
    "NomicBertModel": NomicBertModel,
    "BertModel": BertModel,
    "BertForMaskedLM": BertModel,
    "XLMRobertaModel": BertModel,
    "XLMRobertaForMaskedLM": BertModel,
    "RobertaModel": BertModel,
    "BgeM3EmbeddingModel": BertModel,  # vLLM's name for XLM-R with bge-m3's heads (ember.models.m3)
    "BertSpladeSparseEmbeddingModel": SpladeModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": RobertaForSequenceClassification,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "Qwen3ForSequenceClassification": DecoderForSequenceClassification,
}
_BY_MODEL_TYPE = {
    "qwen3": "Qwen3Model",
    "qwen2": "Qwen2Model",
    "llama": "LlamaModel",
    "mistral": "MistralModel",
    "gemma3_text": "Gemma3TextModel",
    "modernbert": "ModernBertModel",
    "nomic_bert": "NomicBertModel",
    "bert": "BertModel",
    "xlm-roberta": "XLMRobertaModel",
}


def model_class(config: dict[str, Any], st: STModules | None = None) -> tuple[str, type[Architecture]]:
    """The architecture name and ember's class for a config.json and the sentence-transformers files beside it:
    SPLADE when those say SpladePooling (the checkpoint itself is a plain BertForMaskedLM)."""
    sparse = st is not None and st.splade_strategy is not None
    names = list(config.get("architectures") or [])
    if not names and config.get("model_type") in _BY_MODEL_TYPE:
        names = [_BY_MODEL_TYPE[config["model_type"]]]
    for name in names:
        if name in ARCHITECTURES:
            cls = ARCHITECTURES[name]
            if sparse and cls not in (BertModel, SpladeModel):
                raise UnsupportedModelError(f"SPLADE pooling needs a BERT masked-LM checkpoint, not {name}")
            return name, SpladeModel if sparse else cls
    raise UnsupportedModelError(
        f"unsupported architecture {names or config.get('model_type')!r}; "
        f"ember supports: {', '.join(sorted(ARCHITECTURES))}"
    )
