"""Stored pages read straight into the memory they are loaded into: one pass a byte.

A load that reads a segment file into a buffer, hashes it there, and then copies (or
transposes) each page into an engine's blocks moves every byte through memory three
times.  Here the pages go from the file to their destination once: a ``PageSource`` (a
segment whose page pools are still in its file: where each member's pages start, their
size and their stored digests) meets a ``Destination`` (a byte array over the memory
the pages go to, and where a page's rows go in it) in ``Scatter``.  Each thread reads a
stage of pages small enough to stay in its core's L2 cache, hashes each page there and
places only the pages that match their digest, all in one compiled call that holds no
GIL (``page_hash.scatter_reader``); so **no byte reaches its destination before it is
verified**, and a page that fails is never written: its run is reported failed.

Compiled only (numba): without it ``available()`` is False and callers read the segment
whole (``checksums.ReadPlan``) as before.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import LayoutError
from ..threads import PARALLEL_BYTES, run_bands, workers
from . import page_hash

STAGE = 256 << 10  # pages read at once by a thread: they are hashed while still in L2
TASK_PAGES = 32  # a task split so that the threads' bands come out even
WIDTHS = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # an element's bytes: its view
_NOTHING = np.zeros(8, np.uint8)  # no pages held in memory: a file's are read


def available() -> bool:
    """Whether the compiled reader exists here (compiled on the first call)."""
    return page_hash.scatter_reader() is not None


def warm(geometries: Iterable[Sequence[int]]) -> None:
    """Compile the reader for destinations of these geometries (a second or two each
    kind, once a process), start the worker threads and touch their stages, so that a
    process's first load runs as fast as the rest."""
    if page_hash.scatter_reader() is None:
        return
    run_bands(lambda a, b: _stage(STAGE), workers(), PARALLEL_BYTES)
    for width, fast in {(int(g[3]), _fast16([g])) for g in geometries}:
        compile_reader(width, fast)


def compile_reader(width: int, fast: Any) -> None:
    """The reader compiled for elements of ``width`` bytes and the key transposer
    ``fast`` (a call with no pages: nothing is read or written)."""
    fn = page_hash.scatter_reader()
    if fn is None:
        return
    stage = np.zeros(64, np.uint8)
    typed = stage.view(WIDTHS[width])
    fn(-1, stage, stage, typed, stage, typed, np.zeros((0, 4), np.int64),
       np.zeros((1, 7), np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint64),
       np.zeros(0, np.uint8), 0, 0, fast, True)


def _fast16(geometries: Iterable[Sequence[int]]) -> Any:
    """The transposer compiled for the first transposed 2-byte geometry (CPU_ATTN's
    keys), else one that declines every page."""
    for rows, heads, row, elem, s_n, _, s_d in geometries:
        if elem == 2 and s_n == elem and s_d == rows * elem:
            return page_hash.transposer(rows, heads, row // 2)
    return page_hash.transposer(0, 0, 0)


@dataclass(eq=False)
class PageSource:
    """A stored segment's page pools still in its file ``fd`` (owned: closed by ``close``
    or when this is dropped): ``members[name]`` = (the file offset of the member's page
    0, the bytes of a page, the stored digest of every page).  Or, with ``fd`` -1, in
    ``memory`` (uint8; the offsets its, every page checked to lie inside it): a segment
    held in this process; ``verify`` false places its pages unhashed (``memory_source``
    says when).  ``fill``, where the file holds only what was fetched of a remote
    segment (``s3://``): ``fill(offsets, lengths)`` writes those byte ranges into ``fd``;
    ``Scatter.run`` calls it before any page is read, with the merged ranges of every
    page added from this source.  A range it leaves unwritten reads as zeros, fails its
    digest and is never placed; an error it raises ends the run before any page is
    read."""

    fd: int
    name: str
    members: dict[str, tuple[int, int, np.ndarray]]
    memory: np.ndarray | None = None
    verify: bool = True
    # members whose pages are held as an engine's blocks hold them (``engine_form``):
    # each head's [dims, rows], copied head by head, never transposed on the way
    held_as: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    fill: Callable[[np.ndarray, np.ndarray], None] | None = None
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self.fd)
            self.memory = None

    def __del__(self) -> None:
        self.close()


