"""Process setup before torch is imported: allocator, thread pools, CPU binding, oneDNN's kernel cache; and
the native kernels' configuration from the environment.

Environment variables are read here (and in flags.py) and nowhere else in ember.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path

from ember.config import ONEDNN_KERNEL_CACHE, HttpConfig, NativeConfig
from ember.errors import ConfigError
from ember.hardware import check_tier, limit_isa, mkl_isa, onednn_isa
from ember.resources import cpu_budget
from ember.sizing import ThreadPlan, plan_threads

__all__ = [
    "cap_isa",
    "connection_limit",
    "isa_env",
    "max_isa",
    "native_config",
    "parse_bytes",
    "prepare_process",
    "torch_cache_dir",
]


log = logging.getLogger("ember.cli")

_ALLOCATORS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)
_REEXEC_MARK = "EMBER_ALLOCATOR_SET"


def parse_bytes(value: str) -> int:
    """'4G', '4Gi', '4GiB', '3500M', '2147483648' -> bytes (K/M/G/T, binary units)."""
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise ConfigError(f"{value!r} is not a size in bytes (e.g. 4Gi, 3500M)") from None


def _find_allocator() -> str | None:
    choice = os.environ.get("EMBER_ALLOCATOR", "auto")
    if choice == "system":
        return None
    if choice != "auto":
        if not Path(choice).is_file():
            raise ConfigError(f"EMBER_ALLOCATOR={choice!r} is not a file (use auto, system or a path to a .so)")
        return choice
    return next((p for p in _ALLOCATORS if Path(p).is_file()), None)


def maybe_reexec_with_allocator(argv: list[str], program: list[str] | None = None) -> None:
    """Restart under tcmalloc when it is installed: glibc malloc returns large tensors to the OS
    after every op and pays page faults on the next, a large cost on CPU inference.
    The new process runs `program` (default: ember's CLI) with `argv`; benchmark scripts pass
    themselves, so what they time in-process runs on the allocator the server uses."""
    if os.environ.get(_REEXEC_MARK) or "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    lib = _find_allocator()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    env[_REEXEC_MARK] = lib
    command = [*(program or [sys.executable, "-m", "ember.cli.main"]), *argv]
    os.execve(command[0], command, env)


def connection_limit(asked: int | None) -> int:
    """--max-connections, else HttpConfig's default; raises the open-file soft limit to its hard limit first, and never
    lets the connections take more descriptors than that leaves (128 kept for the model, logs and the tokenizer)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    room = max(16, soft - 128)
    if asked is not None and asked < 1:
        raise ConfigError(f"--max-connections must be positive, got {asked}")
    if asked is not None and asked > room:
        log.warning("--max-connections %d lowered to %d: the process may open %d files", asked, room, soft)
    return min(asked if asked is not None else HttpConfig.max_connections, room)


def prepare_process(threads: int | None, cpu_bind: str | None) -> ThreadPlan:
    """Decide and apply the instruction-set cap, the thread count and binding; call before importing torch."""
    cap_isa(max_isa())
    torch_cache_dir()
    label = "--threads" if threads is not None else "EMBER_THREADS"
    requested = threads if threads is not None else _int_env("EMBER_THREADS")
    bind = cpu_bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or None
    bind_label = "--cpu-bind" if cpu_bind else "VLLM_CPU_OMP_THREADS_BIND"
    plan = plan_threads(
        cpu_budget(), requested, os.environ.get("OMP_NUM_THREADS"), bind, label=label, bind_label=bind_label
    )
    n = str(plan.threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = n
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_KERNEL_CACHE))  # read at the first matmul
    os.environ.setdefault("RAYON_NUM_THREADS", n)  # the Rust tokenizer's pool
    # OMP_WAIT_POLICY is left to the runtime's default on purpose: ACTIVE (spin forever) starves the event
    # loop on few cores, PASSIVE (sleep at once) doubles the time of small forwards (measured in benchmarks/).
    if plan.bind:
        os.sched_setaffinity(0, plan.bind)
        os.environ["OMP_PROC_BIND"] = "close"
        os.environ["GOMP_CPU_AFFINITY"] = ",".join(map(str, plan.bind))
    for warning in plan.warnings:
        log.warning("misconfiguration: %s", warning)
    log.info(
        "threads: %d (%s)%s; allocator: %s",
        plan.threads,
        plan.reason,
        f", bound to CPUs {list(plan.bind)}" if plan.bind else "",
        os.environ.get(_REEXEC_MARK, "system malloc"),
    )
    return plan


