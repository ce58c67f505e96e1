"""What this process may really use inside a container: CPUs and memory, from cgroup v1 or v2.

Stdlib only and pure: every reader takes `root` so tests can point it at a fake filesystem tree.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CpuBudget",
    "MemoryBudget",
    "affinity_cpus",
    "cpu_budget",
    "memory_budget",
    "parse_cpu_list",
    "release_free_memory",
]

_ROOT = Path("/")
# cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large cannot be a real limit.
_V1_NO_MEMORY_LIMIT = 2**60


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use, with each limit that was found."""

    affinity: int  # CPUs in sched_getaffinity (or os.cpu_count())
    quota: float | None  # cgroup CPU quota in CPUs (e.g. 1.5), None if unlimited
    cpuset: int | None  # CPUs in the cgroup cpuset, None if unknown
    usable: int  # floor(min of the known limits), at least 1
    source: str  # human-readable reason for `usable`
    cpus: tuple[int, ...] = ()  # the CPU ids of the affinity; empty: 0 .. affinity - 1


@dataclass(frozen=True)
class MemoryBudget:
    """The memory this process may use, with the cgroup limit if there is one."""

    limit_bytes: int | None  # cgroup memory limit, None if unlimited
    available_bytes: int  # the limit when limited, else MemAvailable
    total_bytes: int  # MemTotal
    source: str  # human-readable reason for `available_bytes`


@dataclass(frozen=True)
class _Found:
    """One limit file read in one cgroup directory."""

    value: float  # CPUs or bytes; math.inf when the file says "no limit"
    text: str  # what the file said, for `source`
    where: str  # the cgroup directory, shown as an absolute path under `root`


_Reader = Callable[[Path], _Found | None]


def release_free_memory() -> str:
    """Hand the allocator's freed pages back to the OS (tcmalloc's ReleaseFreeMemory, else glibc's malloc_trim),
    so RSS returns towards idle after a burst instead of staying at its peak; returns which one ran ("" if none)."""
    process = ctypes.CDLL(None)
    for name, args in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
        fn = getattr(process, name, None)
        if fn is not None:
            fn(*args)
            return name
    return ""


