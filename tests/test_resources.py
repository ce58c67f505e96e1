"""ember.resources: cgroup v1/v2 CPU and memory limits on fake trees, plus real v1 cgroups when root."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgroups import real_v1_cgroup, run_in_cgroup
from ember.resources import CpuBudget, MemoryBudget, cpu_budget, memory_budget, parse_cpu_list

GiB = 2**30
MEMINFO = "MemTotal:       16777216 kB\nMemFree:         1048576 kB\nMemAvailable:    8388608 kB\n"
MEM_TOTAL = 16 * GiB
MEM_AVAILABLE = 8 * GiB
V1_UNLIMITED = "9223372036854771712"


def tree(root: Path, files: dict[str, str]) -> Path:
    """Write `files` (paths relative to `root`) and return `root`."""
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def v2(root: Path, cgroup: str, files: dict[str, str]) -> Path:
    """A unified-hierarchy tree: the process sits in `cgroup`; `files` are relative to /sys/fs/cgroup."""
    base = {
        "proc/self/cgroup": f"0::{cgroup}\n",
        "proc/meminfo": MEMINFO,
        "sys/fs/cgroup/cgroup.controllers": "cpu memory cpuset\n",
    }
    return tree(root, base | {f"sys/fs/cgroup/{name}": text for name, text in files.items()})


def v1(root: Path, cgroup: str, files: dict[str, str], cpu_mount: str = "cpu,cpuacct") -> Path:
    """A v1 tree with the process in `cgroup` for every controller; `files` are relative to /sys/fs/cgroup."""
    proc = f"7:memory:{cgroup}\n4:{cpu_mount}:{cgroup}\n3:cpuset:{cgroup}\n1:name=systemd:{cgroup}\n"
    base = {"proc/self/cgroup": proc, "proc/meminfo": MEMINFO}
    for mount in (cpu_mount, "memory", "cpuset"):
        (root / "sys/fs/cgroup" / mount).mkdir(parents=True, exist_ok=True)
    return tree(root, base | {f"sys/fs/cgroup/{name}": text for name, text in files.items()})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
        ("5", {5}),
        ("0-1\n", {0, 1}),
        (" 0 - 2 , 4 ", {0, 1, 2, 4}),
        ("0,0-1,1", {0, 1}),
        ("", set()),
        ("  \n", set()),
    ],
)
def test_parse_cpu_list(text: str, expected: set[int]) -> None:
    assert parse_cpu_list(text) == expected


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "-1", "0-3,x", "1:2", "0-3:2"])
def test_parse_cpu_list_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpu_list(text)


def test_v2_limited(tmp_path: Path) -> None:
    root = v2(tmp_path, "/app", {"app/cpu.max": "200000 100000\n", "app/memory.max": f"{2 * GiB}\n"})
    cpu = cpu_budget(root, affinity=64)
    assert (cpu.quota, cpu.cpuset, cpu.usable) == (2.0, None, 2)
    assert "cgroup v2 cpu.max 200000/100000 = 2 CPUs at /sys/fs/cgroup/app" in cpu.source
    assert "affinity 64" in cpu.source
    memory = memory_budget(root)
    assert memory == MemoryBudget(2 * GiB, 2 * GiB, MEM_TOTAL, memory.source)
    assert "memory.max 2147483648 at /sys/fs/cgroup/app" in memory.source


def test_v2_unlimited(tmp_path: Path) -> None:
    root = v2(tmp_path, "/app", {"app/cpu.max": "max 100000\n", "app/memory.max": "max\n"})
    assert cpu_budget(root, affinity=6) == CpuBudget(
        6, None, None, 6, cpu_budget(root, affinity=6).source, tuple(range(6))
    )
    memory = memory_budget(root)
    assert (memory.limit_bytes, memory.available_bytes, memory.total_bytes) == (None, MEM_AVAILABLE, MEM_TOTAL)
    assert "no limit" in memory.source


def test_v2_nested_parent_is_tighter(tmp_path: Path) -> None:
    files = {
        "kubepods/cpu.max": "max 100000",
        "kubepods/pod1/cpu.max": "300000 100000",
        "kubepods/pod1/ctr/cpu.max": "400000 100000",
        "kubepods/memory.max": "max",
        "kubepods/pod1/memory.max": str(GiB),
        "kubepods/pod1/ctr/memory.max": str(4 * GiB),
    }
    root = v2(tmp_path, "/kubepods/pod1/ctr", files)
    cpu = cpu_budget(root, affinity=64)
    assert (cpu.quota, cpu.usable) == (3.0, 3)
    assert "at /sys/fs/cgroup/kubepods/pod1;" in cpu.source
    assert memory_budget(root).limit_bytes == GiB


def test_v2_path_missing_under_mount_uses_mount_root(tmp_path: Path) -> None:
    # cgroupns=host: /proc/self/cgroup names the host path, the mount is the container's cgroup.
    root = v2(tmp_path, "/system.slice/docker-abc.scope", {"cpu.max": "100000 100000", "memory.max": str(GiB)})
    assert cpu_budget(root, affinity=8).usable == 1
    assert memory_budget(root).limit_bytes == GiB


def test_v1_limited(tmp_path: Path) -> None:
    files = {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "memory/docker/abc/memory.limit_in_bytes": f"{GiB}\n",
    }
    root = v1(tmp_path, "/docker/abc", files)
    cpu = cpu_budget(root, affinity=16)
    assert (cpu.quota, cpu.usable) == (2.0, 2)
    assert "cgroup v1 cpu.cfs_quota_us 200000/100000 = 2 CPUs at /sys/fs/cgroup/cpu,cpuacct/docker/abc" in cpu.source
    memory = memory_budget(root)
    assert (memory.limit_bytes, memory.available_bytes, memory.total_bytes) == (GiB, GiB, MEM_TOTAL)


@pytest.mark.parametrize("limit", [V1_UNLIMITED, str(2**60), str(MEM_TOTAL), str(32 * GiB)])
def test_v1_unlimited(tmp_path: Path, limit: str) -> None:
    files = {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000", "memory/memory.limit_in_bytes": limit}
    root = v1(tmp_path, "/", files, cpu_mount="cpu")
    cpu = cpu_budget(root, affinity=4)
    assert (cpu.quota, cpu.usable) == (None, 4)
    assert "no quota" in cpu.source
    memory = memory_budget(root)
    assert (memory.limit_bytes, memory.available_bytes) == (None, MEM_AVAILABLE)


def test_v1_nested_parent_is_tighter(tmp_path: Path) -> None:
    files = {
        "cpu,cpuacct/kubepods/cpu.cfs_quota_us": "150000",
        "cpu,cpuacct/kubepods/cpu.cfs_period_us": "50000",
        "cpu,cpuacct/kubepods/ctr/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/kubepods/ctr/cpu.cfs_period_us": "100000",
        "memory/kubepods/memory.limit_in_bytes": str(2 * GiB),
        "memory/kubepods/ctr/memory.limit_in_bytes": V1_UNLIMITED,
    }
    root = v1(tmp_path, "/kubepods/ctr", files)
    assert cpu_budget(root, affinity=64).quota == 3.0
    assert memory_budget(root).limit_bytes == 2 * GiB


def test_v1_path_missing_under_mount_uses_mount_root(tmp_path: Path) -> None:
    files = {
        "cpu,cpuacct/cpu.cfs_quota_us": "100000",
        "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "memory/memory.limit_in_bytes": str(GiB),
    }
    root = v1(tmp_path, "/docker/abc", files)
    cpu = cpu_budget(root, affinity=8)
    assert (cpu.quota, cpu.usable) == (1.0, 1)
    assert "at /sys/fs/cgroup/cpu,cpuacct;" in cpu.source
    assert memory_budget(root).limit_bytes == GiB


def test_v1_mountinfo_root_is_stripped(tmp_path: Path) -> None:
    # The mount shows /docker/abc of the host hierarchy; a child cgroup made inside it is "sub".
    files = {
        "cpu,cpuacct/cpu.cfs_quota_us": "400000",
        "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/sub/cpu.cfs_quota_us": "100000",
        "cpu,cpuacct/sub/cpu.cfs_period_us": "100000",
    }
    root = v1(tmp_path, "/docker/abc/sub", files)
    mountinfo = "40 31 0:37 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    tree(root, {"proc/self/mountinfo": mountinfo})
    assert cpu_budget(root, affinity=8).quota == 1.0


def test_hybrid_layout_is_v1(tmp_path: Path) -> None:
    # Like this project's VM: v2 mounted at /sys/fs/cgroup/unified and a "0::/" line, controllers on v1.
    files = {"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000", "unified/cgroup.controllers": ""}
    root = v1(tmp_path, "/", files, cpu_mount="cpu")
    tree(root, {"proc/self/cgroup": "1:cpu:/\n0::/\n"})
    cpu = cpu_budget(root, affinity=2)
    assert (cpu.quota, cpu.usable) == (1.0, 1)
    assert "cgroup v1" in cpu.source


@pytest.mark.parametrize(
    ("version", "quota", "period", "cpus"),
    [("v2", 150000, 100000, 1.5), ("v2", 50000, 100000, 0.5), ("v1", 150000, 100000, 1.5), ("v1", 50000, 100000, 0.5)],
)
def test_fractional_quota_rounds_down_to_at_least_one(
    tmp_path: Path, version: str, quota: int, period: int, cpus: float
) -> None:
    if version == "v2":
        root = v2(tmp_path, "/", {"cpu.max": f"{quota} {period}"})
    else:
        root = v1(
            tmp_path, "/", {"cpu/cpu.cfs_quota_us": str(quota), "cpu/cpu.cfs_period_us": str(period)}, cpu_mount="cpu"
        )
    cpu = cpu_budget(root, affinity=64)
    assert (cpu.quota, cpu.usable) == (cpus, 1)
    assert f"{quota}/{period} = {cpus:g} CPUs" in cpu.source


@pytest.mark.parametrize(
    ("cpu_max", "affinity", "usable"),
    [("max", 64, 5), ("800000 100000", 64, 5), ("200000 100000", 64, 2), ("max", 3, 3)],
)
def test_v2_cpuset_intersects_with_quota_and_affinity(tmp_path: Path, cpu_max: str, affinity: int, usable: int) -> None:
    root = v2(tmp_path, "/app", {"app/cpu.max": cpu_max, "app/cpuset.cpus": "", "app/cpuset.cpus.effective": "0-3,8\n"})
    cpu = cpu_budget(root, affinity=affinity)
    assert (cpu.cpuset, cpu.usable) == (5, usable)
    assert "cpuset.cpus.effective 0-3,8 = 5 CPUs" in cpu.source


def test_v2_cpuset_inherited_from_parent(tmp_path: Path) -> None:
    root = v2(
        tmp_path,
        "/a/b",
        {"cpuset.cpus.effective": "0-7", "a/cpuset.cpus.effective": "2-3", "a/b/cpu.max": "max 100000"},
    )
    assert cpu_budget(root, affinity=64).cpuset == 2


def test_v1_cpuset(tmp_path: Path) -> None:
    root = v1(tmp_path, "/", {"cpuset/cpuset.effective_cpus": "0-3,8", "cpuset/cpuset.cpus": "0-15"})
    cpu = cpu_budget(root, affinity=64)
    assert (cpu.cpuset, cpu.usable) == (5, 5)


def test_missing_files_fall_back_to_affinity(tmp_path: Path) -> None:
    cpu = cpu_budget(tmp_path, affinity=7)
    assert (cpu.quota, cpu.cpuset, cpu.usable) == (None, None, 7)
    assert "no cgroup cpu controller found" in cpu.source
    memory = memory_budget(tmp_path)
    assert memory.limit_bytes is None
    assert memory.total_bytes > 0
    assert "unreadable" in memory.source


def test_garbage_files_do_not_raise(tmp_path: Path) -> None:
    files = {"cpu.max": "garbage", "memory.max": "lots", "cpuset.cpus.effective": "0-x"}
    root = v2(tmp_path, "/", files)
    tree(root, {"proc/meminfo": "nonsense\n"})
    cpu = cpu_budget(root, affinity=3)
    assert (cpu.quota, cpu.cpuset, cpu.usable) == (None, None, 3)
    assert "unreadable" in cpu.source
    assert memory_budget(root).limit_bytes is None


def test_this_machine_gives_sane_answers() -> None:
    cpu, memory = cpu_budget(), memory_budget()
    assert 1 <= cpu.usable <= cpu.affinity
    assert 0 < memory.available_bytes <= max(memory.total_bytes, memory.limit_bytes or 0)


def test_real_v1_cpu_quota_of_one_cpu() -> None:
    settings = {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}
    with real_v1_cgroup("cpu", settings) as cgroup:
        out = run_in_cgroup(cgroup, "from ember.resources import cpu_budget; print(cpu_budget().usable)")
    assert out == "1"


def test_real_v1_memory_limit_of_3_gib() -> None:
    with real_v1_cgroup("memory", {"memory.limit_in_bytes": str(3 * GiB)}) as cgroup:
        out = run_in_cgroup(cgroup, "from ember.resources import memory_budget; print(memory_budget().limit_bytes)")
    assert out == str(3 * GiB)
