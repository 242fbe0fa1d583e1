"""Pins and lifetimes on a ``hurraykv serve`` with a persist directory (the RETAIN
message, decision H93): a pinned object stays through both tiers' evictions and through
a restart; an expired one is gone for every client."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from hurraykv.errors import RemoteError
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from hurraykv.testing import segment


@contextlib.contextmanager
def client_of(**server) -> Iterator[KVClient]:
    """A client of a new server on a free loopback port."""
    with KVServer(listen="127.0.0.1:0", **server).run_in_thread() as st, \
            KVClient(st.address) as c:
        yield c


def test_a_pin_holds_through_disk_evictions_and_a_restart(tmp_path):
    persist = tmp_path / "persist"
    snap = segment(16, 1)
    with client_of(persist=str(persist)) as c:  # an object's bytes and its file's
        c.push("probe", snap)
        held = c.stat()["memory_bytes"]
    size = max(p.stat().st_size for p in persist.glob("*.hrry"))
    budgets = {"persist": str(persist), "memory_budget": 3 * held,
               "persist_budget": 6 * size, "max_pinned_bytes": 2 * size}
    with client_of(**budgets) as c:
        c.push("system", snap)
        assert c.retain(["system", "nothing"], pin=True, ttl_s=None) == ["system"]
        for i in range(20):
            c.push(f"flood-{i}", segment(16, 10 + i))
        assert c.has(["system", "flood-0"]) == [True, False]
        assert c.pull("system").equal(snap)
    with client_of(**budgets) as c:
        assert c.retention()["system"][0] is True  # the record survived
        for i in range(20):
            c.push(f"again-{i}", segment(16, 40 + i))
        assert c.pull("system").equal(snap)
        assert c.retain(["system"], pin=False, ttl_s=0.3) == ["system"]
        assert c.retention()["system"][:1] == (False,)
        time.sleep(0.5)
        assert c.has(["system"]) == [False] and c.retention() == {}


def test_pins_past_max_pinned_bytes_are_refused_with_store_full():
    with client_of(max_pinned_bytes=20_000) as c:
        for key in ("a", "b", "c"):
            c.push(key, segment(16, 1))
        assert c.retain(["a", "b"], pin=True, ttl_s=None) == ["a", "b"]
        with pytest.raises(RemoteError, match="max_pinned_bytes 20000") as e:
            c.retain(["c"], pin=True, ttl_s=None)
        assert e.value.code == 0xF1  # STORE_FULL
        assert sorted(c.retention()) == ["a", "b"]


def test_a_lifetime_no_float_holds_is_refused_and_the_connection_kept():
    with client_of() as c:
        c.push("a", segment(16, 1))
        for bad in (10**400, -1, 1e300):  # an int past a float once dropped the connection
            with pytest.raises(RemoteError, match=r"ttl_s is .*at most 3155760000") as e:
                c.retain(["a"], pin=None, ttl_s=bad)
            assert e.value.code == 6  # INVALID_MESSAGE, on this stream only
        assert c.retain(["a"], pin=None, ttl_s=60) == ["a"]  # the same connection
        assert c.has(["a"]) == [True]


def test_an_overwrite_of_a_pinned_key_is_held_to_max_pinned_bytes(tmp_path):
    """Issue 46 item 3: a pinned key pushed again pins its new size.  Past
    --max-pinned-bytes the push is refused STORE_FULL naming it (the old value stays,
    pinned at its size); within it, the pin holds the new size."""
    small, big = segment(16, 1), segment(64, 2)
    with client_of(max_pinned_bytes=small.nbytes + small.nbytes // 2,
                   persist=str(tmp_path / "persist")) as c:
        c.push("a", small)
        assert c.retain(["a"], pin=True, ttl_s=None) == ["a"]
        with pytest.raises(RemoteError, match="max_pinned_bytes") as e:
            c.push("a", big)
        assert e.value.code == 0xF1  # STORE_FULL
        assert c.pull("a").equal(small) and c.retention()["a"][::2] == (True, small.nbytes)
        c.push("b", big)  # not pinned: any size
        smaller = segment(8, 3)
        c.push("a", smaller)
        assert c.retention()["a"][::2] == (True, smaller.nbytes)
