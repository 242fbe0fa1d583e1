"""The connector over a stack of tiers (``kv_connector_extra_config['tiers']``), without
an engine: the config read once, a lower tier's hit loaded and promoted into the tier
above, so that the next hit comes from there.  Real ``mem://`` and ``file://`` stores;
the engine's cache as vLLM's CPU backend hands it (``test_vllm_worker.py``)."""

from __future__ import annotations

import itertools
import logging
import time
from types import SimpleNamespace

import pytest
import torch

from hurraykv.chunks.guard import Guarded
from hurraykv.chunks.keys import ChunkKeys, identity_digest
from hurraykv.chunks.memory import MemoryChunks
from hurraykv.chunks.stack import StackedChunks, tier_counts
from hurraykv.chunks.urls import open_store
from hurraykv.errors import ConfigError
from hurraykv.integrations.vllm.common import Context
from hurraykv.integrations.vllm.config import ConnectorConfig
from hurraykv.integrations.vllm.context import open_stack
from hurraykv.integrations.vllm.events import HurrayKVEvents
from hurraykv.integrations.vllm.scheduler import SchedulerSide
from hurraykv.integrations.vllm.tier_events import TierKVEvents, TierReports, tier_tags
from hurraykv.io import scatter
from tests.integrations.vllm.test_vllm_scheduler import alloc, match, request, step
from tests.integrations.vllm.test_vllm_worker import (
    BLOCK,
    CHUNK,
    IDENTITY,
    LAYER_NAMES,
    Side,
    fill,
    run_step,
    save,
)
from tests.support.waits import until

_pools = itertools.count()


class Tiers(Side):
    """``Side`` whose contexts read ``tiers`` (given where ``Side`` takes a URL) and open
    the stack ``context.build_context``'s opener opens (``open_stack``)."""

    def context(self, tiers, open_one=None, **extra) -> Context:
        conf = ConnectorConfig.from_extra({"tiers": tiers, **extra})
        counts = tier_counts(len(conf.tiers))  # one connector's stacks share them
        reports = TierReports()  # and report into one place (KV events per tier)

        def opened(ranked: bool = True) -> StackedChunks:
            return open_stack(conf, counts=counts, report=reports.add)

        guards = [Guarded(opened, url=conf.url, what=what, timeout=5.0,
                          log=logging.getLogger("test"))
                  for what in ("lookup", "load", "save")]
        self.guards += guards
        return Context(conf, BLOCK, CHUNK, IDENTITY, identity_digest(IDENTITY),
                       can_load=True, can_save=True, lookups=guards[0], loads=guards[1],
                       saves=guards[2], tier_counts=counts, open=opened,
                       tier_reports=reports)


@pytest.fixture
def tiers():
    s = Tiers()
    yield s
    s.close()



def test_a_lower_tiers_hit_loads_and_is_promoted_so_the_next_comes_from_memory(
        tiers, tmp_path):
    pool = f"tiers-{next(_pools)}"
    stack = [{"url": f"mem://{pool}", "max_bytes": "64M"},
             {"url": (tmp_path / "kv").as_uri(), "max_bytes": "1G"}]
    w = tiers.worker(stack, async_save=False)
    sched = SchedulerSide(tiers.context(stack), HurrayKVEvents(BLOCK, CHUNK, enabled=False))
    prompt = list(range(1, 101))  # 3 whole chunks before the last token
    keys = ChunkKeys(sched.ctx.seed, CHUNK).upto(prompt, 2)
    fill(w, [1, 2, 3, 4], 7.0)
    save(w, "s", keys, 0, [1, 2, 3, 4])
    below = open_store((tmp_path / "kv").as_uri())
    assert until(lambda: below.locate(keys)[0] is not None)  # written through
    memory = MemoryChunks(pool, max_bytes=1 << 26)
    name = memory.locate(keys)[0]
    assert name is not None and memory.remove(name)  # only the lower tier holds it now

    req = request("a", prompt)
    assert match(sched, req, 0) == (64, False)
    alloc(sched, req, 64)
    plan = sched.plan(step(new=[("a", range(10, 17), 0)], scheduled={"a": 100}))
    assert [t.promote for t in plan.loads] == [{name: keys}]
    assert run_step(w, plan) == set()
    for layer, layer_name in enumerate(LAYER_NAMES):  # the pages, bit for bit
        assert torch.equal(w.caches[layer_name][10:14],
                           torch.full_like(w.caches[layer_name][10:14], 7.0 + layer))
    sched.output(SimpleNamespace(invalid_block_ids=set(), kv_cache_events=w.saved.take()))
    w.get_finished(set())  # the job counted: its segment promoted, off the path
    assert until(lambda: memory.locate(keys)[0] == name)
    assert memory.get_verified(name).equal(below.get_verified(name))
    # what the worker's stacks counted, per tier (vllm:hurraykv_tier_* in /metrics)
    counts = w.ctx.tier_counts
    assert counts["hits"] == [0, 1] and counts["loaded_bytes"][1] > 0
    assert until(lambda: counts["promotions"] == [1, 0])  # counted once its put returned
    assert counts["promotions"] == [1, 0] and counts["stored_bytes"][0] > 0
    assert counts["writes"] == [1, 1] and counts["outages"] == [0, 0]
    if scatter.available():  # the lower tier's file read in one pass past the tier above
        assert w.ctx.stats["bytes_loaded_direct"] == w.ctx.stats["bytes_loaded"] > 0


