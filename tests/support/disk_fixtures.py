"""A small file system that fills up for real: a tmpfs mounted for one test (root on
Linux, as CI runs), for full-disk behaviour without a stand-in."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                      capture_output=True).returncode:
        pytest.fail(f"this test mounts a {size} tmpfs (root on Linux, as CI runs)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path, leave: int = 0) -> Path:
    """Take every free byte of ``directory``'s file system but ``leave``, in one file."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                st = os.statvfs(directory)
                free = st.f_bavail * st.f_frsize - leave
                if free <= 0:
                    break
                f.write(b"\0" * min(free, 1 << 20))
                f.flush()
        except OSError:  # full
            pass
    return filler