def engine_form(geometry: Sequence[int]) -> tuple[int, int, int, int] | None:
    """``(rows, heads, dims, element size)`` where a destination of ``geometry`` holds
    each head of a page transposed, its ``[dims, rows]`` contiguous (CPU_ATTN's keys):
    pages held so are placed by copies (``memory_source``'s ``held_as``); else None."""
    rows, heads, row, elem, s_n, _, s_d = (int(x) for x in geometry)
    if rows > 1 and s_n == elem and s_d == rows * elem:
        return rows, heads, row // elem, elem
    return None


def memory_source(name: str, memory: np.ndarray,
                  members: dict[str, tuple[int, int, int]],
                  held_as: dict[str, tuple[int, int, int, int]] | None = None
                  ) -> PageSource:
    """A ``PageSource`` over pages held in ``memory`` (uint8, contiguous, 8-byte
    aligned): ``members[m]`` = (the offset of member ``m``'s page 0 in it, the bytes of a
    page, its pages), each checked to lie inside it; ``held_as[m]``: member ``m``'s pages
    are held in that ``engine_form``, not the segment's ``[rows, heads, dims]``, and go
    only into a destination of that form.  Its pages are placed without being
    hashed: a segment in this process's memory was hashed when it entered (the saver
    computed its checksums from the engine's blocks; a copy from another tier was read
    verified) and has not left the process since."""
    if memory.dtype != np.uint8 or memory.ndim != 1 or memory.ctypes.data % 8:
        raise LayoutError.at("memory", None, f"{memory.dtype}{list(memory.shape)}",
                             "contiguous uint8 bytes aligned to 8")
    out = {}
    for member, (offset, size, pages) in members.items():
        if offset < 0 or size <= 0 or pages < 0 or offset % 8 or \
                offset + size * pages > len(memory):
            raise LayoutError.at(f"{member}.pages", None, [offset, size, pages],
                                 f"pages aligned to 8 inside the {len(memory)} bytes held")
        out[member] = (offset, size, np.zeros(pages, np.uint64))
    return PageSource(-1, name, out, memory, verify=False, held_as=dict(held_as or {}))


@dataclass(frozen=True, eq=False)
class Destination:
    """Where pages of one geometry go: ``memory``, the bytes of the buffer holding them
    (``typed``: the same bytes as unsigned integers of the element's size); block ``b``'s
    page starts at byte ``first + b * block``; ``geometry``: (rows N, heads H, bytes of a
    row, element size, byte strides of N, of H and of a row's elements), for pages laid
    ``[N, H, row]`` in the file; ``keep``: what owns the memory (kept alive)."""

    memory: np.ndarray
    typed: np.ndarray
    first: int
    block: int
    geometry: tuple[int, int, int, int, int, int, int]
    keep: Any = None

    @property
    def page_bytes(self) -> int:
        rows, heads, row = self.geometry[:3]
        return rows * heads * row