def parse_cpu_list(text: str) -> set[int]:
    """Parse a Linux CPU list such as "0-3,8,10-11" (cpuset files, VLLM_CPU_OMP_THREADS_BIND).

    An empty or blank list is the empty set; anything malformed raises ValueError naming the part.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        if not first.strip().isdigit() or (sep and not last.strip().isdigit()):
            raise ValueError(f"invalid CPU list item {part!r} in {text!r}")
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise ValueError(f"invalid CPU range {part!r} in {text!r}: end before start")
        cpus.update(range(low, high + 1))
    return cpus


def cpu_budget(root: Path = _ROOT, affinity: int | None = None) -> CpuBudget:
    """The CPUs usable here: the tightest of affinity, cgroup CPU quota and cgroup cpuset."""
    cpus = affinity_cpus() if affinity is None else tuple(range(affinity))
    affinity = len(cpus)
    version, dirs = _controller_dirs(root, "cpu")
    notes: list[str] = []
    quota: float | None = None
    if dirs is None:
        notes.append("no cgroup cpu controller found: no quota")
    else:
        reader = _v2_cpu_max if version == "v2" else _v1_cfs_quota
        name = "cpu.max" if version == "v2" else "cpu.cfs_quota_us"
        found = _tightest(dirs, root, reader)
        if found is None:
            notes.append(f"cgroup {version} {name} unreadable in {_shown(dirs[0], root)} and above: no quota")
        elif math.isinf(found.value):
            notes.append(f"cgroup {version} {name}: no quota in {_shown(dirs[0], root)} or above")
        else:
            quota = found.value
            notes.append(f"cgroup {version} {name} {found.text} = {found.value:g} CPUs at {found.where}")
    cpuset = _cpuset(root, notes)
    notes.append(f"affinity {affinity}")
    limits = [float(affinity)] + [x for x in (quota, cpuset) if x is not None]
    # A fractional quota still lets one thread run (throttled), so never go below 1.
    usable = max(1, math.floor(min(limits)))
    return CpuBudget(affinity, quota, cpuset, usable, "; ".join(notes), cpus)


def memory_budget(root: Path = _ROOT) -> MemoryBudget:
    """The memory usable here: the cgroup limit when there is one, else MemAvailable."""
    meminfo = _meminfo(root)
    total = meminfo.get("MemTotal")
    notes: list[str] = []
    if total is None:
        # Only a broken /proc gets here; the kernel's page count is the same number by another road.
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        notes.append(f"{_shown(root / 'proc/meminfo', root)} unreadable: MemTotal {total} from sysconf")
    limit = _memory_limit(root, total, notes)
    if limit is not None:
        # The limit, not limit - usage: at startup the server's own usage would count against itself.
        return MemoryBudget(limit_bytes=limit, available_bytes=limit, total_bytes=total, source="; ".join(notes))
    available = meminfo.get("MemAvailable", meminfo.get("MemFree", total))
    notes.append(f"MemAvailable {available} of MemTotal {total}")
    return MemoryBudget(limit_bytes=None, available_bytes=available, total_bytes=total, source="; ".join(notes))


def _memory_limit(root: Path, total: int, notes: list[str]) -> int | None:
    """The tightest cgroup memory limit below MemTotal, or None; explains itself in `notes`."""
    version, dirs = _controller_dirs(root, "memory")
    if dirs is None:
        notes.append("no cgroup memory controller found: no limit")
        return None
    name = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    found = _tightest(dirs, root, _v2_memory_max if version == "v2" else _v1_memory_limit)
    if found is None:
        notes.append(f"cgroup {version} {name} unreadable in {_shown(dirs[0], root)} and above: no limit")
        return None
    if math.isinf(found.value):
        notes.append(f"cgroup {version} {name}: no limit in {_shown(dirs[0], root)} or above")
        return None
    if found.value >= total:
        # A limit at or above physical memory can never bind; MemAvailable is the real bound then.
        notes.append(f"cgroup {version} {name} {found.text} at {found.where} >= MemTotal {total}: no limit")
        return None
    notes.append(f"cgroup {version} {name} {found.text} at {found.where}")
    return int(found.value)


def affinity_cpus() -> tuple[int, ...]:
    """The ids of the CPUs this process may run on (sched_getaffinity), ascending."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux, or a sandbox that forbids the call
        return tuple(range(os.cpu_count() or 1))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _shown(path: Path, root: Path) -> str:
    """`path` as the process would see it, so `source` reads the same under a fake root."""
    try:
        relative = path.relative_to(root).as_posix()
    except ValueError:
        return str(path)
    return "/" if relative == "." else "/" + relative


