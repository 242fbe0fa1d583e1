"""KVCacheSnapshot: construction, cross-member validation, layer access."""

from __future__ import annotations

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.paged import BlockPagedTensor
from hurraykv.snapshot import KVCacheSnapshot
from tests.snapshots import KINDS, make_fused, make_snapshot


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
