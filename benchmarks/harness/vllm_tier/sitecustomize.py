"""Started before vLLM (benchmarks/serve_vllm.sh puts this directory on PYTHONPATH when EMBER_MAX_ISA is set): keeps
vLLM's own kernels inside the emulated tier, as the ISA caps keep oneDNN, oneMKL and ATen.

vLLM's CPU wheel ships three kernel libraries (vllm._C with AVX-512 BF16, _C_AVX512, _C_AVX2) and picks one, and its
attention's instruction set, from torch.cpu's CPU queries, which read the real CPU. So under `--tier avx2` on an
AVX-512 machine it still ran its attention on AVX-512, which an AVX2-only CPU cannot. Here those queries answer as
a CPU of the tier would, in vLLM's processes only (ember's server never loads this file)."""

import os

_TIER = os.environ.get("EMBER_MAX_ISA", "").strip().lower()
_HAS = {  # what each tier has, of the features torch.cpu reports
    "avx2": set(),
    "avx512": {"avx512"},
    "avx512_bf16": {"avx512", "avx512_bf16"},
}

if _TIER in _HAS:
    import torch.cpu

    _has = _HAS[_TIER]
    _avx512, _bf16, _vnni = (
        torch.cpu._is_avx512_supported,
        torch.cpu._is_avx512_bf16_supported,
        torch.cpu._is_vnni_supported,
    )
    torch.cpu._is_avx512_supported = lambda: "avx512" in _has and _avx512()
    torch.cpu._is_avx512_bf16_supported = lambda: "avx512_bf16" in _has and _bf16()
    torch.cpu._is_vnni_supported = lambda: "avx512" in _has and _vnni()
    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_amx_fp16_supported = lambda: False
