"""``hurraykv serve --memory-budget`` against a real server on loopback: objects leave
memory least recently used first, a pull being a use (issue 35 item 7: the order itself
is checked, write by write, not just that something went)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.net import messages as m
from hurraykv.net.client import KVClient
from hurraykv.net.messages import ErrorCode as E
from hurraykv.net.messages import MessageType as T
from hurraykv.net.server import KVServer
from tests.net.test_net import Raw
from tests.support.snapshots import make_snapshot, zeroed


def test_memory_evicts_the_least_recently_used_in_exact_order(caplog):
    caplog.set_level(logging.INFO, logger="hurraykv.server")
    snaps = {f"k{i}": make_snapshot("float16", seed=i) for i in range(7)}
    size = snaps["k0"].nbytes
    assert {s.nbytes for s in snaps.values()} == {size}
    # three objects fit; a fourth's reservation evicts exactly one to make room
    budget = 3 * size + size // 2
    went: list[str] = []
    with KVServer(listen="127.0.0.1:0", memory_budget=budget).run_in_thread() as st, \
            KVClient(st.address) as c:

        def push(key: str, *evicted: str) -> None:
            before = [k for k, _ in c.list_keys()]
            c.push(key, snaps[key])
            after = [k for k, _ in c.list_keys()]
            assert [k for k in before if k not in after] == list(evicted), (key, after)
            assert key in after
            went.extend(evicted)
            s = c.stat()
            assert s["memory_bytes"] == len(after) * size <= budget
            assert s["memory_evictions"] == len(went)

        def pull(key: str) -> None:  # a use: to the young end
            assert c.pull(key).equal(zeroed(snaps[key]))

        for key in ("k0", "k1", "k2"):
            push(key)
        pull("k0")  # used: k1, k2, k0
        push("k3", "k1")  # by insertion or by name, k0 would go
        pull("k2")  # used: k0, k3, k2
        push("k4", "k0")
        push("k5", "k3")  # not k2, pulled after it
        pull("k2")  # used: k4, k5, k2
        push("k6", "k4")
        assert went == ["k1", "k0", "k3", "k4"]
        assert sorted(k for k, _ in c.list_keys()) == ["k2", "k5", "k6"]
        assert c.has(["k1", "k0", "k3", "k4"]) == [False] * 4
        with pytest.raises(hk.RemoteError) as exc:
            c.pull("k1")
        assert exc.value.code == E.UNKNOWN_TENSOR
        for key in ("k2", "k5", "k6"):
            pull(key)
    # the server's log names them in the same order
    logged = [r.args[0] for r in caplog.records
              if r.name == "hurraykv.server" and r.msg.startswith("evicted %r (")]
    assert logged == went


def test_a_put_that_fails_evicts_others_never_the_value_it_replaces():
    """A PUT replacing ``k`` makes room by evicting the least recently used objects other
    than ``k``: its current value must survive a PUT that then fails (here, a connection
    lost before its data), even when it is the least recently used."""
    tensors = {key: make_snapshot("float16", layers=1, seed=i).tensor(0, "key")
               for i, key in enumerate(("k", "x", "y"))}
    size = sum(memoryview(b).nbytes for b in tensors["k"].clean_buffers())
    with KVServer(listen="127.0.0.1:0", memory_budget=3 * size + size // 2
                  ).run_in_thread() as st, KVClient(st.address) as c:
        for key in ("k", "x", "y"):  # used: k, x, y
            c.push_tensor(key, tensors[key])
        raw = Raw(st.address)
        raw.send(T.TENSOR_PUT, 5, m.Put("k", tensors["k"].descriptor(), size).encode())
        raw.send(T.PING, 7, b"after")  # answered once the PUT's room was made
        assert raw.recv() == (T.PONG, 7, b"after")
        assert st.server.store.reserved_bytes == size
        raw.close()  # the PUT fails: its room is given back
        deadline = time.monotonic() + 10
        while st.server.store.reserved_bytes:
            assert time.monotonic() < deadline, "the lost PUT's room was never released"
            time.sleep(0.01)
        assert sorted(k for k, _ in c.list_keys()) == ["k", "y"]  # x went, k stayed
        back = c.pull_tensor("k", seq_lens=tensors["k"].seq_lens)
        np.testing.assert_array_equal(back.to_dense(), tensors["k"].to_dense())
