"""Interoperability with the reference implementation's own Python bindings, ``pyhurray``
0.1.0 (import name ``hurray``, Rust underneath): descriptors, files, streams and whole
snapshots go both ways, and what one side writes the other reads bit for bit."""

from __future__ import annotations

import io
import itertools
import subprocess
import sys

import hurray  # pyhurray: a test dependency (constraints.txt), never skipped
import numpy as np
import pytest

import hurraykv as hk
from hurraykv.io import checksums
from hurraykv.snapshot import KVCacheSnapshot
from hurraykv.wire.layouts import BlockPaged
from tests.support.snapshots import make_fused, make_snapshot, same_tokens


# ---- converting between the two object models -------------------------------------------
def to_ref(desc: hk.TensorDescriptor, bufs) -> object:
    """One of our members as a pyhurray Tensor built from its parts (not from our bytes)."""
    kw = {}
    layout = desc.layout
    if isinstance(layout, BlockPaged):
        kw["layout"] = hurray.BlockPagedLayout(
            page_size=layout.page_size, num_pages=layout.num_pages, paged_axis=0,
            num_seqs=layout.num_seqs, kv_role=layout.kv_role_name,
            layer_index=layout.layer_index, block_table_index_type=layout.index_type_name)
    if desc.quantization is not None:
        kw["quantization"] = hurray.decode_quantization(desc.quantization.encode())
    raw = [np.asarray(memoryview(b).cast("B")).tobytes() for b in bufs]
    if len(raw) > 1:
        kw["aux_buffers"] = raw[1:]
    return hurray.Tensor(raw[0] if raw else b"", hurray.Dtype.from_tag(desc.type_tag),
                         list(desc.shape), **kw)


def ref_buffers(t) -> list[bytes]:
    return [np.asarray(t.buffer(i)).tobytes() for i in range(t.buffer_count)]


def ref_group(snap: KVCacheSnapshot):
    members = [to_ref(d, b) for _, d, b in snap.members()]
    return hurray.Composite("group", shape=[len(members)], dtype=hurray.uint8,
                            members=members)


def snapshots() -> list[tuple[str, KVCacheSnapshot]]:
    out = [(k, make_snapshot(k)) for k in ("float16", "bfloat16", "float32", "fp8", "int8",
                                           "int4")]
    out.append(("fused", make_fused()))
    out.append(("uint64-index", _uint64_index()))
    out.append(("empty-batch", _empty_batch()))
    out.append(("diffkv", make_snapshot("bfloat16", dim=16, dim_v=8)))
    for scheme, dtype, symmetric, axis in (("per_tensor", "int8", False, None),
                                           ("per_channel", "uint8", False, 2),
                                           ("per_channel", "int16", True, 1),
                                           ("per_block_affine", "uint4", False, None)):
        base = make_snapshot("float32")
        out.append((f"{scheme}-{dtype}", KVCacheSnapshot.from_tensors(
            [t.quantize(scheme, dtype, symmetric=symmetric, axis=axis)
             for t in base.tensors()])))
    return out


def _uint64_index() -> KVCacheSnapshot:
    s = make_snapshot("float16")
    tensors = [hk.BlockPagedTensor(t.page_pool, t.block_table, t.seq_ptr, t.seq_lens,
                                   kv_role=t.kv_role, layer_index=t.layer_index,
                                   index_type="uint64") for t in s.tensors()]
    return KVCacheSnapshot.from_tensors(tensors)


def _empty_batch() -> KVCacheSnapshot:
    pool = np.zeros((2, 4, 2, 8), np.float16)
    return KVCacheSnapshot.from_arrays([pool], [pool], [], [0], [])


SNAPSHOTS = snapshots()
IDS = [k for k, _ in SNAPSHOTS]


# ---- descriptors ------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "snap"), SNAPSHOTS, ids=IDS)
def test_descriptors_encode_identically_both_ways(kind, snap):
    for name, desc, bufs in snap.members():
        ours = desc.encode()
        ref = hurray.Descriptor.decode(ours)
        assert ref.encode() == ours, name  # theirs re-encodes our bytes unchanged
        built = to_ref(desc, bufs)
        assert hk.decode_descriptor(built.descriptor.encode()).encode() == \
            built.descriptor.encode(), name
        got = hk.decode_descriptor(built.descriptor.encode())
        assert (got.type_tag, got.shape, got.layout, got.quantization) == \
            (desc.type_tag, desc.shape, desc.layout, desc.quantization), name
        assert [h.byte_size for h in got.buffers] == [h.byte_size for h in desc.buffers]


def test_every_block_paged_field_reads_the_same():
    s = make_snapshot("int8")
    for _, desc, _ in s.members():
        if not isinstance(desc.layout, BlockPaged):
            continue
        ref = hurray.Descriptor.decode(desc.encode()).layout
        ours = desc.layout
        assert (ref.page_size, ref.num_pages, ref.num_seqs, ref.kv_role, ref.layer_index,
                ref.block_table_index_type) == (ours.page_size, ours.num_pages,
                                                ours.num_seqs, ours.kv_role_name,
                                                ours.layer_index, ours.index_type_name)


@pytest.mark.parametrize(("role", "index", "dtype"), list(itertools.product(
    ["key", "value", "fused"], ["uint32", "uint64"],
    ["float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2", "int8", "uint8"])))
