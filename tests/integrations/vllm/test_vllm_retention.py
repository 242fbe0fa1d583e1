"""What stays cached, without an engine (``integrations/vllm/retention.py``): the
scheduler part's reset over a real ``file://`` store, and the removal watch over each
real store.  Through a running vLLM (``LLM.reset_prefix_cache``, events over ZMQ):
``engine_tests/test_vllm_retention.py``."""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.chunks.keys import ChunkKeys, identity_digest
from hurraykv.chunks.urls import open_store
from hurraykv.integrations.vllm.config import ConnectorConfig
from hurraykv.integrations.vllm.events import EventAPI, HurrayKVEvents, SavedSegments
from hurraykv.integrations.vllm.retention import Keep, Watch, keep_of, rank_names
from hurraykv.integrations.vllm.scheduler import SchedulerSide
from hurraykv.io import checksums
from tests.integrations.vllm.test_vllm_scheduler import (
    BLOCK,
    CHUNK,
    IDENTITY,
    PROMPT,
    alloc,
    match,
    request,
    scheduler_side,
    step,
    store_chunks,
)
from tests.support import store_urls


@pytest.fixture
def side(tmp_path):
    url = (tmp_path / "kv").as_uri()
    yield from scheduler_side(tmp_path, open=lambda ranked=True: open_store(url))


def segment_of(identity: str, chunks: int) -> hk.KVCacheSnapshot:
    pages = chunks * (CHUNK // BLOCK)
    pool = np.ones((pages, BLOCK, 1, 8), np.float16)
    return checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
        [pool], [pool], np.arange(pages), [0, pages], [pages * BLOCK], model=identity))


def test_reset_clears_this_identity_and_forgets_what_was_found(side):
    sched, store = side
    store_chunks(store, sched.ctx.seed, PROMPT, 2)
    other = "model=other;cache_dtype=float16;chunk_size=32;tp_size=1"
    theirs = ChunkKeys(identity_digest(other), CHUNK).upto(PROMPT, 2)
    store.put(theirs, 0, segment_of(other, 2), {})
    req = request("a", PROMPT)
    assert match(sched, req) == (64, False)
    assert sched.reset() is True
    assert sched.ctx.stats["segments_cleared"] == 1
    assert match(sched, req) == (0, False)  # asked again, not the answer from before
    assert match(sched, request("b", PROMPT)) == (0, False)
    assert store.locate(theirs)[0] is not None  # another identity's stays
    assert [s.identity for s in store.catalog()] == [other]


def planned_then_reset(sched):
    """A request whose chunks are planned for storing, then vLLM's reset: (it, its save)."""
    req = request("a", PROMPT)
    assert match(sched, req) == (0, False)
    alloc(sched, req, 0)
    save, = sched.plan(step(new=[("a", range(7), 0)], scheduled={"a": 100})).saves
    assert sched.reset() is True
    return req, save


def reported(*records):
    """A step's KVConnectorOutput carrying the workers' records."""
    return type("Out", (), {"kv_cache_events": SavedSegments(list(records)),
                            "invalid_block_ids": set(), "failed_recving": set()})()


def test_a_segment_planned_before_a_reset_and_written_after_it_is_removed(side):
    """The writer runs behind the scheduler: a segment planned before the reset holds KV
    of the old weights, and is removed once its write is reported."""
    sched, store = side
    req, save = planned_then_reset(sched)
    store.put(save.keys, save.first_chunk, segment_of(IDENTITY, len(save.keys)), {})
    assert store.locate(save.keys)[0] is not None  # written after the reset
    # before its write is reported, a lookup finding it is a miss: the old weights' KV
    assert match(sched, request("c", PROMPT)) == (0, False)
    sched.output(reported(save.segment_id))
    assert sched.retainer.wait_idle(5)  # removed off the scheduler thread
    assert store.locate(save.keys) == [None] * len(save.keys)
    assert sched._stale_names() == set()  # and no longer a miss once stored again
    # and the request, whose blocks were computed before the reset, stores nothing more
    req.all_token_ids += list(range(500, 560))  # decoded since
    assert sched.plan(step(cached=[("a", [7, 8], 100)], scheduled={"a": 28})).saves == []
    fresh = request("b", PROMPT + list(range(500, 560)))  # one of after the reset does
    assert match(sched, fresh) == (0, False)
    alloc(sched, fresh, 0)
    assert [len(s.keys) for s in sched.plan(step(new=[("b", range(9), 0)],
                                                 scheduled={"b": 128})).saves] == [4]


# vLLM's BlockStored / BlockRemoved take these keywords (vllm/distributed/kv_events.py);
# with block_size == hash_block_size resolve_block_hashes returns request.block_hashes
# as they are, and maybe_convert_block_hash returns bytes as they are by default
# (vllm/v1/core/kv_cache_utils.py:96-99, 2780-2781)
EVENTS = EventAPI(stored=functools.partial(SimpleNamespace, kind="stored"),
                  removed=functools.partial(SimpleNamespace, kind="removed"),
                  resolve=lambda hashes, hash_block_size, block_size: hashes,
                  convert=lambda h: h)


