"""Issue 47 item 5: a save does no work it can leave out.

The engine is driven as vLLM 0.32 drives a connector (``test_vllm_save_counts``): the
scheduler's plan each step, the worker's hooks, over a real ``file://`` store whose calls
are counted, and the cache tensors vLLM's CPU backend registers.

* The writer asks the store whether it holds a segment's chunks (``has``) only when this
  request's lookup did not already find one of them missing: a miss's prefill is written
  without a round trip to the store; chunks past what the lookup asked (decode tokens)
  are still asked about.
* A step that loads and saves nothing builds no plan (the scheduler hands out one empty
  plan) and costs the workers no bookkeeping: their counters stay as they were.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from hurraykv.chunks.urls import open_store
from hurraykv.integrations.vllm.common import Plan
from hurraykv.integrations.vllm.events import HurrayKVEvents
from hurraykv.integrations.vllm.scheduler import SchedulerSide
from tests.integrations.vllm.test_vllm_save_counts import reported
from tests.integrations.vllm.test_vllm_scheduler import alloc, match, request, step
from tests.integrations.vllm.test_vllm_worker import BLOCK, CHUNK, LAYER_NAMES, Side, fill


@pytest.fixture
def side():
    s = Side()
    yield s
    s.close()


def engine_step(sched: SchedulerSide, w, output: Any) -> Plan:
    """One engine step (``test_vllm_save_counts.engine_step``): the plan it ran."""
    plan = sched.plan(output)
    w.start_load(plan)
    for name in LAYER_NAMES:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, plan)
    w.wait_for_save(plan)
    w.transfer_results(output.finished_req_ids)
    reported(sched, w, w.load_errors())
    return plan


class CountingStore:
    """The real file store, each of its calls counted by name."""

    def __init__(self, url: str) -> None:
        self.inner, self.calls = open_store(url), Counter()

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.inner, name)
        if not callable(found):
            return found

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return found(*args, **kwargs)
        return counted


def test_a_miss_is_stored_without_asking_the_store_what_its_lookup_found_missing(
        side, tmp_path):
    """A 100-token prompt the store lacks: its lookup found chunks 0-2 missing, so the
    writer stores them without ``has`` (it asked once before).  Decoding on to 129 tokens
    completes chunk 3 in a later step: the writer asks the store first (another engine
    may have stored it since the lookup), as it does for a chunk no lookup asked about."""
    url = (tmp_path / "kv").as_uri()
    store = CountingStore(url)
    w = side.worker(url, lambda: store)
    sched = SchedulerSide(side.context(url), HurrayKVEvents(BLOCK, CHUNK, enabled=False))
    req = request("a", list(range(1, 101)))
    assert match(sched, req, 0) == (0, False)
    alloc(sched, req, 0)
    blocks = list(range(1, 10))
    fill(w, blocks, 3.0)
    engine_step(sched, w, step(new=[("a", blocks, 0)], scheduled={"a": 100}))
    w.drain()
    assert w.ctx.stats["segments_saved"] == 1
    assert (store.calls["put"], store.calls["has"]) == (1, 0)  # has was asked once

    req.all_token_ids += list(range(200, 229))  # 129 tokens: chunk 3 is complete
    engine_step(sched, w, step(cached=[("a", [], 100)], scheduled={"a": 29}))
    w.drain()
    assert w.ctx.stats["segments_saved"] == 2
    assert (store.calls["put"], store.calls["has"]) == (2, 1)  # unknown to the lookup

    # a hit of chunks 0-2 whose prefill completes chunk 3 in the lookup's own step: no
    # lookup asked about chunk 3, so the writer does
    hit = request("b", list(range(1, 97)) + list(range(500, 532)))  # 128 tokens
    assert match(sched, hit, 0) == (96, False)
    alloc(sched, hit, 96)
    more = list(range(20, 28))
    plan = engine_step(sched, w, step(new=[("b", more, 96)], scheduled={"b": 32}))
    w.drain()
    assert len(plan.loads) == 1 and [(t.first_chunk, t.absent) for t in plan.saves] == [
        (3, False)]
    assert (store.calls["put"], store.calls["has"]) == (3, 2)


def test_a_step_that_loads_and_saves_nothing_builds_no_plan_and_counts_nothing(
        side, tmp_path):
    """A request's prefill stores its 3 chunks; its next 20 decode steps complete none:
    the scheduler builds no plan for them (one empty plan, made once, was 20) and the
    worker's counters do not move (``save_seconds`` grew every step)."""
    url = (tmp_path / "kv").as_uri()
    w = side.worker(url)
    built: list[Plan] = []

    def new_plan() -> Plan:
        built.append(Plan())
        return built[-1]

    sched = SchedulerSide(side.context(url), HurrayKVEvents(BLOCK, CHUNK, enabled=False),
                          new_plan=new_plan)
    req = request("a", list(range(1, 101)))
    assert match(sched, req, 0) == (0, False)
    alloc(sched, req, 0)
    engine_step(sched, w, step(new=[("a", list(range(1, 10)), 0)], scheduled={"a": 100}))
    w.drain()
    assert len(built) == 1 and len(built[0].saves) == 1
    before = dict(w.ctx.stats.items())
    plans = []
    for k in range(20):  # tokens 100..120: chunk 3 ends at 128
        req.all_token_ids.append(7)
        plans.append(engine_step(sched, w, step(cached=[("a", [], 100 + k)],
                                                scheduled={"a": 1})))
    assert len(built) <= 2, len(built)  # was 21
    assert all(not (p.loads or p.async_loads or p.saves or p.failed) for p in plans)
    assert dict(w.ctx.stats.items()) == before
    # the step that completes chunk 3 plans its save as before
    req.all_token_ids += [7] * 8
    plan = sched.plan(step(cached=[("a", [], 120)], scheduled={"a": 8}))
    assert [(s.first_chunk, len(s.keys)) for s in plan.saves] == [(3, 1)]
