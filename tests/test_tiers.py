"""The instruction-set tiers: how a CPU's flags map to a tier, how EMBER_MAX_ISA caps it, and that the lower tiers
(AVX-512 BF16 without AMX, AVX2) compute what the reference computes when run on a higher CPU."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from ember import hardware
from ember.cli import runtime
from ember.errors import ConfigError
from ember.ops import native

ROOT = Path(__file__).resolve().parent.parent
AMX = frozenset(
    {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}
)


@pytest.fixture
def amx_cpu(monkeypatch: pytest.MonkeyPatch):
    """This process as if on an AMX Xeon, with no cap; the cap restored afterwards."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")  # on an aarch64 test machine too
    monkeypatch.setattr(hardware, "native_cpu_flags", lambda: AMX)
    monkeypatch.setattr(native, "native_cpu_flags", lambda: AMX)
    monkeypatch.setattr(hardware, "amx_granted", lambda: True)
    monkeypatch.setattr(hardware, "cpu_vendor", lambda: "GenuineIntel")
    for var in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(var, "")  # so that what cap_isa sets is undone afterwards
        monkeypatch.delenv(var)
    before = hardware._max_isa
    hardware.limit_isa(None)
    yield
    hardware.limit_isa(before)


@pytest.mark.parametrize(
    ("flags", "tier"),
    [
        (AMX, "amx"),
        (AMX - {"amx_tile", "amx_bf16", "amx_int8"}, "avx512_bf16"),  # AMD EPYC Zen 4/5
        (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}), "avx512"),  # Cascade Lake
        (frozenset({"avx2", "fma", "avx_vnni"}), "avx2"),
        (frozenset({"fp", "asimd", "sve", "bf16", "i8mm"}), "aarch64+sve+bf16+i8mm"),  # Graviton 3
        (frozenset({"fp", "asimd"}), "aarch64"),
        (frozenset({"sse4_2"}), "baseline"),
    ],
)
def test_the_tier_of_a_cpu(flags: frozenset[str], tier: str) -> None:
    assert hardware.isa_tier(flags) == tier


@pytest.mark.parametrize(
    ("flags", "vendor", "dtype"),
    [
        (AMX, "GenuineIntel", "bfloat16"),  # Sapphire Rapids and later, AMX granted
        (AMX - hardware.AMX_FLAGS, "GenuineIntel", "float32"),  # the same Xeon with AMX withheld; Cooper Lake
        (AMX - hardware.AMX_FLAGS, "AuthenticAMD", "bfloat16"),  # EPYC Zen 4/5
        (AMX - hardware.AMX_FLAGS - {"avx512_bf16"}, "AuthenticAMD", "float32"),
        (frozenset({"avx2", "fma"}), "AuthenticAMD", "float32"),  # Zen 2/3
        (frozenset({"fp", "asimd", "bf16"}), "", "float32"),  # Graviton 3
    ],
)
def test_auto_dtype_is_bf16_where_bf16_products_outrun_float32_ones(flags, vendor, dtype) -> None:
    assert hardware.auto_dtype(flags, vendor) == dtype


