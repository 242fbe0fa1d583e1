"""Issue 46 item 16: every save the connector sets out to make lands in exactly one
counted outcome, also while some are still in flight.

Under a 16-client burst against ``vllm serve`` the metrics showed 156 stored segments
for 160 prompts with nothing dropped or present: the scheduler leaves out the chunks
another request of the engine is storing (prompts sharing a new prefix, a duplicate
prompt: ``SchedulerSide._planned_elsewhere``) and counted nothing for them, and a
segment waiting for the writer was in no counter until it landed.  Now::

    saves_attempted == segments_saved + saves_present + saves_dropped
                       + saves_deduplicated + saves_pending

at every read of the counters (``saves.py``), summed over the scheduler's and the
worker's as vLLM's ``/metrics`` sums them (``metrics.py``).

The engine is driven as vLLM 0.32 drives a connector, over a real ``file://`` store and
the cache tensors vLLM's CPU backend registers (``test_vllm_worker.Side``): per step the
scheduler's ``build_connector_meta`` (``vllm/v1/core/sched/scheduler.py:1561``), then
on the worker ``start_load_kv`` (``vllm/v1/worker/kv_connector_model_runner_mixin.py:85``),
each attention layer's ``save_kv_layer`` during the forward pass
(``vllm/model_executor/layers/attention/kv_transfer_utils.py:57``), ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``,
``get_kv_connector_kv_cache_events`` (mixin lines 92-103), and the records back in the
scheduler's ``update_connector_output`` (``scheduler.py:3219``).  Requests and scheduler
outputs are ``test_vllm_scheduler``'s stand-ins with vLLM's fields.  The writer is held
the way another engine sharing the directory holds it: an exclusive ``flock`` on
``DIR/.lock`` (a scan-and-evict, ``file_capacity.py``).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from types import SimpleNamespace

import pytest

from hurraykv.integrations.vllm.events import HurrayKVEvents
from hurraykv.integrations.vllm.scheduler import SchedulerSide
from tests.integrations.vllm.test_vllm_scheduler import alloc, match, request, step
from tests.integrations.vllm.test_vllm_worker import BLOCK, CHUNK, LAYER_NAMES, Side, fill
from tests.support.waits import until

OUTCOMES = ("segments_saved", "saves_present", "saves_dropped", "saves_deduplicated",
            "saves_pending")


@pytest.fixture
def side():
    s = Side()
    yield s
    s.close()


def scrape(*sides) -> dict[str, float]:
    """What ``/metrics`` adds up: each side's counters (a consistent read of each), summed
    as vLLM aggregates the scheduler's stats into the workers' (``scheduler.py:2342``)."""
    out: dict[str, float] = {}
    for ctx in sides:
        for name, value in ctx.stats.items():
            out[name] = out.get(name, 0) + value
    return out


def adds_up(counts: dict[str, float]) -> bool:
    return counts["saves_attempted"] == sum(counts[k] for k in OUTCOMES)


def engine_step(sched: SchedulerSide, w, output: SimpleNamespace) -> None:
    """One engine step: the scheduler's plan, the worker's forward pass and hooks, the
    worker's records back to the scheduler."""
    plan = sched.plan(output)
    w.start_load(plan)
    for name in LAYER_NAMES:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, plan)
    w.wait_for_save(plan)
    w.transfer_results(output.finished_req_ids)
    invalid = w.load_errors()
    reported(sched, w, invalid)


def reported(sched: SchedulerSide, w, invalid=frozenset()) -> None:
    sched.output(SimpleNamespace(kv_cache_events=w.saved.take(), invalid_block_ids=invalid,
                                 failed_recving=set()))


