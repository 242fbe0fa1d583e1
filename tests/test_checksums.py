"""Checksums of stored values (``io/checksums.py``, H89): every page and every other
buffer, carried as ordinary metadata that other Hurray readers keep, verified on load."""

from __future__ import annotations

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.integrations.chunks import ChunkKeys, identity_digest, open_store
from hurraykv.io import checksums
from tests.snapshots import make_snapshot


def flip(buf, at: int) -> None:
    np.frombuffer(memoryview(buf).cast("B"), np.uint8)[at] ^= 0x10


@pytest.mark.parametrize(("member", "buffer", "at", "page"), [
    ("layers.1.value", 0, 3 * 4 * 2 * 8 * 1 + 5, 3),  # a byte in page 3 of a pool (fp8)
    ("kv_scales", 0, 2, None),                          # a layer's scale
    ("layers.0.key", 1, 0, None),                       # the block table
])
def test_a_flipped_byte_is_named_by_member_buffer_and_page(member, buffer, at, page):
    snap = checksums.with_checksums(make_snapshot("fp8"))
    checksums.verify(snap)
    bufs = {name: b for name, _, b in snap.members()}[member]
    flip(bufs[buffer], at)
    assert checksums.mismatches(snap) == [(member, buffer, page)]
    with pytest.raises(checksums.ChecksumError, match=rf"buffer {buffer} of member {member}"):
        checksums.verify(snap, "segment x")


def test_no_checksums_is_refused_by_verify():
    snap = make_snapshot("float16")
    assert not checksums.has_checksums(snap)
    with pytest.raises(checksums.ChecksumError, match=r"carries no checksum\.xxh3_64"):
        checksums.verify(snap)


def test_files_keep_them_and_the_reference_reads_them(tmp_path):
    import hurray

    snap = checksums.with_checksums(make_snapshot("bfloat16"))
    hk.save_snapshot(snap, tmp_path / "s.hrry")
    back = hk.load_snapshot(tmp_path / "s.hrry")
    checksums.verify(back)
    kv = hurray.load_kv(str(tmp_path / "s.hrry"))  # ordinary metadata to the reference
    assert kv[checksums.KEY] == snap.metadata[checksums.KEY]
    loaded = hurray.load(str(tmp_path / "s.hrry"))["snapshot"]
    assert loaded.member_count == snap.member_count()


def segment(pages: int, seed: int) -> hk.KVCacheSnapshot:
    rng = np.random.default_rng(seed)
    pools = [rng.standard_normal((pages, 4, 2, 8)).astype(np.float16) for _ in range(2)]
    return checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
        pools, [p * 2 for p in pools], np.arange(pages), [0, pages], [pages * 4]))


def test_file_segments_of_one_structure_keep_their_own_checksums(tmp_path):
    # the gathered-write and byte-compare fast paths carry each file's own digits
    store = open_store((tmp_path / "kv").as_uri())
    names = []
    for seed in range(4):
        keys = ChunkKeys(identity_digest(f"c{seed}"), 4).upto(list(range(8)), 2)
        store.put(keys, 0, segment(2, seed), {})
        names.append(store.locate(keys)[0])
    reader = open_store((tmp_path / "kv").as_uri())
    for seed, name in enumerate(names):
        for s in (store, reader):
            got = s.get(name)
            checksums.verify(got)
            assert got.equal(segment(2, seed))
    path = tmp_path / "kv" / f"{names[2]}.hrry"
    data = bytearray(path.read_bytes())
    pool = hk.load_snapshot(path).tensor(1, "value")
    offset = bytes(data).find(pool.page_pool[1].tobytes())
    data[offset + 3] ^= 0x01  # one bit of page 1 of layer 1's values
    path.write_bytes(bytes(data))
    with pytest.raises(checksums.ChecksumError, match=r"page 1 of buffer 0 of member "
                                                      r"layers\.1\.value"):
        checksums.verify(reader.get(names[2]))
    reader.discard(names[2])
    assert reader.locate(ChunkKeys(identity_digest("c2"), 4).upto(list(range(8)), 2)) == [
        None, None]
    assert (tmp_path / "kv" / "quarantine" / f"{names[2]}.hrry").is_file()


def test_validate_reports_which_pages_of_which_layers_are_damaged(tmp_path, capsys):
    from hurraykv.cli import main

    snap = checksums.with_checksums(make_snapshot("float32"))
    hk.save_snapshot(snap, tmp_path / "s.hrry")
    assert main(["validate", str(tmp_path / "s.hrry")]) == 0
    assert "every stored value matches its checksum" in capsys.readouterr().out
    data = bytearray((tmp_path / "s.hrry").read_bytes())
    page = snap.tensor(2, "key").page_pool[4].tobytes()
    data[bytes(data).find(page) + 1] ^= 0x40
    (tmp_path / "s.hrry").write_bytes(bytes(data))
    assert main(["validate", str(tmp_path / "s.hrry")]) == 1
    assert "layers.2.key: page 4" in capsys.readouterr().err
