import pytest

from ember.config import PoolerConfig, check_dtype
from ember.errors import ConfigError


def test_pooler_config_parses_vllm_json():
    cfg = PoolerConfig.parse('{"pooling_type": "last", "normalize": false, "enable_chunked_processing": true}')
    assert cfg == PoolerConfig(pooling_type="LAST", normalize=False, enable_chunked_processing=True)


def test_auto_pooling_means_detect_never_a_key_error():
    assert PoolerConfig.parse('{"pooling_type": "auto"}').pooling_type is None
    assert PoolerConfig.parse(None) == PoolerConfig()


@pytest.mark.parametrize(
    "raw, needle",
    [
        ("{nope", "not valid JSON"),
        ('{"pooling_type": "MAX"}', "pooling_type 'MAX' is not supported"),
        ('{"normalize": "yes"}', "normalize must be true or false"),
        ('{"dimensions": 0}', "dimensions must be a positive integer"),
        ('{"pooling": "MEAN"}', "unknown field"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_bad_pooler_config_names_the_flag(raw, needle):
    with pytest.raises(ConfigError) as e:
        PoolerConfig.parse(raw)
    assert "--pooler-config" in str(e.value) and needle in str(e.value)


def test_dtype_aliases_and_refusal():
    assert check_dtype("bf16") == "bfloat16" and check_dtype("float") == "float32"
    with pytest.raises(ConfigError, match="--dtype 'int4'"):
        check_dtype("int4")