def test_a_cap_hides_the_flags_above_its_tier(amx_cpu: None) -> None:
    assert hardware.isa_tier() == "amx" and native._march() == ["-march=native"]
    runtime.cap_isa("avx512_bf16")
    assert hardware.isa_tier() == "avx512_bf16" and not {"amx_tile", "amx_bf16"} & hardware.cpu_flags()
    # an Intel CPU of this tier runs bf16 products at half its float32 rate; an AMD one (Zen 4/5) at twice
    assert hardware.auto_dtype() == "float32" and hardware.auto_dtype(vendor="AuthenticAMD") == "bfloat16"
    assert native._march() == ["-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16" and os.environ["ATEN_CPU_CAPABILITY"] == "avx512"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX512_E3"  # torch's float32 GEMMs: MKL's, without AMX
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("_avx512_bf16")  # never the uncapped runs' kernels
    hardware.limit_isa("avx2")
    assert hardware.isa_tier() == "avx2" and hardware.auto_dtype() == "float32"
    assert not any(f.startswith(("avx512", "amx")) for f in hardware.cpu_flags())
    assert native._march()[-1] == "-mno-avx512f"


def test_a_cap_names_a_known_lower_tier(amx_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="avx512_bf16, avx512, avx2"):
        runtime.cap_isa("sse")
    monkeypatch.setattr(hardware, "native_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    with pytest.raises(ConfigError, match="only reaches avx2"):
        runtime.cap_isa("avx512_bf16")
    assert hardware._max_isa is None and hardware.cpu_flags() == hardware.native_cpu_flags()  # nothing capped


def test_the_native_kernels_say_what_a_capped_cpu_lacks(amx_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    hardware.limit_isa("avx2")
    monkeypatch.setattr(native, "_tried", {})
    monkeypatch.setattr(native, "_loaded", {})
    report = {k.name: k for k in native.build_kernels(native.NativeConfig(attention=False, linear_f32=False))}
    assert not any(k.active for k in report.values())
    # attention and the float32 product run from AVX2 up: built in the avx2 suite below
    assert report["attention"].detail == "disabled by EMBER_NATIVE_ATTENTION=0; torch's SDPA instead"
    assert (
        report["linear_f32"].detail == "disabled by EMBER_NATIVE_LINEAR_F32=0; oneDNN's packed float32 matmul instead"
    )
    assert report["int8_gemm"].detail.startswith("this CPU (as capped by EMBER_MAX_ISA) lacks avx512_bf16 avx512_vnni")
    assert "this CPU (as capped by EMBER_MAX_ISA) lacks avx512_bf16 avx512bw avx512f" in report["elementwise"].detail
    assert "this CPU (as capped by EMBER_MAX_ISA) lacks avx512_bf16 avx512bw avx512f" in report["linear_bf16"].detail
    assert report["linear"].detail.endswith("lacks avx512bw avx512f; float32 weights on oneMKL instead")


def test_below_avx2_no_kernel_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """An x86-64 CPU without AVX2 and FMA (x86-64-v2) runs torch's own ops, saying so."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(hardware, "native_cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    monkeypatch.setattr(native, "native_cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    monkeypatch.setattr(native, "_tried", {})
    monkeypatch.setattr(native, "_loaded", {})
    report = {k.name: k for k in native.build_kernels(native.NativeConfig())}
    assert not any(k.active for k in report.values())
    assert report["attention"].detail == "this CPU lacks avx2 fma; torch's SDPA instead"


def _suite(tier: str, *tests: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, EMBER_MAX_ISA=tier, EMBER_CACHE_DIR=str(tmp_path / "cache"))
    env.update(runtime.isa_env(tier))  # oneDNN, MKL and ATen before torch starts: set by the parent
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # not the uncapped runs' kernels
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", *tests]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.skipif(hardware.isa_tier(hardware.native_cpu_flags()) != "amx", reason="the CPU is not above avx512_bf16")
def test_the_avx512_kernels_on_an_amx_cpu(tmp_path: Path) -> None:
    """Where the CPU has AMX, the kernels' AVX-512 builds (attention on BF16, int8 on VNNI: what an AMD EPYC runs)
    are checked against float32 attention and exact integer arithmetic too. Elsewhere the plain run of these
    tests checks them."""
    done = _suite("avx512_bf16", "tests/test_native.py", "tests/test_quant.py", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "cannot run" not in done.stdout  # no kernel test skipped
    built = {p.name.split("-")[0] for p in (tmp_path / "cache").iterdir()}
    assert {"ember_attention", "ember_int8_gemm"} <= built


def test_where_the_os_refuses_amx_tiles_the_process_is_an_avx512_bf16_cpu(amx_cpu, monkeypatch, tmp_path) -> None:
    """An AMX Xeon whose kernel or sandbox refuses the tile state (arch_prctl XTILEDATA): its AMX flags are hidden,
    so the kernels are the avx512_bf16 tier's (vdpbf16ps and VNNI, not off), prebuilt or built with AMX off; `ember
    doctor` says why the tier is lower."""
    from ember.cli import doctor

    for module in (hardware, doctor):
        monkeypatch.setattr(module, "amx_granted", lambda: False)
    assert hardware.isa_tier() == "avx512_bf16" and not hardware.AMX_FLAGS & hardware.cpu_flags()
    assert hardware.auto_dtype() == "float32"  # without its AMX, a Xeon's bf16 products run at half float32's rate
    assert native._runnable_tiers() == ["avx512_bf16", "avx512", "avx2"]
    assert native._march() == ["-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    assert "the OS refuses this process its tile state" in doctor._tier_note(hardware.cpu_flags())
    runtime.cap_isa("avx2")
    assert doctor._tier_note(hardware.cpu_flags()) == " (capped by EMBER_MAX_ISA; this process could reach avx512_bf16)"


def test_linux_is_asked_for_amx_tiles_only_where_the_cpu_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    monkeypatch.setattr(hardware, "_request_amx_tiles", lambda: asked.append(True) or False)
    monkeypatch.setattr(hardware, "native_cpu_flags", lambda: AMX - hardware.AMX_FLAGS)
    assert hardware.amx_granted() and not asked
    monkeypatch.setattr(hardware, "native_cpu_flags", lambda: AMX)
    assert not hardware.amx_granted() and asked
    assert hardware.isa_tier() == "avx512_bf16"


@pytest.mark.skipif("amx_tile" not in hardware.native_cpu_flags(), reason="this CPU has no AMX")
def test_on_an_amx_cpu_the_process_holds_the_tile_state_once_granted() -> None:
    """Where amx_granted() says yes, Linux's own record agrees: ARCH_GET_XCOMP_PERM shows XTILEDATA (bit 18)."""
    import ctypes

    if not hardware.amx_granted():
        pytest.skip("this machine's Linux refuses the AMX tile state")
    mask = ctypes.c_uint64(0)
    assert ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask)) == 0  # SYS_arch_prctl, ARCH_GET_XCOMP_PERM
    assert mask.value >> 18 & 1


@pytest.mark.skipif(hardware.isa_tier(hardware.native_cpu_flags()) not in ("amx", "avx512_bf16"),
                    reason="the CPU is at the avx512 tier or below: the plain run checks it")  # fmt: skip
def test_the_avx512_tier_kernels_match_the_reference(tmp_path: Path) -> None:
    """As a Skylake-SP to Ice Lake Xeon (AVX-512 without BF16): the attention kernel is built for float32 alone, on
    its 16-lane loops, and checked against float64 attention: every float32 case runs (the bf16 ones skip, as that
    build has none); the bf16-weight linear layers are checked against float64 and the models against
    sentence-transformers."""
    done = _suite("avx512", "tests/test_native.py", "tests/test_linear.py", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "cannot run" not in done.stdout and "AVX-512 only" not in done.stdout
    built = {p.name.split("-")[0] for p in (tmp_path / "cache").glob("*.so")}
    assert built == {"ember_attention", "ember_linear", "ember_linear_f32"}  # the float32 product builds from AVX2 up


@pytest.mark.skipif(hardware.isa_tier(hardware.native_cpu_flags()) not in ("amx", "avx512_bf16", "avx512"),
                    reason="the CPU is AVX2 already: the plain run checks this tier")  # fmt: skip
def test_the_avx2_tier_matches_the_reference(tmp_path: Path) -> None:
    """As an AVX2-only Xeon: float32 by default, torch's AVX2 kernels, and of ember's kernels only attention (its
    float32 build, checked against float64 attention) and the float32 product; the models still match transformers / sentence-transformers
    and a text alone equals it inside a batch."""
    tests = ("tests/test_native.py", "tests/test_models.py", "tests/test_minilm_real.py")
    done = _suite("avx2", *tests, tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout
    assert "native attention kernel cannot run" not in done.stdout  # its float32 tests ran
    built = {p.name.split("-")[0] for p in (tmp_path / "cache").glob("*.so")}
    assert built == {"ember_attention", "ember_linear_f32"}


def _intel() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "GenuineIntel" in cpuinfo.read_text()


@pytest.mark.skipif(not _intel() or hardware.isa_tier(hardware.native_cpu_flags()) == "avx2",
                    reason="needs an Intel CPU above AVX2 (oneMKL honours its cap on Intel CPUs only)")  # fmt: skip
def test_the_avx2_cap_reaches_torchs_float32_gemms(tmp_path: Path) -> None:
    """torch's float32 GEMMs are oneMKL's, which ONEDNN_MAX_CPU_ISA does not cap: under EMBER_MAX_ISA=avx2 MKL
    dispatches its AVX2 code too (on an AVX-512 Xeon it otherwise ran float32 GEMMs 1.7x faster than AVX2 can)."""
    import torch

    if not torch.backends.mkl.is_available():
        pytest.skip("this torch build has no MKL")
    code = (
        "from ember.cli.runtime import prepare_process; prepare_process(None, None)\n"
        "import torch; a = torch.ones(64, 64); print((a @ a)[0, 0].item())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    env.update(EMBER_MAX_ISA="avx2", MKL_VERBOSE="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    banner = next(line for line in done.stdout.splitlines() if line.startswith("MKL_VERBOSE oneMKL"))
    assert "(Intel(R) AVX2)" in banner and "AVX-512" not in banner, banner
    assert done.stdout.strip().endswith("64.0")


def test_on_arm_attention_is_built_for_neon_and_the_x86_kernels_decline(monkeypatch, tmp_path) -> None:
    """On aarch64 (Graviton) the attention kernel is built there (NEON, -mcpu=native, or the prebuilt aarch64 tier);
    the x86-only kernels each say why and what runs instead; --dtype auto is float32 (torch's bf16 GEMMs there are
    not known to be faster). (Its computing is checked on aarch64 itself: tests/arm64/run.sh.)"""
    graviton = frozenset({"fp", "asimd", "sve", "bf16", "i8mm"})
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(hardware, "native_cpu_flags", lambda: graviton)
    monkeypatch.setattr(native, "native_cpu_flags", lambda: graviton)
    monkeypatch.setattr(native, "find_compiler", lambda preferred=None: None)
    monkeypatch.setattr(native, "_tried", {})
    monkeypatch.setattr(native, "_loaded", {})
    report = {k.name: k for k in native.build_kernels(native.NativeConfig(cache_dir=str(tmp_path)))}
    assert not any(k.active for k in report.values())
    assert report["attention"].detail.startswith("no C++ compiler (g++) and no prebuilt library")
    assert report["attention"].detail.endswith("torch's SDPA instead")
    x86_only = (
        ("int8_gemm", "torch's int8 matmul"), ("elementwise", "torch.compile's kernels"),
        ("linear", "float32 weights on oneMKL"),
    )  # fmt: skip
    for name, fallback in x86_only:
        assert report[name].detail == f"needs Linux on x86-64 (Linux aarch64 here); {fallback} instead"
    assert native._march() == ["-mcpu=native"]
    assert native._runnable_tiers() == native.prebuilt_tiers_here() == ["aarch64"]
    assert hardware.isa_tier() == "aarch64+sve+bf16+i8mm" and hardware.auto_dtype() == "float32"


def test_doctor_points_at_the_faster_dtype_the_probe_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """--dtype auto follows the CPU flags; the GEMM probe only advises: float32 where bf16 measured no faster, and
    bf16 where auto is float32 but bf16 measured 1.5x faster (Graviton 3/4's bf16 matrix instructions)."""
    from ember.cli import doctor

    monkeypatch.setattr(doctor, "auto_dtype", lambda: "bfloat16")
    assert "--dtype float32 may be faster" in (doctor._dtype_warning({"float32": 100, "bfloat16": 110}) or "")
    assert doctor._dtype_warning({"float32": 100, "bfloat16": 300}) is None
    monkeypatch.setattr(doctor, "auto_dtype", lambda: "float32")
    warning = doctor._dtype_warning({"float32": 100, "bfloat16": 180}) or ""
    assert "bf16 GEMM measured 1.8x float32" in warning and "--dtype bfloat16 may be faster" in warning
    assert doctor._dtype_warning({"float32": 100, "bfloat16": 120}) is None
