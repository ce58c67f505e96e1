"""The native kernels' switches, report and cache, seen from outside: a server with each kernel switched off
serves with the fallbacks and says so; a cached library that is not what was built is rebuilt, not loaded."""

import shutil

import httpx
import pytest

from checkpoints import build_bert
from ember.ops import native
from server import Server

SWITCHES = {
    "attention": "EMBER_NATIVE_ATTENTION",
    "int8_gemm": "EMBER_NATIVE_INT8",
    "elementwise": "EMBER_NATIVE_ELEMENTWISE",
}


def test_each_switch_keeps_its_kernel_out_and_the_fallback_serves(tmp_path):
    model = build_bert(tmp_path / "bert", layers=1, hidden=64)
    env = {switch: "0" for switch in SWITCHES.values()} | {"EMBER_CACHE_DIR": str(tmp_path / "cache")}
    srv = Server([str(model), "--dtype", "bfloat16", "--quantization", "int8"], tmp_path / "log", env=env)
    try:
        for _ in range(300):
            kernels = httpx.get(srv.url + "/info").json()["kernels"]
            if set(SWITCHES) <= set(kernels):
                break
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": ["the fallbacks serve"]})
        metrics = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    for kernel, switch in SWITCHES.items():
        assert kernels[kernel]["active"] is False and f"disabled by {switch}=0" in kernels[kernel]["detail"]
        assert f'ember_kernel_active{{kernel="{kernel}"}} 0.0' in metrics
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
    assert not (tmp_path / "cache").exists()  # nothing was built
    assert "disabled by EMBER_NATIVE_ATTENTION=0" in (tmp_path / "log").read_text()  # and the log says so


@pytest.fixture
def compiler():
    found = shutil.which("g++")
    if found is None:
        pytest.skip("no C++ compiler here")
    return found


def test_a_corrupt_or_foreign_cached_library_is_rebuilt_not_loaded(tmp_path, compiler):
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int ember_probe_usable() { return 1; }\n')
    cache = tmp_path / "cache"
    built, how = native._library(compiler, source, cache)
    assert how == "built into" and built.is_file()
    assert native._library(compiler, source, cache) == (built, "loaded from")
    built.write_bytes(built.read_bytes()[:100])  # truncated, as by a full disk or a killed copy
    rebuilt, how = native._library(compiler, source, cache)
    assert rebuilt == built and how == "built into" and built.stat().st_size > 100
    built.with_name(built.name + ".sha256").unlink()  # a file of that name that ember did not write
    assert native._library(compiler, source, cache)[1] == "built into"


def test_the_cache_key_changes_with_the_compile_command(tmp_path, compiler, monkeypatch):
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int ember_probe_usable() { return 1; }\n')
    first, _ = native._library(compiler, source, tmp_path)
    command = native._compile_command
    monkeypatch.setattr(native, "_compile_command", lambda *a: [*command(*a), "-DEMBER_OTHER_FLAGS"])
    second, how = native._library(compiler, source, tmp_path)
    assert second != first and how == "built into"