def torch_cache_dir() -> str:
    """A writable TORCHINDUCTOR_CACHE_DIR, set before torch is imported: torch creates it when torch._dynamo is
    first imported (even with --enforce-eager), so a read-only root with no writable /tmp failed at start. Tried
    in order: the operator's setting, torch's default under the temp dir, EMBER_CACHE_DIR, /dev/shm; none
    writable is a clear error naming the fix."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    user = "".join(c if c.isalnum() else "_" for c in os.environ.get("USER", "") or str(os.getuid()))
    name = os.path.basename(given.rstrip("/")) if given else f"torchinductor_{user}"  # keeps a capped tier's own
    candidates = [given] if given else []
    candidates += [os.path.join(d, name) for d in _temp_dirs()]
    if os.environ.get("EMBER_CACHE_DIR"):
        candidates.append(os.path.join(os.environ["EMBER_CACHE_DIR"], name))
    candidates.append(os.path.join("/dev/shm", name))
    for path in candidates:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK | os.X_OK):
            if path != candidates[0]:
                log.warning(
                    "torch's cache directory %s is not writable: using %s (mount a writable /tmp, or set "
                    "TORCHINDUCTOR_CACHE_DIR)",
                    candidates[0],
                    path,
                )
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
            return path
    raise ConfigError(
        f"no writable directory for torch's cache (tried {', '.join(candidates)}): with a read-only root, mount a "
        "tmpfs at /tmp (docker run --tmpfs /tmp; a Kubernetes emptyDir) or set TORCHINDUCTOR_CACHE_DIR"
    )


def _temp_dirs() -> list[str]:
    """The temp directory Python would use, or the usual ones when none is usable."""
    try:
        return [tempfile.gettempdir()]
    except FileNotFoundError:  # no usable temp directory at all
        return [os.environ.get("TMPDIR") or "/tmp"]


def max_isa() -> str | None:
    """EMBER_MAX_ISA, checked (ember.hardware.check_tier), or None."""
    tier = os.environ.get("EMBER_MAX_ISA", "").strip().lower() or None
    return None if tier is None else check_tier(tier)


def isa_env(tier: str) -> dict[str, str]:
    """The variables that keep torch inside a tier (ONEDNN_MAX_CPU_ISA for its bf16 and int8 GEMMs,
    MKL_ENABLE_INSTRUCTIONS for its float32 ones, ATEN_CPU_CAPABILITY, and an inductor cache of the tier's own),
    each as already set if it is: for this process, or for Ray workers started from it. MKL reads its variable
    at its first product, so it still applies when set after `import torch`."""
    # inductor's cache does not tell kernels built for AVX2 from AVX-512 ones: sharing its default directory
    # with uncapped runs loaded the other tier's kernels (NaN outputs, heap corruption). One per tier.
    user = "".join(c if c.isalnum() else "_" for c in os.environ.get("USER", "") or str(os.getuid()))
    wanted = {
        "ONEDNN_MAX_CPU_ISA": onednn_isa(tier),
        "MKL_ENABLE_INSTRUCTIONS": mkl_isa(tier),
        "ATEN_CPU_CAPABILITY": "avx2" if tier == "avx2" else "avx512",
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_{tier}"),
    }
    return {k: os.environ.get(k, v) for k, v in wanted.items()}


def cap_isa(tier: str | None) -> None:
    """EMBER_MAX_ISA=avx512_bf16|avx512|avx2: run as a CPU of that tier would: ember's kernel choice and builds
    (ember.hardware.limit_isa), and torch's (isa_env)."""
    if tier is None:
        return
    limit_isa(check_tier(tier))
    os.environ.update(isa_env(tier))
    log.info(
        "instruction set capped to %s (EMBER_MAX_ISA); oneDNN: %s, MKL: %s",
        tier,
        os.environ["ONEDNN_MAX_CPU_ISA"],
        os.environ["MKL_ENABLE_INSTRUCTIONS"],
    )


def native_config() -> NativeConfig:
    """The native kernels' switches, cache directory and compiler, from the environment (NativeConfig.from_env)."""
    return NativeConfig.from_env(os.environ)


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None
