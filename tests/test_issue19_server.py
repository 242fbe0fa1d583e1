"""Regression tests for issue 19 (outside reliability campaign) against a real
``hurraykv serve`` on loopback: refused pushes, buffered payloads and the memory budget,
per-tenant STAT, server aliases.  Each test failed on the code before its fix."""

from __future__ import annotations

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.net.client import KVClient
from hurraykv.net.messages import ErrorCode as E
from hurraykv.net.server import KVServer

MIB = 1 << 20


def _fused(layers: int, mib: int, seed: int = 0) -> hk.KVCacheSnapshot:
    """``layers`` fused members of ``mib`` MiB each (float16 pages of 16 x 16 x 128)."""
    rng = np.random.default_rng(seed)
    pages = mib * 16  # 64 KiB per page
    pools = [rng.standard_normal((pages, 16, 16, 128)).astype(np.float16)
             for _ in range(layers)]
    return hk.KVCacheSnapshot.from_arrays(pools, None, np.arange(pages), [0, pages],
                                          [pages * 16])


# ------------------------------------------------------------------- 8 refused pushes
def test_a_refused_push_evicts_nobody(tmp_path):
    other, big = _fused(1, 2, seed=1), _fused(5, 2, seed=2)  # 2 MiB; 10 MiB in 5 members
    with KVServer(listen="127.0.0.1:0", memory_budget=8 * MIB).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.push("other", other)
        with pytest.raises(hk.RemoteError) as exc:
            c.push("big", big)
        assert exc.value.code == E.STORE_FULL and f"needs {big.nbytes} bytes" in str(exc.value)
        assert [k for k, _ in c.list()] == ["other"]  # before: [] (evicted for member 4)
        assert c.pull("other").equal(other)
        fits = _fused(3, 2, seed=3)  # 6 MiB: fits only by evicting "other", which it may
        c.push("fits", fits)
        assert [k for k, _ in c.list()] == ["fits"] and c.pull("fits").equal(fits)
        store = st.server.store
        assert store.memory_bytes + store.reserved_bytes <= 8 * MIB


def test_a_group_keeps_objects_on_disk_out_of_memory_as_it_arrives(tmp_path):
    other, big = _fused(1, 2, seed=1), _fused(5, 2, seed=2)
    with KVServer(listen="127.0.0.1:0", memory_budget=8 * MIB,
                  persist=str(tmp_path)).run_in_thread() as st, KVClient(st.address) as c:
        c.push("other", other)
        with pytest.raises(hk.RemoteError):
            c.push("big", big)
        # a persisted object may leave memory for a group still arriving: it stays on disk
        assert "other" not in st.server.store._objects
        assert [k for k, _ in c.list()] == ["other"] and c.pull("other").equal(other)