def test_a_hits_tokens_are_told_by_the_tier_each_chunk_was_found_in(tiers, tmp_path):
    """What vLLM's ``get_external_cache_hit_sources`` is told (issue 49 item 2): a prefix
    whose first chunk is in memory and second only on disk is split between them; a hit
    vLLM takes fewer tokens of counts its first ones (its load's), and one that starts
    inside a chunk (vLLM cached the first block itself) only the tokens the connector
    supplies."""
    pool = f"tiers-{next(_pools)}"
    stack = [{"url": f"mem://{pool}", "max_bytes": "64M"},
             {"url": (tmp_path / "kv").as_uri(), "max_bytes": "1G"}]
    w = tiers.worker(stack, async_save=False)
    sched = SchedulerSide(tiers.context(stack), HurrayKVEvents(BLOCK, CHUNK, enabled=False))
    prompt = list(range(1, 101))
    keys = ChunkKeys(sched.ctx.seed, CHUNK).upto(prompt, 2)
    fill(w, [1, 2, 3, 4], 3.0)
    save(w, "s", keys[:1], 0, [1, 2])
    save(w, "t", keys[1:], 1, [3, 4])
    below = open_store((tmp_path / "kv").as_uri())
    assert until(lambda: None not in below.locate(keys))  # written through
    memory = MemoryChunks(pool, max_bytes=1 << 26)
    assert memory.remove(memory.locate(keys)[1])  # the second chunk on disk only

    req = request("a", prompt)
    assert match(sched, req, 0) == (64, False)
    assert sched.hit_tiers(req, 64) == {0: 32, 1: 32}
    assert sched.hit_tiers(req, 48) == {0: 32, 1: 16}  # vLLM took fewer: the first ones
    assert sched.hit_tiers(req, 65) == {None: 65}  # not its lookup's tokens: unknown
    assert sched.hit_tiers(request("b", prompt), 32) == {None: 32}  # never looked up
    later = request("c", prompt)
    assert match(sched, later, BLOCK) == (64 - BLOCK, False)  # vLLM had a block cached
    assert sched.hit_tiers(later, 64 - BLOCK) == {0: 32 - BLOCK, 1: 32}


def test_tiers_are_read_once_and_a_wrong_one_is_refused_naming_it(tmp_path):
    kv = (tmp_path / "kv").as_uri()
    conf = ConnectorConfig.from_extra({"tiers": [{"url": "mem://", "max_bytes": "8G"},
                                                 {"url": kv, "max_bytes": "500G"}],
                                       "write_policy": "write_back"})
    assert conf.url == "mem://" and conf.store_options == {"max_bytes": 8 << 30}
    assert [t.options for t in conf.tiers] == [{"max_bytes": 8 << 30},
                                               {"max_bytes": 500 << 30}]
    for extra, field, why in [
        ({"url": kv, "tiers": [{"url": kv}]}, "tiers", r"has .tiers. and \[.url.\]"),
        ({"tiers": [{"url": kv}], "max_bytes": "1G"}, "tiers", "go in its tier.s entry"),
        ({"tiers": []}, "tiers", "non-empty list"),
        ({"tiers": [kv]}, "tiers[0]", "a tier is an object"),
        ({"tiers": [{"url": "mem://"}]}, "max_bytes", r"needs kv_connector_extra_config"
                                                      r"\['tiers'\]\[0\]\['max_bytes'\]"),
        ({"tiers": [{"url": kv, "tls_ca": "x"}]}, "tiers[0].url", "not one a file:// store"),
        ({"tiers": [{"url": kv}, {"url": kv}]}, "tiers[1].url", "an earlier tier's"),
        ({"tiers": [{"url": kv, "max_bytes": "lots"}]}, "tiers[0].max_bytes", "a size"),
        ({"tiers": [{"url": kv}], "write_policy": "write_around"}, "write_policy",
         "one of write_through, write_back"),
    ]:
        with pytest.raises(ConfigError, match=why) as e:
            ConnectorConfig.from_extra(extra)
        assert e.value.field == field, (extra, e.value)


