"""The buffers a worker decodes stored pages into, and the kernels warmed before serving.

Decoding itself is the tensor's (``BlockPagedTensor.decode_pages``); what the connector
adds is memory kept between loads: a fresh multi-megabyte output costs a page fault per
4 KiB as it is first written, as much as the decoding itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ... import alloc
from ...paged import BlockPagedTensor
from .store_format import StoreFormat


class DecodeBuffers:
    """One buffer per role, kept between layers and loads.  Each is overwritten by the
    next decode, so its pages must be written into the cache before then
    (``LayerView.write`` copies)."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        self._buffers: list[np.ndarray] = []

    def pages(self, role: int, t: BlockPagedTensor, first: int, count: int) -> np.ndarray:
        """Pages ``first .. first + count - 1`` of ``t`` as the cache dtype, in the
        buffer of ``role``."""
        while len(self._buffers) <= role:
            self._buffers.append(np.zeros(0, np.uint8))
        need = count * t.page_size * t.num_heads * t.head_dim * self.dtype.itemsize
        if self._buffers[role].nbytes < need:
            self._buffers[role] = alloc.empty((need,), np.uint8)
            self._buffers[role][::4096] = 0  # faulted in now, not inside a load
        return t.decode_pages(first, count, self.dtype, self._buffers[role])


def warm(formats: Iterable[StoreFormat], dtype: Any) -> None:
    """Compile (or load from numba's cache) the kernels that save and load ``formats`` on
    a cache of ``dtype`` (codes writable and read-only), so that no forward pass does."""
    pages = np.linspace(-1, 1, 2 * 4 * 2 * 8, dtype=np.float32).reshape(2, 4, 2, 8)
    for fmt in formats:
        if fmt.auto:
            continue
        t = fmt.encode(pages.astype(dtype), "key", 0)
        rows = t.pool_rows
        frozen = t.derive(np.frombuffer(rows.tobytes(), rows.dtype).reshape(rows.shape))
        for each in (t, frozen):
            each.decode_pages(0, 2, dtype)
