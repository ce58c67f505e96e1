"""Score models: a classification head on an encoder or decoder, with the checkpoint's own parameter names.

- BERT (`BertForSequenceClassification`: cross-encoder/ms-marco-*, bge-reranker-base/large): the pooler (dense +
  tanh on [CLS]) and `classifier`;
- XLM-R and RoBERTa (`*ForSequenceClassification`: bge-reranker-v2-m3): `classifier.dense` + tanh, then
  `classifier.out_proj`, on <s>;
- Qwen3 (`Qwen3ForSequenceClassification`): `score` on the last token. Qwen3-Reranker ships as a causal LM that
  answers "yes" or "no"; as vLLM does (`--hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'`), its score row is
  lm_head[yes] - lm_head[no] (sigmoid of it is P(yes)), read as two rows, never the whole LM head.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

import torch
from torch import nn

from ember.config import PoolerConfig
from ember.errors import CheckpointError, UnsupportedModelError
from ember.models.base import Architecture
from ember.models.bert import BertArgs, BertModel
from ember.models.heads import Head, HeadContext
from ember.models.llama import LlamaArgs, LlamaModel
from ember.models.st_modules import STModules
from ember.tokenizer import Tokenizer
from ember.types import Activation, HeadSpec, PairPrompt, PoolingSpec, PoolingType

__all__ = [
    "QWEN3_RERANKER",
    "BertForSequenceClassification",
    "DecoderForSequenceClassification",
    "RobertaForSequenceClassification",
    "ScoreHead",
    "activation",
    "classify_activation",
    "label_names",
    "num_labels",
]

QWEN3_RERANKER = PairPrompt(
    query="<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n",
    document="<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    default_instruction="Given a web search query, retrieve relevant passages that answer the query",
    formatted="<|im_start|>",
)
"""Qwen3-Reranker's prompt (the official format): system, `<Instruct>`, `<Query>`, `<Document>`, then an empty
think block; the model answers "yes" or "no"."""


def num_labels(cfg: dict[str, Any]) -> int:
    """How many outputs the classifier has (config.json's num_labels, or its id2label; transformers' default 2)."""
    if cfg.get("is_original_qwen3_reranker"):
        return 1
    if cfg.get("classifier_from_token"):
        return len(cfg["classifier_from_token"])
    # transformers leaves both out for its default of two labels
    return int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)


class ScoreHead(Head):
    """A score model's: the classifier on the pooled state ([CLS] of an encoder, the last token of a decoder),
    (B, num_labels) logits."""

    def __init__(self, model: _ScoreModel, method: PoolingType, cfg: dict[str, Any]) -> None:
        labels = num_labels(cfg)
        super().__init__(method, labels)
        self.model = model
        self.spec = HeadSpec(
            "score",
            ("classify",),
            num_labels=labels,
            activation=activation(cfg),
            pair_prompt=model.pair_prompt,
            labels=label_names(cfg, labels),
            classify_activation=classify_activation(cfg, labels),
        )

    def __call__(self, hidden: torch.Tensor, seqlens: list[int], owners: list[int] | None = None) -> torch.Tensor:
        pooled = self.pool(hidden, seqlens, owners)
        return self.model.classify(pooled.to(hidden.dtype)).float()


class _ScoreModel(Architecture):
    """What every score model shares: its head reads the pooled state through `classify`."""

    task = "score"
    pair_prompt: ClassVar[PairPrompt | None] = None
    """How a pair becomes one input; None: the tokenizer's pair template."""

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled states (B, hidden) -> (B, num_labels) logits."""
        raise NotImplementedError

    @classmethod
    def head_pooling(cls, st: STModules, pooler: PoolerConfig) -> PoolingSpec:
        return PoolingSpec("LAST" if cls.is_decoder else "CLS", False, "classifier")

    @classmethod
    def head_memory(cls, cfg: dict[str, Any]) -> tuple[int, int]:
        return 0, 0

    def head(self, ctx: HeadContext) -> Head:
        return ScoreHead(self, ctx.pooling.method, ctx.config)


class _Dense(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)


class _RobertaHead(nn.Module):
    def __init__(self, hidden: int, labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)


class BertForSequenceClassification(_ScoreModel, BertModel):
    """BERT with its pooler (dense + tanh on [CLS]) and classifier: (B, hidden) -> (B, num_labels)."""

    def __init__(self, a: BertArgs, labels: int) -> None:
        super().__init__(a)
        self.pooler = _Dense(a.hidden_size, a.hidden_size)
        self.classifier = nn.Linear(a.hidden_size, labels)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Self:
        return cls(BertArgs.from_config(cfg), num_labels(cfg))

    @staticmethod
    def checkpoint_key(name: str) -> str | None:
        if name.startswith(("classifier.", "bert.pooler.")):
            return name.removeprefix("bert.")
        return BertModel.checkpoint_key(name)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(pooled)))


class RobertaForSequenceClassification(_ScoreModel, BertModel):
    """XLM-R / RoBERTa with their classification head (dense + tanh, out_proj) on <s>."""

    def __init__(self, a: BertArgs, labels: int) -> None:
        super().__init__(a)
        self.classifier = _RobertaHead(a.hidden_size, labels)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Self:
        return cls(BertArgs.from_config(cfg), num_labels(cfg))

    @staticmethod
    def checkpoint_key(name: str) -> str | None:
        if name.startswith("classifier."):
            return name
        return BertModel.checkpoint_key(name)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(pooled)))


class DecoderForSequenceClassification(_ScoreModel, LlamaModel):
    """A Llama-family decoder (Qwen3) with a `score` layer on the last token: a seq-cls checkpoint's own, or the
    LM-head rows of `classifier_from_token` (Qwen3-Reranker's "no" and "yes")."""

    pair_prompt = QWEN3_RERANKER

    def __init__(self, a: LlamaArgs, labels: int, token_ids: list[int] | None, yes_minus_no: bool) -> None:
        super().__init__(a)
        self.score = nn.Linear(a.hidden_size, labels, bias=False)
        self.token_ids, self.yes_minus_no = token_ids, yes_minus_no
        self._register_load_state_dict_pre_hook(self._score_from_lm_head)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Self:
        ids = cfg.get("classifier_token_ids")  # the ids of classifier_from_token, found by the loader
        return cls(LlamaArgs.from_config(cfg), num_labels(cfg), ids, bool(cfg.get("is_original_qwen3_reranker")))

    @classmethod
    def with_tokenizer(cls, cfg: dict[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
        """Plus the ids of `classifier_from_token` (Qwen3-Reranker's "no" and "yes"), the LM-head rows to read."""
        tokens = cfg.get("classifier_from_token")
        if not tokens:
            return cfg
        ids = [tokenizer.token_id(t) for t in tokens]
        if None in ids:
            raise CheckpointError(f"classifier_from_token {tokens} names tokens the tokenizer does not have")
        return {**cfg, "classifier_token_ids": ids}

    @staticmethod
    def checkpoint_key(name: str) -> str | None:
        if name in ("score.weight", "lm_head.weight"):
            return name
        return LlamaModel.checkpoint_key(name)

    @staticmethod
    def checkpoint_rows(cfg: dict[str, Any]) -> dict[str, list[int]]:
        ids = cfg.get("classifier_token_ids")
        return {"lm_head.weight": list(ids)} if ids else {}

    def _score_from_lm_head(self, state: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
        """The LM head's rows for the classifier's tokens (read alone; or of the tied input embeddings) -> score."""
        if f"{prefix}score.weight" in state or self.token_ids is None:
            return
        rows = state.pop(f"{prefix}lm_head.weight", None)
        if rows is None:  # tied word embeddings: the LM head is the embedding matrix
            rows = state[f"{prefix}embed_tokens.weight"][self.token_ids]
        rows = rows.float()  # (len(token_ids), H)
        weight = (rows[1] - rows[0])[None] if self.yes_minus_no else rows
        # in the model's dtype: its final norm's (a float32 model may hold its bf16 matrices as they are, but never
        # this difference of two of their rows, which bf16 would round)
        state[f"{prefix}score.weight"] = weight.to(state[f"{prefix}norm.weight"].dtype)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled)


_ACTIVATIONS: dict[str, Activation] = {"identity": "identity", "sigmoid": "sigmoid", "softmax": "softmax"}


def label_names(cfg: dict[str, Any], labels: int) -> tuple[str, ...]:
    """Each logit's label: config.json's id2label (keys are strings there), LABEL_i for any it leaves out."""
    given = {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
    return tuple(given.get(i, f"LABEL_{i}") for i in range(labels))


def classify_activation(cfg: dict[str, Any], labels: int) -> Activation:
    """/classify's: as transformers' text-classification pipeline and vLLM read config.json's problem_type
    (regression: the logits; multi_label_classification: sigmoid each; single_label_classification: softmax),
    else sigmoid for one label and softmax for more."""
    kind = cfg.get("problem_type")
    if kind == "regression":
        return "identity"
    if kind == "multi_label_classification" or (kind != "single_label_classification" and labels == 1):
        return "sigmoid"
    return "softmax"


def activation(cfg: dict[str, Any]) -> Activation:
    """What turns logits into scores, as sentence-transformers' CrossEncoder and vLLM decide: config.json's
    sentence_transformers.activation_fn (ms-marco models say Identity), else sbert_ce_default_activation_function,
    else sigmoid for one label and softmax for more."""
    named = (cfg.get("sentence_transformers") or {}).get("activation_fn") or cfg.get(
        "sbert_ce_default_activation_function"
    )
    if named:
        short = str(named).rsplit(".", 1)[-1].lower()
        if short in _ACTIVATIONS:
            return _ACTIVATIONS[short]
        raise UnsupportedModelError(f"score activation {named!r} is not supported (Identity, Sigmoid or Softmax)")
    return "sigmoid" if num_labels(cfg) == 1 else "softmax"