def test_their_block_paged_tensors_decode_here(role, index, dtype):
    et = hk.wire.element_type(dtype)
    pool = np.zeros(3 * 4 * 2 * 8 * et.bits // 8, np.uint8).tobytes()
    width = 4 if index == "uint32" else 8
    table = np.array([2, 0, 2], f"<u{width}").tobytes()  # page 2 shared by both sequences
    ptr = np.array([0, 2, 3], f"<u{width}").tobytes()
    layout = hurray.BlockPagedLayout(page_size=4, num_pages=3, paged_axis=0, num_seqs=2,
                                     kv_role=role, layer_index=5,
                                     block_table_index_type=index)
    t = hurray.Tensor(pool, hurray.Dtype.from_name(dtype), [9, 2, 8],
                      aux_buffers=[table, ptr], layout=layout)
    raw = t.descriptor.encode()
    desc = hk.decode_descriptor(raw)
    assert desc.encode() == raw
    ours = hk.BlockPagedTensor.from_descriptor(desc, ref_buffers(t), [5, 4])
    assert ours.kv_role == role and ours.layer_index == 5
    assert ours.block_table.tolist() == [2, 0, 2] and set(ours.shared_pages) == {2}


# ---- files ------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "snap"), SNAPSHOTS, ids=IDS)
def test_our_files_load_in_theirs(tmp_path, kind, snap):
    # as save_snapshot writes it: with its checksums (the default)
    snap = checksums.with_checksums(snap.with_info(metadata={"engine": "test"}))
    hk.save_snapshot(snap, tmp_path / "ours.hrry")
    loaded = hurray.load(str(tmp_path / "ours.hrry"))
    group = loaded["snapshot"]
    assert group.layout.composition_rule == "group"
    assert group.member_count == snap.member_count()
    for (name, desc, bufs), t in zip(snap.members(), group.members, strict=True):
        assert t.descriptor.encode() == desc.encode(), name
        assert ref_buffers(t) == [np.asarray(memoryview(b).cast("B")).tobytes()
                                  for b in bufs], name
    kv = hurray.load_kv(str(tmp_path / "ours.hrry"))
    assert kv["engine"] == "test" and kv["hurraykv.seq_lens"] == snap.seq_lens.tolist()


@pytest.mark.parametrize(("kind", "snap"), SNAPSHOTS, ids=IDS)
def test_their_files_load_here_members_recognised_by_fields(tmp_path, kind, snap):
    snap = snap.with_info("ref-model", {"writer": "pyhurray"})
    # hurray.save names a group's members snapshot.0 .. snapshot.N: names mean nothing
    hurray.save(str(tmp_path / "theirs.hrry"), {"snapshot": ref_group(snap)})
    back = hk.load_snapshot(tmp_path / "theirs.hrry")
    assert back.equal(snap)
    assert (back.model, back.metadata) == ("ref-model", {"writer": "pyhurray"})
    if snap.kv_scales is not None:
        assert np.array_equal(back.kv_scales, snap.kv_scales)
    if snap.num_seqs:
        assert back.layer(0)[0].gather(0).tobytes() == snap.layer(0)[0].gather(0).tobytes()
    assert hk.read_snapshot_sequential(tmp_path / "theirs.hrry").equal(snap)


def test_their_file_of_standalone_tensors_is_valid(tmp_path):
    """A file of block-paged tensors that is not a snapshot: each tensor is held to its
    own rules, and `hurraykv validate` / `inspect` accept it."""
    s = make_snapshot("float16")
    tensors = {f"t{i}": to_ref(d, b) for i, (_, d, b) in enumerate(s.members())
               if isinstance(d.layout, BlockPaged)}
    tensors.pop("t2")  # layer 0's key alone: not a whole snapshot
    hurray.save(str(tmp_path / "loose.hrry"), tensors)
    for cmd in ("validate", "inspect"):
        p = subprocess.run([sys.executable, "-m", "hurraykv.cli", cmd,
                            str(tmp_path / "loose.hrry")], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stderr
    assert "no KV snapshot" in p.stdout


# ---- streams ----------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "snap"), SNAPSHOTS, ids=IDS)
def test_streams_both_ways(kind, snap):
    buf = io.BytesIO()
    hk.write_snapshot_stream(snap, buf)
    items = list(hurray.StreamReader(buf.getvalue()))
    assert len(items) == 1 and items[0].member_count == snap.member_count()
    for (name, desc, bufs), t in zip(snap.members(), items[0].members, strict=True):
        assert t.descriptor.encode() == desc.encode(), name
        assert ref_buffers(t) == [np.asarray(memoryview(b).cast("B")).tobytes()
                                  for b in bufs], name
    with hurray.StreamWriter() as w:
        w.write_composite(ref_group(snap))
    theirs = w.getvalue()
    assert theirs == buf.getvalue()  # the same bytes, written independently
    assert hk.read_snapshot_stream(io.BytesIO(theirs)).equal(snap)


def test_a_head_alone_is_a_truncated_stream(tmp_path):
    snap = make_snapshot("float16")
    with hurray.StreamWriter() as w:
        w.write_composite(ref_group(snap))
    head = hk.decode_descriptor(w.getvalue())
    (tmp_path / "cut").write_bytes(w.getvalue()[:len(head.encode())])
    with pytest.raises(hk.StreamError, match="torn group"):
        hk.read_snapshot_stream(io.BytesIO((tmp_path / "cut").read_bytes()))
    p = subprocess.run([sys.executable, "-m", "hurraykv.cli", "validate",
                        str(tmp_path / "cut")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "truncated" in p.stderr


def test_shared_pages_keep_their_aliasing_through_theirs(tmp_path):
    snap = make_snapshot("float16")
    hurray.save(str(tmp_path / "t.hrry"), {"snapshot": ref_group(snap)})
    back = hk.load_snapshot(tmp_path / "t.hrry")
    assert same_tokens(back, snap)
    assert back.tensor(0, "key").shared_pages.tolist() == \
        snap.tensor(0, "key").shared_pages.tolist() == [0]
