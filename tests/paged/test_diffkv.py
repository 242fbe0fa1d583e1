"""Key and value tensors of different head_dim (SGLang's ``v_head_dim``, vLLM's
``*_DIFFKV`` backends): each block-paged tensor carries its own shape, so a snapshot holds
them and every path carries them bit for bit."""

from __future__ import annotations

import io

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from hurraykv.store import PageStore
from tests.support.snapshots import make_snapshot, zeroed

KINDS = ["bfloat16", "fp8", "int8"]


def diffkv(kind: str) -> hk.KVCacheSnapshot:
    return make_snapshot(kind, dim=16, dim_v=8)



@pytest.mark.parametrize("kind", KINDS)
def test_a_snapshot_holds_each_roles_head_dim(kind):
    s = diffkv(kind)
    assert (s.head_dim, s.head_dim_v) == (16, 8)
    key, value = s.layer(1)
    assert key.shape[2] == 16 and value.shape[2] == 8
    assert value.gather(0).shape == (10, 2, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_files_both_readers(tmp_path, kind):
    s = diffkv(kind)
    hk.save_snapshot(s, tmp_path / "d.hrry")
    assert hk.load_snapshot(tmp_path / "d.hrry").equal(s)
    assert hk.read_snapshot_sequential(tmp_path / "d.hrry").equal(s)


@pytest.mark.parametrize("kind", KINDS)
def test_streams(kind):
    s = diffkv(kind)
    buf = io.BytesIO()
    hk.write_snapshot_stream(s, buf)
    buf.seek(0)
    assert hk.read_snapshot_stream(buf).equal(s)


@pytest.mark.parametrize("kind", KINDS)
def test_server(kind):
    s = diffkv(kind)
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st, KVClient(st.address) as c:
        c.push("d", s)
        back = c.pull("d")
    assert back.equal(zeroed(s)) and (back.head_dim, back.head_dim_v) == (16, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_page_store(redis_url, kind):
    store = PageStore.from_url(redis_url)
    try:
        s = diffkv(kind)
        store.put(f"diffkv-{kind}", s)
        assert store.get(f"diffkv-{kind}").equal(zeroed(s))
        key, value = store.get_layer(f"diffkv-{kind}", 2)
        assert (key.shape[2], value.shape[2]) == (16, 8)
    finally:
        store.client.close()


def test_layers_must_agree_per_role():
    s = diffkv("bfloat16")
    tensors = s.tensors()
    odd = make_snapshot("bfloat16", dim=16, dim_v=4).layer(1)[1]
    with pytest.raises(hk.SnapshotError, match="head_dim"):
        hk.KVCacheSnapshot.from_tensors(tensors[:3] + [odd] + tensors[4:])
    np.testing.assert_array_equal(s.seq_lens, [10, 6, 5, 1])
