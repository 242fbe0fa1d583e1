"""``hurraykv serve --max-bytes-per-tenant`` under mutual TLS: a noisy tenant's pushes
evict its own least recently used objects from memory, never another tenant's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from hurraykv.errors import RemoteError
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from hurraykv.testing import segment
from tests.net.test_server_retention import client_of
from tests.support.certs import PKI, name
from tests.support.snapshots import zeroed


def test_a_noisy_tenant_evicts_only_its_own_objects(tmp_path):
    pki = PKI(tmp_path)
    server, key = pki.pair("server")
    with client_of() as c:  # an object's bytes
        c.push("probe", segment(16, 0))
        size = c.stat()["memory_bytes"]
    with KVServer(listen="127.0.0.1:0", tls_cert=server, tls_key=key, tls_ca=pki.ca_pem,
                  max_bytes_per_tenant=3 * size).run_in_thread() as st:
        def connect(label: str) -> KVClient:
            cert, ckey = pki.client(label, name(("CN", label)), None)
            return KVClient(st.address, tls_cert=cert, tls_key=ckey, tls_ca=pki.ca_pem)

        quiet, noisy = connect("quiet"), connect("noisy")
        for i in range(3):
            quiet.push(f"q{i}", segment(16, i))
        for i in range(10):
            noisy.push(f"n{i}", segment(16, 10 + i))
        assert quiet.has(["q0", "q1", "q2"]) == [True] * 3  # untouched
        assert noisy.has([f"n{i}" for i in range(10)]) == [False] * 7 + [True] * 3
        assert noisy.stat()["memory_bytes"] <= 3 * size
        # its pinned objects fill its quota: the next push is refused, naming the quota
        assert noisy.retain(["n7", "n8", "n9"], pin=True, ttl_s=None) == ["n7", "n8", "n9"]
        with pytest.raises(RemoteError, match="max-bytes-per-tenant") as e:
            noisy.push("n10", segment(16, 30))
        assert e.value.code == 0xF1  # STORE_FULL
        assert quiet.has(["q0"]) == [True] and noisy.has(["n9"]) == [True]
        quiet.close()
        noisy.close()


@contextlib.contextmanager
def tenants(tmp_path, **config) -> Iterator[Callable[[str], KVClient]]:
    """A mutual-TLS server; ``connect(label)`` a client of the tenant ``CN=label``."""
    pki = PKI(tmp_path)
    server, key = pki.pair("server")
    opened: list[KVClient] = []
    with KVServer(listen="127.0.0.1:0", tls_cert=server, tls_key=key, tls_ca=pki.ca_pem,
                  **config).run_in_thread() as st:
        def connect(label: str) -> KVClient:
            cert, ckey = pki.client(label, name(("CN", label)), None)
            opened.append(KVClient(st.address, tls_cert=cert, tls_key=ckey,
                                   tls_ca=pki.ca_pem))
            return opened[-1]
        try:
            yield connect
        finally:
            for c in opened:
                c.close()


def memory_keys(c: KVClient) -> set[str]:
    return {k for k, _ in c.list_keys()}


def test_one_push_past_the_quota_evicts_room_for_all_of_itself(tmp_path):
    """A tensor is one reservation: the quota must hold the tenant's objects *and* it, so
    a fourth tensor under a quota of three evicts the oldest (not left at four)."""
    tensors = [segment(16, i).tensor(0, "key") for i in range(5)]
    size = sum(memoryview(b).nbytes for b in tensors[0].clean_buffers())
    with tenants(tmp_path, max_bytes_per_tenant=3 * size) as connect:
        c = connect("t")
        for i, t in enumerate(tensors):
            c.push_tensor(f"k{i}", t)
            assert c.stat()["memory_bytes"] <= 3 * size, i
        assert memory_keys(c) == {"k2", "k3", "k4"}


def test_a_tenants_aliases_count_against_its_own_quota(tmp_path):
    """Issue 46 item 2: aliases are held against their tenant's quota; a tenant linking
    aliases to its own object is refused at its quota, and another tenant's memory-only
    object and its pushes within its quota are untouched."""
    size = segment(16, 0).nbytes
    quota = 6 * size
    with tenants(tmp_path, max_bytes_per_tenant=quota, memory_budget=2 * quota) as connect:
        a, b = connect("a"), connect("b")
        b.push("b0", segment(16, 1))  # memory only: evicting it loses it
        a.push("a0", segment(16, 2))
        linked = 0
        with pytest.raises(RemoteError, match="max-bytes-per-tenant") as e:
            for i in range(200):  # ~1 KB each: 200 would pass 2 * quota
                a.link([(f"{i:04d}".ljust(1000, "x"), "a0")])
                linked += 1
        assert e.value.code == 0xF1  # STORE_FULL
        s = a.stat()
        assert 0 < linked == s["aliases"] and s["memory_bytes"] + s["alias_bytes"] <= quota
        assert a.has(["a0"]) == [True]  # its target is never evicted for its aliases
        for i in range(1, 6):  # b's quota is its own: five more objects fit
            b.push(f"b{i}", segment(16, 10 + i))
        assert memory_keys(b) == {f"b{i}" for i in range(6)}
        assert b.pull("b0").equal(zeroed(segment(16, 1)))


def test_a_push_within_its_quota_never_evicts_another_tenants_object(tmp_path):
    """Issue 46 item 11: quotas that together pass --memory-budget.  Each tenant keeps
    what it holds: a push the budget can hold only by evicting another tenant's object is
    refused STORE_FULL naming --memory-budget; room comes from the tenant's own objects,
    or once the other lets go."""
    size = segment(16, 0).nbytes
    with tenants(tmp_path, max_bytes_per_tenant=3 * size,
                 memory_budget=3 * size + size // 2) as connect:
        a, b = connect("a"), connect("b")
        for i in range(3):
            a.push(f"a{i}", segment(16, i))  # a0 is the least recently used
        with pytest.raises(RemoteError, match="memory-budget") as e:
            b.push("b0", segment(16, 10))
        assert e.value.code == 0xF1  # STORE_FULL
        assert memory_keys(a) == {"a0", "a1", "a2"} and memory_keys(b) == set()
        a.delete("a0")
        b.push("b0", segment(16, 10))
        b.push("b1", segment(16, 11))  # room from b's own b0, not a's
        assert memory_keys(a) == {"a1", "a2"} and memory_keys(b) == {"b1"}


def test_objects_pulled_back_from_the_store_stay_within_the_quota(tmp_path, redis_url):
    """Issue 46 item 5: a copy of an object pulled back from the backing store (--store)
    is kept in memory only within its tenant's quota (its own least recently used copies
    leave for it), never by evicting another tenant's object."""
    from hurraykv.store import PageStore

    store = PageStore.from_url(redis_url)
    store.client.flushall()
    store.client.close()
    size = segment(16, 0).nbytes
    quota = 2 * size + size // 2
    with tenants(tmp_path, store=redis_url, max_bytes_per_tenant=quota,
                 memory_budget=4 * quota) as connect:  # the quota binds, not the budget
        a, b = connect("a"), connect("b")
        for i in range(2):
            b.push(f"b{i}", segment(16, 20 + i))
        snaps = {f"a{i}": segment(16, i) for i in range(6)}
        for key, snap in snaps.items():  # each evicts a's oldest copy: all backed
            a.push(key, snap)
        for key, snap in snaps.items():  # pulled back from the store, one by one
            assert a.pull(key).equal(zeroed(snap))
            assert a.stat()["memory_bytes"] <= quota, key
        assert b.stat()["objects_in_memory"] == 2