def test_a_reset_announces_every_block_it_announced_stored_removed(side):
    """vLLM's reset_prefix_cache(reset_connector=True) clears this identity from the
    store: a router that was told the blocks are stored must be told they are gone, or
    it keeps sending their prompts here for a hit that is not there."""
    plain, store = side  # its context, with KV events on
    sched = SchedulerSide(plain.ctx, HurrayKVEvents(BLOCK, CHUNK, api=EVENTS))
    try:
        req = request("a", PROMPT)
        req.block_hashes = [f"a{b}".encode() for b in range(6)]  # its 6 whole blocks
        assert match(sched, req) == (0, False)
        alloc(sched, req, 0)
        save, = sched.plan(step(new=[("a", range(7), 0)], scheduled={"a": 100})).saves
        store.put(save.keys, save.first_chunk, segment_of(IDENTITY, len(save.keys)), {})
        sched.output(reported(save.segment_id))  # the worker's record: written
        stored, = sched.take_events()
        assert (stored.kind, stored.block_hashes) == ("stored", req.block_hashes)
        assert sched.reset() is True and sched.ctx.stats["segments_cleared"] == 1
        removed, = sched.take_events()
        assert (removed.kind, removed.block_hashes) == ("removed", req.block_hashes)
        assert sched.take_events() == []  # told once
    finally:
        sched.close()


def test_a_reset_that_cannot_reach_its_store_fails(tmp_path):
    """vLLM fails its reset_prefix_cache on a False: a store down is not cleared."""
    gen = scheduler_side(tmp_path, open=lambda ranked=True: open_store("hurray://127.0.0.1:9",
                                                                         timeout=1))
    sched, store = next(gen)
    store_chunks(store, sched.ctx.seed, PROMPT, 2)
    assert sched.reset() is False
    assert match(sched, request("a", PROMPT)) == (64, False)  # nothing was forgotten
    gen.close()


@pytest.mark.parametrize("backend", store_urls.builtin())
def test_the_watch_finds_the_segments_gone_from_each_store(backend, tmp_path, request):
    with store_urls.live_url(backend, tmp_path, request) as url:
        store = open_store(url)
        seed = identity_digest(f"watch-{np.random.random()}")
        names = []
        for i in range(3):
            keys = ChunkKeys(seed, CHUNK).upto([i] * 100, 3)
            store.put(keys, 0, segment_of(IDENTITY, 3), {})
            names.append(store.locate(keys)[0])
        watch = Watch(lambda: open_store(url), every=0.05)
        watch.watch(names)
        time.sleep(0.2)
        assert watch.take_gone() == [] and watch.checks >= 1
        assert store.remove(names[1]) is True  # as an eviction, by another client
        deadline = time.monotonic() + 5
        gone: list[str] = []
        while not gone and time.monotonic() < deadline:
            time.sleep(0.02)
            gone = watch.take_gone()
        assert gone == [names[1]]
        time.sleep(0.2)
        assert watch.take_gone() == []  # told once
        watch.close()
        store.close()


def test_a_watch_with_no_interval_never_starts():
    watch = Watch(lambda: pytest.fail("opened"), every=0.0)
    watch.watch(["a" * 32 + "-0"])
    assert watch._thread is None


def test_rank_names_are_each_ranks_segment():
    assert rank_names("ab-3", 1) == ["ab-3"]
    assert rank_names("ab-3", 2) == ["ab.tp0-3", "ab.tp1-3"]


def test_removal_check_s_takes_zero_and_refuses_negatives():
    url = "file:///tmp/x"
    assert ConnectorConfig.from_extra({"url": url, "removal_check_s": 0}).removal_check_s == 0
    for bad in (-1, float("nan"), "soon"):
        with pytest.raises(hk.HurrayError, match=r"removal_check_s.*0 or more"):
            ConnectorConfig.from_extra({"url": url, "removal_check_s": bad})


def test_a_requests_retention_ask_is_read_from_kv_transfer_params():
    def req(params):
        return request("r", PROMPT) if params is None else type(
            "R", (), {"kv_transfer_params": params})()

    assert keep_of(req(None)) is None and keep_of(req({"other": 1})) is None
    assert keep_of(req({"hurraykv": {"pin": True}})) == Keep(True, None)
    assert keep_of(req({"hurraykv": {"ttl_s": 60}})) == Keep(False, 60.0)
    assert keep_of(req({"hurraykv": {"pin": False}})) is None  # nothing asked
    for bad, field in (({"pin": "yes"}, "pin"), ({"ttl_s": -1}, "ttl_s"),
                       ({"ttl_s": True}, "ttl_s"), ({"pinned": True}, "hurraykv"),
                       ({"ttl_s": 10**400}, "ttl_s"), ({"ttl_s": float("nan")}, "ttl_s"),
                       ({"ttl_s": 1e300}, "ttl_s"), ([1], "hurraykv")):
        with pytest.raises(hk.HurrayError) as e:
            keep_of(req({"hurraykv": bad}))
        assert e.value.field.endswith(field), (bad, e.value.field)
    with pytest.raises(hk.HurrayError, match=r"\['pinned'\]; did you mean 'pin'\?"):
        keep_of(req({"hurraykv": {"pinned": True}}))


