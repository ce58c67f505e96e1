"""The model flags are declared once: serve, doctor and embed take the same ones, with defaults and help read from
ember.config, and build the same ModelConfig; a mapping with the flags' underscored names builds it too."""

import argparse

import pytest

from ember.cli import doctor, embed, serve
from ember.cli.fields import field_default, field_doc
from ember.cli.model_flags import MODEL_KEYS, model_config
from ember.config import DEFAULT_BATCH_TOKENS, EngineConfig, ModelConfig, PoolerConfig
from ember.errors import ConfigError

FLAGS = [
    "--revision", "v2", "--download-dir", "/tmp/hf", "--dtype", "int8", "--max-model-len", "4k",
    "--hf-overrides", '{"is_matryoshka": true}', "--pooler-config", '{"pooling_type": "CLS", "normalize": false}',
    "--max-num-batched-tokens", "1K", "--max-queued-tokens", "20k", "--memory-limit", "3Gi", "--truncate",
    "--served-model-name", "a", "b", "--model", "some/model",
]  # fmt: skip


def _parser(module) -> argparse.ArgumentParser:
    root = argparse.ArgumentParser()
    module.add_parser(root.add_subparsers())
    return root


def _model_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    sub = parser._subparsers._group_actions[0]  # type: ignore[union-attr]
    (command,) = sub.choices.values()
    return {o: a for a in command._actions for o in a.option_strings if a.dest in MODEL_KEYS}


@pytest.mark.parametrize("module,extra", [(serve, []), (doctor, []), (embed, ["in.jsonl", "-o", "out"])])
def test_every_command_takes_every_model_flag_and_builds_the_same_config(module, extra):
    name = module.__name__.rsplit(".", 1)[-1]
    args = _parser(module).parse_args([name, *extra, *FLAGS])
    config = model_config(args)
    assert config == ModelConfig(
        "some/model", served_name="a", revision="v2", download_dir="/tmp/hf", dtype="auto", quantization="int8",
        max_model_len=4000, hf_overrides={"is_matryoshka": True},
        pooler=PoolerConfig(pooling_type="CLS", normalize=False), max_batch_tokens=1024, max_queued_tokens=20_000,
        memory_limit=3 * 2**30,
    )  # fmt: skip
    assert args.truncate is True
    assert set(_model_options(_parser(module))) == set(_model_options(_parser(serve)))


def test_unset_flags_take_the_configs_defaults_and_help_shows_them():
    args = _parser(serve).parse_args(["serve"])
    assert model_config(args) == ModelConfig()
    options = _model_options(_parser(serve))
    assert f"(default: {DEFAULT_BATCH_TOKENS})" in options["--max-num-batched-tokens"].help
    assert options["--max-model-len"].help.startswith("Longest input in tokens")
    assert field_default(EngineConfig, "max_num_seqs") == _parser(serve).parse_args(["serve"]).max_num_seqs
    assert "Most sequences in one batch" in field_doc(EngineConfig, "max_num_seqs")


def test_a_mapping_with_typed_values_builds_the_same_config_as_the_flags():
    from_flags = model_config(_parser(serve).parse_args(["serve", *FLAGS]))
    from_mapping = model_config({
        "model": "some/model", "served_model_name": ["a", "b"], "revision": "v2", "download_dir": "/tmp/hf",
        "dtype": "int8", "max_model_len": 4000, "hf_overrides": {"is_matryoshka": True},
        "pooler_config": {"pooling_type": "CLS", "normalize": False}, "max_num_batched_tokens": 1024,
        "max_queued_tokens": "20k", "memory_limit": "3Gi",
    })  # fmt: skip
    assert from_mapping == from_flags
    with pytest.raises(ConfigError, match="--hf-overrides"):
        model_config({"hf_overrides": "{not json"})


@pytest.mark.parametrize("module,extra", [(serve, []), (doctor, []), (embed, ["in.jsonl", "-o", "out"])])
def test_every_command_takes_the_same_process_flags(module, extra):
    name = module.__name__.rsplit(".", 1)[-1]
    flags = ["--threads", "3", "--cpu-bind", "0-1", "--enforce-eager", "--log-level", "debug"]
    args = _parser(module).parse_args([name, *extra, *flags])
    assert (args.threads, args.cpu_bind, args.enforce_eager, args.log_level) == (3, "0-1", True, "debug")
