"""A verified pull's checksums, computed while the bytes arrive (floor 5).

Hashing a 64 MiB segment after it has been received is a second pass over memory the
transfer has long pushed out of the cache (5-7 ms on the critical path here, a fifth of
the transfer).  So a verified pull receives each page pool in steps of ``STEP`` bytes and
hashes the pages each step completed right after ``recv_into`` wrote them, while they are
still in the core's L2 (``io.checksums.ReadPlan`` does the same for files).  Only the
small buffers (block tables, ``seq_lens``) are hashed once the snapshot is built; then the
stored digests are compared with these (``checksums.verify``'s ``computed``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import xxhash

from ..io import checksums, page_hash
from ..paged import byte_view
from ..snapshot import KVCacheSnapshot
from ..wire.descriptor import TensorDescriptor
from ..wire.layouts import BlockPaged

# Received and hashed at most this much at a time: the step is still in L2 when hashed
# (``ReadPlan.STEP``'s measurement), and a recv_into per 256 KiB costs microseconds.
STEP = 256 << 10


class PoolHashes:
    """The pages of one member's pool, hashed as the bytes of its data region arrive in
    order (the pool is buffer 0: the region's first bytes)."""

    def __init__(self, pool: memoryview, pages: int, compiled: Any) -> None:
        self.pool, self.pages = pool, pages
        self.step = len(pool) // pages
        self.digests = np.zeros(pages, np.uint64)
        self.received = self.done = 0
        self.seconds = 0.0
        self._compiled = compiled
        if compiled is not None:
            base = np.frombuffer(pool, np.uint8).ctypes.data
            self._addresses = base + self.step * np.arange(pages, dtype=np.uint64)
            self._lengths = np.full(pages, self.step, np.uint64)

    @property
    def address(self) -> int:
        return np.frombuffer(self.pool, np.uint8).ctypes.data

    def advance(self, n: int) -> None:
        """``n`` more bytes of the data region have landed: hash the pages they complete."""
        self.received += n
        ready = min(self.received // self.step, self.pages)
        if ready <= self.done:
            return
        started = time.perf_counter()
        a, b = self.done, ready
        if self._compiled is not None:
            self._compiled(0, self._addresses[a:b], self._lengths[a:b], self.digests[a:b])
        else:
            step, pool, out = self.step, self.pool, self.digests
            for k in range(a, b):
                out[k] = xxhash.xxh3_64_intdigest(pool[k * step:(k + 1) * step])
        self.done = ready
        self.seconds += time.perf_counter() - started


class PullDigests:
    """The pools of one pull, hashed as received; then the check of the whole snapshot."""

    def __init__(self) -> None:
        self.pools: dict[int, PoolHashes] = {}  # by the pool's address
        # the compiled hasher where this process has it (a connector's worker compiles
        # it at start); never compiled here: that costs a second, the pull milliseconds
        self._compiled = page_hash.hasher() if page_hash.built() else None
        self.seconds = 0.0
        self.pages = 0  # pages the check took from digests computed on arrival

    def start(self, desc: TensorDescriptor, region: Any) -> PoolHashes | None:
        """The hasher of a member about to be received (None: not a page pool);
        ``region(n)``: the first ``n`` bytes of where its data region lands."""
        layout = desc.layout
        if not isinstance(layout, BlockPaged) or not layout.num_pages or not desc.buffers \
                or desc.buffers[0].byte_size < layout.num_pages:
            return None  # nothing to hash as it lands (the check hashes what there is)
        hashes = PoolHashes(region(desc.buffers[0].byte_size), layout.num_pages,
                            self._compiled)
        self.pools[hashes.address] = hashes
        return hashes

    def check(self, snapshot: KVCacheSnapshot, what: str) -> None:
        """``checksums.verify`` of ``snapshot`` with the digests computed on arrival; a
        pool that is not the memory received into (none should be) is hashed here."""
        started = time.perf_counter()
        try:
            checksums.verify(snapshot, what, self._computed(snapshot))
        finally:
            self.seconds = sum(h.seconds for h in self.pools.values()) + \
                time.perf_counter() - started

    def _computed(self, snapshot: KVCacheSnapshot) -> np.ndarray:
        parts: list[np.ndarray] = []
        for name, desc, bufs in snapshot.members():
            if name == "info":  # it carries the checksums: not among the pieces
                continue
            for i, buf in enumerate(bufs):
                view = byte_view(buf)
                layout = desc.layout
                pages = layout.num_pages if i == 0 and isinstance(layout, BlockPaged) else 0
                if not pages:
                    parts.append(np.array([xxhash.xxh3_64_intdigest(view)], np.uint64))
                    continue
                got = self.pools.get(np.frombuffer(view, np.uint8).ctypes.data
                                     if len(view) else -1)
                if got is not None and got.done == pages and len(got.pool) == len(view):
                    parts.append(got.digests)
                    self.pages += pages
                else:
                    step = len(view) // pages
                    parts.append(np.array([xxhash.xxh3_64_intdigest(
                        view[k * step:(k + 1) * step]) for k in range(pages)], np.uint64))
        return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


__all__ = ["STEP", "PoolHashes", "PullDigests"]