def test_a_pinned_request_pins_what_it_finds_and_carries_the_pin_to_its_saves(tmp_path):
    url = (tmp_path / "kv").as_uri()
    gen = scheduler_side(tmp_path, open=lambda ranked=True: open_store(url))
    sched, store = next(gen)
    store_chunks(store, sched.ctx.seed, PROMPT, 2)
    req = request("a", PROMPT)
    req.kv_transfer_params = {"hurraykv": {"pin": True, "ttl_s": 600}}
    assert match(sched, req) == (64, False)
    assert sched.retainer.wait_idle(5)
    kept, = store.catalog()
    assert kept.pinned and 500 < kept.expiry - time.time() <= 600
    assert sched.ctx.stats["segments_retained"] == 1
    alloc(sched, req, 64)
    plan = sched.plan(step(new=[("a", range(7), 0)], scheduled={"a": 100}))
    assert [s.keep for s in plan.saves] == [Keep(True, 600.0)]
    bad = request("b", PROMPT)
    bad.kv_transfer_params = {"hurraykv": {"pin": 1}}
    assert match(sched, bad) == (64, False)  # runs, unretained, counted
    assert sched.ctx.stats["retention_refused"] == 1
    sched.close()
    gen.close()


def test_saves_carry_their_requests_tenant_as_a_digest_of_its_salt(side):
    from hurraykv.integrations.vllm.request_keys import tenant_of

    sched, _ = side
    for req_id, salt in (("s", "tenant-7"), ("u", None)):
        req = request(req_id, PROMPT, salt=salt)
        assert match(sched, req) == (0, False)
        alloc(sched, req, 0)
        save, = sched.plan(step(new=[(req_id, range(7), 0)], scheduled={req_id: 100})).saves
        assert save.tenant == tenant_of(req)
    assert len(tenant_of(request("s", PROMPT, salt="tenant-7"))) == 16
    assert tenant_of(request("u", PROMPT)) == ""
    assert "tenant-7" not in tenant_of(request("s", PROMPT, salt="tenant-7"))


def test_a_segment_stored_again_during_a_check_is_not_announced_gone():
    """The watch found X gone, but X was stored again (and watched again) while the
    check ran: X is not reported."""
    watch = Watch(lambda: None, every=0.0)
    watch.every = 1.0  # watched, never started: checks run by hand
    watch._stop.set()

    class Store:
        def exists(self, names):
            watch.watch(["x" * 32 + "-0"])  # stored again meanwhile
            return [False] * len(names)

    watch.watch(["x" * 32 + "-0", "y" * 32 + "-0"])
    watch.check(Store())
    assert watch.take_gone() == ["y" * 32 + "-0"]


def test_redis_keyspace_events_tell_the_watch_at_once(tmp_path, redis_url):
    """Where Redis publishes keyspace events, a segment it evicts, expires or deletes is
    reported without waiting for the next check; where it does not (the suite's Redis),
    the watch polls."""
    from tests.support.redis_servers import free_port, redis_server_binary, start_redis

    assert open_store(redis_url).removals(lambda names: None, None) is False
    proc = start_redis(redis_server_binary(), tmp_path, port := free_port(),
                       "--notify-keyspace-events", "Exeg")
    try:
        url = f"redis://127.0.0.1:{port}"
        store = open_store(url)
        names = []
        for i in range(2):
            keys = ChunkKeys(identity_digest("notified"), CHUNK).upto([i] * 100, 3)
            store.put(keys, 0, segment_of(IDENTITY, 3), {})
            names.append(store.locate(keys)[0])
        watch = Watch(lambda: open_store(url), every=30.0)  # no check in the test's time
        watch.watch(names)
        time.sleep(0.5)  # subscribed at its first look
        store.remove(names[0])  # a DEL
        store.retain(names[1:], pin=None, ttl_s=0.2)  # expires
        deadline, gone = time.monotonic() + 5, []
        while len(gone) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            gone += watch.take_gone()
        assert sorted(gone) == sorted(names) and watch.checks == 1
        watch.close()
        store.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_segment_planned_before_a_reset_and_dropped_is_no_longer_kept_away(side):
    from hurraykv.integrations.vllm.events import DROPPED

    sched, _ = side
    _, save = planned_then_reset(sched)
    assert sched._stale_names() == {f"{save.keys[-1]}-0"}
    sched.output(reported((DROPPED, save.segment_id)))
    assert sched._stale_names() == set()  # never written: stored later, it is found
