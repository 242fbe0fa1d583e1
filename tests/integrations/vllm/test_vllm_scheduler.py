"""The connector's scheduler part without an engine (``integrations/vllm/scheduler.py``):
requests and scheduler outputs are ``SimpleNamespace`` stand-ins with exactly the fields
vLLM 0.32 gives them (``vllm/v1/request.py``: ``request_id``, ``prompt_token_ids``,
``all_token_ids``, ``cache_salt``, ``lora_request``; ``vllm/v1/core/sched/output.py``:
``NewRequestData`` lines 41-48, ``CachedRequestData`` 138-151, ``SchedulerOutput``
232-260), over a real ``file://`` store.  The real-engine tests stay in ``engine_tests/``."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.chunks.guard import Guarded
from hurraykv.chunks.keys import ChunkKeys, identity_digest
from hurraykv.chunks.urls import open_store
from hurraykv.integrations.vllm.common import Context
from hurraykv.integrations.vllm.config import ConnectorConfig
from hurraykv.integrations.vllm.events import HurrayKVEvents, SavedSegments
from hurraykv.integrations.vllm.request_keys import request_seed
from hurraykv.integrations.vllm.scheduler import SchedulerSide
from hurraykv.io import checksums

BLOCK, CHUNK = 16, 32  # two blocks a chunk
LOADED = "loaded"  # a worker's load record, (LOADED, request id): events.LOADED
IDENTITY = "model=tiny;cache_dtype=float16;chunk_size=32;tp_size=1"


def scheduler_side(tmp_path, block: int = BLOCK, chunk: int = CHUNK,
                   identity: str = IDENTITY, **context):
    """A scheduler part over a ``file://`` store in ``tmp_path``, and that store (a
    fixture's body: its guards are closed after the yield)."""
    url = (tmp_path / "kv").as_uri()
    guards = [Guarded(lambda: open_store(url), url=url, what=what, timeout=5.0,
                      log=logging.getLogger("test")) for what in ("lookup", "load", "save")]
    ctx = Context(ConnectorConfig.from_extra({"url": url}), block, chunk, identity,
                  identity_digest(identity), can_load=True, can_save=True,
                  lookups=guards[0], loads=guards[1], saves=guards[2], **context)
    yield SchedulerSide(ctx, HurrayKVEvents(block, chunk, enabled=False)), open_store(url)
    for g in guards:
        g.close()


@pytest.fixture
def side(tmp_path):
    yield from scheduler_side(tmp_path)


def request(req_id: str, tokens: list[int], **extra) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens,
                           all_token_ids=list(tokens), cache_salt=extra.get("salt"),
                           lora_request=extra.get("lora"), prompt_embeds=None,
                           mm_features=extra.get("mm"))


def match(sched: SchedulerSide, req: SimpleNamespace, computed: int = 0
          ) -> tuple[int, bool]:
    """``matched`` as vLLM drives it: asked again at each step (``None``) until the
    lookup thread has the store's answer."""
    for _ in range(100):
        got = sched.matched(req, computed)
        if got[0] is not None:
            return got
        sched.lookups.wait(req.request_id, 5.0)
    raise AssertionError(f"no answer for {req.request_id}")


def alloc(sched: SchedulerSide, req: SimpleNamespace, tokens: int, blocks=()) -> None:
    """``update_state_after_alloc`` with the request's blocks (``KVCacheBlocks``)."""
    sched.after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(blocks),)), tokens)


def step(new=(), cached=(), scheduled=None, finished=(), resumed=()) -> SimpleNamespace:
    """A SchedulerOutput: ``new`` as (req_id, blocks, computed), ``cached`` as
    (req_id, new blocks, computed); ``resumed``: those of ``cached`` back from preemption
    (their new blocks are all their blocks, ``_make_cached_request_data``)."""
    new_reqs = [SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c)
                for r, b, c in new]
    cached_reqs = SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                  resumed_req_ids=set(resumed),
                                  new_block_ids=[(list(b),) if b else None
                                                 for _, b, _ in cached],
                                  num_computed_tokens=[c for _, _, c in cached])
    return SimpleNamespace(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                           num_scheduled_tokens=scheduled or {}, finished_req_ids=set(finished))


def store_chunks(store, seed: bytes, tokens: list[int], chunks: int) -> None:
    pages = chunks * (CHUNK // BLOCK)
    pool = np.zeros((pages, BLOCK, 1, 8), np.float16)
    snap = checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
        [pool], [pool], np.arange(pages), [0, pages], [pages * BLOCK], model=IDENTITY))
    store.put(ChunkKeys(seed, CHUNK).upto(tokens, chunks), 0, snap, {})


PROMPT = list(range(1, 101))  # 100 tokens: 3 whole chunks before the last token


