"""``S3Chunks.get_pages`` (``chunks/s3_pages.py``): a load from ``s3://`` fetches its
segment's structure and the pages it places, never the rest, on a real S3 server
(SeaweedFS): the bytes placed, the bytes fetched, a page damaged in the bucket, an object
stored again under its name, a page nothing was fetched for, and the server killed
mid-fetch."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from hurraykv.chunks.urls import open_store
from hurraykv.errors import HurrayError, TransportError
from hurraykv.io import checksums, scatter
from hurraykv.snapshot_members import member_name
from hurraykv.testing import keys
from tests.store.test_s3_store import big
from tests.support.s3_servers import REGION

pytestmark = pytest.mark.skipif(not scatter.available(), reason="no compiled reader")
ROLES = ("key", "value")
MEMBERS = frozenset(member_name(layer, role) for layer in (0, 1) for role in ROLES)
N, K = 256, 64  # a segment's pages (2 MiB a member); a load of its last K


def place(source, first: int, n: int, layers=(0, 1), memory=None
          ) -> tuple[np.ndarray, dict]:
    """Pages ``first .. first + n`` of every member into blocks ``0 .. n`` of a buffer
    of its own (``memory``, else new, 0xAB where nothing is placed), one ``Scatter`` a
    layer as the connector's loads do (``direct.scatter_layer``): the buffers, and what
    failed."""
    page = source.members[member_name(0, "key")][1]
    if memory is None:
        memory = np.full((2, 2, n, page), 0xAB, np.uint8)
    rows, heads, dims, elem = 4, 8, 128, 2  # test_s3_store.big's pages
    failed = {}
    for layer in layers:
        out = scatter.Scatter()
        for r, role in enumerate(ROLES):
            dest = scatter.destination(memory[layer, r].reshape(-1), 0, page,
                                       (rows, heads, dims * elem, elem, heads * dims * elem,
                                        dims * elem, elem), n)
            out.add(source, member_name(layer, role), first, list(range(n)), dest,
                    (layer, role))
        failed.update(out.run())
    return memory, failed


def pages(snap, first: int, n: int) -> np.ndarray:
    """What ``place`` puts where, of ``snap``."""
    return np.stack([np.stack([
        np.frombuffer(snap.tensor(layer, role).page_pool[first:first + n].tobytes(),
                      np.uint8).reshape(n, -1) for role in ROLES]) for layer in (0, 1)])


def loads_last_pages(store, name: str, snap) -> None:
    """A load of the last ``K`` pages of segment ``name`` from ``store`` places exactly
    ``snap``'s."""
    _, source = store.get_pages(name, MEMBERS)
    memory, failed = place(source, N - K, K)
    assert failed == {} and np.array_equal(memory, pages(snap, N - K, K))
    source.close()


def raw(url: str):
    """The bucket of ``url`` as a plain obstore client, and the key of a segment in it:
    objects written around the store (damaged, stored again)."""
    from obstore.store import S3Store

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = S3Store(bucket, config={"endpoint": os.environ["AWS_ENDPOINT_URL"],
                                     "region": REGION,
                                     "virtual_hosted_style_request": False},
                     client_options={"allow_http": True})
    return client, lambda name: f"{prefix}/segments/{name}.hrry"


def stored(url: str, pages_: int = N, seed: int = 1):
    """A segment of ``pages_`` pages put at ``url`` by a store that is then closed (its
    reader is another engine's): its keys, snapshot, name and object bytes."""
    import obstore

    writer = open_store(url)
    k, snap = keys(pages_), big(pages_, seed)
    writer.put(k, 0, snap, {})
    name = writer.locate(k)[-1]
    writer.close()
    client, key = raw(url)
    return k, snap, name, bytes(obstore.get(client, key(name)).bytes())