def destination(memory: np.ndarray, first: int, block: int,
                geometry: Sequence[int], blocks: int, keep: Any = None) -> Destination:
    """A ``Destination`` over ``memory`` (uint8, contiguous) holding ``blocks`` blocks,
    checked to stay inside it: the compiled reader writes where it is told."""
    rows, heads, row, elem, s_n, s_h, s_d = (int(x) for x in geometry)
    if elem not in WIDTHS or row % elem or min(rows, heads, row) <= 0:
        raise LayoutError.at("geometry", None, list(geometry),
                             "rows, heads and row bytes > 0 of 1, 2 or 4-byte elements")
    last = first + (blocks - 1) * block + (rows - 1) * s_n + (heads - 1) * s_h + \
        (row // elem - 1) * s_d + elem
    strides = (first, block, s_n, s_h, s_d)
    if first < 0 or min(block, s_n, s_h, s_d) <= 0 or last > len(memory) or (
            s_d != elem and any(x % elem for x in strides)):
        raise LayoutError.at("geometry", None, list(geometry),
                             f"pages of {blocks} blocks from byte {first} inside "
                             f"{len(memory)} bytes, aligned to their elements")
    typed = memory[:len(memory) // elem * elem].view(WIDTHS[elem])
    return Destination(memory, typed, first, block,
                       (rows, heads, row, elem, s_n, s_h, s_d), keep)


class _Group:
    """The tasks of one source file into one destination memory (one compiled call a
    band)."""

    def __init__(self, source: PageSource, dest: Destination) -> None:
        self.owner = source
        self.fd, self.memory, self.typed = source.fd, dest.memory, dest.typed
        self.source, self.verify = source.memory, source.verify
        self.tasks: list[tuple[int, int, int, int]] = []
        self.geoms: list[tuple[int, ...]] = []
        self.dst: list[np.ndarray] = []
        self.digests: list[np.ndarray] = []
        self.tags: list[Hashable] = []  # per task
        self.where: list[tuple[str, int]] = []  # per task: its member and first page
        self.pages = 0

    def add(self, offset: int, size: int, page_dst: np.ndarray, digests: np.ndarray,
            geometry: tuple[int, ...], tag: Hashable, member: str, first_page: int) -> None:
        if geometry not in self.geoms:
            self.geoms.append(geometry)
        g = self.geoms.index(geometry)
        for at in range(0, len(page_dst), TASK_PAGES):
            n = min(TASK_PAGES, len(page_dst) - at)
            self.tasks.append((offset + at * size, self.pages + at, n, g))
            self.tags.append(tag)
            self.where.append((member, first_page + at))
        self.pages += len(page_dst)
        self.dst.append(page_dst)
        self.digests.append(digests)


class Scatter:
    """The pages of one load to read and place, added run by run; ``run`` places those
    that match their digests and says which runs (their ``tag``) had a page that did
    not, or was not in the file."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, int], _Group] = {}
        self.nbytes = 0

    def add(self, source: PageSource, member: str, first_page: int, blocks: Sequence[int],
            dest: Destination, tag: Hashable) -> None:
        """Pages ``first_page ..`` of ``member`` into ``blocks`` of ``dest``."""
        if source._closed or (source.fd < 0) != (source.memory is not None):
            raise LayoutError.at("source", None, source.name,
                                 "an open segment file, or memory that holds its pages")
        offset, size, digests = source.members[member]
        held = source.memory
        if held is not None and (offset < 0 or offset + len(digests) * size > len(held)):
            raise LayoutError.at(f"{member}.pages", None, len(digests),
                                 f"pages inside the {len(held)} bytes held")
        if size != dest.page_bytes:
            raise LayoutError.at(f"{member}.page", None, size,
                                 f"a destination page of {dest.page_bytes} bytes")
        geometry = dest.geometry
        form = source.held_as.get(member)
        if form is not None:  # held as the blocks hold it: a copy of each head's part
            if engine_form(geometry) != form:
                raise LayoutError.at(f"{member}.held_as", None, list(form),
                                     f"the form of the destination, {list(geometry)}")
            rows, heads, dims, elem = form
            geometry = (1, heads, rows * dims * elem, elem, size, geometry[5], elem)
        ids = np.asarray(blocks, np.int64)
        n = len(ids)
        if first_page < 0 or first_page + n > len(digests):
            raise LayoutError.at(f"{member}.pages", first_page, n,
                                 f"pages of the {len(digests)} stored", where="index")
        key = (source.fd if held is None else -held.ctypes.data - 1, source.verify,
               dest.memory.ctypes.data)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(source, dest)
        group.add(offset + first_page * size, size, dest.first + ids * dest.block,
                  digests[first_page:first_page + n], geometry, tag, member, first_page)
        self.nbytes += n * size

    def run(self) -> dict[Hashable, tuple[str, int]]:
        """Read, verify and place every page added (over the cores); the runs (by tag)
        with a page not placed, and the member and page of their first such page."""
        _fill(list(self._groups.values()))
        failed: dict[Hashable, tuple[str, int]] = {}
        for group in self._groups.values():
            for tag, where in _place(group).items():
                failed.setdefault(tag, where)
        return failed


def _fill(groups: list[_Group]) -> None:
    """Each source with a ``fill`` asked once, before any page is read, for the byte
    ranges of every page added from it (its groups of every destination together,
    overlapping and adjacent ranges merged): one round of fetches for the run, however
    many destinations its pages go to."""
    spans: dict[int, tuple[Callable[[np.ndarray, np.ndarray], None], list[np.ndarray]]] = {}
    for group in groups:
        source = group.owner
        if source.fill is None or not group.tasks:
            continue
        if source._closed:  # its descriptor may be another file's by now
            raise LayoutError.at("source", None, source.name, "an open segment file")
        tasks = np.array(group.tasks, np.int64).reshape(-1, 4)
        sizes = np.array([g[0] * g[1] * g[2] for g in group.geoms], np.int64)[tasks[:, 3]]
        spans.setdefault(id(source), (source.fill, []))[1].append(
            np.stack([tasks[:, 0], tasks[:, 0] + tasks[:, 2] * sizes], axis=1))
    for fill, parts in spans.values():
        both = np.concatenate(parts)
        starts, ends = merged(both[:, 0], both[:, 1])
        fill(starts, ends - starts)


def merged(starts: np.ndarray, ends: np.ndarray, gap: int = 0
           ) -> tuple[np.ndarray, np.ndarray]:
    """The byte ranges ``[starts, ends)`` sorted and merged: a range that begins at most
    ``gap`` bytes past the end of every one before it joins them."""
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    first = np.concatenate([[True], starts[1:] > reach[:-1] + gap])
    last = np.concatenate([np.flatnonzero(first)[1:] - 1, [len(starts) - 1]])
    return starts[first], reach[last]


def _place(group: _Group) -> dict[Hashable, tuple[str, int]]:
    fn = page_hash.scatter_reader()
    tasks = np.array(group.tasks, np.int64).reshape(-1, 4)
    geoms = np.array(group.geoms, np.int64).reshape(-1, 7)
    page_dst, digests = np.concatenate(group.dst), np.concatenate(group.digests)
    ok = np.zeros(len(page_dst), np.uint8)
    page = int(max(g[0] * g[1] * g[2] for g in group.geoms))
    fast = _fast16(group.geoms)

    held = _NOTHING if group.source is None else group.source

    def band(a: int, b: int) -> None:
        stage = _stage(page)
        fn(group.fd, held, stage, stage.view(group.typed.dtype), group.memory, group.typed,
           tasks, geoms, page_dst, digests, ok, a, b, fast, group.verify)

    run_bands(band, len(tasks), len(page_dst) * page)
    failed: dict[Hashable, tuple[str, int]] = {}
    if ok.all():
        return failed
    bad = np.flatnonzero(ok == 0)
    for page, t in zip(bad.tolist(), (np.searchsorted(tasks[:, 1], bad, side="right") - 1
                                      ).tolist(), strict=True):
        member, first = group.where[t]
        failed.setdefault(group.tags[t], (member, first + page - int(tasks[t, 1])))
    return failed


_local = threading.local()


def _stage(page: int) -> np.ndarray:
    """This thread's stage: at least one page, else ``STAGE`` bytes (touched: reused by
    every load on the thread)."""
    need = max(STAGE, page)
    stage = getattr(_local, "stage", None)
    if stage is None or len(stage) < need:
        stage = _local.stage = np.ones(-(-need // 8) * 8, np.uint8)
    return stage


__all__ = ["Destination", "PageSource", "Scatter", "available", "compile_reader",
           "destination", "memory_source", "warm"]
