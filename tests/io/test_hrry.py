"""The .hrry container: layout on disk, zero-copy loading, atomicity, hostile files, the
same verdict from both readers, files that are not Hurray."""

from __future__ import annotations

import contextlib
import io
import json
import mmap
import os
import struct
import threading
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hurraykv as hk
from hurraykv.io.crc32c import crc32c
from hurraykv.io.hrry import (
    ENTRY,
    TRAILER,
    HrryFile,
    iter_hrry_sequential,
    read_hrry_sequential,
    write_hrry,
)
from hurraykv.io.snapshots import snapshot_from_file
from tests.support.paths import REFERENCE
from tests.support.snapshots import KINDS, make_fused, make_snapshot


def saved(tmp_path, kind="float16", **kw):
    s = make_snapshot(kind, **kw)
    path = tmp_path / f"{kind}.hrry"
    hk.save_snapshot(s, path)
    return s, path


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(tmp_path, kind):
    s, path = saved(tmp_path, kind)
    back = hk.load_snapshot(path)
    assert back.equal(s) and back.model == f"test-{kind}"
    for i in range(s.num_layers):
        for a, b in zip(back.layer(i), s.layer(i), strict=True):
            np.testing.assert_array_equal(a.to_dense(dequantize=True),
                                          b.to_dense(dequantize=True))


def test_fused_round_trip(tmp_path):
    s = make_fused()
    hk.save_snapshot(s, tmp_path / "f.hrry")
    assert hk.load_snapshot(tmp_path / "f.hrry").equal(s)


