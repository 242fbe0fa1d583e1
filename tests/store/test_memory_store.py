"""``mem://[NAME]`` beyond the contract (``test_chunk_stores.py::TestMemoryStore``): a
bound is required, pools are per URL and per process, a segment is a copy, and what a
pool forgets it forgets whole (aliases included)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hurraykv.chunks.memory import MemoryChunks, copied, hold_as
from hurraykv.chunks.urls import open_store
from hurraykv.errors import ConfigError, HurrayError
from hurraykv.io import checksums, scatter
from hurraykv.testing import keys, segment

_pools = itertools.count()


def pool() -> str:
    return f"mem://unit-{next(_pools)}"


def test_a_pool_without_max_bytes_is_refused_naming_it():
    with pytest.raises(ConfigError, match="max_bytes") as e:
        open_store(pool())
    assert e.value.field == "max_bytes"
    with pytest.raises(HurrayError, match="max_bytes"):
        MemoryChunks("x", max_bytes=0)


@pytest.mark.parametrize(("url", "why"), [
    ("mem://a/b", "path '/b'"),
    ("mem://a b", "pool name 'a b'"),
    ("mem://u@a", "userinfo"),
    ("mem://a?max_bytes=1", "setting of its own"),
])
def test_a_url_that_is_not_a_pool_is_refused(url, why):
    with pytest.raises(HurrayError, match=why):
        open_store(url, max_bytes=1 << 20)


def test_stores_on_one_url_share_a_pool_and_other_names_do_not():
    url = pool()
    a, b = open_store(url, max_bytes=1 << 24), open_store(url, max_bytes=1 << 24)
    other = open_store(url + "x", max_bytes=1 << 24)
    k, snap = keys(2), segment(2, 1)
    a.put(k, 0, snap, {})
    assert b.get_verified(b.locate(k)[0]).equal(snap)
    assert other.locate(k) == [None, None]


def test_a_segment_is_a_copy_of_what_was_put():
    store = open_store(pool(), max_bytes=1 << 24)
    k, snap = keys(2), segment(2, 2)
    pool_bytes = np.frombuffer(memoryview(snap.tensor(0, "key").page_pool).cast("B"), np.uint8)
    before = pool_bytes.copy()
    store.put(k, 0, snap, {})
    pool_bytes ^= 0xFF  # the saver reuses its copy-out buffer for the next request
    back = store.get_verified(store.locate(k)[0])
    got = np.frombuffer(memoryview(back.tensor(0, "key").page_pool).cast("B"), np.uint8)
    assert np.array_equal(got, before)


def test_eviction_forgets_the_segments_aliases_and_counts_its_bytes():
    size = copied(segment(4, 0).with_info(metadata={}))[1]
    store = MemoryChunks(f"unit-{next(_pools)}", max_bytes=3 * size)
    stored = [keys(1) for _ in range(5)]
    for i, k in enumerate(stored):
        store.put(k, 0, segment(4, i), {})
    assert [store.locate(k)[0] is not None for k in stored] == [False, False, True, True,
                                                                  True]
    assert store.evictions == 2 and store.evicted_bytes == 2 * size
    assert sum(s.nbytes for s in store.catalog()) == 3 * size
    assert len(store._pool.aliases) == 3  # the evicted segments' keys went with them


def test_a_load_is_a_use():
    size = copied(segment(4, 0).with_info(metadata={}))[1]
    store = MemoryChunks(f"unit-{next(_pools)}", max_bytes=2 * size)
    first, second, third = keys(1), keys(1), keys(1)
    store.put(first, 0, segment(4, 1), {})
    store.put(second, 0, segment(4, 2), {})
    store.get(store.locate(first)[0])  # first is now the younger
    store.put(third, 0, segment(4, 3), {})
    assert store.locate(second) == [None] and store.locate(first)[0] is not None


def test_a_segment_larger_than_the_pool_is_refused_and_nothing_is_lost():
    size = copied(segment(4, 0).with_info(metadata={}))[1]
    store = MemoryChunks(f"unit-{next(_pools)}", max_bytes=size + size // 2)
    k = keys(1)
    store.put(k, 0, segment(4, 1), {})
    with pytest.raises(HurrayError, match="larger than max_bytes") as e:
        store.put(keys(2), 0, segment(8, 2), {})
    assert e.value.field == "max_bytes"
    assert store.get_verified(store.locate(k)[0]).equal(segment(4, 1))


def test_hurraykv_cache_says_it_cannot_reach_a_pool_of_another_process():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "hurraykv", "cache", "ls", "mem://x",
                          "-o", "max_bytes=1G"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot reach it" in out.stderr, out.stderr


def test_pages_said_to_be_held_outside_the_allocation_are_refused_naming_them():
    """The compiled reader reads where it is told: a page past the allocation, or one
    not on an 8-byte boundary, is refused before any is read."""
    from hurraykv.errors import LayoutError
    from hurraykv.io.scatter import memory_source

    held = np.zeros(4096, np.uint8)
    assert memory_source("s", held, {"m": (1024, 1024, 3)}).members["m"][:2] == (1024, 1024)
    for bad in [(1024, 1024, 4), (4, 1024, 1), (-8, 8, 1)]:
        with pytest.raises(LayoutError, match=r"m\.pages") as e:
            memory_source("s", held, {"m": bad})
        assert "4096 bytes held" in str(e.value)
    with pytest.raises(LayoutError, match="aligned to 8"):
        memory_source("s", held[1:], {})


def test_a_closed_or_unchecked_memory_source_never_reaches_the_reader(tmp_path):
    """``Scatter.add`` refuses a source whose memory is gone (closed: a load's sources
    are closed when it settles) and pages said to lie past the memory held, whoever built
    the source; a dropped file source closes its descriptor."""
    import os

    from hurraykv.errors import LayoutError
    from hurraykv.io.scatter import PageSource, Scatter, destination, memory_source

    held = np.zeros(4096, np.uint8)
    dest = destination(np.zeros(4096, np.uint8), 0, 1024, (1, 1, 1024, 1, 1024, 1024, 1), 4)
    source = memory_source("s", held, {"m": (0, 1024, 4)})
    Scatter().add(source, "m", 0, [0, 1], dest, "s")  # accepted while open
    source.close()
    with pytest.raises(LayoutError, match="memory that holds its pages"):
        Scatter().add(source, "m", 0, [0, 1], dest, "s")
    forged = PageSource(-1, "s", {"m": (2048, 1024, np.zeros(4, np.uint64))}, held)
    with pytest.raises(LayoutError, match="inside the 4096 bytes held"):
        Scatter().add(forged, "m", 0, [0], dest, "s")
    path = tmp_path / "f"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    dropped = PageSource(fd, "s", {})
    del dropped
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.skipif(not scatter.available(), reason="no compiled reader")
def test_a_pool_holds_keys_as_the_engine_does_and_hands_segments_on_as_they_came():
    """``hold_as`` (CPU_ATTN's keys, each head's ``[dims, rows]``): the key pools are
    held transposed, so a hit places them by copies into a destination of that form, bit
    for bit as the segment's own form is placed by the transpose; everything that hands a
    segment on (``get``, a write-back's eviction) gives it back as it came, checksums
    verified; a destination of another form is refused, and an engine of another layout
    reads such a segment whole."""
    from hurraykv.errors import LayoutError
    from hurraykv.io.scatter import Scatter, destination, memory_source

    url = pool()
    k, snap = keys(2), segment(2, 3)
    pages, rows, heads, dims = snap.tensor(0, "key").page_pool.shape
    form = (rows, heads, dims, 2)
    hold_as(url, {"key": form})
    held_bytes = copied(snap.with_info(metadata={}))[1]
    store = open_store(url, max_bytes=held_bytes * 3 // 2)  # room for one
    evicted = []
    store.watch_evictions(lambda ks, first, s: evicted.append(s()))
    store.put(k, 0, snap, {})
    name = store.locate(k)[0]
    held = store._pool.segments[name].snapshot.tensor(1, "key").page_pool
    want = snap.tensor(1, "key").page_pool
    assert np.array_equal(np.frombuffer(held.tobytes(), np.float16).reshape(
        pages, heads, dims, rows), want.transpose(0, 2, 3, 1))
    assert store.get_verified(name).equal(snap)

    # placed into CPU_ATTN-like blocks (K and V of a head side by side): the held form
    # by copies, the segment's form by the transpose, the same bytes
    size, s_h = rows * heads * dims * 2, 2 * rows * dims * 2
    geometry = (rows, heads, dims * 2, 2, 2, s_h, rows * 2)
    _, source = store.get_pages(name, frozenset({"layers.1.key"}))
    assert source.held_as == {"layers.0.key": form, "layers.1.key": form}
    places = []
    for src in (source, memory_source(name, np.frombuffer(want.tobytes(), np.uint8),
                                      {"layers.1.key": (0, size, pages)})):
        dest = destination(np.zeros(pages * heads * s_h, np.uint8), 0, heads * s_h,
                           geometry, pages)
        scatter = Scatter()
        scatter.add(src, "layers.1.key", 0, list(range(pages))[::-1], dest, "t")
        assert scatter.run() == {}
        places.append(dest.memory)
    assert np.array_equal(*places) and places[0].any()
    rowwise = destination(np.zeros(pages * size, np.uint8), 0, size,
                          (rows, heads, dims * 2, 2, heads * dims * 2, dims * 2, 2), pages)
    with pytest.raises(LayoutError, match=r"layers\.1\.key\.held_as"):
        Scatter().add(source, "layers.1.key", 0, [0], rowwise, "t")
    source.close()

    hold_as(url, {})  # an engine of another layout registered: read whole, right
    assert store.get_pages(name, frozenset({"layers.1.key"})) is None
    assert store.get(name).equal(snap)
    store.put(keys(2), 0, segment(2, 4), {})  # evicts the first: handed on as it came
    assert len(evicted) == 1 and evicted[0].equal(snap)
    checksums.verify(evicted[0], "the evicted segment")  # raises if it is not
