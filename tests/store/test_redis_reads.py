"""The Redis read path (issue 47 item 4): a get is one pipelined pass whose replies land in
a recycled buffer, hashed as they land, against a real redis-server (and a real cluster,
where redis-py pipelines carry the pages instead)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.chunks.urls import open_store
from hurraykv.io import checksums, page_hash
from hurraykv.store import PageStore
from hurraykv.store.capacity import MissingPagesError
from hurraykv.store.members import ZERO, Member
from hurraykv.store.pages import StoreError, page_key
from hurraykv.testing import CHUNK, keys
from tests.support.redis_fixtures import emptied_url
from tests.support.snapshots import KINDS, make_snapshot, zeroed


def big(seed: int, pages: int = 64) -> hk.KVCacheSnapshot:
    """Two layers x K, V of ``pages`` 16 KiB pages, with checksums."""
    rng = np.random.default_rng(seed)
    pools = [rng.standard_normal((pages, CHUNK, 16, 128)).astype(np.float16)
             for _ in range(2)]
    return checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
        pools, [-p for p in pools], np.arange(pages), [0, pages], [pages * CHUNK]))


def memory_of(snap: hk.KVCacheSnapshot) -> set[int]:
    """The ids of the arrays owning the memory of the snapshot's page pools."""
    return {id(_owner(t.page_pool)) for t in snap.tensors()}


def _owner(a: np.ndarray) -> np.ndarray:
    """The last array of ``a``'s chain of bases (through the memoryviews tensors take)."""
    owner: object = a
    while isinstance(owner, np.ndarray | memoryview):
        if isinstance(owner, np.ndarray):
            a = owner
        owner = owner.obj if isinstance(owner, memoryview) else owner.base
    return a


def test_a_get_lands_in_one_buffer_reused_once_its_snapshot_is_gone(redis_url):
    store = open_store(redis_url)
    try:
        k = keys(64)
        store.put(k, 0, big(1), {})
        name = store.locate(k)[0]
        first = store.get_verified(name)
        owners = memory_of(first)
        assert len(owners) == 1, "every member's pages in one buffer"
        buffer = weakref.ref(_owner(first.tensor(0, "key").page_pool))
        second = store.get(name)  # the first is alive: other memory
        assert memory_of(second) != owners and first.equal(big(1))
        del first
        gc.collect()
        third = store.get_verified(name)
        assert buffer() is not None and memory_of(third) == {id(buffer())}, \
            "the buffer of a snapshot that is gone is received into again"
        assert third.equal(big(1)) and second.equal(big(1))
    finally:
        store.close()


def test_a_damaged_page_is_caught_in_a_recycled_buffer(redis_url):
    """The recycled buffer held the page's good bytes from the get before: a page damaged
    in Redis since is still found by its checksum, never read as the stale bytes; and
    found by the get itself, even in a member the connector would check later (a
    ``redis://`` get leaves nothing for later)."""
    store = open_store(redis_url)
    later = frozenset({"layers.1.value"})
    try:
        k, snap = keys(64), big(2)
        store.put(k, 0, snap, {})
        name = store.locate(k)[0]
        back, pending = store.get_checked(name, later)
        assert back.equal(snap) and pending is None
        del back
        digests = Member(snap.tensor(1, "value")).digests()
        store.store.client.setrange(page_key(digests[37]), 100, b"\x55")
        with pytest.raises(checksums.ChecksumError,
                           match=r"page 37 of buffer 0 of member layers\.1\.value"):
            store.get_checked(name, later)
        store.discard(name)
        k = keys(64)
        store.put(k, 0, big(3), {})  # the store reads on
        assert store.get_verified(store.locate(k)[0]).equal(big(3))
    finally:
        store.close()


@pytest.fixture(params=["single", "cluster"])
def page_store(request):
    s = PageStore.from_url(emptied_url(request))
    yield s
    s.client.close()