def test_file_layout_follows_the_spec(tmp_path):
    _s, path = saved(tmp_path, "int8")
    data = path.read_bytes()
    f = HrryFile.open(path)
    assert data[:8] == b"HRRYFILE" and data[-4:] == b"HRRY"
    flags, align = struct.unpack_from("<II", data, 12)
    assert flags == 0b111 and align == 4096  # KV metadata, sorted index, CRC-32C
    assert struct.unpack_from("<Q", data, 28)[0] == len(f.names)  # tensor_count_hint
    assert f.names == ["snapshot", "seq_lens", "info", *[f"layers.{i}.{r}" for i in range(3)
                                                 for r in ("key", "value")]]
    prev_end = 0
    for name in f.names:
        e, desc = f.entry(name), f.descriptor(name)
        assert e.descriptor_offset % 8 == 0 and e.descriptor_offset >= prev_end
        off = e.data_offset
        for h in desc.buffers:
            assert off % 4096 == 0
            off += -(-h.byte_size // 4096) * 4096
        if desc.buffers:
            end = e.data_offset + e.data_length
            pad_end = -(-end // 4096) * 4096  # padding after the last buffer (spec 2e)
            assert not any(data[end:pad_end]) and data[e.descriptor_offset:][:4] == b"HRRY"
            prev_end = pad_end
        else:  # the group head: no alignment padding after it
            prev_end = e.descriptor_offset + e.descriptor_length
            nxt = f.entry(f.names[f.names.index(name) + 1]).descriptor_offset
            assert nxt == -(-prev_end // 8) * 8
    assert f.kv["hurraykv.num_layers"] == 3 and list(f.kv["hurraykv.seq_lens"]) == [10, 6, 5, 1]
    assert f.kv["hurraykv.model"] == "test-int8"


def test_loading_is_lazy_and_zero_copy(tmp_path):
    _s, path = saved(tmp_path, "float16")
    back = hk.load_snapshot(path)
    assert back._cache == {}
    key, _ = back.layer(1)
    assert set(back._cache) == {(1, "key"), (1, "value")}
    assert not key.page_pool.flags.writeable
    base = key.page_pool
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    assert isinstance(memoryview(base).obj, mmap.mmap)


def test_reference_file_matches_its_manifest(reference_dir):
    manifest = json.loads((reference_dir / "manifest.json").read_text())
    for spec in manifest["files"]:
        f = HrryFile.open(reference_dir / spec["file"])
        assert f.names == [t["name"] for t in spec["tensors"]]
        for t in spec["tensors"]:
            desc = f.descriptor(t["name"])
            assert (desc.element_type_name, desc.type_tag, list(desc.shape)) == (
                t["element_type"], t["element_type_tag"], t["shape"])
            assert sum(len(b) for b in f.buffers(t["name"])) == t["data_bytes"]
        for kv in spec["kv"]:
            value = f.kv[kv["key"]]
            assert value == (kv["value_string"] if kv["kind"] == "string" else kv["value_int"])
        with open(reference_dir / spec["file"], "rb") as raw:
            seq = list(iter_hrry_sequential(raw))  # unknown count: read through the trailer
        assert [n for n, _, _ in seq] == f.names


def test_sequential_reader_on_a_pipe(tmp_path):
    s, path = saved(tmp_path, "fp8")
    r_fd, w_fd = os.pipe()
    data = path.read_bytes()

    import threading

    def feed() -> None:
        with os.fdopen(w_fd, "wb") as w:
            w.write(data)

    t = threading.Thread(target=feed)
    t.start()
    with os.fdopen(r_fd, "rb") as r:
        back = hk.read_snapshot_sequential(r)
    t.join()
    assert back.equal(s)


def test_sequential_reader_names_a_tensor_region_cut_short(tmp_path):
    _, path = saved(tmp_path, "float16")
    last = HrryFile.open(path).entries[-1].descriptor_offset
    cut = path.read_bytes()[:last]  # the hint promises one more tensor than arrives
    with pytest.raises(hk.ContainerError, match=r"tensor_count_hint at byte 28 is \d+; the file"):
        list(iter_hrry_sequential(io.BytesIO(cut)))
    torn = path.read_bytes()[:last + 40]  # inside the last descriptor: the file's damage
    with pytest.raises(hk.ContainerError, match="descriptor"):
        list(iter_hrry_sequential(io.BytesIO(torn)))


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    s, path = saved(tmp_path, "float16")
    before = path.read_bytes()

    def boom(done, total):
        if done > total // 2:
            raise RuntimeError("disk full (simulated)")

    with pytest.raises(RuntimeError, match="disk full"):
        hk.save_snapshot(make_snapshot("bfloat16"), path, progress=boom)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left
    bad = [("a", s.head(), [])] + [("x", *m[1:]) for m in s.members()][:1]
    bad.append(("x", *list(s.members())[1][1:]))  # duplicate name fails mid-write
    with pytest.raises(hk.ContainerError, match="already used"):
        write_hrry(path, bad)
    assert path.read_bytes() == before


def test_metadata_and_mirrors(tmp_path):
    s = make_snapshot("float16")
    with pytest.raises(hk.SnapshotError, match="reserved prefix"):
        hk.save_snapshot(s, tmp_path / "m.hrry", metadata={"hurraykv.x": 1})
    hk.save_snapshot(s, tmp_path / "m.hrry", metadata={"engine": "vllm", "tp": 2})
    f = HrryFile.open(tmp_path / "m.hrry")
    assert f.kv["engine"] == "vllm" and f.kv["tp"] == 2
    kv = dict(f.kv, **{"hurraykv.num_layers": np.uint64(4)})
    tensors = [(n, f.descriptor(n), f.buffers(n)) for n in f.names]
    write_hrry(tmp_path / "lie.hrry", tensors, kv)
    with pytest.raises(hk.ContainerError, match="num_layers is 4"):
        hk.load_snapshot(tmp_path / "lie.hrry")


# ---- hostile files --------------------------------------------------------------------
def _with_index(data: bytes, mutate) -> bytes:
    """Rewrite the index through ``mutate(entries)`` and re-sign it with a valid CRC."""
    t = len(data) - 40
    index_off, index_len, kv_off, kv_len, _, rsv, magic = TRAILER.unpack_from(data, t)
    index = data[index_off:index_off + index_len]
    (count,) = struct.unpack_from("<Q", index)
    pos, entries = 8, []
    for _ in range(count):
        (n,) = struct.unpack_from("<H", index, pos)
        name = index[pos + 2:pos + 2 + n]
        entries.append([name, *ENTRY.unpack_from(index, pos + 2 + n)])
        pos += 2 + n + ENTRY.size
    mutate(entries)
    new = struct.pack("<Q", len(entries)) + b"".join(
        struct.pack("<H", len(e[0])) + e[0] + ENTRY.pack(*e[1:]) for e in entries)
    body = data[:index_off] + new
    return body + TRAILER.pack(index_off, len(new), kv_off, kv_len, crc32c(new), rsv, magic)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("h") / "small.hrry"
    hk.save_snapshot(make_snapshot("int8", layers=1, heads=1, dim=4), path)
    return path.read_bytes()


def _load(data: bytes):
    return hk.io.snapshots.snapshot_from_file(HrryFile.from_bytes(data))


def test_every_truncation_length_is_rejected(small_file):
    assert _load(small_file).num_layers == 1
    for cut in range(len(small_file)):
        with pytest.raises(hk.HurrayError):
            _load(small_file[:cut])


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda es: es.append(list(es[0])), "appears twice"),
    (lambda es: es[1].__setitem__(3, 1 << 40), "data at"),
    (lambda es: es[1].__setitem__(1, 1 << 40), "descriptor at"),
    (lambda es: es[2].__setitem__(1, es[1][1]), "descriptor_length|overlaps|data at"),
    (lambda es: es[2].__setitem__(3, es[1][3]), "overlaps|data at"),
    (lambda es: es[0].__setitem__(5, 1), "flags"),
    (lambda es: es.reverse(), "not sorted"),
    (lambda es: es[1].__setitem__(2, es[1][2] + 8), "descriptor_length"),
])
def test_hostile_indexes_are_rejected(small_file, mutate, match):
    with pytest.raises(hk.HurrayError, match=match):
        _load(_with_index(small_file, mutate))