def test_a_load_of_the_last_pages_fetches_them_and_the_structure_only(s3_url):
    k, snap, name, data = stored(s3_url)
    store = open_store(s3_url)
    assert store.locate(k)[-1] == name
    before = store.bytes_fetched
    got, source = store.get_pages(name, MEMBERS)  # a structure this process never read
    assert store.bytes_fetched - before == len(data)  # the whole object, once
    memory, failed = place(source, 0, N)
    assert failed == {} and np.array_equal(memory, pages(snap, 0, N))
    source.close()
    assert store.bytes_fetched - before == len(data)  # nothing more: it held every page

    pool = snap.tensor(0, "key").page_pool
    page, pools = pool[0].nbytes, 4 * pool.nbytes
    before = store.bytes_fetched
    got, source = store.get_pages(name, MEMBERS)  # known now: its structure only
    structure = len(data) - pools
    assert store.bytes_fetched - before == structure
    # the block tables and sequence lengths were fetched and verified with it
    assert np.array_equal(got.tensor(1, "value").block_table,
                          snap.tensor(1, "value").block_table)
    memory, failed = place(source, N - K, K, layers=(0,))
    # the first layer's pages asked for those of every layer: one round a load
    assert store.bytes_fetched - before == structure + 4 * K * page
    memory_1, failed_1 = place(source, N - K, K, layers=(1,))
    assert store.bytes_fetched - before == structure + 4 * K * page  # fetched already
    assert failed == failed_1 == {}
    memory[1] = memory_1[1]
    assert np.array_equal(memory, pages(snap, N - K, K))
    source.close()
    assert (structure + 4 * K * page) / len(data) < 0.26  # about K / N of the pools
    store.close()


def test_a_segment_of_another_tenant_of_the_same_size_is_fetched_in_ranges_too(s3_url):
    """Two tenants' segments differ in their metadata only (``cache_salt``'s digest), so
    in size not at all: the second is read over the first's layout in ranges (its
    structure parsed from what was fetched, its pools where that layout's are), not
    fetched whole at every load; its bytes are its own."""
    store = open_store(s3_url)
    segs = []
    for tenant, seed in (("a" * 16, 11), ("b" * 16, 12)):
        k, snap = keys(N), big(N, seed)
        store.put(k, 0, snap, {"tenant": tenant})
        segs.append((store.locate(k)[-1], snap))
    (first, _), (second, snap) = segs
    store.get_pages(first, MEMBERS)[1].close()  # the layout of that size learned
    size = int(store._head(second)["size"])
    pools = 4 * snap.tensor(0, "key").page_pool.nbytes
    for _ in range(2):
        before = store.bytes_fetched
        got, source = store.get_pages(second, MEMBERS)
        assert store.bytes_fetched - before == size - pools  # its structure only
        assert got.metadata["tenant"] == "b" * 16
        memory, failed = place(source, N - K, K)
        assert failed == {} and np.array_equal(memory, pages(snap, N - K, K))
        source.close()
    store.close()


