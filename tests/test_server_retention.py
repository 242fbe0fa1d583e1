"""Pins and lifetimes on a ``hurraykv serve`` with a persist directory (the RETAIN
message, decision H93): a pinned object stays through both tiers' evictions and through
a restart; an expired one is gone for every client."""

from __future__ import annotations

import time

from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from tests.store_contract import segment


def test_a_pin_holds_through_disk_evictions_and_a_restart(tmp_path):
    persist = tmp_path / "persist"
    snap = segment(16, 1)
    with KVServer(listen="127.0.0.1:0", persist=str(persist)).run_in_thread() as st:
        with KVClient(st.address) as c:  # an object's bytes and its file's, to size
            c.push("probe", snap)        # the budgets
            held = c.stat()["memory_bytes"]
        size = max(p.stat().st_size for p in persist.glob("*.hrry"))
    budgets = {"memory_budget": 3 * held, "persist_budget": 6 * size,
               "max_pinned_bytes": 2 * size}
    with KVServer(listen="127.0.0.1:0", persist=str(persist), **budgets).run_in_thread() as st:
        with KVClient(st.address) as c:
            c.push("system", snap)
            assert c.retain(["system", "nothing"], pin=True, ttl_s=None) == ["system"]
            for i in range(20):
                c.push(f"flood-{i}", segment(16, 10 + i))
            assert c.has(["system", "flood-0"]) == [True, False]
            assert c.pull("system").equal(snap)
    with KVServer(listen="127.0.0.1:0", persist=str(persist), **budgets).run_in_thread() as st:
        with KVClient(st.address) as c:
            assert c.retention()["system"][0] is True  # the record survived
            for i in range(20):
                c.push(f"again-{i}", segment(16, 40 + i))
            assert c.pull("system").equal(snap)
            assert c.retain(["system"], pin=False, ttl_s=0.3) == ["system"]
            assert c.retention()["system"][:1] == (False,)
            time.sleep(0.5)
            assert c.has(["system"]) == [False] and c.retention() == {}


def test_pins_past_max_pinned_bytes_are_refused_with_store_full(tmp_path):
    import pytest

    from hurraykv.errors import RemoteError

    with KVServer(listen="127.0.0.1:0", max_pinned_bytes=20_000).run_in_thread() as st:
        with KVClient(st.address) as c:
            for key in ("a", "b", "c"):
                c.push(key, segment(16, 1))
            assert c.retain(["a", "b"], pin=True, ttl_s=None) == ["a", "b"]
            with pytest.raises(RemoteError, match="max_pinned_bytes 20000") as e:
                c.retain(["c"], pin=True, ttl_s=None)
            assert e.value.code == 0xF1  # STORE_FULL
            assert sorted(c.retention()) == ["a", "b"]
