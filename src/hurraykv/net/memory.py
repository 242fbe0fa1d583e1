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

import numpy as np

CLASS = 2 << 20  # size classes: multiples of 2 MiB (one huge page)
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; the mmap module has no name for it yet


class ReceivePool:
    def __init__(self, max_idle_bytes: int = 1 << 30) -> None:
        self.max_idle_bytes = max_idle_bytes
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
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(OSError, AttributeError):
                mm.madvise(mmap.MADV_HUGEPAGE)
        arr = np.frombuffer(mm, np.uint8, count=n)
        weakref.finalize(arr, self._give, mm, size)
        return arr, mm, recycled

    def _give(self, mm: mmap.mmap, size: int) -> None:
        with self._lock:
            if self.idle_bytes + size <= self.max_idle_bytes:
                self._free.setdefault(size, []).append(mm)
                self.idle_bytes += size
                return
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