def test_index_bit_flips_fail_the_crc(small_file):
    index_off = struct.unpack_from("<Q", small_file, len(small_file) - 40)[0]
    for bit in range(0, 64, 7):
        raw = bytearray(small_file)
        raw[index_off + 8 + bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(hk.ContainerError, match="index_crc32c"):
            _load(bytes(raw))
        with pytest.raises(hk.ContainerError, match="index_crc32c"):
            list(iter_hrry_sequential(io.BytesIO(bytes(raw))))


def test_header_and_trailer_rules(small_file):
    # streamed tensor by tensor: the hint is the tensor count
    assert struct.unpack_from("<Q", small_file, 28)[0] == len(HrryFile.from_bytes(small_file).names)
    cases = [(0, b"HRRYFILX", "magic"), (8, b"\x02", "container_version_major"),
             (12, b"\x08", "file_flags"), (16, struct.pack("<I", 1000), "alignment"),
             (20, struct.pack("<Q", 12), "first_descriptor_offset"), (40, b"\x01", "reserved"),
             (len(small_file) - 4, b"HRRX", "trailer_magic"),
             (len(small_file) - 8, b"\x01", "trailer reserved")]
    for off, patch, match in cases:
        raw = bytearray(small_file)
        raw[off:off + len(patch)] = patch
        with pytest.raises(hk.ContainerError, match=match):
            _load(bytes(raw))
        with pytest.raises(hk.ContainerError, match=match):  # the same rules, streaming
            list(iter_hrry_sequential(io.BytesIO(bytes(raw))))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzzed_files_raise_only_hurray_errors(small_file, data):
    raw = bytearray(small_file)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        snap = _load(bytes(raw))
        for t in snap.tensors():
            t.to_dense(dequantize=True)
    except hk.HurrayError:
        pass
    with contextlib.suppress(hk.HurrayError):
        list(iter_hrry_sequential(io.BytesIO(bytes(raw))))


def test_crc32c_known_values():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4: 32 bytes of 0xFF
    assert crc32c(bytes(range(32))) == 0x46DD794E  # RFC 3720 B.4: incrementing


# ---- both readers, one verdict (issue 10) ----------------------------------------------
def _both(raw: bytes):
    """(random-access verdict, sequential verdict): a snapshot or the error class."""
    out = []
    for read in (lambda: snapshot_from_file(HrryFile.from_bytes(raw)),
                 lambda: hk.read_snapshot_sequential(_Pipe(raw))):
        try:
            snap = read()
            for t in snap.tensors():
                t.validate()
            out.append(snap)
        except hk.HurrayError as e:
            out.append(type(e))
    return out


class _Pipe(io.RawIOBase):
    """A non-seekable byte source, as a pipe is."""

    def __init__(self, data: bytes) -> None:
        self._src = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self._src.readinto(b)


def _patch_index(raw: bytes, name: str, field: str, delta: int) -> bytes:
    from hurraykv.io.crc32c import crc32c
    from hurraykv.io.hrry import ENTRY

    data = bytearray(raw)
    index_off, index_len = struct.unpack_from("<QQ", data, len(data) - 40)
    pos = index_off + 8
    while pos < index_off + index_len:
        (n,) = struct.unpack_from("<H", data, pos)
        entry = pos + 2 + n
        if data[pos + 2:entry].decode() == name:
            fields = list(ENTRY.unpack_from(data, entry))
            i = ("descriptor_offset", "descriptor_length", "data_offset", "data_length").index(
                field)
            fields[i] += delta
            ENTRY.pack_into(data, entry, *fields)
        pos = entry + ENTRY.size
    struct.pack_into("<I", data, len(data) - 12, crc32c(bytes(data[index_off:index_off
                                                                     + index_len])))
    return bytes(data)


def test_both_readers_give_the_same_verdict(tmp_path):
    s = make_snapshot("int8")
    hk.save_snapshot(s, tmp_path / "s.hrry")
    raw = (tmp_path / "s.hrry").read_bytes()
    f = HrryFile.from_bytes(raw)
    cases = [_patch_index(raw, "layers.0.key", "data_offset", 4096),
             _patch_index(raw, "layers.0.key", "data_length", 1),
             _patch_index(raw, "layers.1.value", "descriptor_length", 8),
             _patch_index(raw, "seq_lens", "data_offset", 8)]
    kv = bytearray(raw)  # a KV mirror that disagrees with the tensors
    kv_off = struct.unpack_from("<Q", raw, len(raw) - 24)[0]
    lens_at = bytes(kv).index(b"hurraykv.seq_lens", kv_off) + len("hurraykv.seq_lens") + 6
    kv[lens_at] ^= 1
    cases.append(bytes(kv))
    torn = bytearray(raw)  # the group head announces more members than follow
    head = f.entry("snapshot")
    struct.pack_into("<I", torn, head.descriptor_offset + 20 + 8 + 8 + 4, 263)
    cases.append(bytes(torn))
    for case in cases:
        ra, sq = _both(case)
        assert isinstance(ra, type) and ra is sq, (ra, sq)
    rng = np.random.default_rng(0)
    for _ in range(300):
        data = bytearray(raw)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        ra, sq = _both(bytes(data))
        if isinstance(ra, type):
            assert sq is ra, (ra, sq)
        else:
            assert not isinstance(sq, type) and ra.equal(sq)
    assert not isinstance(_both(raw)[1], type)
    assert read_hrry_sequential(_Pipe(raw)).names == f.names


def test_the_sequential_reader_takes_a_reference_file_in_small_pieces():
    r_fd, w_fd = os.pipe()
    data = (REFERENCE / "files" / "basic.hrry").read_bytes()

    def feed() -> None:
        with os.fdopen(w_fd, "wb") as w:
            for i in range(0, len(data), 7):
                w.write(data[i:i + 7])

    t = threading.Thread(target=feed)
    t.start()
    with os.fdopen(r_fd, "rb") as r:
        f = read_hrry_sequential(r)
    t.join()
    assert f.names == HrryFile.from_bytes(data).names


# ---- files that are not what was expected -----------------------------------------------
def _safetensors(path) -> None:
    header = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))


