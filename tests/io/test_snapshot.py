"""KVCacheSnapshot: construction, cross-member validation, layer access; model and
metadata on every path (file, stream, server, page store)."""

from __future__ import annotations

import io

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.io import checksums
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from hurraykv.paged import BlockPagedTensor
from hurraykv.snapshot import KVCacheSnapshot
from hurraykv.store import PageStore
from tests.support.snapshots import KINDS, make_fused, make_snapshot


@pytest.mark.parametrize("kind", KINDS)
def test_facts_and_layer_access(kind):
    s = make_snapshot(kind)
    assert (s.num_layers, s.num_seqs, s.num_kv_heads, s.head_dim, s.page_size) == (3, 4, 2, 8, 4)
    assert list(s.seq_lens) == [10, 6, 5, 1] and s.total_tokens == 22
    assert s.dtype == {"fp8": "float8_e4m3"}.get(kind, kind)
    key, value = s.layer(1)
    assert (key.kv_role, key.layer_index, value.kv_role) == ("key", 1, "value")
    assert [(t.layer_index, t.kv_role) for t in s.tensors()] == [
        (i, r) for i in range(3) for r in ("key", "value")]
    assert [len(layer) for layer in s] == [2, 2, 2]
    if kind == "fp8":
        assert s.kv_scales.tolist() == [[0.5, 1.5], [1.5, 2.5], [2.5, 3.5]]
        assert s.layer(2)[1].fp8_scale == 3.5
    names = [n for n, _, _ in s.members()]
    assert names[0] == "seq_lens" and names[-1] == "layers.2.value"
    assert ("kv_scales" in names) == (kind == "fp8")
    assert s.head().layout.member_count == len(names)


def test_fused_layers():
    s = make_fused()
    assert s.fused and s.roles == ("fused",)
    assert [t.kv_role for t in s.tensors()] == ["fused", "fused"]
    assert len(s.layer(0)) == 1


def _tensors():
    s = make_snapshot("float16")
    return s, [t.copy() for t in s.tensors()]


def test_missing_layer_and_role_are_rejected():
    _s, ts = _tensors()
    with pytest.raises(hk.SnapshotError, match=r"layer 1 is missing"):
        KVCacheSnapshot.from_tensors([t for t in ts if t.layer_index != 1])
    with pytest.raises(hk.SnapshotError, match=r"layer 2 has roles \['key'\]"):
        KVCacheSnapshot.from_tensors(ts[:-1])
    with pytest.raises(hk.SnapshotError, match="two members for layer 0"):
        KVCacheSnapshot.from_tensors(ts + [ts[0]])


def test_members_must_share_geometry_and_seq_ptr():
    _s, ts = _tensors()
    # same lengths, but sequence 1 holds a spare third page
    other = BlockPagedTensor(np.zeros((9, 4, 2, 8), np.float16), [0, 1, 2, 0, 3, 7, 4, 5, 6],
                             [0, 3, 6, 8, 9], [10, 6, 5, 1], kv_role="value", layer_index=2)
    with pytest.raises(hk.SnapshotError, match="different seq_ptr"):
        KVCacheSnapshot.from_tensors(ts[:-1] + [other], seq_lens=None)
    wide = BlockPagedTensor(np.zeros((9, 4, 4, 8), np.float16), ts[0].block_table,
                            ts[0].seq_ptr, ts[0].seq_lens, kv_role="value", layer_index=2)
    with pytest.raises(hk.SnapshotError, match="num_heads 4"):
        KVCacheSnapshot.from_tensors(ts[:-1] + [wide])


def test_seq_lens_and_kv_scales_are_checked():
    _s, ts = _tensors()
    with pytest.raises(hk.SnapshotError, match="seq_lens"):
        KVCacheSnapshot.from_tensors(ts, seq_lens=[10, 6, 5, 2])
    with pytest.raises(hk.SnapshotError, match="kv_scales belong to fp8 caches"):
        KVCacheSnapshot.from_tensors(ts, kv_scales=np.ones((3, 2)))
    fp8 = make_snapshot("fp8")
    with pytest.raises(hk.SnapshotError, match=r"shape \[2, 2\]"):
        KVCacheSnapshot.from_tensors(fp8.tensors(), kv_scales=np.ones((2, 2)))
    with pytest.raises(hk.SnapshotError, match="finite and non-zero"):
        KVCacheSnapshot.from_tensors(fp8.tensors(), kv_scales=np.zeros((3, 2)))


