"""Memory of a server and all its processes (vLLM runs an API server, an engine core and workers).

The peak is sampled: the largest sum of the tree's resident set sizes seen every `interval` seconds.
For a single process this matches the kernel's own high-water mark (VmHWM) to within a sample.
"""

from __future__ import annotations

import threading
from pathlib import Path

__all__ = ["PeakRss", "peak_rss", "tree_pids", "tree_rss"]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return kids


def tree_pids(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(root: int) -> int:
    return sum(_rss(pid) for pid in tree_pids(root))


class PeakRss:
    """Samples tree_rss(root) on a thread until stopped: `with PeakRss(pid) as peak: ...; peak.bytes`."""

    def __init__(self, root: int, interval: float = 0.25) -> None:
        self.root, self.interval, self.bytes = root, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.bytes = max(self.bytes, tree_rss(self.root))
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, tree_rss(self.root))


def peak_rss(pid: int) -> int:
    """The kernel's high-water mark of one process (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0