def _zip(path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("data.pkl", b"x")


@pytest.mark.parametrize(("make", "what"), [
    (lambda p: np.save(p, np.zeros(3)), "a NumPy .npy file"),
    (_safetensors, "a safetensors file"),
    (lambda p: p.write_bytes(b""), "an empty file"),
    (lambda p: _zip(p), "a zip archive"),
])
def test_not_a_hurray_file_says_what_it_looks_like(tmp_path, make, what):
    path = tmp_path / "input"
    make(path)
    if not path.exists():  # np.save appends .npy
        path = tmp_path / "input.npy"
    with pytest.raises(hk.ContainerError, match=f"this is {what}.*, not a .hrry file"):
        hk.load_snapshot(path)
    if path.stat().st_size:
        with pytest.raises(hk.StreamError, match=f"this is {what}.*, not a Hurray stream"):
            hk.read_snapshot_stream(io.BytesIO(path.read_bytes()))


def test_a_stream_and_a_file_are_told_apart(tmp_path):
    s = make_snapshot("float16")
    hk.save_snapshot(s, tmp_path / "s.hrry")
    buf = io.BytesIO()
    hk.write_snapshot_stream(s, buf)
    (tmp_path / "s.stream").write_bytes(buf.getvalue())
    with pytest.raises(hk.ContainerError, match=r"this is a Hurray stream .* not a .hrry "
                                                r"file .*read_snapshot_stream"):
        hk.load_snapshot(tmp_path / "s.stream")
    with pytest.raises(hk.StreamError, match=r"this is a .hrry file, not a Hurray stream .*"
                                             r"load_snapshot"):
        hk.read_snapshot_stream(io.BytesIO((tmp_path / "s.hrry").read_bytes()))
