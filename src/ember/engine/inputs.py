"""Turning request inputs into validated token-id windows, and pooled windows into vectors (pure, no torch).

`Preprocessor` is the one place both the offline Embedder and the async engine go through, so both accept
and refuse the same things with the same messages (vLLM's wording where clients match on it): the inputs'
form, `dimensions`, the prompt, token ids, lengths (truncation, chunking), then the head and the merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

import numpy as np

from ember.config import PoolerConfig
from ember.engine.chunking import Specials, embed_windows, split_windows, token_head, truncate, window_overlap
from ember.engine.lexical import TokenWeights
from ember.errors import ConfigError, InputError, InputTooLongError
from ember.tokenizer import Tokenizer
from ember.types import POOLED, ModelInfo, Output

__all__ = [
    "EmbedParams",
    "Fitted",
    "Preprocessor",
    "check_length",
    "fit_length",
    "split_inputs",
    "tokenize",
    "truncation_length",
]

Input = str | list[int]


def split_inputs(inputs: Any, param: str = "input") -> list[Input]:
    """str | list[str] | list[int] | list[list[int]] -> a list of texts or token-id lists."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, bytes):
        raise InputError(f"'{param}' must be a string, a list of strings or a list of token ids", param)
    if len(inputs) == 0:
        raise InputError(f"You must pass at least one prompt ('{param}' is empty)", param)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in inputs):
        return [list(inputs)]
    items: list[Input] = []
    for x in inputs:
        if isinstance(x, str):
            if not x:
                raise InputError(f"'{param}' strings must not be empty", param)
            items.append(x)
        elif isinstance(x, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            items.append(list(x))
        else:
            raise InputError(f"'{param}' items must all be strings or all be lists of token ids", param)
    return items


def tokenize(
    tokenizer: Tokenizer, items: list[Input], prompt: str = "", add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids for every item: texts are encoded (with `prompt` in front), ids checked as given."""
    texts = [(i, prompt + x) for i, x in enumerate(items) if isinstance(x, str)]
    out: list[list[int]] = [[] for _ in items]
    if texts:
        encoded = tokenizer.encode_batch([t for _, t in texts], add_special_tokens)
        for (i, _), ids in zip(texts, encoded, strict=True):
            out[i] = ids
    for i, x in enumerate(items):
        if isinstance(x, list):
            tokenizer.check_ids(x)
            out[i] = x
    for ids in out:
        if not ids:
            raise InputError(
                "The decoder prompt cannot be empty: an input has zero tokens; every input needs at least one token",
                "input",
            )
    return out


def check_length(n_tokens: int, max_model_len: int) -> None:
    """vLLM's context-length error for an input longer than max_model_len."""
    if n_tokens > max_model_len:
        raise InputTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n_tokens} tokens in the input for embedding generation. Please reduce the length of "
            "the input.",
            "input",
        )


def _check_dimensions(info: ModelInfo, dimensions: int | None) -> None:
    """Refuse `dimensions` the model cannot give, as vLLM does and in its words (Matryoshka, range, list)."""
    if dimensions is None:
        return
    if not info.is_matryoshka:
        raise InputError(
            f"Model {info.name!r} does not support Matryoshka embeddings; dimensions must be unset "
            f"(received dimensions={dimensions}).",
            "dimensions",
        )
    if not 1 <= dimensions <= info.dimension:
        raise InputError(
            f"Model {info.name!r} only supports dimensions in range [1, {info.dimension}], got {dimensions}.",
            "dimensions",
        )
    if info.matryoshka_dimensions and dimensions not in info.matryoshka_dimensions:
        raise InputError(
            f"Model {info.name!r} only supports Matryoshka dimensions {list(info.matryoshka_dimensions)}, "
            f"got {dimensions}.",
            "dimensions",
        )


class Fitted(NamedTuple):
    """One input ready to embed: its windows, and the tokens it counts for in `usage`."""

    windows: list[list[int]]
    tokens: int