def _meminfo(root: Path) -> dict[str, int]:
    """/proc/meminfo in bytes, e.g. {"MemTotal": 25325268992}; empty when unreadable."""
    values: dict[str, int] = {}
    for line in (_read(root / "proc/meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            unit = 1024 if fields[1:] == ["kB"] else 1
            values[key.strip()] = int(fields[0]) * unit
    return values


def _proc_cgroups(root: Path) -> dict[str, str]:
    """Controller name -> cgroup path from /proc/self/cgroup; the v2 line is under ""."""
    paths: dict[str, str] = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if fields[0] == "0" and fields[1] == "":
            paths[""] = fields[2]
        for controller in fields[1].split(","):
            if controller:
                paths[controller] = fields[2]
    return paths


def _controller_dirs(root: Path, controller: str) -> tuple[str, list[Path] | None]:
    """("v1" or "v2", this process's cgroup directories for `controller`, leaf first, up to the mount)."""
    base = root / "sys/fs/cgroup"
    paths = _proc_cgroups(root)
    # Only a v2 mount at /sys/fs/cgroup itself is "unified"; hybrid hosts also mount v2 at
    # /sys/fs/cgroup/unified (and list a "0::/" line) but keep every controller on v1.
    if (base / "cgroup.controllers").is_file():
        return "v2", _cgroup_dirs(root, base, paths.get("", "/"))
    mount = _v1_mount(base, controller)
    if mount is None:
        return "v1", None
    return "v1", _cgroup_dirs(root, mount, paths.get(controller, "/"))


def _v1_mount(base: Path, controller: str) -> Path | None:
    """The v1 hierarchy holding `controller`: "cpu", or a co-mount such as "cpu,cpuacct"."""
    if (base / controller).is_dir():
        return base / controller
    try:
        names = sorted(entry.name for entry in base.iterdir() if entry.is_dir())
    except OSError:
        return None
    return next((base / name for name in names if controller in name.split(",")), None)


def _cgroup_dirs(root: Path, mount: Path, path: str) -> list[Path]:
    """Directories from the process's cgroup up to the mount root, leaf first."""
    path = _strip_mount_root(root, mount, path)
    parts = [part for part in path.split("/") if part]
    leaf = mount.joinpath(*parts)
    if ".." in parts or not leaf.is_dir():
        # Inside a container the mount usually is the container's cgroup already, and the
        # host-side path in /proc/self/cgroup does not exist under it.
        return [mount]
    dirs = [leaf]
    while dirs[-1] != mount:
        dirs.append(dirs[-1].parent)
    return dirs


def _strip_mount_root(root: Path, mount: Path, path: str) -> str:
    """`path` relative to the mount, when mountinfo says the mount shows a sub-tree (containers)."""
    shown = _shown(mount, root)
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == shown and fields[3] not in ("/", ""):
            mount_root = fields[3].rstrip("/")
            if path == mount_root or path.startswith(mount_root + "/"):
                return path[len(mount_root) :] or "/"
    return path


def _tightest(dirs: list[Path], root: Path, reader: _Reader) -> _Found | None:
    """The smallest limit found from the leaf up: nested limits (k8s pod and container) all apply."""
    found = [item for item in (reader(directory) for directory in dirs) if item is not None]
    if not found:
        return None
    best = min(found, key=lambda item: item.value)
    return _Found(best.value, best.text, _shown(Path(best.where), root))


def _v2_cpu_max(directory: Path) -> _Found | None:
    fields = (_read(directory / "cpu.max") or "").split()
    if not fields:
        return None
    if fields[0] == "max":
        return _Found(math.inf, "max", str(directory))
    return _cpus(fields[0], fields[1] if len(fields) > 1 else "100000", directory)


def _v1_cfs_quota(directory: Path) -> _Found | None:
    quota = _read(directory / "cpu.cfs_quota_us")
    period = _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _cpus(quota, period, directory)


def _cpus(quota: str, period: str, directory: Path) -> _Found | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:  # -1 is v1's "no quota"
        return _Found(math.inf, quota, str(directory))
    return _Found(quota_us / period_us, f"{quota_us}/{period_us}", str(directory))


def _v2_memory_max(directory: Path) -> _Found | None:
    text = _read(directory / "memory.max")
    if text == "max":
        return _Found(math.inf, text, str(directory))
    return _bytes(text, directory)


def _v1_memory_limit(directory: Path) -> _Found | None:
    found = _bytes(_read(directory / "memory.limit_in_bytes"), directory)
    if found is not None and found.value >= _V1_NO_MEMORY_LIMIT:
        return _Found(math.inf, found.text, found.where)
    return found


def _bytes(text: str | None, directory: Path) -> _Found | None:
    if text is None or not text.isdigit():
        return None
    return _Found(int(text), text, str(directory))


def _cpuset(root: Path, notes: list[str]) -> int | None:
    """How many CPUs the cgroup cpuset allows, or None when unknown; explains itself in `notes`."""
    version, dirs = _controller_dirs(root, "cpuset")
    names = ("cpuset.cpus.effective", "cpuset.cpus") if version == "v2" else ("cpuset.effective_cpus", "cpuset.cpus")
    # Leaf first: v2 leaves without the cpuset controller have no files and inherit the parent's.
    for directory in dirs or []:
        for name in names:
            text = _read(directory / name)
            if not text:  # missing, or empty meaning "inherit" in v2
                continue
            try:
                cpus = parse_cpu_list(text)
            except ValueError:
                continue
            if cpus:
                notes.append(f"cgroup {version} {name} {text} = {len(cpus)} CPUs at {_shown(directory, root)}")
                return len(cpus)
    notes.append("no cgroup cpuset found")
    return None
