"""Memory for received tensors: anonymous mappings, populated in bulk, recycled.

A server keeps what it receives, so every PUT needs memory the kernel has never handed
out before - and zeroing fresh pages costs about as much as receiving them.  The pool
hands out anonymous mappings (2 MiB pages advised) and takes each one back once nothing
references the array built on it (the object was replaced, deleted or evicted and its
last reader finished); the next PUT of that size class reuses it without a page fault.
Every byte of a recycled buffer is overwritten by the new tensor before anyone can read
it: data frames must cover the data region exactly (checked before the tensor commits).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from collections.abc import Callable

import numpy as np

from ..alloc import HUGE, huge_mapping

CLASS = HUGE  # size classes: multiples of 2 MiB (one huge page)
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; the mmap module has no name for it yet


class ReceivePool:
    """Idle mappings by size class, at most ``max_idle_bytes`` of them and never more
    than ``room()`` says (the server's memory budget left over)."""

    def __init__(self, max_idle_bytes: int = 1 << 30,
                 room: Callable[[], int | None] | None = None) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.room = room
        self.idle_bytes = 0
        self.recycled = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> tuple[np.ndarray, mmap.mmap, bool]:
        """An ``n``-byte array, its mapping, and whether it is recycled (populated)."""
        size = -(-n // CLASS) * CLASS
        with self._lock:
            free = self._free.get(size)
            mm = free.pop() if free else None
            if mm is not None:
                self.idle_bytes -= size
                self.recycled += 1
        recycled = mm is not None
        if mm is None:
            mm = huge_mapping(size)
        arr = np.frombuffer(mm, np.uint8, count=n)
        weakref.finalize(arr, self._give, mm, size)
        return arr, mm, recycled

    def _give(self, mm: mmap.mmap, size: int) -> None:
        room = self.room() if self.room is not None else None
        with self._lock:
            limit = self.max_idle_bytes if room is None else min(room, self.max_idle_bytes)
            if self.idle_bytes + size <= limit:
                self._free.setdefault(size, []).append(mm)
                self.idle_bytes += size
                return
        _close(mm)

    def trim(self, keep_bytes: int) -> None:
        """Unmap idle buffers until at most ``keep_bytes`` stay idle."""
        dropped = []
        with self._lock:
            for size in sorted(self._free, reverse=True):
                free = self._free[size]
                while free and self.idle_bytes > keep_bytes:
                    dropped.append(free.pop())
                    self.idle_bytes -= size
        for mm in dropped:
            _close(mm)


def _close(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError, ValueError):
        mm.close()


def populate(mm: mmap.mmap, start: int, length: int) -> bool:
    """Fault in ``[start, start + length)`` in one call; False if the kernel cannot."""
    start -= start % mmap.PAGESIZE
    try:
        mm.madvise(MADV_POPULATE_WRITE, start, length)
    except (OSError, ValueError):
        return False
    return True
