"""Checksums of stored values (``io/checksums.py``, H89): every page and every other
buffer, carried as ordinary metadata that other Hurray readers keep, verified on load."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import xxhash

import hurraykv as hk
from hurraykv.chunks.keys import ChunkKeys, identity_digest
from hurraykv.chunks.urls import open_store
from hurraykv.io import checksum_digests, checksums
from tests.support.snapshots import make_snapshot


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


def test_save_snapshot_writes_checksums_by_default_and_validate_catches_a_flip(
        tmp_path, capsys):
    """The default a user gets from ``save_snapshot``: a flipped value byte is an error
    of ``validate``, not a silent wrong load; ``checksums=False`` writes none,
    ``"keep"`` a caller's own entry unchanged (the connector's saver hashes segments
    itself)."""
    from hurraykv.cli import main

    snap = make_snapshot("float16")
    assert not checksums.has_checksums(snap)
    hk.save_snapshot(snap, tmp_path / "s.hrry")
    back = hk.load_snapshot(tmp_path / "s.hrry")
    assert checksums.has_checksums(back) and not checksums.mismatches(back)
    data = bytearray((tmp_path / "s.hrry").read_bytes())
    page = snap.tensor(1, "value").page_pool[2].tobytes()
    data[bytes(data).find(page) + 3] ^= 0x01
    (tmp_path / "s.hrry").write_bytes(bytes(data))
    assert main(["validate", str(tmp_path / "s.hrry")]) == 1
    assert "layers.1.value: page 2" in capsys.readouterr().err

    hk.save_snapshot(snap, tmp_path / "plain.hrry", checksums=False)
    assert not checksums.has_checksums(hk.load_snapshot(tmp_path / "plain.hrry"))
    stale = snap.with_info(metadata={checksums.KEY: "0" * len(checksums.digests(snap)),
                                     "engine": "x"})
    hk.save_snapshot(stale, tmp_path / "kept.hrry", checksums="keep")
    assert hk.load_snapshot(tmp_path / "kept.hrry").metadata[checksums.KEY] == \
        stale.metadata[checksums.KEY]
    # False writes none: a stale entry (a loaded file's, its pages since edited) would
    # make validate report damage that is not there
    hk.save_snapshot(stale, tmp_path / "none.hrry", checksums=False)
    assert hk.load_snapshot(tmp_path / "none.hrry").metadata == {"engine": "x"}
    assert checksums.KEY in stale.metadata  # the caller's snapshot is left as it was
    hk.save_snapshot(stale, tmp_path / "fresh.hrry")  # the default hashes what it writes
    checksums.verify(hk.load_snapshot(tmp_path / "fresh.hrry"))
    with pytest.raises(hk.SnapshotError, match=r"checksums is 'yes'; it is \"auto\", True"):
        hk.save_snapshot(snap, tmp_path / "x.hrry", checksums="yes")


def test_checksums_that_do_not_fit_the_info_member_are_left_out_with_a_warning(
        tmp_path, monkeypatch):
    """A whole engine's pool has more pages than the info member's 1 MiB holds digests
    for (a 2 GiB snapshot of 65,600 pages failed to save): ``"auto"`` writes none and
    says so, ``True`` refuses, naming the count."""
    from hurraykv.io import snapshots

    snap = make_snapshot("float16").with_info(metadata={"engine": "x"})
    n = checksums.pieces(snap)
    assert n == len(checksums.digests(snap)) // 16
    monkeypatch.setattr(snapshots, "MAX_BYTES", 16 * n + 60)  # the info, but not the digests
    with pytest.warns(snapshots.ChecksumsNotWritten, match=rf"no checksums written: {n} "
                      r"pages and buffers would take \d+ bytes of metadata, more than"):
        hk.save_snapshot(snap, tmp_path / "big.hrry")
    back = hk.load_snapshot(tmp_path / "big.hrry")
    assert back.metadata == {"engine": "x"} and back.equal(snap)
    with pytest.raises(hk.SnapshotError, match=rf"checksums of {n} pages and buffers take "):
        hk.save_snapshot(snap, tmp_path / "big.hrry", checksums=True)
    monkeypatch.setattr(snapshots, "MAX_BYTES", 16 * n + 200)  # room for them: written
    hk.save_snapshot(snap, tmp_path / "fits.hrry")
    checksums.verify(hk.load_snapshot(tmp_path / "fits.hrry"))


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


def stored_segments(tmp_path, count: int, pages: int) -> tuple[list[str], list]:
    store = open_store((tmp_path / "kv").as_uri())
    names, snaps = [], []
    for seed in range(count):
        keys = ChunkKeys(identity_digest(f"p{seed}"), 4).upto(list(range(8)), 2)
        snaps.append(segment(pages, seed))
        store.put(keys, 0, snaps[-1], {})
        names.append(store.locate(keys)[0])
    return names, snaps


@pytest.fixture
def small_steps(monkeypatch):
    """Sub-ranges of 4 KiB and two bands from 64 KiB on: a small segment is read in many
    sub-ranges on both of them, as a large one is."""
    from hurraykv import threads

    monkeypatch.setattr(checksums.ReadPlan, "STEP", 4096)
    monkeypatch.setattr(threads, "PARALLEL_BYTES", 64 << 10)
    monkeypatch.setenv("HURRAYKV_THREADS", "2")
    monkeypatch.setattr(threads, "_pool", None)


def test_a_known_structure_is_hashed_while_it_is_read(tmp_path, small_steps, monkeypatch):
    names, snaps = stored_segments(tmp_path, 3, 40)  # 40 pages of 128 B a pool: ~25 KiB
    reader = open_store((tmp_path / "kv").as_uri())
    reader.get_verified(names[0])  # learns the structure (parsed, then hashed)
    reads = []
    real = checksums.ReadPlan.read

    def spy(plan, fd, view, skip=frozenset()):
        got = real(plan, fd, view, skip)
        reads.append((plan, got))
        return got

    monkeypatch.setattr(checksums.ReadPlan, "read", spy)
    for name, snap in zip(names, snaps, strict=True):
        got = reader.get_verified(name)
        assert got.equal(snap)
        plan, (nbytes, found, _, skipped) = reads[-1]
        assert len(skipped) == 0
        assert nbytes == plan.size == (tmp_path / "kv" / f"{name}.hrry").stat().st_size
        assert found.tolist() == [int(checksums.digests(snap)[k:k + 16], 16)
                                  for k in range(0, len(checksums.digests(snap)), 16)]
    assert len(reads) == 3
    plan = reads[0][0]
    assert len(plan.edges) > 4  # many sub-ranges, so the bands each read several
    for s in range(len(plan.edges) - 1):  # no piece is cut by a sub-range's end
        for j in range(plan.starts[s], plan.starts[s + 1]):
            assert plan.edges[s] <= plan.offsets[j]
            assert plan.offsets[j] + plan.lengths[j] <= plan.edges[s + 1]
    assert reader.verify_seconds > 0


@pytest.mark.parametrize(("what", "match"), [
    ("pool", r"page 7 of buffer 0 of member layers\.1\.key"),
    ("block_table", r"buffer 1 of member layers\.0\.key"),
    ("digits", r": buffer 0 of member seq_lens does not match its checksum \(1 damaged"),
])
def test_a_flipped_byte_is_found_by_the_one_pass_read(tmp_path, small_steps, what, match):
    names, snaps = stored_segments(tmp_path, 2, 40)
    reader = open_store((tmp_path / "kv").as_uri())
    reader.get_verified(names[0])
    path = tmp_path / "kv" / f"{names[1]}.hrry"
    data = bytearray(path.read_bytes())
    if what == "pool":
        at = bytes(data).find(snaps[1].tensor(1, "key").page_pool[7].tobytes()) + 2
    elif what == "block_table":  # outside the pools: the structure no longer matches
        table = snaps[1].tensor(0, "key").block_table.astype("<i4").tobytes()
        at = bytes(data).find(table) + 4
    else:  # a digit of the first stored digest (seq_lens'), not the values, is damaged
        at = bytes(data).find(checksums.digests(snaps[1]).encode())
    data[at] = (data[at] ^ 0x01) if what != "digits" else ord("01"[data[at] == ord("0")])
    path.write_bytes(bytes(data))
    with pytest.raises(checksums.ChecksumError, match=match):
        reader.get_verified(names[1])


def test_a_file_cut_short_under_the_one_pass_read_is_an_error(tmp_path, small_steps):
    names, _ = stored_segments(tmp_path, 2, 40)
    reader = open_store((tmp_path / "kv").as_uri())
    reader.get_verified(names[0])
    path = tmp_path / "kv" / f"{names[1]}.hrry"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(hk.HurrayError, match=r"shrank|size|truncat|end"):
        reader.get_verified(names[1])


def test_the_compiled_hasher_gives_xxhash_digests_for_every_length_class():
    import xxhash

    from hurraykv.io import page_hash

    compiled = page_hash.hasher()
    if compiled is None:
        pytest.skip("numba is not installed: pieces are hashed by xxhash itself")
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    lengths = np.array([0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025, 4096,
                        *rng.integers(0, 20000, 40)], np.uint64)
    offsets = np.array([rng.integers(0, len(data) - n) for n in lengths], np.uint64)
    out = np.zeros(len(lengths), np.uint64)
    compiled(data.ctypes.data, offsets, lengths, out)
    view = memoryview(data)
    assert out.tolist() == [xxhash.xxh3_64_intdigest(view[int(o):int(o) + int(n)])
                            for o, n in zip(offsets, lengths, strict=True)]


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("what", ["pool", "none"])
def test_the_first_file_of_a_structure_is_hashed_while_it_is_read(
        tmp_path, small_steps, monkeypatch, compiled, what):
    from hurraykv.io import page_hash

    if not compiled:  # hashed piece by piece in Python, as without numba
        monkeypatch.setattr(page_hash, "_built", (None, None))
    names, snaps = stored_segments(tmp_path, 1, 40)
    path = tmp_path / "kv" / f"{names[0]}.hrry"
    if what == "pool":
        data = bytearray(path.read_bytes())
        data[bytes(data).find(snaps[0].tensor(0, "value").page_pool[39].tobytes())] ^= 0x80
        path.write_bytes(bytes(data))
    reads = []
    real = checksums.ReadPlan.read
    monkeypatch.setattr(checksums.ReadPlan, "read",
                        lambda plan, fd, view, skip=frozenset(): reads.append(1)
                        or real(plan, fd, view, skip))
    reader = open_store((tmp_path / "kv").as_uri())  # knows no structure yet
    if what == "pool":
        with pytest.raises(checksums.ChecksumError,
                           match=r"page 39 of buffer 0 of member layers\.0\.value"):
            reader.get_verified(names[0])
    else:
        assert reader.get_verified(names[0]).equal(snaps[0])
    assert reads == [1]  # one pass: the structure came from small reads before it


def test_later_layers_are_left_to_a_pending_check_that_finds_their_damage(tmp_path):
    from hurraykv.integrations.vllm.loads import later_members, layer_members

    names, snaps = stored_segments(tmp_path, 2, 40)
    path = tmp_path / "kv" / f"{names[1]}.hrry"
    data = bytearray(path.read_bytes())
    data[bytes(data).find(snaps[1].tensor(1, "value").page_pool[5].tobytes()) + 1] ^= 0x04
    path.write_bytes(bytes(data))
    reader = open_store((tmp_path / "kv").as_uri())
    later = later_members(2)
    for name in names:  # the read checks layer 0 and the small buffers only
        _, pending = reader.get_checked(name, later)
        assert pending is not None and pending.members == later
    good, pending = reader.get_checked(names[0], later)
    pending.check(layer_members(1))  # a load job's check, just before it writes layer 1
    _, pending = reader.get_checked(names[1], later)
    pending.check(layer_members(0))  # layer 0 was checked by the read: nothing left
    with pytest.raises(checksums.ChecksumError,
                       match=r"page 5 of buffer 0 of member layers\.1\.value"):
        pending.check(layer_members(1))
    assert good.equal(snaps[0])
    with pytest.raises(checksums.ChecksumError):  # a full check finds it at once
        reader.get_verified(names[1])


def test_a_damaged_layer_0_is_found_by_the_read_even_with_later_layers_left(tmp_path):
    from hurraykv.integrations.vllm.loads import later_members

    names, snaps = stored_segments(tmp_path, 2, 40)
    reader = open_store((tmp_path / "kv").as_uri())
    reader.get_checked(names[0], later_members(2))  # the structure is known from here
    path = tmp_path / "kv" / f"{names[1]}.hrry"
    data = bytearray(path.read_bytes())
    data[bytes(data).find(snaps[1].tensor(0, "key").page_pool[2].tobytes())] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(checksums.ChecksumError, match=r"page 2 of buffer 0 of member "
                                                      r"layers\.0\.key"):
        reader.get_checked(names[1], later_members(2))


@pytest.mark.parametrize("dtype", ["fp8", "float16", "bfloat16", "float32"])
@pytest.mark.parametrize("compile_worth", [0, 1 << 62])
def test_the_digests_are_xxh3_of_every_piece_in_order(dtype, compile_worth, monkeypatch):
    """On both paths: the compiled hasher (a process that has it, or bytes worth its
    compile) and xxhash piece by piece (a small save in a fresh process)."""
    import xxhash

    from hurraykv.io import page_hash

    monkeypatch.setattr(checksum_digests, "COMPILE_WORTH", compile_worth)
    monkeypatch.setattr(page_hash, "_built", page_hash._UNSET if compile_worth else
                        page_hash._built)
    snap = make_snapshot(dtype)
    assert checksums.digests(snap) == "".join(
        f"{xxhash.xxh3_64_intdigest(v):016x}" for *_, v in checksum_digests.piece_views(snap))
    assert page_hash.built() == (compile_worth == 0)  # small bytes compile nothing



def test_a_copy_of_the_digests_in_another_entry_decides_nothing_on_either_path(tmp_path):
    # Issue 29 item 5: a reader that had learned the structure took the digests from the
    # first place their text sat, here another entry, and accepted what a fresh one refused
    def plain(seed: int) -> hk.KVCacheSnapshot:
        rng = np.random.default_rng(seed)
        pools = [rng.standard_normal((2, 4, 2, 8)).astype(np.float16) for _ in range(2)]
        return hk.KVCacheSnapshot.from_arrays(pools, [p * 2 for p in pools], np.arange(2),
                                              [0, 2], [8])

    directory = tmp_path / "kv"
    open_store(directory.as_uri())
    good, bad = plain(0), plain(1)
    ours, theirs = checksums.digests(good), checksums.digests(bad)
    good_name, bad_name = "a" * 32 + "-0", "b" * 32 + "-0"
    for name, snap, copy, entry in [(good_name, good, ours, ours),  # a copy of its own
                                    (bad_name, bad, theirs, ours)]:  # copy right, entry not
        # the copy first in the file: the text a search for it finds first
        hk.save_snapshot(snap.with_info(metadata={"note": copy, checksums.KEY: entry}),
                         directory / f"{name}.hrry", fsync=False, checksums="keep")
    fresh = open_store(directory.as_uri())
    with pytest.raises(checksums.ChecksumError, match=r"does not match its checksum"):
        fresh.get_verified(bad_name)
    learned = open_store(directory.as_uri())
    assert learned.get_verified(good_name).equal(good)
    assert learned.layouts.by_size  # the structure is known from here on
    with pytest.raises(checksums.ChecksumError, match=r"does not match its checksum"):
        learned.get_verified(bad_name)
    unverified = open_store(directory.as_uri())  # a plain get, then verify: the same
    unverified.get(good_name)
    got = unverified.get(bad_name)
    assert (got.metadata["note"], got.metadata[checksums.KEY]) == (theirs, ours)
    with pytest.raises(checksums.ChecksumError, match=r"does not match its checksum"):
        checksums.verify(got)
    # a file whose copy is the same as the learnt one's takes the known structure, and
    # still its own entry's digests
    hk.save_snapshot(bad.with_info(metadata={"note": ours, checksums.KEY: theirs}),
                     directory / f"{'c' * 32}-0.hrry", fsync=False, checksums="keep")
    assert learned.get_verified("c" * 32 + "-0").equal(bad)


@pytest.mark.parametrize(("cut", "why"), [
    (16, r"holds {n1} digests \({c1} characters\) for {n} checksummed pieces; the number of "
         r"digests must equal the number of pieces"),
    (3, r"holds {n1} digests and 13 hex digit\(s\) more \({c3} characters\) for {n} "
        r"checksummed pieces"),
])
def test_a_wrong_number_of_digests_is_said_as_such(tmp_path, capsys, cut, why):
    # Issue 29 item 7: the file was refused, as "73 damaged pieces ... seq_lens"
    from hurraykv.cli import main

    snap = checksums.with_checksums(make_snapshot("fp8"))
    text = snap.metadata[checksums.KEY]
    n = len(text) // 16
    why = why.format(n=n, n1=n - 1, c1=len(text) - 16, c3=len(text) - 3)
    short = snap.with_info(metadata={checksums.KEY: text[:-cut]})
    with pytest.raises(checksums.ChecksumError, match=r"segment x: checksum\.xxh3_64 " + why
                       ) as e:
        checksums.verify(short, "segment x")
    assert (e.value.field, e.value.value) == (checksums.KEY, n - 1)
    assert "damaged" not in str(e.value)
    store = open_store((tmp_path / "kv").as_uri())
    hk.save_snapshot(short, tmp_path / "kv" / f"{'d' * 32}-0.hrry", fsync=False,
                     checksums="keep")
    for read in (store.get_verified, lambda name: store.get_checked(name, frozenset(
            {"layers.1.key", "layers.1.value"}))):
        with pytest.raises(checksums.ChecksumError, match=why):
            read("d" * 32 + "-0")
    capsys.readouterr()
    assert main(["validate", str(tmp_path / "kv" / f"{'d' * 32}-0.hrry")]) == 1
    assert re.search(why, capsys.readouterr().err)


def test_a_digest_that_is_not_hex_is_named_by_its_place():
    snap = checksums.with_checksums(make_snapshot("float16"))
    text = snap.metadata[checksums.KEY]
    for bad in (text[:37] + "g" + text[38:], text[:16] + " " * 16 + text[32:]):
        with pytest.raises(checksums.ChecksumError, match=r"checksum\.xxh3_64 at character "
                                                          r"(37 \(digest 2\)|16 \(digest 1\))"):
            checksums.verify(snap.with_info(metadata={checksums.KEY: bad}))


@pytest.mark.parametrize("fused", [False, True])
def test_pool_digests_are_the_entry_of_the_snapshot_over_those_pools(fused):
    """Issue 47 item 5: a connector's segments differ from their template only in their
    pools; ``PoolDigests`` hashes those in one compiled call and takes every other
    piece's digest from the template, and its entry is ``digests``' of the same
    snapshot, page for page (a page changed changes only its own digest)."""
    checksums.warm()  # the compiled hasher, as in an engine
    rng = np.random.default_rng(3)
    shape, dtype = (5, 16, 2, 8), np.float16 if fused else ml_dtypes.float8_e4m3fn
    pools = [rng.standard_normal(shape).astype(dtype) for _ in range(4)]
    keys = pools[:2]
    values = None if fused else pools[2:]
    template = hk.KVCacheSnapshot.from_arrays(
        keys, values, np.array([0, 1, 2, 3, 4, 2]), [0, 3, 6], [40, 48],
        kv_scales=None if fused else np.ones((2, 2), np.float32), model="m").skeleton()
    digester = checksums.PoolDigests(template)
    for _ in range(2):
        new = [rng.standard_normal(shape).astype(dtype) for _ in range(2 if fused else 4)]
        snap = template.with_pools({k: p for k, p in zip(template.member_keys(), new,
                                                         strict=True)})
        assert digester.entry(new) == checksums.digests(snap)
        checksums.verify(digester.with_checksums(snap, new))
    before = digester.entry(new)
    new[-1][4] += 1  # the last pool's last page
    snap = template.with_pools(dict(zip(template.member_keys(), new, strict=True)))
    entry = digester.entry(new)
    assert entry == checksums.digests(snap)
    changed = [i for i in range(0, len(entry), 16) if entry[i:i + 16] != before[i:i + 16]]
    assert len(changed) == 1
    at = changed[0]
    assert int(entry[at:at + 16], 16) == xxhash.xxh3_64_intdigest(new[-1][4].tobytes())
    with pytest.raises(hk.HurrayError, match=r"pool 1 is \d+ bytes; the template's is \d+ con"):
        digester.entry([new[0], new[1][:2], *new[2:]])
