"""The digests of a snapshot's checksum entry (``checksums.py`` says what the entry is and
verifies it): every piece in checksum order (each page of every block-paged member's
pool, every other buffer of every member but ``info``), its xxh3-64 digest computed by
the compiled hasher (``page_hash``) in bands over the cores or, for a process that
hashes little, by xxhash piece by piece; and ``PoolDigests``, the entry of snapshots made
from one template's structure and new pools, in one compiled call.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from ..errors import HurrayError
from ..paged import byte_view
from ..snapshot import KVCacheSnapshot
from ..snapshot_members import member_name
from ..threads import run_bands
from ..wire.layouts import BlockPaged
from . import page_hash

KEY = "checksum.xxh3_64"  # the "hurraykv." prefix is reserved for the KV section's own keys
WIDTH = 16  # hex characters per digest


def piece_views(snapshot: KVCacheSnapshot) -> Iterator[tuple[str, int, int | None, memoryview]]:
    """``(member, buffer, page or None, bytes)`` in checksum order."""
    for name, desc, bufs in snapshot.members():
        if name == "info":
            continue
        for i, buf in enumerate(bufs):
            view = byte_view(buf)
            if i == 0 and isinstance(desc.layout, BlockPaged) and desc.layout.num_pages:
                step = len(view) // desc.layout.num_pages
                for page in range(desc.layout.num_pages):
                    yield name, i, page, view[page * step:(page + 1) * step]
            else:
                yield name, i, None, view


# Compiling the hasher takes 1.4 s in a fresh process here (it cannot be cached: it holds
# library addresses), the time xxhash takes piece by piece over some 16 GiB.  A process
# that hashes one small snapshot (a CLI save, a script) does not pay it; a long-running
# one has compiled it at start (``warm``) and always uses it.
COMPILE_WORTH = 16 << 30


def hasher(nbytes: int) -> Any:
    """The compiled hasher, when it exists or ``nbytes`` are worth compiling it for."""
    return page_hash.hasher() if page_hash.built() or nbytes >= COMPILE_WORTH else None


def hash_all(views: list[memoryview], parallel: bool = True) -> np.ndarray:
    """Every view's digest: compiled and (``parallel``) in bands over the cores when there
    is a compiled hasher (given absolute addresses), else one by one."""
    compiled = hasher(sum(v.nbytes for v in views))
    if compiled is None:
        return np.array([xxhash.xxh3_64_intdigest(v) for v in views], np.uint64)
    keep = [np.frombuffer(v, np.uint8) for v in views]
    addresses = np.array([a.ctypes.data if len(a) else 0 for a in keep], np.uint64)
    lengths = np.array([len(a) for a in keep], np.uint64)
    out = np.zeros(len(views), np.uint64)
    run_bands(lambda a, b: compiled(0, addresses[a:b], lengths[a:b], out[a:b]), len(views),
              int(lengths.sum()) if parallel else 0)
    return out


def _columns(snapshot: KVCacheSnapshot) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Every piece's address and length in checksum order (a pool's pages at one stride:
    computed per buffer, not per page), and the arrays that keep them alive."""
    addresses, lengths, keep = [], [], []
    for name, desc, bufs in snapshot.members():
        if name == "info":
            continue
        for i, buf in enumerate(bufs):
            raw = np.frombuffer(byte_view(buf), np.uint8)
            keep.append(raw)
            base = raw.ctypes.data if len(raw) else 0
            pages = desc.layout.num_pages if i == 0 and isinstance(
                desc.layout, BlockPaged) else 0
            if pages:
                step = len(raw) // pages
                addresses.append(base + step * np.arange(pages, dtype=np.uint64))
                lengths.append(np.full(pages, step, np.uint64))
            else:
                addresses.append(np.array([base], np.uint64))
                lengths.append(np.array([len(raw)], np.uint64))
    if not addresses:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64), keep
    return np.concatenate(addresses), np.concatenate(lengths), keep


def digests(snapshot: KVCacheSnapshot) -> str:
    """The checksum entry's value for ``snapshot``."""
    compiled = hasher(snapshot.nbytes)
    if compiled is None:
        found = hash_all([v for *_, v in piece_views(snapshot)])
    else:
        addresses, lengths, _keep = _columns(snapshot)
        found = np.zeros(len(addresses), np.uint64)
        run_bands(lambda a, b: compiled(0, addresses[a:b], lengths[a:b], found[a:b]),
                  len(found), int(lengths.sum()))
    return found.astype(">u8").tobytes().hex()  # 16 hex digits a piece, in order


