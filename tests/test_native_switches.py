"""The native kernels' switches, report and cache, seen from outside: a server with each kernel switched off
serves with the fallbacks and says so; a cached library that is not what was built is rebuilt, not loaded."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from checkpoints import build_bert
from ember.ops import cxx, native
from server import Server

SWITCHES = {
    "attention": "EMBER_NATIVE_ATTENTION",
    "int8_gemm": "EMBER_NATIVE_INT8",
    "elementwise": "EMBER_NATIVE_ELEMENTWISE",
    "linear": "EMBER_NATIVE_LINEAR",
    "linear_f32": "EMBER_NATIVE_LINEAR_F32",
    "linear_bf16": "EMBER_NATIVE_LINEAR_BF16",
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
        assert f'ember_kernel_active{{kernel="{kernel}",model_name="{model}"}} 0.0' in metrics
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
    cache = tmp_path / "cache"
    kept = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
    assert kept in ([], ["int8"])  # no kernel was built (the calibrated int8 weights are kept there too)
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
    command = cxx.compile_command
    monkeypatch.setattr(cxx, "compile_command", lambda *a: [*command(*a), "-DEMBER_OTHER_FLAGS"])
    second, how = native._library(compiler, source, tmp_path)
    assert second != first and how == "built into"


def _kernels(srv):
    for _ in range(600):
        kernels = httpx.get(srv.url + "/info").json()["kernels"]
        if set(SWITCHES) <= set(kernels):
            return kernels
        time.sleep(0.1)
    raise AssertionError("the kernels never reported")


def test_prebuilt_kernels_load_with_no_compiler_where_ember_serves(tmp_path, compiler):
    """`ember build-kernels` at image build; then a server whose PATH has no compiler loads them at start."""
    import platform

    from ember.hardware import cpu_flags, isa_tier

    if platform.machine() != "x86_64":
        pytest.skip("the avx512_bf16 tier is built on x86-64")

    cache = tmp_path / "baked"
    done = subprocess.run([sys.executable, "-m", "ember.cli.main", "build-kernels", "--cache-dir", str(cache),
                           "--tier", "avx512_bf16"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    libraries = sorted(p.name for p in cache.glob("*.so"))
    assert [n.split("-")[0] for n in libraries] == [
        "ember_attention", "ember_elementwise", "ember_int8_gemm", "ember_linear", "ember_linear_bf16", "ember_linear_f32"
    ]  # fmt: skip
    assert all((cache / (n + ".sha256")).is_file() for n in libraries)
    if isa_tier(cpu_flags()) not in ("amx", "avx512_bf16"):
        pytest.skip("this CPU cannot run the AVX-512 BF16 build (it was built all the same)")
    model = build_bert(tmp_path / "bert", layers=1, hidden=64)
    no_compiler = {"PATH": str(Path(sys.executable).parent), "CXX": "", "EMBER_CACHE_DIR": str(cache)}
    no_compiler |= {switch: "1" for switch in SWITCHES.values()}  # the test servers keep them off by default
    srv = Server([str(model), "--dtype", "bfloat16", "--quantization", "int8"], tmp_path / "log", env=no_compiler)
    try:
        kernels = _kernels(srv)
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": ["prebuilt kernels serve"]})
    finally:
        srv.stop()
    for name in SWITCHES:
        assert kernels[name]["active"] is True, kernels[name]
        assert f"prebuilt, loaded from {cache}" in kernels[name]["detail"]
    assert r.status_code == 200
    assert sorted(p.name for p in cache.glob("*.so")) == libraries  # nothing else was built


@pytest.mark.parametrize("x86_tier", ["avx512", "avx2"])
def test_the_float32_tiers_prebuild_their_kernels_and_load_them_with_no_compiler(tmp_path, compiler, x86_tier):
    """`ember build-kernels --tier avx512` or `--tier avx2` (on x86-64), or `--tier aarch64` (on ARM), builds the
    float32 attention kernel (and on avx512 the bf16-weight linear layers), what a Skylake-SP to Ice Lake Xeon, an
    AVX2-only Xeon or a Graviton runs; a process of that tier (an x86 one capped to it), with no compiler, loads
    them from there."""
    import platform

    from ember.hardware import ISA_TIERS, isa_tier, native_cpu_flags

    arm = platform.machine() == "aarch64"
    if arm and x86_tier != "avx2":
        pytest.skip("aarch64 has one tier")
    here = isa_tier(native_cpu_flags())
    if not arm and (here not in ISA_TIERS or ISA_TIERS.index(here) > ISA_TIERS.index(x86_tier)):
        pytest.skip(f"this CPU cannot run the {x86_tier} build")
    tier, isa = ("aarch64", "NEON") if arm else (x86_tier, {"avx512": "AVX-512", "avx2": "AVX2"}[x86_tier])
    cache = tmp_path / "baked"
    done = subprocess.run([sys.executable, "-m", "ember.cli.main", "build-kernels", "--cache-dir", str(cache),
                           "--tier", tier], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    built = sorted(p.name.split("-")[:2] for p in cache.glob("*.so"))  # and the bf16-weight layers on AVX-512
    linears = [*([["ember_linear", tier]] if tier == "avx512" else []), *([] if arm else [["ember_linear_f32", tier]])]
    assert built == [["ember_attention", tier], *linears]
    probe = (
        "from ember.cli.runtime import native_config, prepare_process; prepare_process(None, None); "
        "from ember.ops import native; import torch; "
        "print([(k.name, k.active, k.detail) for k in native.build_kernels(native_config())]); "
        "print(sorted(str(d) for d in native.native_attention_dtypes()))"
    )
    no_compiler = {"PATH": str(Path(sys.executable).parent), "CXX": "", "EMBER_CACHE_DIR": str(cache),
                   "HOME": str(tmp_path), **({} if arm else {"EMBER_MAX_ISA": tier})}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, env=no_compiler)
    assert done.returncode == 0, done.stderr
    report, dtypes = done.stdout.splitlines()[-2:]
    assert f"('attention', True, '{isa}, prebuilt, loaded from {cache}" in report
    if tier == "avx512":
        assert f"('linear', True, 'AVX-512, prebuilt, loaded from {cache}" in report
    if not arm:
        assert f"('linear_f32', True, '{isa}, prebuilt, loaded from {cache}" in report
    if arm:
        assert "needs Linux on x86-64 (Linux aarch64 here); torch's int8 matmul instead" in report
    else:
        assert "lacks avx512_bf16" in report and "torch's int8 matmul instead" in report  # capped or not
    assert dtypes == "['torch.float32']"


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None, reason="no aarch64 cross compiler (Debian's "
                    "g++-aarch64-linux-gnu; .ci/run installs it)")  # fmt: skip
@pytest.mark.parametrize("source", ["attention.cpp", "linear.cpp", "linear_f32.cpp"])
def test_the_float32_kernels_compile_for_aarch64(tmp_path, source):
    """The attention kernel's source builds for any ARMv8-A CPU (the prebuilt aarch64 tier's flags), so nothing
    x86-only has crept into what both architectures share; its NEON entry points are there. So does the
    bf16-weight linear kernel's 8-lane build (not loaded on ARM, where it is not measured)."""
    import torch

    include = Path(torch.__file__).parent / "include"
    obj = tmp_path / source.replace(".cpp", ".o")
    command = ["aarch64-linux-gnu-g++", "-O3", *native.PREBUILT_TIERS["aarch64"], "-std=c++17", "-fPIC", "-fopenmp",
               "-w", "-c", f"-I{include}", f"-I{include / 'torch/csrc/api/include'}",
               str(Path(native.__file__).with_name("csrc") / source), "-o", str(obj)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    elf = obj.read_bytes()
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183  # EM_AARCH64
    name = source.removesuffix(".cpp")
    for symbol in (
        f"ember_{name}_isa",
        f"ember_{name}_usable",
        *(["ember_attention_f32"] if name == "attention" else []),
    ):
        assert symbol.encode() in elf
    assert b"ember_attention\x00" not in elf  # no bf16 entry: that half needs AVX-512 BF16


def test_build_kernels_refuses_a_tier_of_another_architecture(tmp_path):
    """`ember build-kernels --tier aarch64` on x86-64 (or an x86 tier on aarch64) says where that tier is built."""
    import platform

    other = "avx2" if platform.machine() == "aarch64" else "aarch64"
    done = subprocess.run([sys.executable, "-m", "ember.cli.main", "build-kernels", "--cache-dir", str(tmp_path),
                           "--tier", other], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2
    assert f"--tier {other} is built on an" in done.stderr and "this one builds" in done.stderr
    assert not list(tmp_path.glob("*.so"))


def test_with_no_compiler_and_nothing_prebuilt_the_log_says_how_to_get_them(tmp_path, monkeypatch):
    from ember.config import NativeConfig
    from ember.hardware import cpu_flags, isa_tier

    if isa_tier(cpu_flags()) not in ("amx", "avx512_bf16"):
        pytest.skip("the kernels decline this CPU before looking for a compiler")
    monkeypatch.setattr(native, "find_compiler", lambda preferred=None: None)
    lib, detail = native._build(native._KERNELS[0], NativeConfig(cache_dir=str(tmp_path)))
    assert lib is None
    assert detail == (f"no C++ compiler (g++) and no prebuilt library in {tmp_path} (build them with `ember "
                      "build-kernels` at image build); torch's SDPA instead")  # fmt: skip


def test_a_corrupt_prebuilt_library_is_not_loaded(tmp_path, compiler):
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int ember_probe_usable() { return 1; }\n')
    cxx.compile_library(compiler, source, native._prebuilt_path(source, tmp_path, "avx512_bf16"), ["-O1"])
    assert native._prebuilt(source, tmp_path, "avx512_bf16") is not None
    path = native._prebuilt_path(source, tmp_path, "avx512_bf16")
    path.write_bytes(path.read_bytes()[:64])
    assert native._prebuilt(source, tmp_path, "avx512_bf16") is None
    assert native._prebuilt(source, tmp_path / "missing", "amx") is None  # no cache dir: nothing, no error