def test_not_layer_scoped_tensor_is_rejected():
    t = BlockPagedTensor(np.zeros((1, 4, 1, 1), np.float16), [0], [0, 1], [3])
    with pytest.raises(hk.SnapshotError, match="layer_index"):
        KVCacheSnapshot.from_tensors([t])


def test_compact_snapshot_keeps_every_sequence():
    s = make_snapshot("int8")
    c = s.compact()
    assert all(t.num_pages == 7 for t in c.tensors())
    for a, b in zip(s.tensors(), c.tensors(), strict=True):
        for q in range(s.num_seqs):
            np.testing.assert_array_equal(a.gather(q, dequantize=True),
                                          b.gather(q, dequantize=True))


META = {"engine": "vllm", "tp": 2, "scale": 0.5, "ok": True, "layers": [1, 2]}


def with_meta() -> hk.KVCacheSnapshot:
    return make_snapshot("bfloat16").with_info("llama-3-8b", META)


# ---- model and metadata on every path ---------------------------------------------------
def test_metadata_survives_files_both_readers(tmp_path):
    s = make_snapshot("bfloat16")
    hk.save_snapshot(s, tmp_path / "m.hrry", model="llama-3-8b", metadata=META)
    for snap in (hk.load_snapshot(tmp_path / "m.hrry"),
                 hk.read_snapshot_sequential(tmp_path / "m.hrry")):
        # save_snapshot adds the values' checksums to what it was given (checksums.py)
        assert (snap.model, snap.metadata) == ("llama-3-8b", META | {
            checksums.KEY: checksums.digests(s)})
        assert snap.equal(s)
    f = hk.HrryFile.open(tmp_path / "m.hrry")  # mirrored for KV-only tools
    assert f.kv["hurraykv.model"] == "llama-3-8b" and f.kv["engine"] == "vllm"


def test_metadata_survives_streams():
    buf = io.BytesIO()
    hk.write_snapshot_stream(with_meta(), buf)
    buf.seek(0)
    back = hk.read_snapshot_stream(buf)
    assert (back.model, back.metadata) == ("llama-3-8b", META)


def test_metadata_survives_push_and_pull(tmp_path):
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st:
        with KVClient(st.address) as c:
            c.push("k", with_meta())
            back = c.pull("k")
        assert (back.model, back.metadata) == ("llama-3-8b", META)
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address) as c:  # and through the server's own files
        back = c.pull("k")
    assert (back.model, back.metadata) == ("llama-3-8b", META)


def test_metadata_survives_the_page_store(redis_url):
    store = PageStore.from_url(redis_url)
    try:
        store.put("meta", with_meta())
        back = store.get("meta")
        assert (back.model, back.metadata) == ("llama-3-8b", META)
    finally:
        store.client.close()


def test_a_plain_snapshot_has_no_info_member():
    s = make_snapshot("float16").with_info()
    s.model = None
    assert [n for n, *_ in s.members()][:2] == ["seq_lens", "layers.0.key"]


@pytest.mark.parametrize(("metadata", "why"), [
    ({"hurraykv.x": 1}, "reserved prefix"),
    ({"blob": b"\x00"}, r"metadata\['blob'\] is a bytes"),
    ({"nested": {"a": 1}}, "lists of them"),
    ({3: "x"}, "keys are str"),
])
def test_metadata_values_every_path_can_carry(tmp_path, metadata, why):
    with pytest.raises(hk.SnapshotError, match=why):
        hk.save_snapshot(make_snapshot("float16"), tmp_path / "x.hrry", metadata=metadata)
    assert not (tmp_path / "x.hrry").exists()


# ---- arrays in the wrong order ---------------------------------------------------------
def test_an_hnd_pool_is_named():
    pool = np.zeros((6, 4, 16, 8), np.float16)  # [num_pages, heads, page_size, head_dim]
    with pytest.raises(hk.LayoutError, match=r"HND order.*transpose\(0, 2, 1, 3\)"):
        hk.KVCacheSnapshot.from_arrays([pool], [pool], [0, 1, 2], [0, 3], [40], page_size=16)
    with pytest.raises(hk.LayoutError, match=r"pools are \[num_pages, page_size, num_heads, "
                                             r"head_dim\]"):
        hk.KVCacheSnapshot.from_arrays([pool], [pool], [0, 1, 2], [0, 3], [40])