# ---------------------------------------------------------------- store_threshold per tier
def test_a_tiers_store_threshold_is_read_and_write_back_refuses_one_below_the_first(
        tmp_path):
    kv = (tmp_path / "kv").as_uri()
    conf = ConnectorConfig.from_extra({"tiers": [
        {"url": "mem://", "max_bytes": "8G"},
        {"url": kv, "max_bytes": "500G", "store_threshold": 2},
        {"url": (tmp_path / "kv2").as_uri(), "store_threshold": "1"}], "store_threshold": 3})
    assert conf.thresholds() == (3, 2, 1)  # the connector's where a tier has none
    assert conf.tiers[1].options == {"max_bytes": 500 << 30}  # not a store option
    assert ConnectorConfig.from_extra({"url": kv, "store_threshold": 2}).thresholds() == (2,)
    first_only = ConnectorConfig.from_extra({"tiers": [
        {"url": "mem://", "max_bytes": "8G", "store_threshold": 2}, {"url": kv}],
        "write_policy": "write_back"})
    assert first_only.thresholds() == (2, 2)  # what the first admits, each is given
    for tier, policy, field, why in [
        ({"url": kv, "store_threshold": 0}, "write_through", "tiers[1].store_threshold",
         r"\['tiers\[1\].store_threshold'\] is 0; it is a positive int"),
        ({"url": kv, "store_threshold": "twice"}, "write_through",
         "tiers[1].store_threshold", "positive int"),
        ({"url": kv, "store_threshold": 2}, "write_back", "tiers[1].store_threshold",
         r"\['tiers'\]\[1\]\['store_threshold'\] is 2 with write_policy 'write_back': a "
         "lower tier receives only what the first tier drops"),
    ]:
        with pytest.raises(ConfigError, match=why) as e:
            ConnectorConfig.from_extra({"tiers": [{"url": "mem://", "max_bytes": "8G"}, tier],
                                        "write_policy": policy})
        assert e.value.field == field, (tier, e.value)


def _computed(sched: SchedulerSide, w, req_id: str, prompt: list[int], blocks: list[int],
              hashes: list[bytes] | None = None):
    """``req_id`` computes ``prompt`` whole (its lookup misses): the step's plan, run on
    the worker ``w`` (its saves written, the stack's queue drained); ``hashes``: its
    blocks' hashes (vLLM's ``request.block_hashes``), for its KV events."""
    req = request(req_id, prompt)
    req.block_hashes = hashes or []
    assert match(sched, req, 0) == (0, False)
    alloc(sched, req, 0)
    plan = sched.plan(step(new=[(req_id, blocks, 0)], scheduled={req_id: len(prompt)}))
    for layer_name in LAYER_NAMES:  # the forward pass's layers copied out
        w.save_kv_layer(layer_name, plan)
    assert run_step(w, plan) == set()
    w.ctx.saves.call("settle", lambda stack: stack.settle(), None)
    sched.output(SimpleNamespace(invalid_block_ids=set(), kv_cache_events=w.saved.take()))
    sched.requests.pop(req_id)
    return plan


