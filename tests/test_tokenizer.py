"""The tokenizer wrapper: special tokens, batch == single, EOS for decoders, id checks."""

import json

import pytest

from checkpoints import build_qwen3
from ember.errors import CheckpointError, InputError
from ember.models.checkpoint import bundled_default_model
from ember.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def minilm():
    return Tokenizer.from_dir(bundled_default_model())


def test_bert_specials_are_found_around_a_single_input(minilm):
    cls, sep = minilm.encode("a")[0], minilm.encode("a")[-1]
    assert minilm.special_tokens.prefix == (cls,) and minilm.special_tokens.suffix == (sep,)
    assert minilm.encode("hello world", add_special_tokens=False) == minilm.encode("hello world")[1:-1]


def test_a_batch_encodes_each_text_as_it_would_alone(minilm):
    texts = ["hello", "a longer sentence, with punctuation!", "ünïcödé and emoji 🙂", " "]
    assert minilm.encode_batch(texts) == [minilm.encode(t) for t in texts]


def test_ids_outside_the_vocabulary_are_an_input_error(minilm):
    with pytest.raises(InputError, match="out of vocabulary"):
        minilm.check_ids([1, minilm.vocab_size])
    with pytest.raises(InputError):
        minilm.decode([-1])
    assert minilm.decode(minilm.encode("hello world")) == "hello world"


def test_a_missing_or_broken_tokenizer_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        Tokenizer.from_dir(tmp_path)


def test_decoders_end_with_eos_and_the_eos_id_comes_from_the_config_the_model_was_built_with(tmp_path):
    path = build_qwen3(tmp_path / "q", layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32)
    tok = Tokenizer.from_dir(path, json.loads((path / "config.json").read_text()), ensure_eos=True)
    assert tok.eos_id is not None and tok.encode("hello")[-1] == tok.eos_id
    assert all(ids[-1] == tok.eos_id for ids in tok.encode_batch(["a", "b c"]))
    (path / "tokenizer_config.json").unlink(missing_ok=True)
    overridden = Tokenizer.from_dir(path, {"eos_token_id": 42})  # --hf-overrides reach the tokenizer
    assert overridden.eos_id == 42
