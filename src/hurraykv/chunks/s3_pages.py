"""``S3Chunks.get_pages``: a load fetches the bytes of the pages it places, and the
segment's structure, never the whole object once the structure is known.

A mixin of ``S3Chunks`` (``s3.py``): it uses the store's requests (``_call``, ``_ob``,
``_s3``, ``_key``, ``_head``), its threads (``_pool``), ``_lock`` and ``_touch``, and
keeps what it learns itself (``_init_pages`` sets it up).

A load often needs part of a segment: vLLM's own prefix cache holds its first chunks
(the load starts at page ``j``), or the request shares only the first chunks of a longer
stored segment.  So a load reads a segment as a ``file://`` load reads its file
(``Layouts.pages``), over a sparse memory file that holds what was fetched:

* the object's size and ETag: from the HEAD of the lookup that found it in this process
  (remembered, bounded), else one HEAD;
* its structure (every byte but the page pools of the members loaded), in ranged GETs
  where the layout of segments of that size is known (``Layouts``); else the whole
  object, once, which teaches it (a process's first segment of each size);
* the pages, when ``io.scatter`` places them (``PageSource.fill``): the pages asked at a
  load's first layer are fetched for every member at once, since a load places the same
  pages of every layer (one round of requests a load, not one a layer).

The compiled pass hashes every page it places against the digest read with the
structure: a page damaged in the bucket is refused as a damaged file page is, and a
range of the memory file that nothing was fetched into (a hole, read as zeros) is never
placed.  Every ranged GET carries the ETag (``If-Match``), so the bytes of two versions
of an object are never put together: an object stored again under its name between the
lookup and the load is a miss, never damage.  Ranges closer than ``GAP`` are fetched as
one request, and none is longer than ``PIECE``; they run on the store's threads.
``bytes_fetched`` counts every segment byte received (whole GETs too).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import wait
from typing import Any

import numpy as np

from ..errors import HurrayError, TransportError
from ..io import scatter
from ..io.scatter import PageSource
from ..snapshot import KVCacheSnapshot
from ..snapshot_members import member_name
from .file.layouts import FileLayout, Layouts
from .keys import check_name

Fetch = Callable[[np.ndarray, np.ndarray], None]
# (store URL, segment) -> its size and ETag, from a HEAD of any store of this process
_HEADS: dict[tuple[str, str], tuple[int, str | None]] = {}
_HEADS_LOCK = threading.Lock()


class RangedReads:
    """``get_pages`` and ``bytes_fetched`` of ``S3Chunks`` (the module docstring)."""

    # a request waits for its first byte (tens of ms on S3) about as long as a connection
    # takes to receive 1 MiB: a gap under it costs less fetched than asked for apart
    GAP = 1 << 20
    PIECE = 8 << 20  # a request's most bytes: a large range comes in parallel pieces
    HEADS = 4096  # sizes and ETags remembered from lookups
    LAYOUTS = 32  # structures remembered

    # the host's (S3Chunks)
    url: str
    verify_seconds: float
    _lock: threading.Lock
    _pool: Any
    _ob: Any
    _s3: Any
    _call: Callable[..., Any]
    _key: Callable[[str, str], str]
    _head: Callable[[str], Any]
    _touch: Callable[[str], None]
    _deadline: float

    def _init_pages(self) -> None:
        self.bytes_fetched = 0
        self.layouts = Layouts(self.LAYOUTS)

    def _saw(self, name: str, meta: Any) -> None:
        """A HEAD's answer for segment ``name``: its size and ETag, kept for its load by
        any store of this URL in the process (the scheduler's lookups and the worker's
        loads are stores of their own; the newest half kept when full)."""
        global _HEADS
        with _HEADS_LOCK:
            _HEADS[(self.url, name)] = (int(meta["size"]), meta.get("e_tag"))
            if len(_HEADS) > self.HEADS:
                _HEADS = dict(list(_HEADS.items())[self.HEADS // 2:])

    def _received(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_fetched += nbytes

    def _forget(self, name: str) -> None:
        """Segment ``name`` stored again or gone: its size and ETag asked again."""
        with _HEADS_LOCK:
            _HEADS.pop((self.url, name), None)

    def get_pages(self, name: str, members: frozenset[str]
                  ) -> tuple[KVCacheSnapshot, PageSource] | None:
        """Segment ``name`` with the pages of ``members`` left for ``io.scatter`` to
        fetch, verify and place (a ``PageSource`` over a sparse memory file, its ``fill``
        fetching the pages a load adds); everything else fetched and verified now.  None
        where that cannot be (no compiled reader, no checksums, a pool that is not one
        member's pages): the caller reads the segment whole (``get_checked``).  A failed
        request is a ``TransportError``; a segment not stored, or stored again while it
        was read, a ``HurrayError``."""
        check_name(name)
        if not scatter.available():
            return None
        with _HEADS_LOCK:
            head = _HEADS.get((self.url, name))
        if head is None:
            meta = self._head(name)
            if meta is None:
                raise _absent(self.url, name)
            self._saw(name, meta)
            head = (int(meta["size"]), meta.get("e_tag"))
        size, etag = head
        key = self._key("segments", name)
        label = f"{self.url}/{key}"
        fd = memory_file(name)
        try:
            os.ftruncate(fd, size)
            got, known = None, self.layouts.planned(size)
            if known is not None:
                fetched = self._fetch(fd, name, etag, *structure(known, members))
                got = self.layouts.pages(fd, name, label, members, known)
            if got is None:  # a structure not seen yet (or not the one known): all of it
                fetched = self._fetch(fd, name, etag, np.zeros(1, np.int64),
                                      np.array([size], np.int64))
                got = self.layouts.pages(fd, name, label, members)
        except BaseException:
            os.close(fd)
            raise
        if got is None:  # a segment no PageSource holds: get_checked reads it
            os.close(fd)
            return None
        snap, source, seconds = got
        self.verify_seconds += seconds
        fill = PageFill(source.members,
                        lambda offs, lens: self._fetch(fd, name, etag, offs, lens), fetched)
        source.fill = None if fill.have.all() else fill  # all there (small pools, or whole)
        self._touch(name)
        return snap, source

    def _fetch(self, fd: int, name: str, etag: str | None, offsets: np.ndarray,
               lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bytes ``[offsets[i], offsets[i] + lengths[i])`` of segment ``name`` (the
        version ``etag``) written at their offsets into memory file ``fd``, and the
        ranges written (``[starts, ends)``: those, with the gaps under ``GAP`` between
        them).  Waits at most the store's deadline (a page fetch runs outside any guard,
        on a load's thread): past it, a ``TransportError``.  Nothing writes into ``fd``
        once this returned or raised (its caller may close it, and the descriptor's
        number be another file's): a request answering later drops its bytes."""
        from obstore.exceptions import PreconditionError

        key = self._key("segments", name)
        joined = scatter.merged(offsets, offsets + lengths, self.GAP)
        starts, ends = pieces(*joined, self.PIECE)
        options: dict[str, Any] = {} if etag is None else {"if_match": etag}

        def one(start: int, end: int) -> None:
            got = self._call(f"GET {key} bytes {start}-{end - 1}", lambda: self._ob.get(
                self._s3, key, options={**options, "range": (start, end)}).bytes(),
                absent=True, keep=(PreconditionError,))
            if got is None:
                raise _absent(self.url, name)
            data = memoryview(got)
            if len(data) != end - start:
                raise HurrayError(f"segment {name} in {self.url}: bytes {start}-{end - 1} "
                                  f"asked, {len(data)} received", field="segment",
                                  value=name, rule="an object of the size its HEAD gave")
            with writing:
                if not wanted:
                    return
                done = 0
                while done < len(data):
                    done += os.pwrite(fd, data[done:], start + done)
            self._received(len(data))

        writing, wanted = threading.Lock(), [True]
        try:
            futures = [self._pool.submit(one, int(a), int(b))
                       for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        except RuntimeError:  # the store was closed
            raise TransportError(f"{self.url}: closed", field="url", value=self.url,
                                 rule="an open store") from None
        late = wait(futures, timeout=self._deadline).not_done
        if late:
            with writing:
                wanted.clear()
            for future in late:
                future.cancel()
            raise TransportError(f"{self.url}: {len(late)} of {len(futures)} ranged GETs of "
                                 f"segment {name} unanswered within {self._deadline:.1f} s",
                                 field="timeout", value=self._deadline,
                                 rule="a load's fetch within the store's deadline")
        for future in futures:
            error = future.exception()
            if isinstance(error, PreconditionError | HurrayError):
                self._forget(name)  # its size and ETag are asked again next time
            if isinstance(error, PreconditionError):
                raise HurrayError(f"segment {name} in {self.url} was stored again while it "
                                  "was read (its ETag changed): not loaded", field="segment",
                                  value=name, rule="an object unchanged while it is read")
            if error is not None:
                raise error
        return joined


class PageFill:
    """The ``fill`` of a ``PageSource`` over a fetched segment (``members`` as the
    source's): asked for the byte ranges of some pages, it fetches (``fetch``) those
    pages of every member, each page once: a load places the same pages of every
    layer, so its first layer's call fetches the load."""

    def __init__(self, members: dict[str, tuple[int, int, np.ndarray]], fetch: Fetch,
                 fetched: tuple[np.ndarray, np.ndarray]) -> None:
        """``fetched``: the ranges ``[starts, ends)`` in the file already (sorted, apart)."""
        self.starts = np.array([m[0] for m in members.values()], np.int64)
        self.sizes = np.array([m[1] for m in members.values()], np.int64)
        self.counts = np.array([len(m[2]) for m in members.values()], np.int64)
        most = int(self.counts.max()) if len(self.counts) else 0
        self.pages = np.arange(most)[None, :] < self.counts[:, None]  # member x page
        # a page inside a range fetched with the structure (a gap under GAP) is there
        first = self.starts[:, None] + np.arange(most)[None, :] * self.sizes[:, None]
        at = np.searchsorted(fetched[0], first, side="right") - 1
        inside = (at >= 0) & (fetched[1][np.maximum(at, 0)] >= first + self.sizes[:, None])
        self.have = ~self.pages | inside
        self.fetch = fetch
        self._lock = threading.Lock()

    def __call__(self, offsets: np.ndarray, lengths: np.ndarray) -> None:
        asked = self.asked(offsets, offsets + lengths)
        with self._lock:  # a second load of the source waits for the bytes it shares
            need = asked[None, :] & self.pages & ~self.have
            if not need.any():
                return
            self.fetch(*self.ranges(need))
            self.have |= need

    def asked(self, offsets: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The page numbers that the ranges ``[offsets, ends)`` hold of any member."""
        pools = self.starts + self.counts * self.sizes
        lo = np.maximum(offsets[None, :], self.starts[:, None])  # member x range
        hi = np.minimum(ends[None, :], pools[:, None])
        inside = lo < hi
        first = (lo - self.starts[:, None]) // self.sizes[:, None]
        last = -(-(hi - self.starts[:, None]) // self.sizes[:, None])
        edges = np.zeros(self.pages.shape[1] + 1, np.int64)
        np.add.at(edges, first[inside], 1)
        np.add.at(edges, last[inside], -1)
        return np.cumsum(edges)[:-1] > 0

    def ranges(self, need: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges of the runs of pages ``need`` (member x page) marks."""
        padded = np.zeros((need.shape[0], need.shape[1] + 2), np.int8)
        padded[:, 1:-1] = need
        steps = np.diff(padded, axis=1)
        rows, first = np.nonzero(steps == 1)
        _, last = np.nonzero(steps == -1)  # in the same order: each run's end
        return (self.starts[rows] + first * self.sizes[rows],
                (last - first) * self.sizes[rows])


def structure(layout: FileLayout, members: frozenset[str]) -> tuple[np.ndarray, np.ndarray]:
    """The byte ranges of a file of ``layout`` outside the page pools of ``members``."""
    pools = sorted((off, n) for off, n, source in layout.regions
                   if isinstance(source, tuple) and len(source) == 2
                   and member_name(*source) in members)
    edges = np.array([0] + [x for off, n in pools for x in (off, off + n)] + [layout.size],
                     np.int64).reshape(-1, 2)
    edges = edges[edges[:, 1] > edges[:, 0]]
    return edges[:, 0], edges[:, 1] - edges[:, 0]


def pieces(starts: np.ndarray, ends: np.ndarray, piece: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """Each range ``[starts, ends)`` cut into parts of at most ``piece`` bytes."""
    parts = -(-(ends - starts) // piece)
    first = np.repeat(starts, parts) + piece * (np.arange(int(parts.sum())) - np.repeat(
        np.cumsum(parts) - parts, parts))
    return first, np.minimum(first + piece, np.repeat(ends, parts))


def memory_file(name: str) -> int:
    """A file in memory, gone with its last descriptor (``memfd``, else an unlinked
    temporary file)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(f"hurraykv:{name}", os.MFD_CLOEXEC)
    import tempfile

    with tempfile.TemporaryFile() as f:  # unlinked already: gone with its last descriptor
        return os.dup(f.fileno())


def _absent(url: str, name: str) -> HurrayError:
    return HurrayError(f"segment {name} is not in {url}", field="segment", value=name,
                       rule="a stored segment")


__all__ = ["PageFill", "RangedReads", "memory_file", "pieces", "structure"]