def test_a_page_nothing_was_fetched_for_is_never_placed(s3_url):
    """The memory file's holes read as zeros: their pages fail their digests (no fill
    at all, or one that fetched half of what it was asked) and nothing is written."""
    _, snap, name, _ = stored(s3_url, seed=2)
    store = open_store(s3_url)
    store.get_pages(name, MEMBERS)[1].close()  # the layout learned
    _, source = store.get_pages(name, MEMBERS)
    source.fill = None  # no page fetched
    memory, failed = place(source, N - K, K)
    assert failed == {(layer, role): (member_name(layer, role), N - K)
                      for layer in (0, 1) for role in ROLES}
    assert (memory == 0xAB).all()
    source.close()

    _, source = store.get_pages(name, MEMBERS)
    fill = source.fill
    source.fill = lambda offsets, lengths: fill(offsets, lengths // 2)  # K / 2 pages each
    memory, failed = place(source, N - K, K)
    assert failed == {(layer, role): (member_name(layer, role), N - K // 2)
                      for layer in (0, 1) for role in ROLES}
    want = pages(snap, N - K, K)
    assert np.array_equal(memory[:, :, :K // 2], want[:, :, :K // 2])
    assert (memory[:, :, K // 2:] == 0xAB).all()
    source.close()
    store.close()


def test_a_page_damaged_in_the_bucket_is_refused_and_one_outside_the_load_is_not_read(
        s3_url):
    import obstore

    k, snap, name, data = stored(s3_url, seed=3)
    store = open_store(s3_url)
    store.get_pages(name, MEMBERS)[1].close()  # the layout learned
    damaged = bytearray(data)
    inside = snap.tensor(1, "value").page_pool[N - K + 3].tobytes()
    outside = snap.tensor(0, "key").page_pool[5].tobytes()
    for page in (inside, outside):
        at = data.find(page)
        assert at > 0 and data.find(page, at + 1) < 0
        damaged[at + 100] ^= 0x04
    client, key = raw(s3_url)
    obstore.put(client, key(name), bytes(damaged))  # overwritten in the bucket
    assert store.locate(k)[-1] == name  # a lookup: its HEAD gives the new ETag
    _, source = store.get_pages(name, MEMBERS)
    memory, failed = place(source, N - K, K)
    assert failed == {(1, "value"): (member_name(1, "value"), N - K + 3)}
    assert (memory[1, 1, 3] == 0xAB).all()  # never placed
    want = pages(snap, N - K, K)
    assert np.array_equal(memory[1, 1, :3], want[1, 1, :3])
    assert np.array_equal(memory[:, 0], want[:, 0])
    source.close()
    store.close()


def test_an_object_stored_again_while_it_is_loaded_is_a_miss_not_damage(s3_url):
    """Every ranged GET names the ETag the structure was read with: the digests of one
    version and the pages of another are never put together (their pages would fail
    their digests, as a damaged segment's do, and a damaged segment is deleted), so
    the load is a miss; the next load reads the object as it is now."""
    import obstore

    k, snap, name, data = stored(s3_url, seed=4)
    _, other, _, other_data = stored(s3_url, seed=5)  # the same structure, other values
    assert len(other_data) == len(data)
    client, key = raw(s3_url)
    store = open_store(s3_url)
    store.get_pages(name, MEMBERS)[1].close()  # the layout learned
    _, source = store.get_pages(name, MEMBERS)  # the structure and digests of the first
    obstore.put(client, key(name), other_data)  # stored again, another engine's values
    memory = np.full((2, 2, K, source.members[member_name(0, "key")][1]), 0xAB, np.uint8)
    with pytest.raises(HurrayError, match="stored again while it was read") as e:
        place(source, N - K, K, memory=memory)
    assert not isinstance(e.value, checksums.ChecksumError | TransportError)
    assert (memory == 0xAB).all()
    source.close()
    _, source = store.get_pages(name, MEMBERS)  # asked again: the object as it is now
    memory, failed = place(source, N - K, K)
    assert failed == {} and np.array_equal(memory, pages(other, N - K, K))
    source.close()

    obstore.put(client, key(name), data)  # the first again, after a lookup saw the second
    with pytest.raises(HurrayError, match="stored again while it was read"):
        store.get_pages(name, MEMBERS)  # the size and ETag remembered are the second's
    assert store.locate(k)[-1] == name
    loads_last_pages(store, name, snap)
    store.close()


@pytest.mark.slow
def test_a_server_killed_mid_fetch_is_a_store_error_then_the_segment_is_served_again(
        own_server):
    server, proxy = own_server
    url = "s3://killed/pages"
    store = open_store(url, endpoint=proxy.endpoint, timeout=3)
    k, snap = keys(N), big(N, 6)
    store.put(k, 0, snap, {})
    name = store.locate(k)[-1]
    store.get_pages(name, MEMBERS)[1].close()  # the layout learned
    _, source = store.get_pages(name, MEMBERS)
    memory = np.full((2, 2, K, source.members[member_name(0, "key")][1]), 0xAB, np.uint8)
    proxy.arm(upstream=False, after=512 << 10, cut=server.kill)  # a quarter of the pages
    started = time.monotonic()
    # a request refused, or one the cut left waiting past the store's deadline
    with pytest.raises(TransportError, match=r"s3://killed/pages: (GET .* bytes |\d+ of "
                                             r"\d+ ranged GETs .* unanswered within 3\.0 s)"):
        place(source, N - K, K, memory=memory)
    # never a hang: a request the cut left waiting ends at the store's timeout (3 s), a
    # retry is never started past it
    assert time.monotonic() - started < 3 * 3
    assert (memory == 0xAB).all()  # the run ended before any page was read
    assert proxy.cut_done.wait(10)
    server.start("killed")
    # the client's pooled connections died with the server: its first requests after
    # the restart fail (TransportError, as the breaker's probes would) until they are gone
    deadline = time.monotonic() + 30
    while True:
        try:
            memory, failed = place(source, N - K, K)  # the same source: what it lacks
            break
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert failed == {} and np.array_equal(memory, pages(snap, N - K, K))
    source.close()
    loads_last_pages(store, name, snap)
    store.close()


@pytest.mark.slow
def test_a_server_that_hangs_mid_fetch_costs_the_deadline_and_nothing_is_written_late(
        own_server):
    """The page fetch runs on a load's thread, outside any guard: a server that stops
    answering (SIGSTOP) costs the store's deadline, a ``TransportError`` naming it, and
    what it sends once it answers again is dropped, never written into the memory file
    (whose descriptor's number may be another file's by then); the guard of the tier
    (``GuardedTier``, ``Guarded.watched``) counts the failure."""
    import signal

    from hurraykv.chunks.guarded_tier import GuardedTier

    server, _ = own_server
    url = "s3://killed/hung"
    endpoint = f"http://127.0.0.1:{server.ports['s3.port']}"
    store = open_store(url, endpoint=endpoint, timeout=1)
    k, snap = keys(N), big(N, 7)
    store.put(k, 0, snap, {})
    name = store.locate(k)[-1]
    tier = GuardedTier(lambda: store, url=url, timeouts={"lookup": 1, "load": 1, "save": 1},
                       log=__import__("logging").getLogger("test"))
    tier.get_pages(name, MEMBERS)[1].close()  # the layout learned
    _, source = tier.get_pages(name, MEMBERS)
    first = source.members[member_name(0, "key")]
    page = first[1]
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"unanswered within 1\.0 s"):
            place(source, N - K, K)
        assert time.monotonic() - started < 2.5
        assert tier.guard.stats["failures"] == 1
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    time.sleep(1.5)  # the requests under way answered by now (their bytes dropped)
    at = first[0] + (N - K) * page
    assert os.pread(source.fd, K * page, at) == bytes(K * page)  # nothing written late
    source.close()
    tier.close()


def test_a_load_needs_no_head_where_a_lookup_of_this_process_made_one(s3_url):
    """The scheduler's lookups and the worker's loads are stores of their own: the size
    and ETag a lookup's HEAD gave serve a load by any store of the URL in the process
    (no HEAD on the load's path); a segment removed is asked again."""
    k, snap, name, _ = stored(s3_url, seed=21)
    lookups, loads = open_store(s3_url), open_store(s3_url)
    assert lookups.locate(k)[-1] == name

    def no_head(_name):
        raise AssertionError("a HEAD on the load's path")

    loads._head = no_head
    got, source = loads.get_pages(name, MEMBERS)
    assert got.tensor(0, "key").page_pool.shape == snap.tensor(0, "key").page_pool.shape
    source.close()
    assert lookups.remove(name)
    with pytest.raises(AssertionError, match="HEAD on the load's path"):
        loads.get_pages(name, MEMBERS)
    lookups.close()
    loads.close()