def fit_length(
    ids: list[int],
    max_model_len: int,
    specials: Specials,
    *,
    truncate_to: int | None = None,
    side: str | None = None,
    pooler: PoolerConfig | None = None,
    auto_truncate: bool = False,
) -> Fitted:
    """The windows to embed for one input: itself, truncated, or split when chunking is on."""
    pooler = pooler or PoolerConfig()
    if truncate_to is not None:
        ids = _truncated(ids, truncate_to, side or "right", max_model_len, specials)
    if len(ids) <= max_model_len:
        return Fitted([ids], len(ids))
    if not pooler.enable_chunked_processing:
        if auto_truncate:
            kept = truncate(ids, max_model_len, side or "right", specials)
            return Fitted([kept], len(kept))
        check_length(len(ids), max_model_len)
    if pooler.max_embed_len is not None and len(ids) > pooler.max_embed_len:
        raise InputTooLongError(
            f"This model's maximum embedding input length is {pooler.max_embed_len} tokens. However, you "
            f"requested {len(ids)} tokens in the input for embedding generation. Please reduce the length "
            "of the input.",
            "input",
        )
    return Fitted(split_windows(ids, max_model_len, specials, pooler.chunk_overlap), len(ids))


def truncation_length(k: int, max_model_len: int) -> int:
    """The tokens a request's truncate_prompt_tokens keeps (-1: max_model_len), refused as vLLM refuses it."""
    if k == -1:
        return max_model_len
    if k < 1:
        raise InputError("truncate_prompt_tokens must be -1 or a positive number of tokens", "truncate_prompt_tokens")
    if k > max_model_len:
        raise InputError(
            "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    return k


def _truncated(ids: list[int], k: int, side: str, max_model_len: int, specials: Specials) -> list[int]:
    k = truncation_length(k, max_model_len)
    if side not in ("left", "right"):
        raise InputError(f"truncation_side must be 'left' or 'right', got {side!r}", "truncation_side")
    return truncate(ids, k, side, specials)


@dataclass(frozen=True)
class EmbedParams:
    """Per-request options (OpenAI's and vLLM's field names)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool = True
    prompt_name: str | None = None
    """A prompt of the model's (config_sentence_transformers.json) put before each text; None: its default."""
    prompt: str | None = None
    """The text to put before each text instead ("": nothing, whatever the model's default)."""
    output: Output = "embed"
    """What each input gives (vLLM's pooling task): its pooled vector; token_embed, a vector per token (the last
    hidden states through the model's Dense modules, or bge-m3's ColBERT head, then `dimensions` and normalisation
    each); token_classify, a weight per token (bge-m3's sparse head). token_embed inputs are never chunked;
    token_classify ones are, when chunked processing is on, each token's weight taken once."""


class Prepared(NamedTuple):
    """A request's inputs checked (cheap, before tokenising), with what its answer needs."""

    items: list[Input]
    prompt: str
    dimensions: int | None
    normalize: bool
    output: Output = "embed"


class Preprocessor:
    """Checks a request, turns its inputs into windows of token ids, and pooled windows into vectors."""

    def __init__(self, info: ModelInfo, tokenizer: Tokenizer, pooler: PoolerConfig, auto_truncate: bool) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.pooler = pooler
        self.auto_truncate = auto_truncate
        try:
            self._dimensions(None)  # the server-wide default must be one the model can give
        except InputError as e:
            raise ConfigError(f"--pooler-config dimensions: {e}") from None

    def check(self, inputs: Any, params: EmbedParams) -> Prepared:
        """Everything about a request that needs no tokenising; raises InputError."""
        items = split_inputs(inputs)
        self._check_output(params.output)
        normalize = self.info.pooling.normalize if params.normalize is None else params.normalize
        prompt = self.prompt(params.prompt_name) if params.prompt is None else params.prompt
        return Prepared(items, prompt, self._dimensions(params.dimensions), normalize, params.output)

    def _check_output(self, output: Output) -> None:
        head = self.info.head
        if output not in head.outputs:
            raise InputError(
                f"model {self.info.name!r} ({self.info.architecture}) does not give {output}; it gives "
                f"{', '.join(head.outputs) or 'scores (/score, /rerank)'}",
                "task",
            )

    def prompt(self, prompt_name: str | None) -> str:
        """The prompt to put before each text: the named one, else the model's default, else none."""
        info = self.info
        name = prompt_name if prompt_name is not None else info.default_prompt_name
        if name is None:
            return ""
        if name not in info.prompts:
            raise InputError(f"unknown prompt_name {name!r}; this model has {sorted(info.prompts)}", "prompt_name")
        return info.prompts[name]

    def _dimensions(self, asked: int | None) -> int | None:
        dimensions = asked if asked is not None else self.pooler.dimensions
        _check_dimensions(self.info, dimensions)
        return dimensions

    def fit(self, prepared: Prepared, params: EmbedParams) -> list[Fitted]:
        """Tokenise (texts) or check (token ids), then fit each input to the model's length."""
        seqs = tokenize(self.tokenizer, prepared.items, prepared.prompt, params.add_special_tokens)
        specials, max_len = self.tokenizer.special_tokens, self.info.max_model_len
        # a weight per token merges across windows (each token once); token vectors are given per window only
        chunked = self.pooler.enable_chunked_processing and params.output not in ("token_embed", "classify")
        pooler = replace(self.pooler, enable_chunked_processing=chunked)
        return [
            fit_length(
                ids,
                max_len,
                specials,
                truncate_to=params.truncate_prompt_tokens,
                side=params.truncation_side,
                pooler=pooler,
                auto_truncate=self.auto_truncate,
            )
            for ids in seqs
        ]

    def vectors(
        self, windows: list[list[list[int]]], pooled: dict[tuple[int, int], np.ndarray], prepared: Prepared
    ) -> list[Any]:
        """Each input's answer from its pooled windows (keyed (input, window)): its vector, head applied and merged
        when chunked; for token_embed its (tokens, D) vectors with the head applied to every row; for
        token_classify its TokenWeights."""
        if prepared.output in POOLED:
            merge = self.info.head.merge
            return [
                embed_windows(
                    [pooled[(i, j)] for j in range(len(ws))],
                    [len(w) for w in ws],
                    prepared.dimensions,
                    prepared.normalize,
                    merge,
                )
                for i, ws in enumerate(windows)
            ]
        if prepared.output == "token_embed":
            return [
                token_head(self._token_rows(ws[0], pooled[(i, 0)], False)[1], prepared.dimensions, prepared.normalize)
                for i, ws in enumerate(windows)
            ]
        return [self._token_weights(ws, [pooled[(i, j)] for j in range(len(ws))]) for i, ws in enumerate(windows)]

    def _token_rows(self, ids: list[int], rows: np.ndarray, last_too: bool) -> tuple[np.ndarray, np.ndarray]:
        """A window's token ids and output rows; for a head that trims specials (as vLLM serves bge-m3), without its
        first token (BOS), and with `last_too` its last (EOS), where the window has them."""
        specials, trim = self.tokenizer.special_tokens, self.info.head.trim_specials
        start = 1 if trim and specials.prefix and ids[:1] == list(specials.prefix[:1]) else 0
        last = last_too and trim and specials.suffix and ids[-1:] == list(specials.suffix[-1:])
        end = max(start, len(ids) - 1 if last else len(ids))
        return np.asarray(ids[start:end], dtype=np.int64), np.asarray(rows[start:end], dtype=np.float32)

    def _token_weights(self, windows: list[list[int]], rows: list[np.ndarray]) -> TokenWeights:
        """One input's weight per token from its windows' rows: each content token once, windows after the first
        without the tokens they repeat from the one before (chunk_overlap)."""
        parts = [self._token_rows(w, r, True) for w, r in zip(windows, rows, strict=True)]
        if len(parts) > 1:
            specials, wrapped = self.tokenizer.special_tokens, self.tokenizer.special_tokens.unwrap(windows[0])[1]
            shared = window_overlap(self.info.max_model_len, specials, self.pooler.chunk_overlap, wrapped)
            parts = [parts[0], *((ids[shared:], w[shared:]) for ids, w in parts[1:])]
        return TokenWeights(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
