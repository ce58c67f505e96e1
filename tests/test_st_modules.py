import json

import pytest

from ember.config import PoolerConfig
from ember.errors import UnsupportedModelError
from ember.models.st_modules import read_st_modules, resolve_pooling
from ember.types import PoolingSpec


def _write(tmp_path, pooling: dict | None, normalize=True, extra_modules=()):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules += list(extra_modules)
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    return tmp_path


LEGACY = {
    "word_embedding_dimension": 8,
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": False,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
}


@pytest.mark.parametrize(
    "pooling, method",
    [
        ({**LEGACY, "pooling_mode_lasttoken": True}, "LAST"),
        ({**LEGACY, "pooling_mode_mean_tokens": True}, "MEAN"),
        ({**LEGACY, "pooling_mode_cls_token": True}, "CLS"),
        (LEGACY, "MEAN"),  # sentence-transformers' own default when no mode is set
        ({"embedding_dimension": 8, "pooling_mode": "lasttoken"}, "LAST"),
        ({"word_embedding_dimension": 8, "pooling_mode": "cls"}, "CLS"),
        ({"embedding_dimension": 8, "pooling_mode": ["mean"]}, "MEAN"),
    ],
)
def test_pooling_detected_from_both_sentence_transformers_formats(tmp_path, pooling, method):
    st = read_st_modules(_write(tmp_path, pooling))
    assert resolve_pooling(st, PoolerConfig(), is_decoder=False) == PoolingSpec(method, True, "modules.json")


def test_no_normalize_module_means_no_normalisation(tmp_path):
    st = read_st_modules(_write(tmp_path, {**LEGACY, "pooling_mode_cls_token": True}, normalize=False))
    assert resolve_pooling(st, PoolerConfig(), is_decoder=False) == PoolingSpec("CLS", False, "modules.json")


def test_without_sentence_transformers_files_decoders_pool_last_encoders_cls(tmp_path, caplog):
    st = read_st_modules(tmp_path)
    assert resolve_pooling(st, PoolerConfig(), is_decoder=True) == PoolingSpec("LAST", True, "default")
    assert resolve_pooling(st, PoolerConfig(), is_decoder=False) == PoolingSpec("CLS", True, "default")
    assert "no sentence-transformers pooling config" in caplog.text


def test_override_wins_and_auto_detects(tmp_path):
    st = read_st_modules(_write(tmp_path, {**LEGACY, "pooling_mode_mean_tokens": True}))
    override = PoolerConfig.parse('{"pooling_type": "LAST", "normalize": false}')
    assert resolve_pooling(st, override, is_decoder=False) == PoolingSpec("LAST", False, "override")
    auto = PoolerConfig.parse('{"pooling_type": "auto"}')
    assert resolve_pooling(st, auto, is_decoder=False).method == "MEAN"


@pytest.mark.parametrize(
    "pooling, needle",
    [
        ({**LEGACY, "pooling_mode_max_tokens": True}, "pooling mode 'max' is not supported"),
        ({"pooling_mode": "weightedmean"}, "pooling mode 'weightedmean' is not supported"),
        ({**LEGACY, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "['cls', 'mean']"),
    ],
)
def test_pooling_we_cannot_do_is_a_clear_startup_error_unless_overridden(tmp_path, pooling, needle):
    st = read_st_modules(_write(tmp_path, pooling))
    with pytest.raises(UnsupportedModelError) as e:
        resolve_pooling(st, PoolerConfig(), is_decoder=False)
    assert needle in str(e.value) and "1_Pooling" in str(e.value)
    override = PoolerConfig.parse('{"pooling_type": "MEAN"}')
    assert resolve_pooling(st, override, is_decoder=False) == PoolingSpec("MEAN", True, "override")


def test_unknown_module_type_is_refused(tmp_path):
    odd = {"idx": 3, "name": "3", "path": "3_X", "type": "sentence_transformers.models.WordWeights"}
    with pytest.raises(UnsupportedModelError, match="WordWeights"):
        read_st_modules(_write(tmp_path, LEGACY, extra_modules=[odd]))


def test_prompts_and_max_seq_length_are_read(tmp_path):
    st_config = {"prompts": {"query": "Q: "}, "default_prompt_name": "query"}
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    st = read_st_modules(tmp_path)
    assert st.prompts == {"query": "Q: "} and st.max_seq_length == 256 and not st.present
    assert st.default_prompt_name == "query"
