"""The contract every chunk store keeps (``hurraykv.chunks.ChunkStore``), as
one pytest test class that each backend's test class inherits (as zarr's
``zarr.testing.StoreTests``): a store, the package's or a third party's, gets every test
below by subclassing ``ChunkStoreTests`` and giving two fixtures,

* ``make``: a callable opening a new client of the backend (another engine), and
* ``capped``: a client of the backend with a small capacity, twelve segments of
  ``segment(16, ...)`` (``max_bytes``-like, a quarter of it for pins: about 1 MB, as
  ``12 * segment(16, 0)``'s saved size, 83,542 bytes in files), or None when it has
  none,

and, where the backend cannot do something, the class attributes ``KEEPS_RECENT`` and
``PINS`` (its own test then says what it does instead)::

    from hurraykv.testing import ChunkStoreTests

    class TestToyStore(ChunkStoreTests):
        @pytest.fixture
        def make(self, tmp_path):
            return lambda: open_store(f"toy://{tmp_path}")

        @pytest.fixture
        def capped(self):
            return None

Segments are small real snapshots with checksums (``segment``); each test keys its own
chunks (``keys``), so a shared server's earlier contents never match."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.io import checksums

from ..chunks.keys import ChunkKeys, identity_digest, identity_key
from ..chunks.registry import ChunkStore

CHUNK = 4
_names = itertools.count()


def segment(pages: int, seed: int, summed: bool = True) -> hk.KVCacheSnapshot:
    """A real segment: ``pages`` pages of ``CHUNK`` tokens, two layers, values drawn from
    ``seed``; with checksums unless ``summed`` is False."""
    rng = np.random.default_rng(seed)
    pools = [rng.standard_normal((pages, CHUNK, 2, 8)).astype(np.float16) for _ in range(2)]
    snap = hk.KVCacheSnapshot.from_arrays(pools, [p * 2 for p in pools], np.arange(pages),
                                          [0, pages], [pages * CHUNK])
    return checksums.with_checksums(snap) if summed else snap


def keys(chunks: int) -> list[str]:
    """Chunk keys no other test uses."""
    return ChunkKeys(identity_digest(f"contract-{next(_names)}-{np.random.random()}"),
                     CHUNK).upto(list(range(chunks * CHUNK)), chunks)


class ChunkStoreTests:
    """Every test a chunk store passes; inherit it and give the fixtures ``make`` and
    ``capped`` (the module docstring says how)."""

    # Past its capacity the store keeps the most recently used (a store whose eviction is
    # sampled, like Redis's, may keep none of a burst: only exactness is asked of it).
    KEEPS_RECENT = True
    PINS = True  # it keeps a pinned segment through evictions (Redis cannot: refused)

    @pytest.fixture
    def store(self, make: Callable[[], ChunkStore]):
        s = make()
        yield s
        s.close()

    def test_a_segment_is_found_by_every_chunk_key(self, store):
        k = keys(6)
        assert store.locate(k) == [None] * 6 and store.has(k) == [False] * 6
        snap = segment(3, 1)
        store.put(k[2:5], 2, snap, {"vllm.first_chunk": 2})
        located = store.locate(k)
        assert located[:2] == [None, None] and located[5] is None
        assert len(set(located[2:5])) == 1
        assert store.has(k) == [False, False, True, True, True, False]
        assert store.get(located[3]).equal(snap)
        back = store.get_verified(located[3])
        assert back.equal(snap)
        assert back.metadata["vllm.first_chunk"] == 2  # what put was given comes back

    def test_another_client_finds_what_one_stored(self, store, make):
        k, snap = keys(2), segment(2, 2)
        store.put(k, 0, snap, {})
        other = make()
        try:
            assert other.get_verified(other.locate(k)[0]).equal(snap)
        finally:
            other.close()

    def test_the_catalog_lists_each_segment_with_its_identity(self, store):
        mine, theirs = (f"model=contract-{next(_names)}-{np.random.random()}" for _ in "ab")
        ka, kb = keys(2), keys(3)
        store.put(ka, 0, segment(2, 3).with_info(model=mine), {})
        store.put(kb, 0, segment(3, 4).with_info(model=theirs), {})
        a, b = store.locate(ka)[0], store.locate(kb)[0]
        listed = {s.name: s for s in store.catalog()}
        assert listed[a].identity_key == identity_key(mine)
        assert listed[b].identity_key == identity_key(theirs)
        assert listed[a].identity in (mine, None)  # the string, where the store keeps it
        assert 0 < listed[a].nbytes < listed[b].nbytes  # 2 pages against 3
        for s in (listed[a], listed[b]):
            assert s.used is None or abs(s.used - time.time()) < 120
            assert s.created is None or abs(s.created - time.time()) < 120

    def test_clear_removes_one_identity_and_nothing_else(self, store, make):
        mine, theirs = (f"model=contract-{next(_names)}-{np.random.random()}" for _ in "ab")
        ka, kb, kc = keys(2), keys(2), keys(1)
        store.put(ka[:1], 0, segment(1, 5).with_info(model=mine), {})
        store.put(ka[1:], 1, segment(1, 6).with_info(model=mine), {})
        store.put(kb, 0, segment(2, 7).with_info(model=theirs), {})
        store.put(kc, 0, segment(1, 8), {})  # stored with no identity at all
        names = store.locate(ka)
        other = make()  # another engine's client clears them
        try:
            removed = other.clear(identity_key(mine))
        finally:
            other.close()
        assert sorted(s.name for s in removed) == sorted(names)
        assert store.locate(ka) == [None, None] and store.exists(names) == [False, False]
        assert store.get_verified(store.locate(kb)[0]).equal(segment(2, 7))
        assert store.locate(kc)[0] is not None
        assert store.clear(identity_key(mine)) == []  # nothing left of it: idempotent
        assert store.remove(names[0]) is False

    def test_a_name_never_stored_is_a_hurray_error(self, store):
        with pytest.raises(hk.HurrayError):
            store.get("0" * 32 + "-0")

    def test_damaged_values_are_refused_and_discarded(self, store):
        """Stored values that do not match the checksums written with them (a damaged
        object, as any backend can hold one) are a ChecksumError, never data; once
        discarded, the chunks are misses."""
        k, snap = keys(2), segment(2, 3)
        damaged = checksums.with_checksums(snap)
        np.frombuffer(memoryview(damaged.tensor(1, "value").page_pool).cast("B"),
                      np.uint8)[7] ^= 0x20
        store.put(k, 0, damaged, {})
        name = store.locate(k)[0]
        with pytest.raises(checksums.ChecksumError, match=r"member layers\.1\.value"):
            store.get_verified(name)
        store.discard(name)
        assert store.locate(k) == [None, None]

    def test_members_besides_the_pages_come_back_whole_in_order_and_checked(self, store):
        """A hybrid model's segment carries its layers' recurrent states as row-major
        members besides the block-paged ones (integrations/vllm/hybrid.py): every
        backend keeps them, bytes, dtype, shape and order (names need not survive), and
        their checksums hold them like pages."""
        from hurraykv.integrations.vllm.hybrid import state_member

        rng = np.random.default_rng(9)
        states = [rng.standard_normal((3, 5)).astype(np.float32),
                  rng.integers(0, 255, 7, dtype=np.uint8)]
        base = segment(2, 7, summed=False)
        snap = hk.KVCacheSnapshot.from_tensors(
            base.tensors(), extras=[state_member(f"states.0.{k}", s)
                                    for k, s in enumerate(states)])
        k = keys(2)
        store.put(k, 0, checksums.with_checksums(snap), {})
        back = store.get_verified(store.locate(k)[0])
        assert back.equal(base)
        got = [(np.dtype(d.element_type.numpy), tuple(d.shape), np.asarray(
            memoryview(b[0]).cast("B")).tobytes()) for _, d, b in back.extras]
        assert got == [(s.dtype, s.shape, s.tobytes()) for s in states]
        damaged = checksums.with_checksums(snap)
        np.frombuffer(damaged.extras[0][2][0], np.uint8)[5] ^= 0x10
        k = keys(2)
        store.put(k, 0, damaged, {})
        with pytest.raises(checksums.ChecksumError):
            store.get_verified(store.locate(k)[0])

    def test_a_segment_without_checksums_is_not_vouched_for(self, store):
        k = keys(1)
        store.put(k, 0, segment(1, 4, summed=False), {})
        with pytest.raises(checksums.ChecksumError):
            store.get_verified(store.locate(k)[0])

    def test_concurrent_writers_lose_nothing(self, make):
        clients = [make() for _ in range(2)]
        work = [(keys(2), segment(2, 10 + i)) for i in range(8)]
        errors: list[BaseException] = []

        def write(client: ChunkStore, part: list) -> None:
            try:
                for k, snap in part:
                    client.put(k, 0, snap, {})
            except BaseException as e:  # reported below, not lost in the thread
                errors.append(e)

        threads = [threading.Thread(target=write, args=(c, work[i::2]))
                   for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        try:
            assert errors == []
            for k, snap in work:
                assert clients[0].get_verified(clients[0].locate(k)[0]).equal(snap)
        finally:
            for c in clients:
                c.close()

    def test_past_its_capacity_a_store_evicts_and_every_read_is_exact_or_an_error(
            self, capped):
        if capped is None:
            pytest.skip("this backend's capacity is set elsewhere (see its test class)")
        stored = []
        for i in range(60):
            k, snap = keys(4), segment(16, 100 + i)
            try:
                capped.put(k, 0, snap, {})
            except hk.HurrayError:  # refused for room: nothing stored, nothing lost
                continue
            stored.append((k, snap))
        found = 0
        for k, snap in stored:
            name = capped.locate(k)[0]
            if name is None:
                continue
            try:
                got = capped.get_verified(name)
            except hk.HurrayError:  # evicted between locate and read: a miss
                continue
            assert got.equal(snap)
            found += 1
        assert found < len(stored), "nothing was evicted"
        assert found > 0 or not self.KEEPS_RECENT, (found, len(stored))

    def test_a_segment_past_its_lifetime_is_a_miss(self, store):
        k, snap = keys(2), segment(2, 20)
        store.put(k, 0, snap, {})
        name = store.locate(k)[0]
        asked = time.time()
        assert store.retain([name, "f" * 32 + "-0"], pin=False, ttl_s=2.0) == [name]
        listed = {s.name: s for s in store.catalog()}
        expiry = listed[name].expiry
        # two seconds from the ask (a loaded machine may take one to list)
        assert expiry is not None and asked + 1.9 <= expiry <= time.time() + 2.1
        if time.time() < expiry:  # still alive: served
            assert store.get_verified(store.locate(k)[0]).equal(snap)
        time.sleep(max(0.0, expiry - time.time()) + 0.3)
        assert store.locate(k) == [None, None]
        store.put(k, 0, snap, {})  # stored again: a new segment, not one past its lifetime
        assert store.get_verified(store.locate(k)[0]).equal(snap)

    def test_a_lifetime_that_is_not_one_is_refused_naming_ttl_s(self, store):
        k = keys(1)
        store.put(k, 0, segment(1, 22), {})
        name = store.locate(k)[0]
        for bad in (10**400, float("nan"), float("inf"), 0, -1, 1e300, True, "60"):
            with pytest.raises(hk.HurrayError) as e:  # never an OverflowError, never a drop
                store.retain([name], pin=None, ttl_s=bad)
            assert e.value.field is not None and e.value.field.endswith("ttl_s"), (bad, e.value)
        assert {s.name: s for s in store.catalog()}[name].expiry is None  # nothing changed
        assert store.retain([name], pin=None, ttl_s=3600.0) == [name]  # and it still answers

    def test_a_requests_lifetime_never_undoes_a_pin(self, store):
        if not self.PINS:
            pytest.skip("no pins on this backend (see its test class)")
        k = keys(1)
        store.put(k, 0, segment(1, 21), {})
        name = store.locate(k)[0]
        assert store.retain([name], pin=True, ttl_s=None) == [name]  # an operator's
        store.retain([name], pin=None, ttl_s=0.3, extend=True)  # a request's ask
        kept = {s.name: s for s in store.catalog()}[name]
        assert kept.pinned and kept.expiry is None
        time.sleep(0.5)
        assert store.locate(k)[0] == name
        assert store.retain([name], pin=False, ttl_s=None) == [name]  # released
        assert not {s.name: s for s in store.catalog()}[name].pinned

    def test_a_pinned_segment_outlives_a_flood_until_released(self, capped):
        if capped is None or not self.PINS:
            pytest.skip("no capacity of its own here, or no pins (see its test class)")
        k, snap = keys(4), segment(16, 30)
        capped.put(k, 0, snap, {})
        name = capped.locate(k)[0]
        assert capped.retain([name], pin=True, ttl_s=None) == [name]
        for i in range(30):  # 2.5 times the capacity
            capped.put(keys(4), 0, segment(16, 200 + i), {})
        assert capped.locate(k)[0] == name
        assert capped.get_verified(name).equal(snap)
        assert [s.pinned for s in capped.catalog() if s.name == name] == [True]
        assert capped.retain([name], pin=False, ttl_s=None) == [name]
        for i in range(30):
            capped.put(keys(4), 0, segment(16, 300 + i), {})
        assert capped.locate(k)[0] is None  # released, it went as any other

    def test_pins_past_the_pinned_budget_are_refused(self, capped):
        if capped is None or not self.PINS:
            pytest.skip("no capacity of its own here, or no pins (see its test class)")
        names = []
        for i in range(4):  # the budget is a quarter of 12 segments: three
            k = keys(4)
            capped.put(k, 0, segment(16, 40 + i), {})
            names.append(capped.locate(k)[0])
        assert capped.retain(names[:3], pin=True, ttl_s=None) == names[:3]
        with pytest.raises(hk.HurrayError, match="max_pinned_bytes") as e:
            capped.retain(names[3:], pin=True, ttl_s=None)
        assert e.value.field == "max_pinned_bytes"
        pinned = {s.name for s in capped.catalog() if s.pinned}
        assert pinned == set(names[:3])  # the refused one changed nothing
        capped.retain(names[:1], pin=False, ttl_s=None)
        assert capped.retain(names[3:], pin=True, ttl_s=None) == names[3:]  # room now
