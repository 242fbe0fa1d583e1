"""Issue 30 without an engine: lookups off vLLM's scheduler thread (batched), loads
across steps (one ``LoadJob`` per request, ``loads.py``), what ``load_mode`` chooses, and
what the scheduler counts, over a real ``file://`` store and the cache tensors vLLM's CPU
backend hands ``register_kv_caches`` (``tests/integrations/vllm/test_vllm_worker.py``'s ``Side``).

vLLM's side of the protocol, as 0.32 runs it (``vllm/v1/core/sched/scheduler.py``): a
``None`` from ``get_num_new_matched_tokens`` skips the request for the step; ``(n, True)``
allocates its blocks, calls ``update_state_after_alloc(request, blocks, n)`` and parks
it in ``WAITING_FOR_REMOTE_KVS`` (never in the step's ``scheduled_new_reqs``) until a
worker's ``get_finished`` names it; its failed blocks come from
``get_block_ids_with_load_errors`` of the same step (``base.py``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from hurraykv.chunks.keys import ChunkKeys
from hurraykv.chunks.urls import open_store
from hurraykv.integrations.vllm.events import HurrayKVEvents
from hurraykv.integrations.vllm.loads import STATES, LoadJob
from hurraykv.integrations.vllm.scheduler import SchedulerSide
from tests.integrations.vllm.test_vllm_scheduler import alloc, match, request, step
from tests.integrations.vllm.test_vllm_worker import (
    BLOCK,
    CHUNK,
    LAYER_NAMES,
    Side,
    fill,
    flip,
    save,
)

PROMPT = list(range(1, 101))  # 3 whole chunks before the last token


@pytest.fixture
def side():
    s = Side()
    yield s
    s.close()


def stored(side: Side, url: str, **extra):
    """A scheduler and a worker over ``url``; ``PROMPT``'s 3 chunks stored from blocks
    1-6 as two segments (chunks 0-1 and chunk 2)."""
    w = side.worker(url, async_save=False, **extra)
    sched = SchedulerSide(side.context(url, **extra), HurrayKVEvents(BLOCK, CHUNK,
                                                                      enabled=False))
    keys = ChunkKeys(sched.ctx.seed, CHUNK).upto(PROMPT, 3)
    fill(w, [1, 2, 3, 4, 5, 6], 7.0)
    save(w, "s", keys[:2], 0, [1, 2, 3, 4])
    save(w, "s", keys[2:], 2, [5, 6])
    return sched, w, keys


def async_plan(sched: SchedulerSide, req_id: str, blocks: list[int]):
    req = request(req_id, PROMPT)
    assert match(sched, req, 0) == (3 * CHUNK, True)
    alloc(sched, req, 3 * CHUNK, blocks)
    plan = sched.plan(step())  # the request is not scheduled while it loads
    assert [t.req_id for t in plan.async_loads] == [req_id] and not plan.loads
    return plan


def until_finished(w, timeout: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = w.finished(set())
        if done:
            return done
        time.sleep(0.002)
    return set()


def test_an_async_hit_is_written_exactly_and_counted_when_reported(side, tmp_path):
    sched, w, _ = stored(side, (tmp_path / "kv").as_uri(), load_mode="async")
    blocks = list(range(10, 16))
    plan = async_plan(sched, "a", blocks)
    w.start_load(plan)
    assert until_finished(w) == {"a"}
    assert w.load_errors() == set()
    for name in LAYER_NAMES:
        assert torch.equal(w.caches[name][blocks], w.caches[name][1:7])
    sched.output(SimpleNamespace(invalid_block_ids=set(), kv_cache_events=w.saved.take()))
    s = sched.ctx.stats
    assert (s["tokens_hit"], s["tokens_failed"], s["lookups"], s["lookup_hits"]) == (96, 0, 1, 1)
    ws = w.ctx.stats
    assert (ws["loads_async"], ws["loads_sync"], ws["chunks_loaded"]) == (1, 0, 3)
    assert not sched.async_pending
    # vLLM schedules it once loaded: a new request with the loaded tokens computed, and
    # the second after_alloc of issue's protocol takes no tokens: nothing loads again
    alloc(sched, request("a", PROMPT), 0, blocks)
    again = sched.plan(step(new=[("a", blocks + [16], 96)], scheduled={"a": 4}))
    assert not again.loads and not again.async_loads and not again.saves


def test_get_finished_reports_a_load_as_received_never_as_sent(side, tmp_path):
    """vLLM's ``get_finished`` answers ``(finished_sending, finished_recving)``
    (``kv_connector/v1/base.py:383-398``; ``get_transfer_results`` unpacks it in that
    order, lines 400-409): a request swapped into the sending set would have its
    blocks freed as a finished send and never be scheduled with its loaded tokens."""
    sched, w, _ = stored(side, (tmp_path / "kv").as_uri(), load_mode="async")
    w.start_load(async_plan(sched, "a", list(range(10, 16))))
    deadline = time.monotonic() + 10.0
    while (got := w.get_finished(set())) == (None, None) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert got == (None, {"a"})
    assert w.get_finished(set()) == (None, None)  # reported once


def test_an_async_load_with_a_damaged_segment_fails_from_its_first_chunk(side, tmp_path):
    kv = tmp_path / "kv"
    sched, w, keys = stored(side, kv.as_uri(), load_mode="async")
    name = open_store(kv.as_uri()).locate(keys[2:])[0]
    flip(kv / f"{name}.hrry", 8.0)  # layer 1 of the second segment
    blocks = list(range(10, 16))
    w.start_load(async_plan(sched, "a", blocks))
    assert until_finished(w) == {"a"}
    failed = w.load_errors()
    assert failed == {14, 15}  # chunk 2's blocks: vLLM recomputes from there
    for name_ in LAYER_NAMES:
        assert torch.equal(w.caches[name_][10:14], w.caches[name_][1:5])
    sched.output(SimpleNamespace(invalid_block_ids=failed, kv_cache_events=w.saved.take()))
    s = sched.ctx.stats
    assert (s["tokens_hit"], s["tokens_failed"]) == (64, 32)
    assert w.ctx.stats["chunks_corrupt"] == 1
    # that request is not offered a load again (a preempted one is asked again)
    assert match(sched, request("a", PROMPT), 0) == (0, False)


def test_load_mode_auto_is_sync_for_a_small_file_hit_only(side, tmp_path):
    url = (tmp_path / "kv").as_uri()
    sched, _, _ = stored(side, url, sync_load_max_tokens=64)
    assert match(sched, request("big", PROMPT), 0) == (96, True)
    assert match(sched, request("part", PROMPT), 32) == (64, False)  # 32 cached by vLLM
    for mode, expected in (("sync", False), ("async", True)):
        forced = SchedulerSide(side.context(url, load_mode=mode),
                               HurrayKVEvents(BLOCK, CHUNK, enabled=False))
        assert match(forced, request(mode, PROMPT), 32) == (64, expected)


def test_lookups_asked_in_one_step_are_one_round_trip(side, tmp_path):
    """Eight requests arrive while the store is busy with a first lookup: they are asked
    about together, in one ``locate``."""
    url = (tmp_path / "kv").as_uri()
    sched, _, _ = stored(side, url)
    calls, gate = [], threading.Event()
    real = open_store(url)

    class Counting:
        def locate(self, keys):
            calls.append(len(keys))
            gate.wait(5)
            return real.locate(keys)

    sched.ctx.lookups._store = Counting()
    first = request("first", PROMPT)
    assert sched.matched(first, 0) == (None, False)
    while not calls:
        time.sleep(0.001)
    others = [request(f"r{i}", PROMPT + [i]) for i in range(8)]
    assert all(sched.matched(r, 0) == (None, False) for r in others)
    gate.set()
    assert all(match(sched, r, 0)[0] == 96 for r in [first, *others])
    assert calls == [3, 8 * 3]


def test_an_aborted_request_s_load_is_dropped_by_the_scheduler(side, tmp_path):
    sched, _, _ = stored(side, (tmp_path / "kv").as_uri(), load_mode="async")
    async_plan(sched, "gone", list(range(10, 16)))
    assert "gone" in sched.async_pending and "gone" in sched.loading
    sched.finished(request("gone", PROMPT))
    assert not sched.async_pending and "gone" not in sched.loading
    assert sched.ctx.stats["tokens_hit"] == 0 and sched.ctx.stats["tokens_failed"] == 0


def test_an_allocation_the_scheduler_cannot_plan_is_still_reported_failed(side, tmp_path):
    """vLLM waits for every async load to be reported: a plan that cannot be made (a
    bug of ours, blocks it cannot read) is a load reported failed, never one forgotten."""
    sched, w, _ = stored(side, (tmp_path / "kv").as_uri(), load_mode="async")
    req = request("odd", PROMPT)
    assert match(sched, req, 0) == (96, True)
    blocks = list(range(10, 13))  # fewer blocks than the 6 the hit needs
    alloc(sched, req, 96, blocks)
    plan = sched.plan(step())
    assert plan.async_loads[0].failed.startswith("HurrayError: request odd has 3 blocks")
    w.start_load(plan)
    deadline = time.monotonic() + 10
    while not (results := w.transfer_results(set()))[0] and time.monotonic() < deadline:
        time.sleep(0.002)
    assert results == ({"odd"}, {"odd"})  # finished, and failed as a whole
    for name in LAYER_NAMES:
        assert not w.caches[name][blocks].any()


def test_job_states_follow_the_load(side, tmp_path):
    sched, w, _ = stored(side, (tmp_path / "kv").as_uri(), load_mode="async")
    plan = async_plan(sched, "a", list(range(10, 16)))
    job = LoadJob(plan.async_loads[0])
    assert job.state == "queued" and not job.done
    job.fetch(w.target, {})
    assert job.state == "fetched" and len(job.runs) == 2
    job.write_layer(w.target, 0, w.loader._buffers)
    assert job.state == "writing" and job.written == 1
    job.cancel()
    job.write_layer(w.target, 1, w.loader._buffers)
    assert job.state == "cancelled" and job.written == 1 and job.done
    assert {"queued", "fetched", "writing", "cancelled"} <= set(STATES)
    # layer 1 was never written
    assert not w.caches[LAYER_NAMES[1]][10:16].any()


def test_a_burst_sharing_a_new_prefix_copies_it_out_once(side, tmp_path):
    """Without a store call on the scheduler thread, two requests computing the same new
    chunks in one step would both copy them out: the second skips the chunks the first
    planned (the writer skips whatever the store already holds)."""
    url = (tmp_path / "kv").as_uri()
    sched = SchedulerSide(side.context(url), HurrayKVEvents(BLOCK, CHUNK, enabled=False))
    a, b = request("a", PROMPT), request("b", PROMPT[:64] + [5] * 36)
    for req in (a, b):
        assert match(sched, req, 0) == (0, False)
        alloc(sched, req, 0)
    plan = sched.plan(step(new=[("a", range(1, 8), 0), ("b", range(10, 17), 0)],
                           scheduled={"a": 100, "b": 100}))
    assert [(t.req_id, t.first_chunk, len(t.keys)) for t in plan.saves] == [
        ("a", 0, 3), ("b", 2, 1)]  # b's own third chunk only


def test_a_chunk_planned_by_another_request_is_planned_again_once_the_window_passes(
        side, tmp_path):
    """The store may lose what another request stored (a restart, an operator, a dropped
    save): past ``PLANNED_SECONDS`` the next request computing the chunks stores them."""
    sched = SchedulerSide(side.context((tmp_path / "kv").as_uri()),
                          HurrayKVEvents(BLOCK, CHUNK, enabled=False))

    def saves_of(req_id: str, blocks) -> list[tuple[int, int]]:
        req = request(req_id, PROMPT)
        assert match(sched, req, 0) == (0, False)
        alloc(sched, req, 0)
        plan = sched.plan(step(new=[(req_id, blocks, 0)], scheduled={req_id: 100}))
        return [(t.first_chunk, len(t.keys)) for t in plan.saves]

    assert saves_of("a", range(1, 8)) == [(0, 3)]
    assert saves_of("b", range(10, 17)) == []  # a stores them
    sched.save_planner.PLANNED_SECONDS = 0.0
    assert saves_of("c", range(20, 27)) == [(0, 3)]


def test_chunks_that_failed_to_load_are_stored_again_under_their_segments_names(
        side, tmp_path):
    """A load failed from chunk 0; the chunks came from two segments (chunks 0-1 and
    chunk 2): stored again as the same two segments, so the damaged ones are replaced,
    not left beside new ones."""
    sched, _, keys = stored(side, (tmp_path / "kv").as_uri(), load_mode="sync")
    req = request("a", PROMPT)
    assert match(sched, req, 0) == (96, False)
    alloc(sched, req, 96)
    blocks = list(range(10, 17))
    sched.plan(step(new=[("a", blocks, 0)], scheduled={"a": 4}))
    sched.output(SimpleNamespace(invalid_block_ids=set(blocks), kv_cache_events=None))
    plan = sched.plan(step(cached=[("a", [], 0)], scheduled={"a": 100}))
    assert [(t.first_chunk, t.keys, t.rewrite) for t in plan.saves] == [
        (0, keys[:2], True), (2, keys[2:], True)]


def test_a_chunk_is_planned_again_once_its_save_is_reported_written_or_dropped(
        side, tmp_path):
    """The writer's report frees the keys at once (the store may lose the chunk right
    after, or the writer drop it)."""
    from hurraykv.integrations.vllm.events import SavedSegments

    sched = SchedulerSide(side.context((tmp_path / "kv").as_uri()),
                          HurrayKVEvents(BLOCK, CHUNK, enabled=False))

    def plan_of(req_id: str, blocks):
        req = request(req_id, PROMPT)
        assert match(sched, req, 0) == (0, False)
        alloc(sched, req, 0)
        return sched.plan(step(new=[(req_id, blocks, 0)], scheduled={req_id: 100})).saves

    (first,) = plan_of("a", range(1, 8))
    assert plan_of("b", range(10, 17)) == []  # a stores them
    sched.output(SimpleNamespace(invalid_block_ids=set(), kv_cache_events=SavedSegments(
        [("dropped", f"a/{first.keys[0]}")])))
    assert [len(t.keys) for t in plan_of("c", range(20, 27))] == [3]
