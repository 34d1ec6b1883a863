"""The chaos run's small disk: with `--storage dir`, the job storage is a tmpfs of its own that
the harness mounts (as root), so that the disk-full fault can fill it for a while, the way a
full volume under a worker's output stops every write with ENOSPC, and free it again.

A tmpfs, not a loop-mounted image: no mkfs, nothing left on the machine's disk, and it holds
only what is written (its size is a ceiling, not memory taken). Mounting needs root (or
CAP_SYS_ADMIN); where the harness cannot mount, disk-full is not offered (`can_mount`).
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CHUNK = 1 << 20


@functools.cache
def can_mount() -> bool:
    """Whether this process can mount a tmpfs (tried once, on a scratch directory)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    with tempfile.TemporaryDirectory(prefix="batchllm-chaos-mount-") as scratch:
        tried = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", scratch], capture_output=True
        )
        if tried.returncode != 0:
            return False
        subprocess.run(["umount", scratch], capture_output=True, check=False)
    return True


class SmallDisk:
    """A tmpfs of `size_mb` at `path`: mount, fill (to ENOSPC), free, unmount."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path, self.size_mb = path, size_mb
        self.ballast = path / ".chaos-ballast"
        self.mounted = False

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.path)],
            check=True,
            capture_output=True,
        )
        self.mounted = True

    def fill(self) -> int:
        """Writes a ballast file until the disk is full; returns the bytes it took."""
        written = 0
        block = b"\0" * CHUNK
        with self.ballast.open("wb", buffering=0) as ballast:
            while True:
                try:
                    written += ballast.write(block) or 0
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        # A last partial block: what is left below a chunk.
        with self.ballast.open("ab", buffering=0) as ballast:
            for size in (CHUNK // 16, 4096, 512, 1):
                while True:
                    try:
                        written += ballast.write(b"\0" * size) or 0
                    except OSError:
                        break
        return written

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path).free

    def unmount(self) -> None:
        if self.mounted:
            # Lazy: a worker's open file must not keep the run from ending.
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
            self.mounted = False