def test_a_stored_prefix_is_matched_and_planned_into_the_allocated_blocks(side):
    sched, store = side
    store_chunks(store, sched.ctx.seed, PROMPT, 2)  # the first 64 tokens
    req = request("a", PROMPT)
    assert match(sched, req, 16) == (48, False)  # 64 stored, 16 cached by vLLM itself
    alloc(sched, req, 48)
    blocks = list(range(10, 17))
    plan = sched.plan(step(new=[("a", blocks, 16)], scheduled={"a": 84}))
    load, = plan.loads
    assert load.blocks == [[11], [12, 13]]  # block 10 is vLLM's; chunks 0 and 1 after it
    assert load.pages == [1, 2] and len(set(load.names)) == 1
    save, = plan.saves  # the third chunk (tokens 64..96) is computed this step
    assert save.first_chunk == 2 and save.blocks == [[14, 15]]
    stats = sched.ctx.stats
    assert (stats["lookups"], stats["lookup_hits"], stats["tokens_hit"]) == (1, 1, 0)
    # hit tokens are counted once the workers report the step that loaded them
    sched.output(SimpleNamespace(invalid_block_ids=set(),
                                 kv_cache_events=SavedSegments([(LOADED, "a")])))
    assert (stats["tokens_hit"], stats["tokens_failed"]) == (48, 0)


def test_nothing_stored_is_a_miss_and_every_computed_chunk_is_saved(side):
    sched, _ = side
    req = request("b", PROMPT)
    assert match(sched, req, 0) == (0, False)
    alloc(sched, req, 0)
    plan = sched.plan(step(new=[("b", range(7), 0)], scheduled={"b": 100}))
    assert plan.loads == []
    assert [(s.first_chunk, len(s.keys)) for s in plan.saves] == [(0, 3)]  # one segment
    plan = sched.plan(step(cached=[("b", [], 100)], scheduled={"b": 1}))
    assert plan.saves == []  # already planned
    assert sched.ctx.stats["lookup_misses"] == 1


def test_salted_tenants_and_adapters_never_match_each_other(side):
    sched, store = side
    store_chunks(store, request_seed(sched.ctx.seed, request("s", PROMPT, salt="tenant-a")),
                 PROMPT, 3)
    assert match(sched, request("s2", PROMPT, salt="tenant-a"), 0)[0] == 96
    assert match(sched, request("s3", PROMPT, salt="tenant-b"), 0)[0] == 0
    assert match(sched, request("plain", PROMPT), 0)[0] == 0
    lora = SimpleNamespace(lora_name="adapter", lora_int_id=1, lora_path="/nonexistent")
    assert match(sched, request("l", PROMPT, salt="tenant-a", lora=lora), 0)[0] == 0
    assert match(sched, request("mm", PROMPT, mm=["image"]), 0)[0] == 0  # passed through


def test_a_failed_load_makes_its_chunks_stored_again(side):
    sched, store = side
    store_chunks(store, sched.ctx.seed, PROMPT, 3)
    req = request("c", PROMPT)
    assert match(sched, req, 0)[0] == 96
    alloc(sched, req, 96)
    sched.plan(step(new=[("c", range(20, 27), 0)], scheduled={"c": 4}))
    sched.output(SimpleNamespace(invalid_block_ids={22}, kv_cache_events=None))
    plan = sched.plan(step(cached=[("c", [], 100)], scheduled={"c": 1}))
    assert [(s.first_chunk, len(s.keys)) for s in plan.saves] == [(1, 2)]  # from chunk 1


def test_a_plan_that_cannot_be_made_reports_the_expected_loads_failed(side):
    sched, store = side
    store_chunks(store, sched.ctx.seed, PROMPT, 2)
    req = request("d", PROMPT)
    match(sched, req, 16)
    alloc(sched, req, 48)
    plan = sched.failed_plan(step(new=[("d", range(30, 37), 16)]))
    assert plan.failed == [31, 32, 33, 34, 35, 36] and plan.loads == plan.saves == []
    assert (sched.ctx.stats["tokens_hit"], sched.ctx.stats["tokens_failed"]) == (0, 48)


def test_finished_requests_are_forgotten(side):
    sched, _ = side
    match(sched, request("e", PROMPT), 0)
    sched.plan(step(finished=["e"]))
    assert "e" not in sched.requests


def test_a_load_is_counted_when_its_step_is_reported_even_after_the_request_finished(side):
    """vLLM frees a request that finished in the step that loaded it (max_tokens=1)
    before it hands the connector that step's output: the load is counted all the same,
    once (every tensor-parallel rank reports it), split at the first failed block."""
    sched, store = side
    store_chunks(store, sched.ctx.seed, PROMPT, 3)
    req = request("f", PROMPT)
    assert match(sched, req, 0)[0] == 96
    alloc(sched, req, 96)
    sched.plan(step(new=[("f", range(40, 47), 0)], scheduled={"f": 100}))
    sched.finished(req)
    sched.output(SimpleNamespace(invalid_block_ids={42, 43, 44, 45}, kv_cache_events=(
        SavedSegments([(LOADED, "f"), (LOADED, "f"), "f/unknown-segment"]))))
    stats = sched.ctx.stats
    assert (stats["tokens_hit"], stats["tokens_failed"]) == (32, 64)
    sched.output(SimpleNamespace(invalid_block_ids=set(),
                                 kv_cache_events=SavedSegments([(LOADED, "f")])))
    assert (stats["tokens_hit"], stats["tokens_failed"]) == (32, 64)


