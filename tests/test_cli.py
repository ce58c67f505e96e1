"""Command-line parsing: vLLM's flag semantics, sizes, and refusals that name the problem."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from ember.cli.flags import add_serve_flags, check_runner, max_inputs_per_request
from ember.cli.model_flags import parse_size
from ember.cli.runtime import _find_allocator, parse_bytes
from ember.errors import ConfigError


def serve_args(*argv):
    p = argparse.ArgumentParser(allow_abbrev=False)
    add_serve_flags(p)
    return p.parse_args(list(argv))


def test_sizes_follow_vllm_suffixes():
    assert parse_size("8192") == 8192 and parse_size("8k") == 8000 and parse_size("8K") == 8192
    assert parse_bytes("4Gi") == parse_bytes("4G") == parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("3500M") == 3500 * 2**20 and parse_bytes("123") == 123
    with pytest.raises(ConfigError):
        parse_bytes("lots")


def test_vllm_command_lines_parse():
    a = serve_args(
        "Qwen/Qwen3-Embedding-0.6B",
        "--runner",
        "pooling",
        "--max-model-len",
        "8k",
        "--served-model-name",
        "qwen3",
        "emb",
        "--api-key",
        "k1",
        "--gpu-memory-utilization",
        "0.9",
        "--enforce-eager",
        "--pooler-config",
        '{"pooling_type": "LAST"}',
        "-tp",
        "1",
    )
    assert a.model_tag == "Qwen/Qwen3-Embedding-0.6B" and a.max_model_len == 8000
    assert a.served_model_name == ["qwen3", "emb"] and a.api_key == ["k1"] and a.gpu_memory_utilization == "0.9"
    check_runner(a)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--runner", "generate"], "text generation is not supported"),
        (["--task", "generate"], "text generation is not supported"),
        (["--tensor-parallel-size", "2"], "must be 1"),
    ],
)
def test_refusals_name_the_problem(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        check_runner(serve_args(*argv))


def test_unknown_and_abbreviated_flags_are_errors_not_models():
    out = subprocess.run(
        [sys.executable, "-m", "ember.cli.main", "serve", "--no-such-flag", "2"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "unrecognized arguments" in out.stderr
    with pytest.raises(SystemExit):
        serve_args("--tokenizer", "x")  # not taken as --tokenizer-mode


def test_a_script_restarts_itself_under_tcmalloc(tmp_path):
    """Benchmarks re-exec themselves on the server's allocator; the restarted script keeps its arguments."""
    if _find_allocator() is None:
        pytest.skip("tcmalloc is not installed here")
    script = tmp_path / "probe.py"
    script.write_text(
        "import os, sys\n"
        "from ember.cli.runtime import maybe_reexec_with_allocator\n"
        "maybe_reexec_with_allocator(sys.argv[1:], program=[sys.executable, sys.argv[0]])\n"
        "print(os.environ.get('LD_PRELOAD', ''), sys.argv[1:])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMBER_ALLOCATOR_SET")}
    out = subprocess.run([sys.executable, str(script), "--x", "1"], capture_output=True, text=True, env=env, check=True)
    assert "tcmalloc" in out.stdout and "['--x', '1']" in out.stdout