def test_each_tier_stores_a_chunk_once_its_own_threshold_admits_it(tiers, tmp_path):
    """``mem://`` at 1, ``file://`` at 2: a prompt computed once is kept in memory only;
    evicted from there and computed again, it lands in both.  The scheduler counts each
    chunk's computations once, and what each tier kept out."""
    pool = f"tiers-{next(_pools)}"
    stack = [{"url": f"mem://{pool}", "max_bytes": "64M", "store_threshold": 1},
             {"url": (tmp_path / "kv").as_uri(), "max_bytes": "1G", "store_threshold": 2}]
    w = tiers.worker(stack, async_save=False)
    sched = SchedulerSide(tiers.context(stack), HurrayKVEvents(BLOCK, CHUNK, enabled=False))
    memory, below = MemoryChunks(pool, max_bytes=1 << 26), open_store((tmp_path / "kv").as_uri())
    prompt = list(range(1, 101))  # 3 whole chunks before the last token
    keys = ChunkKeys(sched.ctx.seed, CHUNK).upto(prompt, 3)
    fill(w, list(range(1, 7)), 5.0)

    plan = _computed(sched, w, "a", prompt, list(range(1, 8)))
    assert [(s.first_chunk, len(s.keys), s.tiers) for s in plan.saves] == [(0, 3, (0,))]
    name = memory.locate(keys)[0]
    assert name is not None and below.locate(keys) == [None] * 3  # memory only
    assert w.ctx.tier_counts["writes"] == [1, 0]
    assert sched.ctx.tier_counts["unadmitted"] == [0, 3]
    assert sched.ctx.stats["chunks_unadmitted"] == 0  # a tier took every chunk

    assert memory.remove(name)  # dropped from memory: the next request computes it again
    plan = _computed(sched, w, "b", prompt, list(range(1, 8)))
    assert [(s.first_chunk, len(s.keys), s.tiers) for s in plan.saves] == [(0, 3, None)]
    assert memory.locate(keys) == [name] * 3 and below.locate(keys) == [name] * 3
    assert below.get_verified(name).equal(memory.get_verified(name))
    assert w.ctx.tier_counts["writes"] == [2, 1]
    assert sched.ctx.tier_counts["unadmitted"] == [0, 3]


def test_under_write_back_the_first_tiers_threshold_admits_for_the_stack(tiers, tmp_path):
    """``write_back`` with ``mem://`` at 2 over ``file://``: a prompt computed once is
    stored nowhere (not planned for the lower tier alone, which the stack would refuse:
    refused saves declared the saves' store down); computed again, it is stored in
    memory, and no save failed."""
    pool = f"tiers-{next(_pools)}"
    stack = [{"url": f"mem://{pool}", "max_bytes": "64M", "store_threshold": 2},
             {"url": (tmp_path / "kv").as_uri()}]
    w = tiers.worker(stack, async_save=False, write_policy="write_back")
    sched = SchedulerSide(tiers.context(stack, write_policy="write_back"),
                          HurrayKVEvents(BLOCK, CHUNK, enabled=False))
    memory = MemoryChunks(pool, max_bytes=1 << 26)
    prompt = list(range(1, 101))
    keys = ChunkKeys(sched.ctx.seed, CHUNK).upto(prompt, 3)
    fill(w, list(range(1, 7)), 5.0)
    for req_id, planned in (("a", []), ("b", [(0, 3, None)])):
        plan = _computed(sched, w, req_id, prompt, list(range(1, 8)))
        assert [(s.first_chunk, len(s.keys), s.tiers) for s in plan.saves] == planned
    assert memory.locate(keys)[0] is not None
    assert w.ctx.stats["saves_dropped"] == 0 and w.ctx.saves.stats["failures"] == 0