def test_a_request_resumed_after_preemption_loads_what_vllm_takes_as_computed(side):
    """vLLM 0.32 frees a preempted request's blocks and sets its num_computed_tokens to 0
    (scheduler.py, _preempt_request); back from the waiting queue it asks the connector
    for its matched tokens again, allocates, calls update_state_after_alloc and schedules
    it as a resumed cached request with all its blocks new (schedule(),
    _make_cached_request_data).  Those tokens must be loaded into the new blocks: before,
    no load was planned and the engine read blocks nobody wrote as computed KV."""
    sched, store = side
    store_chunks(store, sched.ctx.seed, PROMPT, 3)
    req = request("p", PROMPT)
    assert match(sched, req, 0)[0] == 96
    alloc(sched, req, 96)
    first = sched.plan(step(new=[("p", range(40, 47), 0)], scheduled={"p": 100}))
    assert [b for load in first.loads for b in load.blocks] == [[40, 41], [42, 43], [44, 45]]
    # preempted, then scheduled again into other blocks
    assert match(sched, req, 0)[0] == 96
    alloc(sched, req, 96)
    again = sched.plan(step(cached=[("p", range(60, 67), 0)], resumed=["p"],
                            scheduled={"p": 100}))
    load, = again.loads
    before, = first.loads
    assert load.blocks == [[60, 61], [62, 63], [64, 65]]  # the same pages, new blocks
    assert (load.names, load.pages) == (before.names, before.pages)
    assert sched.loading["p"] == (96, [60, 61, 62, 63, 64, 65])


def test_a_resumed_request_whose_plan_fails_has_its_expected_loads_reported_failed(side):
    sched, store = side
    store_chunks(store, sched.ctx.seed, PROMPT, 2)
    req = request("q", PROMPT)
    match(sched, req, 0)
    alloc(sched, req, 64)
    plan = sched.failed_plan(step(cached=[("q", range(70, 77), 0)], resumed=["q"]))
    assert plan.failed == [70, 71, 72, 73, 74, 75, 76]
    assert sched.ctx.stats["tokens_failed"] == 64


def test_store_threshold_stores_a_chunk_the_second_time_it_is_computed(side):
    """``store_threshold`` 2 (as vLLM's offloading connector): a prompt computed once is
    not stored (counted ``chunks_unadmitted``), the same prompt computed again is; a
    prefix shared with an earlier prompt is stored, the new tail waits for its second
    time; the counting table keeps ``max_tracker_size`` keys, the least recently counted
    leaving it."""
    import dataclasses

    sched, _ = side
    sched.ctx.config = dataclasses.replace(sched.ctx.config, store_threshold=2,
                                          max_tracker_size=4)
    sched.save_planner.admission = type(sched.save_planner.admission)((2,), 4)

    def computed(req_id: str, tokens: list[int]) -> list[tuple[int, int]]:
        req = request(req_id, tokens)
        assert match(sched, req, 0)[0] == 0
        alloc(sched, req, 0)
        plan = sched.plan(step(new=[(req_id, range(7), 0)], scheduled={req_id: 100}))
        sched.requests.pop(req_id)
        return [(s.first_chunk, len(s.keys)) for s in plan.saves]

    assert computed("a", PROMPT) == []
    assert sched.ctx.stats["chunks_unadmitted"] == 3
    assert computed("b", PROMPT) == [(0, 3)]  # the second time
    other = PROMPT[:40] + [999] * 60  # shares chunk 0 (tokens 0..31) only
    assert computed("c", other) == []  # chunk 0: its third time, but planned by b (2 s)
    sched.save_planner.planned.clear()
    assert computed("d", other) == [(0, 3)]  # chunk 0 again, chunks 1, 2: their second
    # four keys tracked: PROMPT's chunk 1 left the table and is counted anew, so chunk 2
    # (admitted: its third time) waits too (a hit is a prefix: no use without chunk 1)
    sched.save_planner.planned.clear()
    assert computed("e", PROMPT) == [(0, 1)]
    assert computed("f", PROMPT) == [(1, 2)]


def test_store_threshold_is_a_positive_count():
    with pytest.raises(hk.HurrayError, match="store_threshold") as e:
        ConnectorConfig.from_extra({"url": "file:///tmp/x", "store_threshold": 0})
    assert e.value.field == "store_threshold"
