"""Hashing many pieces of one buffer without the GIL (for ``checksums.ReadPlan``).

``xxhash.xxh3_64_intdigest`` lets the GIL go while it hashes, and must take it back after:
for pages of 64 KiB (1.5 us of hashing each) two threads hashing at once spend more
time handing the GIL over than hashing (2 threads: 38 GiB/s, as fast as 1), and in an
engine process, with its own busy threads, each take-back can wait far longer.  So a
compiled loop (numba, ``nogil``) calls xxHash's own ``XXH3_64bits`` for every piece of a
sub-range in one call: the function the ``xxhash`` extension exports, the variant that
picks the CPU's widest vectors at run time (AVX-512 here: 43 GiB/s a core from cache,
66 GiB/s on two).  The digests are those of ``xxhash.xxh3_64_intdigest`` (tested).

``reader()`` compiles the whole of a band's work: ``pread`` a sub-range (libc, called
from the compiled loop), hash its pieces while they are in the cache, next sub-range.  No
Python runs per sub-range, so a band costs one call however many sub-ranges it has (a
numba call from Python costs microseconds, which at 256 KiB a sub-range was a third of
the hashing).

Without numba (``HURRAYKV_KERNELS=numpy`` too) or without those symbols, ``hasher()`` and
``reader()`` are None and callers hash piece by piece in Python.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import kernels
from . import stream_stores

_UNSET: Any = object()
_built: Any = _UNSET


def hasher() -> Callable[..., None] | None:
    """``fn(address, offsets, lengths, out)``: ``out[k]`` = XXH3-64 of the ``lengths[k]``
    bytes at ``address + offsets[k]`` (uint64 arrays); compiled on the first call."""
    return _compiled()[0]


def reader() -> Callable[..., float] | None:
    """``fn(fd, address, edges, starts, offsets, lengths, out, got, first, stop)``: for
    each sub-range ``s`` in ``[first, stop)``, read bytes ``edges[s]:edges[s + 1]`` of
    file ``fd`` to ``address + edges[s]`` (``got[s]``: how many came; a short one ends the
    band), then ``out[j]`` = XXH3-64 of piece ``j`` for ``j`` in ``starts[s]:starts[s+1]``
    (``offsets``, ``lengths``: uint64); returns the seconds spent hashing."""
    return _compiled()[1]


def scatter_reader() -> Callable[..., int] | None:
    """``fn(fd, held, stage, stage_t, dst, dst_t, tasks, geoms, page_dst, digests, ok,
    first, stop, fast16, verify)``: for each task ``t`` in ``[first, stop)``
    (``tasks[t]``: file offset, first page, page count, geometry), read its pages from
    file ``fd`` a stage at a time into ``stage`` (a buffer that fits the core's L2), hash
    each page there and compare the digest with ``digests[page]`` (unless ``verify`` is
    false); with ``fd`` -1 the pages are in ``held`` (uint8, the offsets its, checked by
    the caller to lie inside it): read there when copied by rows, else copied into the
    stage first.  A page that matches is placed into ``dst`` at byte
    ``page_dst[page]`` by its geometry (``geoms[g]``: rows N, heads H, row bytes,
    element size, the byte strides in ``dst`` of N, H and of a row's elements; the page
    is ``[N, H, row]`` in the file): one ``memcpy`` a row where its elements are
    adjacent (streaming stores, ``stream_stores``), else transposed (CPU_ATTN's keys:
    through a tile in L1, streamed out per head) or element by element through
    ``stage_t``/``dst_t`` (the same memory as unsigned integers of the element's size), and
    ``ok[page]`` set to 1.  A page that does not match, or is not in the file, is never
    written (``ok`` stays 0).  Returns the bytes read."""
    return _compiled()[2]


def transposer(rows: int, heads: int, dims: int) -> Callable[..., bool] | None:
    """The key transpose of ``scatter_reader`` compiled for pages of ``rows`` x ``heads``
    x ``dims`` 2-byte elements (passed to it as its ``fast16``): known when compiled, the
    geometry lets the compiler keep the 4x4 transposes in vector registers, 5x the
    transpose with the geometry known only at run time here.  It declines (False) pages
    of another geometry; ``transposer(0, 0, 0)`` declines every page.  Each geometry
    compiles the reader once more (a second or two)."""
    made = _compiled()[3]
    if made is None:
        return None
    key = (int(rows), int(heads), int(dims))
    if key not in _transposers:
        _transposers[key] = made(*key)
    return _transposers[key]


_transposers: dict[tuple[int, int, int], Any] = {}


def built() -> bool:
    """Whether the compiled functions exist already in this process (``hasher()`` would
    not compile them)."""
    return _built is not _UNSET


def _compiled() -> tuple[Any, Any, Any, Any]:
    global _built
    if _built is _UNSET:
        _built = _build()
    return _built


def _build() -> tuple[Any, Any]:
    if kernels.impl() is None:
        return None, None, None, None
    try:
        import numba
        import xxhash._xxhash as ext

        xxh3 = ctypes.CDLL(ext.__file__).XXH3_64bits_dispatch
        libc = ctypes.CDLL(None, use_errno=False)
        pread, clock, memcpy = libc.pread, libc.clock_gettime, libc.memcpy
    except (ImportError, OSError, AttributeError):
        return None, None, None, None
    xxh3.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    xxh3.restype = ctypes.c_uint64
    pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
    pread.restype = ctypes.c_ssize_t
    clock.argtypes = [ctypes.c_int, ctypes.c_void_p]
    clock.restype = ctypes.c_int
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    memcpy.restype = ctypes.c_void_p
    monotonic = 1  # CLOCK_MONOTONIC
    streaming = stream_stores.build(memcpy)
    if streaming is None:
        return None, None, None, None
    copy_row, fence = streaming

    # Not cached: the compiled code holds the addresses the libraries were loaded at.
    @numba.njit(nogil=True)
    def hash_pieces(address, offsets, lengths, out):  # pragma: no cover - compiled
        for k in range(len(offsets)):
            out[k] = xxh3(address + offsets[k], lengths[k])

    @numba.njit(nogil=True)
    def read_and_hash(fd, address, edges, starts, offsets, lengths, out, got, first,
                      stop):  # pragma: no cover - compiled
        ts = np.zeros(4, np.int64)
        spent = 0
        for s in range(first, stop):
            pos, end = edges[s], edges[s + 1]
            while pos < end:
                n = pread(fd, address + pos, end - pos, pos)
                if n <= 0:  # the end of a file that shrank, or an error: a short read
                    break
                pos += n
            got[s] = pos - edges[s]
            if pos < end:
                break
            clock(monotonic, ts.ctypes.data)
            for j in range(starts[s], starts[s + 1]):
                out[j] = xxh3(address + offsets[j], lengths[j])
            clock(monotonic, ts[2:].ctypes.data)
            spent += (ts[2] - ts[0]) * 1_000_000_000 + ts[3] - ts[1]
        return spent / 1e9

    @numba.njit(nogil=True)
    def transpose_head(src, tile, at, rows, heads, dims, elem, h):  # pragma: no cover
        # head h of the page at element ``at`` of ``src`` ([rows, heads, dims]) into
        # ``tile`` as [dims, rows]: the 8 // elem rows adjacent in the tile packed into
        # one 8-byte store, each row of the page read contiguously
        span, k, width = heads * dims, 8 // elem, rows * elem // 8
        s16, s32, s48 = np.uint64(16), np.uint64(32), np.uint64(48)
        for n0 in range(0, rows, k):
            r, col = at + n0 * span + h * dims, n0 * elem // 8
            if k == 4:
                for d in range(dims):
                    tile[d * width + col] = (
                        np.uint64(src[r + d]) | np.uint64(src[r + span + d]) << s16 |
                        np.uint64(src[r + 2 * span + d]) << s32 |
                        np.uint64(src[r + 3 * span + d]) << s48)
            elif k == 2:
                for d in range(dims):
                    tile[d * width + col] = (np.uint64(src[r + d]) |
                                             np.uint64(src[r + span + d]) << s32)
            else:
                for d in range(dims):
                    v = np.uint64(0)
                    for j in range(k):
                        v |= np.uint64(src[r + j * span + d]) << np.uint64(8 * elem * j)
                    tile[d * width + col] = v

    @numba.njit(nogil=True)
    def transpose_head16(src64, tile, at, rows, heads, dims, h):  # pragma: no cover
        # transpose_head for 2-byte elements, 4 rows by 4 dims at a time: four 8-byte
        # loads, a 4x4 transpose of 16-bit lanes in registers, four 8-byte stores (1.5x
        # the element-wise packing here); at, heads * dims and dims in 8-byte words
        width, span, words = rows // 4, heads * dims // 4, dims // 4
        lo16, hi16 = np.uint64(0x0000FFFF0000FFFF), np.uint64(0xFFFF0000FFFF0000)
        lo32, hi32 = np.uint64(0x00000000FFFFFFFF), np.uint64(0xFFFFFFFF00000000)
        s16, s32 = np.uint64(16), np.uint64(32)
        for n0 in range(0, rows, 4):
            r, col = at + n0 * span + h * words, n0 // 4
            for q in range(words):
                r0, r1 = src64[r + q], src64[r + span + q]
                r2, r3 = src64[r + 2 * span + q], src64[r + 3 * span + q]
                t0 = (r0 & lo16) | ((r1 & lo16) << s16)
                t1 = ((r0 >> s16) & lo16) | (r1 & hi16)
                t2 = (r2 & lo16) | ((r3 & lo16) << s16)
                t3 = ((r2 >> s16) & lo16) | (r3 & hi16)
                o = 4 * q * width + col
                tile[o] = (t0 & lo32) | (t2 << s32)
                tile[o + width] = (t1 & lo32) | (t3 << s32)
                tile[o + 2 * width] = (t0 >> s32) | (t2 & hi32)
                tile[o + 3 * width] = (t1 >> s32) | (t3 & hi32)

    def make_transposer(ROWS, HEADS, DIMS):
        # the geometry as closure variables: constants to the compiler
        WIDTH, SPAN, WORDS = ROWS // 4, HEADS * DIMS // 4, DIMS // 4

        @numba.njit(nogil=True)
        def fast16(src64, tile, at, rows, heads, dims, h):  # pragma: no cover - compiled
            if rows != ROWS or heads != HEADS or dims != DIMS or ROWS == 0:
                return False
            lo16, hi16 = np.uint64(0x0000FFFF0000FFFF), np.uint64(0xFFFF0000FFFF0000)
            lo32, hi32 = np.uint64(0x00000000FFFFFFFF), np.uint64(0xFFFFFFFF00000000)
            s16, s32 = np.uint64(16), np.uint64(32)
            for n0 in range(0, ROWS, 4):
                r, col = at + n0 * SPAN + h * WORDS, n0 // 4
                for q in range(WORDS):
                    r0, r1 = src64[r + q], src64[r + SPAN + q]
                    r2, r3 = src64[r + 2 * SPAN + q], src64[r + 3 * SPAN + q]
                    t0 = (r0 & lo16) | ((r1 & lo16) << s16)
                    t1 = ((r0 >> s16) & lo16) | (r1 & hi16)
                    t2 = (r2 & lo16) | ((r3 & lo16) << s16)
                    t3 = ((r2 >> s16) & lo16) | (r3 & hi16)
                    o = 4 * q * WIDTH + col
                    tile[o] = (t0 & lo32) | (t2 << s32)
                    tile[o + WIDTH] = (t1 & lo32) | (t3 << s32)
                    tile[o + 2 * WIDTH] = (t0 >> s32) | (t2 & hi32)
                    tile[o + 3 * WIDTH] = (t1 >> s32) | (t3 & hi32)
            return True

        return fast16

    @numba.njit(nogil=True)
    def read_verify_scatter(fd, held, stage, stage_t, dst, dst_t, tasks, geoms, page_dst,
                            digests, ok, first, stop, fast16, verify
                            ):  # pragma: no cover - compiled
        total = 0
        tile = np.empty(0, np.uint64)
        stage64 = stage[:len(stage) // 8 * 8].view(np.uint64)
        stage_at, d_at = stage.ctypes.data, dst.ctypes.data
        for t in range(first, stop):
            off, page, count, g = tasks[t, 0], tasks[t, 1], tasks[t, 2], tasks[t, 3]
            rows, heads, row, elem = geoms[g, 0], geoms[g, 1], geoms[g, 2], geoms[g, 3]
            s_n, s_h, s_d = geoms[g, 4], geoms[g, 5], geoms[g, 6]
            size = rows * heads * row
            per = max(1, len(stage) // size)
            # held in memory, copied by rows: read where held; transposed: through the
            # stage, where a head's strided reads stay in L2
            in_place = fd < 0 and s_d == elem
            done = 0
            while done < count:
                if in_place:
                    k = count - done
                    want = pos = k * size
                    s_at, at = held.ctypes.data, off + done * size
                else:
                    k = min(per, count - done)
                    want, pos, s_at, at = k * size, 0, stage_at, 0
                    if fd < 0:
                        memcpy(s_at, held.ctypes.data + off + done * size, want)
                        pos = want
                    while pos < want:
                        n = pread(fd, s_at + pos, want - pos, off + (done * size) + pos)
                        if n <= 0:
                            break
                        pos += n
                total += pos
                for j in range(k):
                    p = page + done + j
                    src = at + j * size
                    if (j + 1) * size > pos or (verify and xxh3(s_at + src, size)
                                                != digests[p]):
                        continue
                    base = page_dst[p]
                    if s_d == elem and s_h == row and s_n == heads * row:  # the same page
                        copy_row(d_at + base, s_at + src, size)
                    elif s_d == elem and s_h == row:
                        for n in range(rows):
                            copy_row(d_at + base + n * s_n, s_at + src + n * heads * row,
                                     heads * row)
                    elif s_d == elem:
                        for n in range(rows):
                            for h in range(heads):
                                copy_row(d_at + base + n * s_n + h * s_h,
                                         s_at + src + (n * heads + h) * row, row)
                    elif s_n == elem and s_d == rows * elem and rows % (8 // elem) == 0:
                        # transposed (CPU_ATTN keys: each head's [dims, rows] contiguous):
                        # built in a tile that stays in L1, then streamed out whole
                        if len(tile) * 8 < row * rows:
                            tile = np.empty(row * rows // 8, np.uint64)
                        for h in range(heads):
                            if elem == 2 and row % 8 == 0 and rows % 4 == 0:
                                if not fast16(stage64, tile, src // 8, rows, heads,
                                              row // 2, h):
                                    transpose_head16(stage64, tile, src // 8, rows, heads,
                                                     row // 2, h)
                            else:
                                transpose_head(stage_t, tile, src // elem, rows, heads,
                                               row // elem, elem, h)
                            copy_row(d_at + base + h * s_h, tile.ctypes.data, row * rows)
                    else:  # elements apart: transposed, one element at a time
                        dims, step, span = row // elem, s_n // elem, heads * (row // elem)
                        for h in range(heads):
                            for d in range(dims):
                                to = (base + h * s_h + d * s_d) // elem
                                fr = src // elem + h * dims + d
                                for n in range(rows):
                                    dst_t[to + n * step] = stage_t[fr + n * span]
                    ok[p] = 1
                if pos < want:
                    fence()
                    return total
                done += k
        fence()  # the streaming stores seen by every core before the caller goes on
        return total

    return hash_pieces, read_and_hash, read_verify_scatter, make_transposer


__all__ = ["hasher", "reader", "scatter_reader"]
