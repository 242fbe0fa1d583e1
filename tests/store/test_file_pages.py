"""``FileChunks.get_pages`` and ``io.scatter``: a segment's structure read and verified
with small reads, its pages read from the file into their destination and verified
there (issue 47 item 1), on real files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hurraykv.chunks.file.store import FileChunks
from hurraykv.io import checksums, page_hash, scatter
from hurraykv.snapshot_members import member_name
from tests.store.test_file_capacity import keys, later, put, segment

pytestmark = pytest.mark.skipif(not scatter.available(), reason="no compiled reader")
MEMBERS = frozenset(member_name(0, r) for r in ("key", "value"))


def place(store: FileChunks, name: str, blocks: list[int], got=None
          ) -> tuple[np.ndarray, dict]:
    """Every page of layer 0 into ``blocks`` of a plain ``[blocks, page]`` buffer per
    role (a destination whose pages are contiguous): the buffers and what failed."""
    snap, source = got or store.get_pages(name, MEMBERS)
    page = snap.tensor(0, "key").page_pool[0]
    memory = np.full(2 * 16 * page.nbytes, 0xAB, np.uint8)
    out = scatter.Scatter()
    rows, heads, dims = page.shape
    elem = page.itemsize
    for r, role in enumerate(("key", "value")):
        dest = scatter.destination(memory, r * 16 * page.nbytes, page.nbytes,
                                   (rows, heads, dims * elem, elem, heads * dims * elem,
                                    dims * elem, elem), 16)
        out.add(source, member_name(0, role), 0, blocks, dest, role)
    failed = out.run()
    source.close()
    return memory.reshape(2, 16, page.nbytes), failed


def test_pages_land_in_their_blocks_verified_and_the_rest_is_read_whole(tmp_path):
    store = FileChunks(tmp_path / "kv")
    name = put(store, 1)
    blocks = [9, 2, 5, 11, 0, 3, 7, 14]  # any order
    memory, failed = place(store, name, blocks)
    assert failed == {}
    want = segment(1)
    for r, role in enumerate(("key", "value")):
        pool = want.tensor(0, role).page_pool
        for page, block in enumerate(blocks):
            assert memory[r, block].tobytes() == pool[page].tobytes()
    untouched = sorted(set(range(16)) - set(blocks))
    assert (memory[:, untouched] == 0xAB).all()  # nothing written where it was not asked
    # the snapshot's other buffers were read and verified: its block table is the stored
    snap, source = store.get_pages(name, MEMBERS)
    assert np.array_equal(snap.tensor(0, "key").block_table, want.tensor(0, "key").block_table)
    source.close()


def test_a_damaged_or_missing_page_is_not_placed_and_names_its_member_and_page(tmp_path):
    store = FileChunks(tmp_path / "kv")
    name = put(store, 2)
    path = store.path(name)
    data = bytearray(path.read_bytes())
    value_page = segment(2).tensor(0, "value").page_pool[5].tobytes()
    at = bytes(data).find(value_page)
    data[at + 3] ^= 0x01
    path.write_bytes(bytes(data))
    memory, failed = place(store, name, list(range(8)))
    assert failed == {"value": ("layers.0.value", 5)}
    assert (memory[1, 5] == 0xAB).all()  # the damaged page never reached its block
    assert memory[1, 4].tobytes() == segment(2).tensor(0, "value").page_pool[4].tobytes()
    # a file cut inside its pools after its structure was read: the pages past the cut
    # are not placed (a short read, never a crash or a hang)
    path.write_bytes(bytes(data[:at]) + value_page[:3] + bytes([value_page[3]]) +
                     bytes(data[at + 4:]))  # the page mended
    got = store.get_pages(name, MEMBERS)
    offset = got[1].members["layers.0.key"][0]
    os.truncate(path, offset + 3 * got[0].tensor(0, "key").page_pool[0].nbytes + 5)
    memory, failed = place(store, name, list(range(8)), got)
    assert failed == {"key": ("layers.0.key", 3), "value": ("layers.0.value", 0)}
    assert memory[0, 2].tobytes() == segment(2).tensor(0, "key").page_pool[2].tobytes()
    assert (memory[0, 3:] == 0xAB).all() and (memory[1] == 0xAB).all()


def test_a_damaged_block_table_is_refused_before_any_page_is_read(tmp_path):
    store = FileChunks(tmp_path / "kv")
    name = put(store, 3)
    path = store.path(name)
    data = bytearray(path.read_bytes())
    table = segment(3).tensor(0, "key").block_table.astype("<i4").tobytes()
    at = bytes(data).find(table)
    assert at > 0
    data[at] ^= 0x02
    path.write_bytes(bytes(data))
    with pytest.raises(checksums.ChecksumError, match="does not match its checksum"):
        store.get_pages(name, MEMBERS)


def test_a_one_pass_load_is_a_use_for_eviction(tmp_path):
    store = FileChunks(tmp_path / "kv")
    old, new = put(store, 4), None
    later(tmp_path / "kv")
    new = put(store, 5)
    assert os.stat(store.path(old)).st_mtime_ns < os.stat(store.path(new)).st_mtime_ns
    later(tmp_path / "kv")
    _, source = store.get_pages(store.locate(keys(4))[0], MEMBERS)
    source.close()
    assert os.stat(store.path(old)).st_mtime_ns > os.stat(store.path(new)).st_mtime_ns


@pytest.mark.parametrize("first", [0, 2])  # whole cache lines (streamed), or not
@pytest.mark.parametrize("compiled_for", ["geometry", "any"])
def test_a_transposed_destination_gets_each_page_transposed(tmp_path, first, compiled_for,
                                                            monkeypatch):
    """CPU_ATTN's keys: each (block, head) holds ``[dims, rows]``; the pages of the
    file ``[rows, heads, dims]`` are transposed on the way, by the transpose compiled for
    their geometry or by the one that takes any."""
    if compiled_for == "any":
        monkeypatch.setattr(scatter, "_fast16", lambda geoms: page_hash.transposer(0, 0, 0))
    store = FileChunks(tmp_path / "kv")
    name = put(store, 6)
    snap, source = store.get_pages(name, MEMBERS)
    rows, heads, dims = snap.tensor(0, "key").page_pool[0].shape
    elem, blocks = 2, 8
    memory = np.zeros(first + blocks * heads * dims * rows * elem + 8, np.uint8)
    dest = scatter.destination(memory, first, heads * dims * rows * elem,
                               (rows, heads, dims * elem, elem, elem, dims * rows * elem,
                                rows * elem), blocks)
    out = scatter.Scatter()
    out.add(source, member_name(0, "key"), 0, list(range(blocks))[::-1], dest, "key")
    assert out.run() == {}
    source.close()
    got = memory[first:first + blocks * heads * dims * rows * elem].view(np.float16)
    got = got.reshape(blocks, heads, dims, rows)[::-1]
    assert np.array_equal(got, segment(6).tensor(0, "key").page_pool.transpose(0, 2, 3, 1))


def test_the_layouts_of_stored_segments_are_learned_at_start(tmp_path, monkeypatch):
    """A process's first load of a segment structure reads at the speed of the rest:
    ``learn_layouts`` (called when the connector registers the engine's caches) parses
    the newest segment of each size once, so the first ``get_pages`` of a segment of
    that size reads its structure with small reads and no parse."""
    writer = FileChunks(tmp_path / "kv")
    put(writer, 7)
    writer.put(keys(8), 0, segment(8, pages=16), {})  # another size
    reader = FileChunks(tmp_path / "kv")
    assert reader.learn_layouts(MEMBERS) == 2
    assert sorted(reader.layouts.by_size) == sorted(p.stat().st_size
                                             for p in (tmp_path / "kv").glob("*.hrry"))
    assert reader.learn_layouts(MEMBERS) == 0  # known: nothing parsed again
    parsed = []
    original = checksums.ReadPlan.of
    monkeypatch.setattr(checksums.ReadPlan, "of",
                        classmethod(lambda cls, *a: parsed.append(1) or original(*a)))
    _, failed = place(reader, reader.locate(keys(7))[0], list(range(8)))
    assert failed == {} and parsed == []
