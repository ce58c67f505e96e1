"""Thread and memory planning (pure), `ember doctor`, and ember inside real CPU and memory cgroups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cgroups import join_cgroup, real_v1_cgroup, run_in_cgroup
from checkpoints import build_bert
from ember.errors import ConfigError
from ember.resources import CpuBudget, MemoryBudget
from ember.sizing import GIB, OUTPUT_VALUE_BYTES, plan_memory, plan_threads
from server import Server

FOUR = CpuBudget(affinity=64, quota=4.0, cpuset=None, usable=4, source="cgroup v2 cpu.max 400000 100000")


def test_threads_follow_the_quota_not_the_host():
    plan = plan_threads(FOUR)
    assert plan.threads == 4 and not plan.warnings and "cpu.max" in plan.reason


def test_explicit_threads_and_omp_are_respected_but_reported_above_the_quota():
    assert plan_threads(FOUR, requested=2).threads == 2
    over = plan_threads(FOUR, omp_env="64")
    assert over.threads == 64 and "OMP_NUM_THREADS=64 is above the 4 CPU(s)" in over.warnings[0]
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS"):
        plan_threads(FOUR, omp_env="lots")


def test_cpu_bind_list_sets_threads_and_must_be_in_the_affinity():
    plan = plan_threads(CpuBudget(2, None, None, 2, "affinity 2"), bind="0-1")
    assert plan.bind == (0, 1) and plan.threads == 2
    with pytest.raises(ConfigError, match="outside this process's affinity"):
        plan_threads(FOUR, bind="0-511")
    assert plan_threads(FOUR, bind="nobind").bind is None


MEM4G = MemoryBudget(limit_bytes=4 * GIB, available_bytes=4 * GIB, total_bytes=64 * GIB, source="cgroup v2 memory.max")


def _plan(memory=MEM4G, weights=int(1.2 * GIB), per_token=40 * 1024, max_len=8192, **kw):
    args = dict(
        weights_bytes=weights,
        per_token_bytes=per_token,
        fixed_bytes=36 * 2**20,
        max_model_len=max_len,
        batch_tokens=2048,
        queued_tokens=1_000_000,
    )
    return plan_memory(memory, **(args | kw))


def test_memory_plan_fits_budgets_inside_the_limit():
    plan = _plan()
    assert plan.max_batch_tokens == 2048 and plan.budget_bytes == int(0.9 * 4 * GIB)
    peak = 0.45 * GIB + plan.weights_bytes + plan.fixed_bytes + max(2048, 8192) * plan.per_token_bytes
    assert peak + plan.max_queued_tokens * 64 <= plan.budget_bytes


def test_a_model_that_cannot_fit_is_refused_with_what_would_fit():
    small = MemoryBudget(limit_bytes=GIB, available_bytes=GIB, total_bytes=64 * GIB, source="cgroup v2 memory.max")
    with pytest.raises(ConfigError) as e:
        _plan(memory=small, weights=int(2.4 * GIB), dtype_bytes=4)
    message = str(e.value)
    assert "does not fit" in message and "--dtype bfloat16" in message and "0.90 GiB is available" in message


def test_tight_memory_shrinks_the_batch_and_queue():
    tight = MemoryBudget(limit_bytes=2 * GIB, available_bytes=2 * GIB, total_bytes=64 * GIB, source="cgroup")
    plan = _plan(memory=tight, max_len=512, per_token=200 * 1024)
    assert plan.max_batch_tokens < 2048 and plan.max_queued_tokens < 1_000_000


def test_doctor_json_reports_and_exits_by_problems():
    out = subprocess.run([sys.executable, "-m", "ember.cli.main", "doctor", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["problems"] == [] and report["threads"]["count"] >= 1
    assert report["gemm_gflops"]["float32"] > 0 and report["model"]["weights_bytes"] > 0
    assert set(report["cpu"]["isa"]) >= {"avx2", "avx512_bf16", "amx_bf16"}
    bad = subprocess.run(
        [sys.executable, "-m", "ember.cli.main", "doctor", "--json", "--memory-limit", "300M"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "does not fit" in json.loads(bad.stdout)["problems"][0]


def test_a_process_in_a_one_cpu_cgroup_uses_one_thread():
    code = (
        "from ember.cli.runtime import prepare_process; from ember.engine.cpu import set_threads; import torch;"
        "p = prepare_process(None, None); set_threads(p.threads); print(p.threads, torch.get_num_threads())"
    )
    with real_v1_cgroup("cpu", {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}) as cgroup:
        assert run_in_cgroup(cgroup, code) == "1 1"


def test_serve_under_a_tight_memory_limit_answers_a_burst_with_429_not_oom(tmp_path):
    model = build_bert(tmp_path / "m")
    with real_v1_cgroup("memory", {"memory.limit_in_bytes": str(900 * 2**20)}) as cgroup:
        args = [str(model), "--dtype", "float32", "--max-queued-tokens", "60000"]
        srv = Server(args, tmp_path / "log", preexec_fn=join_cgroup(cgroup))
        try:

            def burst(i):
                body = {"input": ["word " * 500] * 32, "truncate_prompt_tokens": -1}
                r = httpx.post(srv.url + "/v1/embeddings", json=body, timeout=120)
                return r.status_code, r.headers.get("retry-after")

            with ThreadPoolExecutor(24) as pool:
                results = list(pool.map(burst, range(24)))
            codes = [c for c, _ in results]
            assert 200 in codes and 429 in codes, codes
            assert all(retry for c, retry in results if c == 429)
            assert srv.proc.poll() is None and httpx.get(srv.url + "/health").status_code == 200
            assert "oom_kill 0" in (cgroup / "memory.oom_control").read_text()
            assert int((cgroup / "memory.max_usage_in_bytes").read_text()) < 900 * 2**20
        finally:
            srv.stop()
            time.sleep(0.2)


@pytest.mark.parametrize(("given", "expected"), [(None, "384"), ("500", "500")])
def test_onednn_kernel_cache_is_bounded_unless_the_operator_sets_it(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    if given:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = given
    code = "import os; from ember.cli.runtime import prepare_process; prepare_process(1, None); print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_a_bad_cpu_list_names_where_it_came_from():
    cpu = FOUR
    with pytest.raises(ConfigError, match=r"^VLLM_CPU_OMP_THREADS_BIND '4096' names CPUs outside"):
        plan_threads(cpu, bind="4096", bind_label="VLLM_CPU_OMP_THREADS_BIND")
    with pytest.raises(ConfigError, match=r"^--cpu-bind 'x-y': invalid CPU list"):
        plan_threads(cpu, bind="x-y")


def test_answers_are_part_of_the_memory_plan():
    plan = _plan(dimension=1024)
    assert plan.max_queued_vectors is not None and plan.max_queued_vectors > 1000
    peak = 0.45 * GIB + plan.weights_bytes + plan.fixed_bytes + max(2048, 8192) * plan.per_token_bytes
    answers = plan.max_queued_vectors * 1024 * OUTPUT_VALUE_BYTES
    assert peak + answers + plan.max_queued_tokens * 64 <= plan.budget_bytes
    assert "answers of up to" in plan.describe()
    wider = _plan(dimension=4096)
    assert wider.max_queued_vectors * 4 == pytest.approx(plan.max_queued_vectors, rel=0.01)


def test_a_request_of_two_million_inputs_is_refused_in_a_700_mb_cgroup_not_oom_killed(tmp_path):
    model = build_bert(tmp_path / "m")
    with real_v1_cgroup("memory", {"memory.limit_in_bytes": str(700 * 2**20)}) as cgroup:
        srv = Server([str(model), "--dtype", "float32"], tmp_path / "log", preexec_fn=join_cgroup(cgroup))
        try:
            body = b'{"input": [' + b",".join([b'"a"'] * 1_900_000) + b"]}"  # 7.6 MB, under the body limit
            r = httpx.post(srv.url + "/v1/embeddings", content=body, headers={"content-type": "application/json"},
                           timeout=120)  # fmt: skip
            # refused as it streams in: more JSON values than any admissible request holds (before parsing)
            assert r.status_code == 413 and "more JSON values" in r.json()["error"]["message"]
            assert httpx.post(srv.url + "/v1/embeddings", json={"input": "still here"}, timeout=30).status_code == 200
            assert srv.proc.poll() is None
            assert "oom_kill 0" in (cgroup / "memory.oom_control").read_text()
            peak = int((cgroup / "memory.max_usage_in_bytes").read_text())
        finally:
            srv.stop()
            time.sleep(0.2)
        assert peak < 700 * 2**20


@pytest.fixture(scope="module")
def e5_mistral_7b(tmp_path_factory):
    from checkpoints.families import E5_MISTRAL_7B_CONFIG, write_shape_only_checkpoint

    return write_shape_only_checkpoint(tmp_path_factory.mktemp("e5-mistral-7b"), E5_MISTRAL_7B_CONFIG)


@pytest.mark.parametrize(
    ("limit_gib", "quantization", "outcome"),
    [
        (16, None, "weights 13.24 GiB"),  # bf16 fits 16 GiB
        (16, "int8", "weights 6.74 GiB"),  # every linear layer at one byte, embeddings and norms in bf16
        (12, None, "--quantization int8 (weights 6.74 GiB; it fits)"),  # refused, and told what would fit
        (8, None, "needs about 14.29 GiB"),  # refused: int8 would not fit either, so it is not offered
        (8, "int8", "needs about 7.79 GiB"),
    ],
)
def test_a_7b_mistral_embedder_is_planned_or_refused_with_the_reason(e5_mistral_7b, limit_gib, quantization, outcome):
    from ember.config import ModelConfig
    from ember.engine.build import plan

    memory = MemoryBudget(limit_gib * GIB, limit_gib * GIB, 64 * GIB, "cgroup v2 memory.max")
    config = ModelConfig(str(e5_mistral_7b), dtype="bfloat16", quantization=quantization)
    if outcome.startswith("weights"):
        p = plan(config, memory)
        assert outcome in p.memory.describe()
        assert p.max_model_len == 4096  # e5-mistral's sliding window
        return
    with pytest.raises(ConfigError, match="does not fit") as refused:
        plan(config, memory)
    assert outcome in str(refused.value)
    assert ("--quantization int8" in str(refused.value)) == (limit_gib == 12)
