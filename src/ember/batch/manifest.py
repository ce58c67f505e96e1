"""An indexing job's record on disk: `_manifest.jsonl` (what was written) and the lock that keeps a second job out.

Each line records one written file: its part, the offset of its first row in the part, how many input rows it
covers, a hash of those rows' text and id as read, and the job's signature. Lines are appended and synced one at a
time, so a kill leaves at most a cut last line, which is dropped when the manifest is read again. The lock is an
advisory `flock` on `.ember-embed.lock` in the output directory, released by the kernel when the process dies.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.errors import ConfigError

__all__ = ["MANIFEST", "Manifest", "Segment", "lock_output"]

MANIFEST = "_manifest.jsonl"
_LOCK = ".ember-embed.lock"

log = logging.getLogger("ember.embed")


@dataclass(frozen=True)
class Segment:
    """Rows [offset, offset + rows) of a part, written to one file."""

    offset: int
    rows: int
    digest: str | None
    """The rows' content hash as read when written (None in manifests written before hashes were kept)."""


@dataclass
class Manifest:
    """The segments written so far, by part, for a job of one signature."""

    path: Path
    signature: str
    parts: dict[int, list[Segment]] = field(default_factory=dict)
    assembled: bool = False

    @classmethod
    def read(cls, out: Path, signature: str) -> Manifest:
        """The manifest in `out` (empty if none); refused when another job's signature is in it."""
        manifest = cls(out / MANIFEST, signature)
        if not manifest.path.exists():
            return manifest
        raw = manifest.path.read_bytes()
        lines = raw.split(b"\n")
        if lines and lines[-1]:  # a cut last line: the write it began never finished
            log.warning("%s: dropping a cut last line (a run was killed while writing it)", manifest.path)
            with manifest.path.open("r+b") as f:
                f.truncate(len(raw) - len(lines[-1]))
        for number, line in enumerate(lines[:-1], 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                raise ConfigError(
                    f"{manifest.path} line {number} is not JSON: pass --overwrite to start over"
                ) from None
            manifest._add(entry)
        return manifest

    def _add(self, entry: dict[str, Any]) -> None:
        if entry.get("signature") != self.signature:
            raise ConfigError(
                f"{self.path.parent} holds the output of a different job (other inputs, columns or model options): "
                "pass --overwrite to start over, or choose another output directory"
            )
        if entry.get("assembled"):
            self.assembled = True
        elif "part" in entry:
            segment = Segment(int(entry.get("offset", 0)), int(entry["rows"]), entry.get("digest"))
            self.parts.setdefault(int(entry["part"]), []).append(segment)

    def covered(self, part: int) -> int:
        """Rows of `part` written so far (its segments are contiguous from its first row)."""
        return sum(s.rows for s in self.parts.get(part, []))

    def record(self, entry: dict[str, Any]) -> None:
        """Append one line, synced before returning: whole, or (after a kill) a cut line dropped on the next read."""
        entry = {**entry, "signature": self.signature}
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._add(entry)


def lock_output(out: Path) -> Any:
    """Hold the output directory for this job (an open file: closing it, or the process ending, releases it)."""
    handle = (out / _LOCK).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"{out} is being written by another ember embed ({holder}): wait for it, or choose another output directory"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    return handle
