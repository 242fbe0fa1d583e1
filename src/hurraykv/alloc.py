"""Output arrays that fill at memory speed (floor 1).

A fresh multi-megabyte array costs a page fault per 4 KiB as it is first written, which
held whole-batch gathers to a third of memory speed.  Large outputs are anonymous
mappings advised for 2 MiB pages (one fault per 2 MiB where transparent huge pages are
set to ``madvise`` or ``always``); the mapping is unmapped when the array is freed.
Small outputs use NumPy's allocator, which recycles them itself.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import numpy as np

HUGE = 2 << 20
MAPPED_FROM = 4 << 20  # below this NumPy's allocator reuses freed blocks without faults


def empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """``np.empty(shape, dtype)``, from a huge-page-advised mapping when large."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < MAPPED_FROM:
        return np.empty(shape, dt)
    try:
        mm = huge_mapping(nbytes)
    except OSError:  # out of address space or mappings: the allocator says so its own way
        return np.empty(shape, dt)
    return np.frombuffer(mm, dt, count=math.prod(shape)).reshape(shape)


def sparse(nbytes: int) -> np.ndarray:
    """``nbytes`` of uint8 of which only a few pages will be touched (a file's structure
    read at its offsets, its page pools never): small pages, so each touch faults 4 KiB
    and not a zeroed 2 MiB."""
    if nbytes < MAPPED_FROM:
        return np.empty(nbytes, np.uint8)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mm, np.uint8)


def huge_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous mapping of ``nbytes`` rounded up to 2 MiB, advised for 2 MiB pages."""
    mm = mmap.mmap(-1, -(-nbytes // HUGE) * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return mm