def pieces(snapshot: KVCacheSnapshot) -> int:
    """How many digests ``snapshot``'s entry holds (every page of every pool, every other
    buffer), counted without hashing."""
    return len(_columns(snapshot)[0])


def with_checksums(snapshot: KVCacheSnapshot) -> KVCacheSnapshot:
    """``snapshot`` (nothing copied) with its checksum entry."""
    return snapshot.with_info(metadata={KEY: digests(snapshot)})


class PoolDigests:
    """The checksum entry of the snapshots ``template.with_pools`` makes from page pools
    alone (a connector's segments: one structure, new pages each time).  Everything but
    the pools is the template's, so its digests are computed here, once; a snapshot's
    entry then costs one compiled call over its pools' pages (``page_hash``), with no
    walk over its members (that walk, not the hashing, was nine tenths of ``digests``
    for a small segment).  The entry is ``digests``' of the same snapshot."""

    def __init__(self, template: KVCacheSnapshot) -> None:
        names = {member_name(*key): i for i, key in enumerate(template.member_keys())}
        self.sizes = [0] * len(names)  # each pool's bytes, in member order
        fixed: list[int] = []
        pooled: list[int] = []
        pages, offsets, lengths = [], [], []
        k = 0
        for name, desc, bufs in template.members():
            if name == "info":
                continue
            for i, buf in enumerate(bufs):
                count = desc.layout.num_pages if i == 0 and isinstance(
                    desc.layout, BlockPaged) else 0
                if count and name in names:  # a pool: hashed anew for every snapshot
                    size = byte_view(buf).nbytes
                    self.sizes[names[name]] = size
                    step = size // count
                    pages.append(np.full(count, names[name], np.int64))
                    offsets.append(step * np.arange(count, dtype=np.uint64))
                    lengths.append(np.full(count, step, np.uint64))
                    pooled += range(k, k + count)
                    k += count
                else:  # the template's own bytes in every snapshot made from it
                    n = count or 1
                    fixed += range(k, k + n)
                    k += n
        self.count = k
        self._pooled, self._fixed = np.array(pooled, np.int64), np.array(fixed, np.int64)
        self._pool_of = np.concatenate(pages) if pages else np.zeros(0, np.int64)
        self._offsets = np.concatenate(offsets) if offsets else np.zeros(0, np.uint64)
        self._lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.uint64)
        whole = hash_all([v for *_, v in piece_views(template)], parallel=False)
        self._fixed_digests = whole[self._fixed]

    def entry(self, pools: list[np.ndarray]) -> str:
        """The checksum entry of ``template.with_pools`` over ``pools`` (C-contiguous
        arrays, one per block-paged member in ``member_keys`` order)."""
        for i, (pool, size) in enumerate(zip(pools, self.sizes, strict=True)):
            if pool.nbytes != size or not pool.flags.c_contiguous:
                raise HurrayError(f"pool {i} is {pool.nbytes} bytes"
                                  f"{'' if pool.flags.c_contiguous else ', not contiguous'}"
                                  f"; the template's is {size} contiguous bytes",
                                  field="pools", offset=i, value=pool.nbytes,
                                  rule="a pool of the template's structure")
        found = np.zeros(self.count, np.uint64)
        found[self._fixed] = self._fixed_digests
        compiled = hasher(sum(self.sizes))
        if compiled is None:
            found[self._pooled] = [xxhash.xxh3_64_intdigest(
                memoryview(pools[p]).cast("B")[o:o + n]) for p, o, n in zip(
                self._pool_of.tolist(), self._offsets.tolist(), self._lengths.tolist(),
                strict=True)]
        else:
            bases = np.array([p.ctypes.data for p in pools], np.uint64)
            out = np.zeros(len(self._pooled), np.uint64)
            compiled(0, bases[self._pool_of] + self._offsets, self._lengths, out)
            found[self._pooled] = out
        return found.astype(">u8").tobytes().hex()

    def with_checksums(self, snapshot: KVCacheSnapshot, pools: list[np.ndarray]
                       ) -> KVCacheSnapshot:
        """``snapshot`` (``template.with_pools`` over ``pools``) with its entry."""
        return snapshot.with_info(metadata={KEY: self.entry(pools)})


__all__ = ["COMPILE_WORTH", "KEY", "WIDTH", "PoolDigests", "digests", "hash_all", "hasher",
           "piece_views", "pieces", "with_checksums"]