@pytest.mark.parametrize("hashing", ["compiled", "xxhash"])
@pytest.mark.parametrize("kind", [*KINDS, "float16, values of another head size"])
def test_hashed_get_digests_are_the_checksum_entry(page_store, kind, hashing, monkeypatch):
    """Every page hashed as it landed (unreferenced pages as zeros, per-slot scales
    apart from the pool, keys' and values' pages of two sizes in one window), the other
    buffers after: the entry the writer recorded; by the compiled hasher a process has
    built, else page by page."""
    if hashing == "compiled" and page_hash.hasher() is None:
        pytest.skip("no compiled hasher here (numba missing or HURRAYKV_KERNELS=numpy)")
    if hashing == "xxhash":
        monkeypatch.setattr(page_hash, "_built", (None, None, None))
    snap = checksums.with_checksums(zeroed(
        make_snapshot(kind) if kind in KINDS else make_snapshot("float16", dim_v=24)))
    page_store.put("hashed", snap)
    back, digests = page_store.get_hashed("hashed")
    assert back.equal(snap)
    assert digests.astype(">u8").tobytes().hex() == snap.metadata[checksums.KEY]
    checksums.verify(back, "hashed", digests)


def _unshared_page(snap: hk.KVCacheSnapshot, member: tuple[int, str], index: int) -> bytes:
    digests = Member(snap.tensor(*member)).digests()
    assert digests[index] != ZERO
    return digests[index]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_missing_page_anywhere_in_a_window_is_named_and_the_connection_stays_usable(
        redis_url, where):
    """A nil reply among scattered ones (the first, one in the middle of a window, the
    very last: no byte follows it) is found without waiting for bytes Redis never sends;
    the store's next get on the same connection reads whole."""
    store = PageStore.from_url(redis_url + "?socket_timeout=10")
    pages = 160  # 4 members of 2.5 MiB: replies past two of the reader's 4 MiB windows
    snap, other = big(4, pages), big(5, 8)
    store.put("victim", snap)
    store.put("other", other)
    member, index = {"first": ((0, "key"), 0), "middle": ((0, "value"), pages // 2),
                     "last": ((1, "value"), pages - 1)}[where]
    store.client.delete(page_key(_unshared_page(snap, member, index)))
    with pytest.raises(MissingPagesError, match=rf"layer {member[0]} {member[1]} page "
                                                rf"{index} .* missing"):
        store.get("victim")
    assert store.get("other").equal(other)
    store.delete("victim")
    store.delete("other")


def test_a_page_of_another_size_is_refused_naming_it(redis_url):
    store = PageStore.from_url(redis_url + "?socket_timeout=10")
    snap = big(6, 16)
    store.put("resized", snap)
    key = page_key(_unshared_page(snap, (1, "key"), 5))
    store.client.append(key, b"xyz")
    with pytest.raises(StoreError, match=r"'resized': layer 1 key page 5 \(hkv:p:.*\) holds "
                                         r"16387 bytes, expected 16384") as e:
        store.get("resized")
    assert e.value.field == "page"
    store.client.delete(key)
    with pytest.raises(MissingPagesError):
        store.get("resized")
    store.delete("resized")


def test_an_error_reply_among_the_pages_is_a_store_error_and_the_store_reads_on(redis_url):
    store = PageStore.from_url(redis_url + "?socket_timeout=10")
    snap, other = big(7, 40), big(8, 8)
    store.put("typed", snap)
    store.put("other", other)
    key = page_key(_unshared_page(snap, (0, "value"), 17))
    store.client.delete(key)
    store.client.hset(key, "a", 1)  # not a string: Redis answers WRONGTYPE to its GET
    with pytest.raises(StoreError, match="WRONGTYPE") as e:
        store.get("typed")
    assert e.value.field == "reply"
    assert store.get("other").equal(other)
    store.client.delete(key)
    store.delete("typed")
    store.delete("other")
