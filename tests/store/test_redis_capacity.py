"""The redis:// store at Redis's memory limit (decision H91), against real redis-servers
started with a small ``maxmemory``: under ``allkeys-lru`` whatever Redis evicts is a miss
or a HurrayError, never other bytes, and ``fsck`` repairs what eviction leaves behind;
under ``noeviction`` a put past the limit is a ``StoreFullError`` naming maxmemory that
takes back what it wrote and costs no stored snapshot anything.

Each test runs both client paths: raw RESP (``resp.py``, a single server over TCP) and
redis-py pipelines (what a cluster or TLS connection uses)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hurraykv.errors import HurrayError
from hurraykv.paged import BlockPagedTensor
from hurraykv.snapshot import KVCacheSnapshot
from hurraykv.store import MissingPagesError, PageStore, StoreFullError, resp
from hurraykv.store.members import ZERO, Member
from hurraykv.store.pages import StoreError
from hurraykv.store.scripts import (
    PAGE_SIZES,
    STATS,
    manifest_key,
    owners_key,
    page_key,
    pending_key,
)
from tests.support import store_checks
from tests.support.redis_servers import free_port, redis_server_binary, start_redis
from tests.support.snapshots import zeroed

PAGE, HEADS, DIM = 16, 4, 32  # 4 KiB float16 pages
SHARED = 3  # full pages of a system prompt every snapshot starts with
PROMPT = np.random.default_rng(0).standard_normal((4, SHARED * PAGE, HEADS, DIM)).astype(
    np.float16)
PROMPT_TOKENS = np.random.default_rng(1).integers(0, 32000, SHARED * PAGE)


def batch(seed: int) -> tuple[KVCacheSnapshot, list[np.ndarray]]:
    """Two layers, two sequences that share the system prompt (stored once across every
    snapshot) and then hold 3 and 2.5 pages of their own; and their token ids."""
    rng = np.random.default_rng(1000 + seed)
    own = [3 * PAGE, 2 * PAGE + PAGE // 2]
    tensors = []
    for member, (layer, role) in enumerate((i, r) for i in range(2) for r in ("key", "value")):
        seqs = [np.concatenate([PROMPT[member], rng.standard_normal(
            (n, HEADS, DIM)).astype(np.float16)]) for n in own]
        tensors.append(BlockPagedTensor.from_sequences(seqs, PAGE, kv_role=role,
                                                       layer_index=layer))
    tokens = [np.concatenate([PROMPT_TOKENS, rng.integers(0, 32000, n)]) for n in own]
    return KVCacheSnapshot.from_tensors(tensors, metadata={"seed": seed}), tokens


@contextlib.contextmanager
def limited_redis(tmp_path, policy: str, maxmemory: str) -> Iterator[str]:
    proc = start_redis(redis_server_binary(), tmp_path, free_port(), "--maxmemory", maxmemory,
                       "--maxmemory-policy", policy)
    try:
        yield f"redis://127.0.0.1:{proc.args[2]}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(params=["raw", "pipelines"])
def path(request, monkeypatch) -> str:
    """Which client path carries pages: "pipelines" turns the raw RESP path off, as a
    cluster or a TLS connection does."""
    if request.param == "pipelines":
        @contextlib.contextmanager
        def no_wire(client):
            yield None

        monkeypatch.setattr(resp, "open_wire", no_wire)
    return request.param


_keys, _digest = store_checks.keys, store_checks.digest


def read(store: PageStore, sid: str, expected: KVCacheSnapshot) -> str:
    """"ok" (bit for bit what was stored), "gone" (no snapshot) or "damaged"; anything
    else fails the test."""
    try:
        back = store.get(sid)
    except MissingPagesError:
        return "damaged"
    except StoreError as e:
        assert "no snapshot" in str(e), e
        return "gone"
    assert back.equal(zeroed(expected)), f"{sid}: other bytes than were stored"
    assert back.metadata == expected.metadata
    return "ok"


def check_whole(store: PageStore) -> int:
    """After fsck on a store Redis no longer evicts from: the store is consistent and every
    snapshot reads back bit for bit."""
    return store_checks.check_consistent(store, lambda seed: zeroed(batch(seed)[0]))


# ------------------------------------------------------------------ allkeys-lru
@pytest.mark.slow  # ~5 s for each path alone on 2 cores
def test_allkeys_lru_evicts_and_every_read_is_exact_or_a_miss(tmp_path, path):
    n = 240  # ~96 KiB of pages of its own each: about twice what 12 MiB holds
    with limited_redis(tmp_path, "allkeys-lru", "12mb") as url:
        store = PageStore.from_url(url)
        cache = PageStore.from_url(url, drop_damaged=True)  # as a cache that recomputes
        tokens: dict[str, list[np.ndarray]] = {}
        for i in range(n):
            snap, tokens[f"s{i}"] = batch(i)
            store.put(f"s{i}", snap, token_ids=tokens[f"s{i}"])
        assert store.client.info("stats")["evicted_keys"] > 0
        assert store.client.info("memory")["used_memory"] < 16 << 20

        # every get: the stored bytes, or a HurrayError (gone / damaged), nothing else
        seen = {sid: read(store, sid, batch(int(sid[1:]))[0]) for sid in tokens}
        counts = {k: sum(v == k for v in seen.values()) for k in ("ok", "gone", "damaged")}
        print("after", n, "puts into 12 MiB:", counts)
        assert counts["gone"] + counts["damaged"] > n // 4, counts  # it did evict
        present = store.contains_many(list(tokens))
        for sid, there in zip(tokens, present, strict=True):
            if seen[sid] == "gone":
                assert not there and sid not in store  # a miss

        # a lookup answers a snapshot still stored whose tokens are the ones asked for;
        # one stored just now (older keys idle for a second of Redis's LRU clock) is
        # there to be found whatever the sampled eviction left of the others
        time.sleep(1.1)
        recent, tokens[f"s{n}"] = batch(n)
        store.put(f"s{n}", recent, token_ids=tokens[f"s{n}"])
        hits = 0
        for sid, toks in tokens.items():
            for seq in toks:
                found = store.lookup_prefix(seq)
                if found is None:
                    continue
                hit, s, count = found
                assert np.array_equal(tokens[hit][s][:count], seq[:count]), (sid, found)
                hits += 1
        assert hits

        # the cache's reads turn a damaged snapshot into a miss (removed, stored again)
        for sid in [s for s, v in seen.items() if v == "damaged"][:20]:
            expected = batch(int(sid[1:]))[0]
            try:
                back = cache.get(sid)
            except HurrayError:
                assert sid not in cache
                cache.put(sid, expected)
            else:  # a shared page stored again since then healed it
                assert back.equal(zeroed(expected))

        # storing goes on at the limit: what was just stored reads back (older keys are
        # idle for at least a second of Redis's LRU clock, the new ones are not)
        time.sleep(1.1)
        fresh, _ = batch(10_000)
        store.put("fresh", fresh)
        assert read(store, "fresh", fresh) == "ok"

        # fsck repairs what eviction left behind; Redis is given room first, so that it
        # evicts nothing while the result is checked
        store.client.config_set("maxmemory", "0")
        report = store.fsck(grace=0)
        print("fsck:", {k: v for k, v in report.items() if k != "missing_pages"},
              len(report["missing_pages"]), "damaged")
        assert report["references_dropped"] or report["damaged_removed"] or \
            report["references_added"] or report["orphan_pages_freed"], report
        assert report["damaged_removed"] == len(report["missing_pages"])
        assert check_whole(store) >= 1
        again = store.fsck(grace=0)
        assert not again["missing_pages"] and not any(again[k] for k in (
            "releases_completed", "references_dropped", "references_added", "pages_freed",
            "orphan_pages_freed", "damaged_removed", "dangling_owners_removed")), again
        store.client.close()
        cache.client.close()


@pytest.mark.parametrize("kind", ["page", "shared_page", "manifest", "owners", "pending",
                                  "prefix", "stats", "page_sizes"])
def test_each_key_redis_may_evict_is_a_miss_and_fsck_repairs_it(redis_url, kind):
    """One key of each kind deleted, as Redis evicts it; then reads, fsck, and writes."""
    store = PageStore.from_url(redis_url)
    c = store.client
    c.flushall()
    snaps = {f"s{i}": batch(i) for i in range(3)}
    for sid, (snap, toks) in snaps.items():
        store.put(sid, snap, token_ids=toks)
    victim = snaps["s1"][0]
    digests = [d for k in victim.member_keys() for d in Member(victim.tensor(*k)).digests()
               if d != ZERO]
    others = {d for sid in ("s0", "s2") for k in snaps[sid][0].member_keys()
              for d in Member(snaps[sid][0].tensor(*k)).digests()}
    own = next(d for d in digests if d not in others)
    shared = next(d for d in digests if d in others)
    if kind == "page":
        c.delete(page_key(own))
    elif kind == "shared_page":
        c.delete(page_key(shared))
    elif kind == "manifest":
        c.delete(manifest_key("s1"))
    elif kind == "owners":
        c.delete(owners_key(shared), owners_key(own))
    elif kind == "pending":  # a delete's release, evicted before it ran
        store._script("remove", "s1")
        c.delete(pending_key("s1"))
    elif kind == "prefix":
        for key in _keys(c, "x"):
            c.delete(key)
    elif kind == "stats":
        c.delete(STATS)
    else:
        c.delete(PAGE_SIZES)
    for sid, (snap, toks) in snaps.items():
        state = read(store, sid, snap)
        if kind in ("page", "manifest", "pending"):
            assert state == ("ok" if sid != "s1" else
                             "damaged" if kind == "page" else "gone"), (sid, state)
        elif kind == "shared_page":
            assert state == "damaged"  # every snapshot names the system prompt's pages
        else:
            assert state == "ok"
        found = store.lookup_prefix(toks[0])
        if kind in ("manifest", "pending") and sid == "s1":
            # at most the shared prompt, as the last snapshot to index it
            assert sid not in store and (found is None or found[0] != sid), found
        else:
            assert found is None or found[0] == sid or kind == "shared_page", found
    if kind == "owners":
        # a put of another snapshot sharing the page, then its delete, frees the page
        # whose owners Redis lost: the snapshots still naming it are damaged, not wrong
        store.put("t", batch(0)[0])
        store.delete("t")
        assert {read(store, sid, snap) for sid, (snap, _) in snaps.items()} <= {
            "ok", "damaged"}

    report = store.fsck(grace=0)
    damaged = {"page": {"s1"}, "shared_page": set(snaps)}.get(kind, set())
    if kind == "owners":
        damaged = set(report["missing_pages"])
    assert set(report["missing_pages"]) == damaged
    assert report["damaged_removed"] == len(damaged)
    if kind in ("manifest", "pending"):
        assert report["references_dropped"] and report["pages_freed"]
    assert check_whole(store) == 3 - len(damaged) - (kind in ("manifest", "pending"))
    for sid, (snap, toks) in snaps.items():  # what was lost is stored again, and found
        store.put(sid, snap, token_ids=toks)
        assert read(store, sid, snap) == "ok"
        assert store.lookup_prefix(toks[1])[0] == sid
    assert check_whole(store) == 3
    c.close()


def test_drop_damaged_makes_a_damaged_snapshot_a_miss(redis_url):
    with pytest.raises(StoreError, match="drop_damaged 'yes' is not a bool"):
        PageStore.from_url(redis_url, drop_damaged="yes")
    store = PageStore.from_url(redis_url, drop_damaged=True)
    store.client.flushall()
    snap, _ = batch(5)
    store.put("d", snap)
    store.put("e", batch(6)[0])
    victim = next(d for d in Member(snap.tensor(1, "value")).digests() if d != ZERO)
    store.client.delete(page_key(victim))
    with pytest.raises(MissingPagesError, match=r"'d': layer 1 value page \d+ .* missing.*"
                       r"was removed \(drop_damaged\): store it again"):
        store.get_layer("d", 1)
    assert "d" not in store and store.contains_many(["d", "e"]) == [False, True]
    assert store.stats()["snapshots"] == 1
    store.put("d", snap)
    assert read(store, "d", snap) == "ok"
    assert check_whole(store) == 2
    store.client.close()


def test_a_prefix_entry_of_a_manifest_that_is_gone_is_never_a_hit(redis_url):
    """An id stored again with other tokens after its manifest was evicted (its delete
    never removed its prefix entries), or replaced: the old entries name the id but not
    its manifest, and a lookup passes over them."""
    store = PageStore.from_url(redis_url)
    store.client.flushall()
    (a, ta), (b, tb) = batch(1), batch(2)
    store.put("x", a, token_ids=ta)
    store.client.delete(manifest_key("x"))  # evicted
    store.put("x", b, token_ids=tb)
    def matched(tokens: np.ndarray) -> tuple[str, int] | None:
        found = store.lookup_prefix(tokens)
        return None if found is None else (found[0], found[2])

    # before: ("x", 0, 96), a's own pages, while "x" holds b's
    assert matched(ta[0]) == ("x", SHARED * PAGE)  # the shared prompt only
    assert matched(ta[0][SHARED * PAGE:]) is None
    store.put("x", a, token_ids=ta)  # replaced
    assert matched(tb[0]) == ("x", SHARED * PAGE)
    assert matched(ta[0]) == ("x", 6 * PAGE)
    store.client.close()


# ------------------------------------------------------------------ noeviction
def test_noeviction_refuses_a_put_naming_maxmemory_and_loses_nothing(tmp_path, path):
    with limited_redis(tmp_path, "noeviction", "8mb") as url:
        store = PageStore.from_url(url)
        c = store.client
        stored: list[int] = []
        for i in range(200):
            keys = {k: sorted(_keys(c, k)) for k in ("p", "o", "m", "d")}
            stats = store.stats()
            try:
                store.put(f"s{i}", batch(i)[0], token_ids=batch(i)[1])
            except StoreFullError as e:
                refused = e
                break
            stored.append(i)
        else:
            raise AssertionError("8 MiB held 200 snapshots: nothing was refused")
        print(f"refused after {len(stored)} snapshots:", refused)
        assert refused.field == "maxmemory" and refused.value == 8 << 20
        assert "maxmemory-policy noeviction" in str(refused)
        assert "allkeys-lru" in str(refused) and f"'s{i}'" in str(refused)
        # the refused put took back what it wrote; nothing stored before was touched
        assert {k: sorted(_keys(c, k)) for k in ("p", "o", "m", "d")} == keys
        assert store.stats() == stats
        assert f"s{i}" not in store
        for j in stored:
            assert read(store, f"s{j}", batch(j)[0]) == "ok"
        # deletes still work at the limit, and make room for the next put
        for j in stored[:10]:
            store.delete(f"s{j}")
        store.put("after", batch(5000)[0])
        assert read(store, "after", batch(5000)[0]) == "ok"
        report = store.fsck(grace=0)
        assert not report["missing_pages"] and not report["damaged_removed"]
        assert check_whole(store) == len(stored) - 10 + 1
        c.close()


def test_a_put_refused_at_its_manifest_takes_back_its_references(redis_url, monkeypatch):
    """Redis at its limit may let the pages in and refuse the manifest (the last write to
    push memory over is a reference): that put takes everything back too."""
    import redis

    store = PageStore.from_url(redis_url)
    store.client.flushall()
    store.put("kept", batch(1)[0])
    keys = {k: sorted(_keys(store.client, k)) for k in ("p", "o", "m", "d")}
    stats = store.stats()
    swap = store._script

    def refused(name, snapshot_id, args=None):
        if name == "swap":
            raise redis.exceptions.OutOfMemoryError(
                "command not allowed when used memory > 'maxmemory'. script: 0, on "
                "@user_script:9.")
        return swap(name, snapshot_id, args)

    monkeypatch.setattr(store, "_script", refused)
    with pytest.raises(StoreFullError, match=r"put of snapshot 'new'.*maxmemory"):
        store.put("new", batch(2)[0])
    assert {k: sorted(_keys(store.client, k)) for k in ("p", "o", "m", "d")} == keys
    assert store.stats() == stats
    assert check_whole(store) == 1
    store.client.close()


# ---------------------------------------------------------------- the connector's store
def _chunk_segment(seed: int) -> tuple[list[str], KVCacheSnapshot]:
    from hurraykv.chunks.keys import ChunkKeys, identity_digest
    from hurraykv.io import checksums

    snap, _ = batch(seed)
    keys = ChunkKeys(identity_digest(f"redis-{seed}"), PAGE).upto(list(range(4 * PAGE)), 2)
    return keys, checksums.with_checksums(snap)


def test_a_connector_segment_that_lost_a_page_is_a_miss_from_then_on(tmp_path):
    """RedisChunks opens its store with drop_damaged: the first failed load removes the
    segment, so later lookups miss and the recomputed chunks are stored again."""
    from hurraykv.chunks.urls import open_store

    with limited_redis(tmp_path, "allkeys-lru", "64mb") as url:
        store = open_store(url)
        keys, seg = _chunk_segment(1)
        store.put(keys, 0, seg, {})
        name = store.locate(keys)[0]
        assert name is not None and store.get_verified(name).equal(seg)
        client = store.store.client
        page = next(k for k in client.scan_iter(match="hkv:p:*") if client.type(k) == b"string")
        client.delete(page)  # what allkeys-lru does to one key
        with pytest.raises(HurrayError, match=r"missing|lost|evicted"):
            store.get_verified(name)
        assert store.locate(keys) == [None, None]
        store.put(keys, 0, seg, {})  # stored again once recomputed
        assert store.get_verified(store.locate(keys)[0]).equal(seg)


def test_a_connector_segment_refused_for_memory_leaves_no_alias_or_segment(tmp_path):
    from hurraykv.chunks.urls import open_store

    with limited_redis(tmp_path, "noeviction", "3mb") as url:
        store = open_store(url)
        stored, refused = [], None
        for seed in range(200):
            keys, seg = _chunk_segment(seed)
            try:
                store.put(keys, 0, seg, {})
            except StoreFullError as e:
                refused = (keys, e)
                break
            stored.append((keys, seg))
        assert refused is not None, "3 MB never filled"
        keys, error = refused
        assert "maxmemory" in str(error)
        assert store.locate(keys) == [None, None]
        for keys, seg in stored:  # nothing stored before is lost
            assert store.get_verified(store.locate(keys)[0]).equal(seg)