def _ember(*argv, env=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ember.cli.main", *argv], capture_output=True, text=True, env=env)


def test_doctor_refuses_what_serve_refuses_with_the_same_message():
    doctor = _ember("doctor", "--json", "--max-model-len", "8000")
    serve = _ember("serve", "--max-model-len", "8000", "--port", "1")
    assert doctor.returncode == 1 and serve.returncode == 2
    problem = json.loads(doctor.stdout)["problems"][0]
    assert "greater than the model's 512 position embeddings" in problem and problem in serve.stderr


def test_doctor_reports_the_int8_plan():
    out = _ember("doctor", "--json", "--quantization", "int8", "--dtype", "float32")
    plain = _ember("doctor", "--json", "--dtype", "float32")
    assert out.returncode == 0, out.stdout + out.stderr
    model = json.loads(out.stdout)["model"]
    assert model["dtype"].endswith("(int8 weights)")
    # the layers' matrices take a byte a weight instead of four; the embedding table (half of MiniLM) stays float32
    assert model["weights_bytes"] < 0.8 * json.loads(plain.stdout)["model"]["weights_bytes"]


def test_bench_errors_are_one_clear_line():
    unknown = _ember("bench", "--workloads", "bulk,nope")
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines() == [
        "ember bench: unknown workload(s) nope; choose from bulk, mixed, queries, query, passages, long, chunked"
    ]
    unreachable = _ember("bench", "--url", "http://127.0.0.1:1")
    assert unreachable.returncode == 2 and len(unreachable.stderr.strip().splitlines()) == 1
    assert "cannot reach http://127.0.0.1:1" in unreachable.stderr


def test_the_kuberay_job_runs_a_command_ember_embed_accepts():
    import shlex
    from pathlib import Path

    import yaml

    from ember.cli.main import build_parser

    manifest = Path(__file__).resolve().parent.parent / "deploy/kuberay/rayjob-embed.yaml"
    spec = yaml.safe_load(manifest.read_text())["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[0] == "ember"
    args = build_parser().parse_args(argv[1:])
    assert args.ray == "" and args.id_column and args.inputs == ["s3://my-bucket/corpus/"]  # joins RAY_ADDRESS
    head = spec["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # actors only on the workers
    workers = spec["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert int(workers["resources"]["limits"]["cpu"]) % args.cpus_per_actor == 0  # whole actors per pod


def test_inputs_per_request_comes_from_the_flag_else_the_env_else_2048(monkeypatch):
    def limit(*argv):
        return max_inputs_per_request(serve_args("m", *argv).max_inputs_per_request)

    assert limit() == 2048
    monkeypatch.setenv("EMBER_MAX_INPUTS_PER_REQUEST", "64")
    assert limit() == 64
    assert limit("--max-inputs-per-request", "8") == 8
    monkeypatch.setenv("EMBER_MAX_INPUTS_PER_REQUEST", "lots")
    with pytest.raises(ConfigError, match="EMBER_MAX_INPUTS_PER_REQUEST='lots' is not a whole number"):
        limit()


def test_a_key_flag_takes_one_value_so_a_model_after_it_is_the_model():
    a = serve_args("--api-key", "k1", "/path/to/model")
    assert a.api_key == ["k1"] and a.model_tag == "/path/to/model"
    a = serve_args("--api-key", "k1", "--api-key", "k2", "m")
    assert a.api_key == ["k1", "k2"] and a.model_tag == "m"
    check_runner(a)


def test_a_model_swallowed_by_served_model_name_stops_the_start():
    a = serve_args("--served-model-name", "emb", "/path/to/model")
    with pytest.raises(ConfigError, match="put the model first"):
        check_runner(a)
    check_runner(serve_args("--served-model-name", "emb"))  # the default model under one name: meant


def test_an_unwritable_tmp_falls_back_to_the_cache_dir_with_a_log_line(tmp_path):
    """A read-only root without a tmpfs at /tmp: torch creates its cache directory as soon as torch._dynamo is
    imported (loading any model does), so ember picks a writable one before, and says so."""
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    cache = tmp_path / "cache"
    env = {"TMPDIR": str(blocked / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(blocked / "inductor"),
           "EMBER_CACHE_DIR": str(cache)}  # fmt: skip
    doctor = _ember("doctor", "--json", env=env)
    assert doctor.returncode == 0, doctor.stderr
    assert f"torch's cache directory {blocked / 'inductor'} is not writable: using /tmp/inductor" in doctor.stderr


def test_the_cache_dir_is_the_next_choice_after_the_temp_dirs(tmp_path, monkeypatch):
    from ember.cli import runtime

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setattr(runtime, "_temp_dirs", lambda: [str(blocked)])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocked / "ember-inductor"))
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    assert runtime.torch_cache_dir() == str(tmp_path / "cache" / "ember-inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "ember-inductor")


def test_no_writable_directory_for_torchs_cache_is_one_clear_error(monkeypatch):
    from ember.cli import runtime

    def read_only(path, exist_ok=False):
        raise OSError(30, "Read-only file system", path)

    monkeypatch.setattr(runtime.os, "makedirs", read_only)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/ember-inductor")
    with pytest.raises(ConfigError, match="mount a tmpfs at /tmp"):
        runtime.torch_cache_dir()
