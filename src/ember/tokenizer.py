"""The tokenizer: a thin wrapper over Hugging Face `tokenizers` (no torch here).

Truncation and padding configured in tokenizer.json are switched off: ember decides
lengths itself (chunking, truncation, errors), and packed batches need no padding.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from ember.errors import CheckpointError, InputError
from ember.types import Specials

__all__ = ["Tokenizer"]

log = logging.getLogger(__name__)


class Tokenizer:
    """Encodes texts to token ids, with the model's special tokens, and decodes them back."""

    def __init__(self, hf: HFTokenizer, *, eos_id: int | None = None, append_eos: bool = False) -> None:
        hf.no_truncation()
        hf.no_padding()
        self._hf = hf
        self.eos_id = eos_id
        self.append_eos = append_eos and eos_id is not None
        """Append EOS when the post-processor does not (decoder models pooled on the last token)."""
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.special_tokens = self._specials()
        """The special tokens around a single input ([CLS] ... [SEP], or ... <|endoftext|>)."""
        self.special_ids = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
        """Every special token's id ([CLS], [SEP], [PAD], [UNK], [MASK], <s>, </s>, ...)."""

    @classmethod
    def from_dir(cls, path: Path, config: dict[str, Any] | None = None, *, ensure_eos: bool = False) -> Tokenizer:
        """Load tokenizer.json from a model directory; `config` is its config.json as the model was built from
        (with --hf-overrides), read for the EOS id; `ensure_eos` for LAST-pooled decoders."""
        file = path / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(f"no tokenizer.json in {path}; ember needs a fast tokenizer file")
        try:
            hf = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"cannot read {file}: {e}") from None
        eos_id = _eos_id(path, hf, config or {})
        append_eos = False
        if ensure_eos and eos_id is not None:
            probe = hf.encode("a").ids
            if not probe or probe[-1] != eos_id:
                log.warning("tokenizer.json does not append EOS (id %d); ember appends it", eos_id)
                append_eos = True
        return cls(hf, eos_id=eos_id, append_eos=append_eos)

    def _specials(self) -> Specials:
        content = self._hf.encode("a", add_special_tokens=False).ids
        full = self.encode("a", add_special_tokens=True)
        for start in range(len(full) - len(content) + 1):
            if full[start : start + len(content)] == content:
                return Specials(tuple(full[:start]), tuple(full[start + len(content) :]))
        return Specials()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one text."""
        try:
            ids: list[int] = self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            raise _not_unicode([text]) from None
        if self.append_eos and add_special_tokens and (not ids or ids[-1] != self.eos_id):
            ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of many texts, encoded in parallel by the Rust tokenizer."""
        try:
            encs = self._hf.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        except TypeError:
            raise _not_unicode(texts) from None
        out = [e.ids for e in encs]
        if self.append_eos and add_special_tokens:
            eos = self.eos_id
            assert eos is not None
            for ids in out:
                if not ids or ids[-1] != eos:
                    ids.append(eos)
        return out

    def encode_pairs(
        self, pairs: list[tuple[str, str]], max_len: int | None = None, max_second: int | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """Each (first, second) text pair joined by the tokenizer's pair template ([CLS] a [SEP] b [SEP], or
        <s> a </s></s> b </s>): (ids, token type ids). The second text is cut to
        `max_second` tokens, then so that the pair fits `max_len` (the first is never cut); each distinct first
        text is encoded once."""
        firsts = {a: None for a, _ in pairs}
        try:
            first_enc = dict(
                zip(firsts, self._hf.encode_batch_fast(list(firsts), add_special_tokens=False), strict=True)
            )
            second_enc = self._hf.encode_batch_fast([b for _, b in pairs], add_special_tokens=False)
        except TypeError:
            raise _not_unicode([t for pair in pairs for t in pair]) from None
        extra = self._hf.num_special_tokens_to_add(True)
        out = []
        for (a, _), eb in zip(pairs, second_enc, strict=True):
            ea = first_enc[a]
            if max_second is not None and len(eb.ids) > max_second:
                eb.truncate(max_second)
            if max_len is not None and len(ea.ids) + len(eb.ids) + extra > max_len:
                eb.truncate(max(0, max_len - extra - len(ea.ids)))
            joined = self._hf.post_process(ea, eb, add_special_tokens=True)
            out.append((joined.ids, joined.type_ids))
        return out

    def pieces(self, text: str, add_special_tokens: bool = True) -> list[tuple[int, bool, int, int]]:
        """Each token of one text: (id, whether it is special, start, end), the offsets in characters of `text`."""
        try:
            enc = self._hf.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            raise _not_unicode([text]) from None
        return [
            (i, bool(special), start, end)
            for i, special, (start, end) in zip(enc.ids, enc.special_tokens_mask, enc.offsets, strict=True)
        ]

    def token_id(self, token: str) -> int | None:
        """The id of a token string (None when it is not in the vocabulary)."""
        return self._hf.token_to_id(token)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; ids outside the vocabulary are an InputError."""
        self.check_ids(ids)
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of an id (None when unknown)."""
        return self._hf.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for, with the leading space a SentencePiece piece ("▁the") holds but a
        decoder strips from a lone token (" the"), as vLLM shows tokens."""
        text = self._hf.decode([token_id], skip_special_tokens=False)
        raw = self._hf.id_to_token(token_id) or ""
        marks = len(raw) - len(raw.lstrip("▁"))
        missing = marks - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def check_ids(self, ids: list[int], param: str = "input") -> None:
        """Raise InputError unless every id is a valid token of this vocabulary."""
        bad = [i for i in ids if not isinstance(i, int) or i < 0 or i >= self.vocab_size]
        if bad:
            raise InputError(f"Token id {bad[0]} is out of vocabulary (valid ids are 0..{self.vocab_size - 1})", param)


def _not_unicode(texts: list[str]) -> InputError:
    """The error for texts the tokenizer refused: a lone surrogate (JSON's "\ud800") is not Unicode text."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return InputError(
                f"input text is not valid Unicode: it holds a lone surrogate {text[e.start]!r} at character "
                f"{e.start}; send UTF-8 text",
                "input",
            )
    return InputError("input text could not be tokenized: it is not a string", "input")


def _eos_id(path: Path, hf: HFTokenizer, config: dict[str, Any]) -> int | None:
    """The EOS token id from tokenizer_config.json, else the model config's eos_token_id."""
    cfg_file = path / "tokenizer_config.json"
    if cfg_file.is_file():
        eos = json.loads(cfg_file.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and hf.token_to_id(eos) is not None:
            return hf.token_to_id(eos)
    eos_id = config.get("eos_token_id")
    if isinstance(eos_id, list):
        eos_id = eos_id[0] if eos_id else None
    return eos_id if isinstance(eos_id, int) else None