def test_a_run_breaks_where_its_tiers_change_and_a_promotion_is_not_admitted(
        tiers, tmp_path):
    """``mem://`` at 2 under ``file://`` at 1: a chunk computed once goes to the disk
    alone, written before the save is done (the first tier that admits it); a prompt whose
    first chunk is computed the second time is stored in two segments, the first in both
    tiers; and a hit from the disk is promoted into memory whatever memory's threshold (a
    hit is a reuse)."""
    pool = f"tiers-{next(_pools)}"
    stack = [{"url": f"mem://{pool}", "max_bytes": "64M", "store_threshold": 2},
             {"url": (tmp_path / "kv").as_uri(), "max_bytes": "1G"}]
    w = tiers.worker(stack, async_save=False)
    sched = SchedulerSide(tiers.context(stack), HurrayKVEvents(BLOCK, CHUNK, enabled=False))
    memory, below = MemoryChunks(pool, max_bytes=1 << 26), open_store((tmp_path / "kv").as_uri())
    one = list(range(1, 41))  # 1 whole chunk before the last token
    fill(w, list(range(1, 7)), 9.0)
    plan = _computed(sched, w, "a", one, [1, 2, 3])
    assert [(s.first_chunk, s.tiers) for s in plan.saves] == [(0, (1,))]
    first = ChunkKeys(sched.ctx.seed, CHUNK).upto(one, 1)
    name = below.locate(first)[0]
    assert name is not None and memory.locate(first) == [None]
    assert w.ctx.tier_counts["writes"] == [0, 1]

    assert below.remove(name)
    longer = one[:CHUNK] + [7] * 68  # chunk 0 computed the second time, then 2 new ones
    plan = _computed(sched, w, "b", longer, list(range(1, 8)))
    assert [(s.first_chunk, len(s.keys), s.tiers) for s in plan.saves] == [
        (0, 1, None), (1, 2, (1,))]
    assert sched.ctx.tier_counts["unadmitted"] == [1 + 2, 0]

    # the lower tier's hit of chunks 1-2 promoted into memory, which never admitted them
    req = request("c", longer)
    assert match(sched, req, 0) == (96, False)
    alloc(sched, req, 96)
    plan = sched.plan(step(new=[("c", range(10, 17), 0)], scheduled={"c": 100}))
    assert run_step(w, plan) == set()
    w.get_finished(set())
    rest = ChunkKeys(sched.ctx.seed, CHUNK).upto(longer, 3)[1:]
    assert until(lambda: memory.locate(rest)[0] is not None)
    assert w.ctx.tier_counts["promotions"] == [1, 0]


# ---------------------------------------------------------------- KV events per tier
def _told(sched: SchedulerSide) -> list[tuple]:
    """The events vLLM would publish now, as (kind, medium, ownership, locality, hashes)."""
    return [(e.kind, e.medium, e.ownership, e.locality, tuple(e.block_hashes))
            for e in sched.take_events()]


def _hashes(tag: str) -> tuple[bytes, ...]:
    return tuple(f"{tag}{b}".encode() for b in range(6))  # a prompt's 6 whole blocks


def test_each_tier_announces_what_it_holds_and_what_it_dropped(tiers, tmp_path):
    """``mem://`` (vLLM's CPU medium) over ``file://`` (STORAGE), each tier named by its
    ownership: a save is announced in each tier once that tier holds it (the lower one
    through the stack's queue); what memory drops to make room is announced removed
    there, at once (the worker's stack reports it); what the directory loses behind the
    engine's back is found by the removal watch, in that tier alone (memory still holds
    it)."""
    from tests.integrations.vllm.test_vllm_retention import EVENTS

    pool, kv = f"tiers-{next(_pools)}", (tmp_path / "kv").as_uri()
    stack = [{"url": f"mem://{pool}", "max_bytes": 150_000},  # one segment of 3 chunks
             {"url": kv, "max_bytes": "1G"}]
    w = tiers.worker(stack, async_save=False)
    sched = SchedulerSide(tiers.context(stack, removal_check_s=0.05), TierKVEvents(
        BLOCK, CHUNK, tiers=tier_tags([t["url"] for t in stack]), api=EVENTS))
    mem, disk = ("CPU", "hurraykv:0:mem", "LOCAL"), ("STORAGE", "hurraykv:1:file", "LOCAL")
    below = open_store(kv)
    a, b = list(range(1, 101)), list(range(201, 301))
    fill(w, list(range(1, 7)), 4.0)
    try:
        _computed(sched, w, "a", a, list(range(1, 8)), list(_hashes("a")))
        got = sched.events.take_events()
        assert [(e.kind, e.medium, e.ownership, e.locality) for e in got] == [
            ("stored", *mem), ("stored", *disk)]
        assert all(e.block_hashes == list(_hashes("a")) and e.token_ids == a[:96]
                   and e.parent_block_hash is None for e in got)

        _computed(sched, w, "b", b, list(range(1, 8)), list(_hashes("b")))
        assert _told(sched) == [("removed", *mem, _hashes("a")), ("stored", *mem, _hashes("b")),
                                ("stored", *disk, _hashes("b"))]
        name = below.locate(ChunkKeys(sched.ctx.seed, CHUNK).upto(b, 3))[0]
        assert below.remove(name)  # another engine's cap, an operator: memory holds it
        seen: list[tuple] = []
        assert until(lambda: seen.extend(_told(sched)) or seen, 10)
        assert seen == [("removed", *disk, _hashes("b"))]
        time.sleep(0.2)
        assert _told(sched) == []  # told once; a on disk and b in memory still held
    finally:
        sched.close()