def test_every_save_attempted_lands_in_one_counted_outcome_at_every_scrape(side, tmp_path):
    """A burst of 8 prompts in one step while another engine holds the directory's lock:
    6 distinct, one sharing its first two chunks with another, one a duplicate.  The
    duplicate's chunks and the shared ones are another request's (deduplicated), 4
    segments wait for the writer (pending: max_pending_saves) and the other 3 are
    dropped; released, the 4 are stored.  A ninth request, looked up before any of it
    was stored, computes a stored prompt again (present).  A scraper thread reads the
    counters all along, as /metrics would be scraped during the burst."""
    kv = tmp_path / "kv"
    url = kv.as_uri()
    w = side.worker(url, max_pending_saves=4)  # async_save: the writer thread
    sched = SchedulerSide(side.context(url), HurrayKVEvents(BLOCK, CHUNK, enabled=False))
    base = [[1000 * i + t for t in range(100)] for i in range(6)]  # 3 chunks each
    prompts = {f"a{i}": p for i, p in enumerate(base)}
    prompts["shared"] = base[0][:2 * CHUNK] + [7] * 36  # a0's first two chunks
    prompts["dup"] = list(base[1])  # a1 again, in the same step
    prompts["late"] = list(base[2])  # a2 again, scheduled once a2 is stored
    blocks = {r: list(range(1 + 7 * n, 8 + 7 * n)) for n, r in enumerate(prompts)}
    for n, r in enumerate(prompts):
        fill(w, blocks[r], float(n))
        req = request(r, prompts[r])
        assert match(sched, req, 0) == (0, False)  # nothing stored yet: every one a miss
        alloc(sched, req, 0)

    scrapes, wrong, stop = [0], [], threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            counts = scrape(sched.ctx, w.ctx)
            scrapes[0] += 1
            if not adds_up(counts):
                wrong.append(counts)
            time.sleep(0.0005)

    reader = threading.Thread(target=scraper, daemon=True)
    reader.start()
    try:  # the scraper stops whatever fails
        kv.mkdir(parents=True, exist_ok=True)
        lock = os.open(kv / ".lock", os.O_RDONLY | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another engine's scan-and-evict
            burst = [r for r in prompts if r != "late"]
            engine_step(sched, w, step(new=[(r, blocks[r], 0) for r in burst],
                                       scheduled={r: 100 for r in burst}))
            during = scrape(sched.ctx, w.ctx)
            assert {k: during[k] for k in ("saves_attempted", *OUTCOMES)} == {
                "saves_attempted": 9, "segments_saved": 0, "saves_present": 0,
                "saves_dropped": 3, "saves_deduplicated": 2, "saves_pending": 4}, during
            seen = scrapes[0]  # scraped while the saves wait, however loaded the machine
            assert until(lambda: scrapes[0] >= seen + 5, 10)
        finally:
            os.close(lock)  # released: the writer stores what waits
        w.drain(10.0)
        reported(sched, w)
        after = scrape(sched.ctx, w.ctx)
        assert (after["segments_saved"], after["saves_pending"]) == (4, 0), after
        engine_step(sched, w, step(new=[("late", blocks["late"], 0)], scheduled={"late": 100}))
        w.drain(10.0)
        reported(sched, w)
        final = scrape(sched.ctx, w.ctx)
        # a2 was stored (the writer takes the burst's segments in order, a0 to a3): its
        # chunks are in the store when "late" computes them again, so they are not rewritten
        assert {k: final[k] for k in ("saves_attempted", *OUTCOMES)} == {
            "saves_attempted": 10, "segments_saved": 4, "saves_present": 1,
            "saves_dropped": 3, "saves_deduplicated": 2, "saves_pending": 0}, final
    finally:
        stop.set()
        reader.join()
    assert scrapes[0] > 10 and not wrong, (scrapes[0], wrong[:3])


def test_saves_still_waiting_at_shutdown_are_counted_dropped(side, tmp_path):
    """vLLM's shutdown while the writer is held: the writer waits ``save_timeout_ms``
    for the segments queued and cancels the rest, which are then dropped, not pending
    for ever."""
    kv = tmp_path / "kv"
    url = kv.as_uri()
    w = side.worker(url, save_timeout_ms=100)
    sched = SchedulerSide(side.context(url), HurrayKVEvents(BLOCK, CHUNK, enabled=False))
    names = [f"r{i}" for i in range(4)]
    for n, r in enumerate(names):
        req = request(r, [1000 * n + t for t in range(100)])
        assert match(sched, req, 0) == (0, False)
        alloc(sched, req, 0)
    kv.mkdir(parents=True, exist_ok=True)
    lock = os.open(kv / ".lock", os.O_RDONLY | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        engine_step(sched, w, step(new=[(r, range(1 + 7 * n, 8 + 7 * n), 0)
                                        for n, r in enumerate(names)],
                                   scheduled=dict.fromkeys(names, 100)))
        assert w.ctx.stats["saves_pending"] == 4
        w.shutdown()  # the first is being written; the 3 behind it never will be
        counts = scrape(sched.ctx, w.ctx)
        assert adds_up(counts) and counts["saves_dropped"] >= 3, counts
    finally:
        os.close(lock)
    deadline = time.monotonic() + 10
    while w.ctx.stats["saves_pending"] and time.monotonic() < deadline:
        time.sleep(0.01)
    counts = scrape(sched.ctx, w.ctx)
    assert counts["saves_pending"] == 0 and adds_up(counts), counts
    assert counts["segments_saved"] + counts["saves_dropped"] == 4, counts