def test_a_promotion_is_announced_in_the_tier_it_reached_and_a_reset_in_each(tiers,
                                                                          tmp_path):
    """A segment this scheduler never planned (stored by another engine into the
    directory) is not announced; a hit of it promoted into memory is, in memory, with
    the payload of the request whose load promoted it; a reset announces removed what
    each tier was told to hold."""
    from tests.integrations.vllm.test_vllm_retention import EVENTS

    pool, kv = f"tiers-{next(_pools)}", (tmp_path / "kv").as_uri()
    stack = [{"url": f"mem://{pool}", "max_bytes": "64M"}, {"url": kv, "max_bytes": "1G"}]
    w = tiers.worker(stack, async_save=False)
    sched = SchedulerSide(tiers.context(stack), TierKVEvents(
        BLOCK, CHUNK, tiers=tier_tags([t["url"] for t in stack]), api=EVENTS))
    prompt = list(range(1, 101))
    keys = ChunkKeys(sched.ctx.seed, CHUNK).upto(prompt, 3)
    memory = MemoryChunks(pool, max_bytes=1 << 26)

    def reported() -> None:
        for guard in (w.ctx.saves, w.ctx.loads):
            guard.call("settle", lambda stack: stack.settle(), None)
        sched.output(SimpleNamespace(invalid_block_ids=set(), kv_cache_events=w.saved.take()))

    try:
        fill(w, list(range(1, 7)), 6.0)
        save(w, "elsewhere", keys, 0, list(range(1, 7)))
        reported()
        assert _told(sched) == [] and sched.events.unknown == 2  # not this one's to tell
        name = memory.locate(keys)[0]
        assert memory.remove(name)  # only the directory holds it now

        req = request("c", prompt)
        req.block_hashes = list(_hashes("c"))
        assert match(sched, req, 0) == (96, False)
        alloc(sched, req, 96)
        plan = sched.plan(step(new=[("c", range(10, 17), 0)], scheduled={"c": 100}))
        assert run_step(w, plan) == set()
        reported()
        w.get_finished(set())
        assert until(lambda: memory.locate(keys)[0] == name)
        reported()
        got = sched.events.take_events()
        assert [(e.kind, e.medium, e.ownership) for e in got] == [
            ("stored", "CPU", "hurraykv:0:mem")]
        assert got[0].block_hashes == list(_hashes("c")) and got[0].token_ids == prompt[:96]
        assert sched.reset() is True
        assert _told(sched) == [("removed", "CPU", "hurraykv:0:mem", "LOCAL", _hashes("c"))]
    finally:
        sched.close()


def test_a_ranks_memory_tier_tells_its_evictions_by_the_plain_names(tmp_path):
    """A tensor-parallel rank's stack (its tiers behind the rank's suffix, as
    ``open_stack`` opens them): the memory tier opens, tells the stack what it drops by
    the names callers know, and under ``write_back`` sends it down under the rank's own
    names."""
    from hurraykv.chunks.keys import segment_name
    from hurraykv.chunks.memory import copied
    from hurraykv.testing import keys, segment

    one = copied(segment(2, 0).with_info(metadata={}))[1]
    kv = (tmp_path / "kv").as_uri()
    conf = ConnectorConfig.from_extra({"tiers": [
        {"url": f"mem://tiers-{next(_pools)}", "max_bytes": one + one // 2}, {"url": kv}],
        "write_policy": "write_back"})
    reports = TierReports()
    stack = open_stack(conf, ".tp1", report=reports.add)
    first, second = keys(2), keys(2)
    stack.put(first, 0, segment(2, 1), {})
    stack.put(second, 0, segment(2, 2), {})  # the first dropped to make room
    stack.settle()
    name = segment_name(first, 0)
    assert ("removed", name, 0) in reports.take() and stack.counts["outages"] == [0, 0]
    rank = open_store(kv, suffix=".tp1")
    assert rank.locate(first) == [name] * 2 and open_store(kv).locate(first) == [None] * 2
    assert rank.get_verified(name).equal(segment(2, 1))
    stack.close()
