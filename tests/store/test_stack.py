"""A stack of stores (``chunks/stack.py``): the contract, then what a stack adds: a prefix
split across tiers, promotion on a lower tier's hit, write-through and write-back, and a
tier that fails while the others serve.  Real stores throughout: ``mem://`` pools over
``file://`` directories."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import pytest

from hurraykv.chunks.guarded_tier import GuardedTier
from hurraykv.chunks.keys import segment_name
from hurraykv.chunks.memory import MemoryChunks, copied
from hurraykv.chunks.registry import ChunkStore
from hurraykv.chunks.stack import StackedChunks
from hurraykv.chunks.urls import open_store
from hurraykv.errors import HurrayError
from hurraykv.testing import ChunkStoreTests, keys, segment
from tests.support.waits import until

_pools = itertools.count()


def mem(max_bytes: int = 1 << 30, name: str | None = None) -> MemoryChunks:
    return MemoryChunks(name or f"stack-{next(_pools)}", max_bytes=max_bytes)


class TestStackedStore(ChunkStoreTests):
    """Every copy made before the call returns (``queue_depth`` 0), so another client
    sees each tier as the contract expects."""

    @pytest.fixture
    def make(self, tmp_path):
        name = f"stack-{next(_pools)}"
        return lambda: StackedChunks([mem(name=name), open_store((tmp_path / "kv").as_uri())],
                                     queue_depth=0)

    @pytest.fixture
    def capped(self, tmp_path):
        probe = open_store((tmp_path / "probe").as_uri())
        probe.put(["0" * 32], 0, segment(16, 0), {})
        size = (tmp_path / "probe" / f"{'0' * 32}-0.hrry").stat().st_size
        in_memory = copied(segment(16, 0).with_info(metadata={}))[1]
        return StackedChunks([mem(12 * in_memory),
                              open_store((tmp_path / "capped").as_uri(), max_bytes=12 * size)],
                             queue_depth=0)


def two_tiers(tmp_path, **kw) -> tuple[StackedChunks, ChunkStore, ChunkStore]:
    top, below = mem(), open_store((tmp_path / "kv").as_uri())
    return StackedChunks([top, below], **kw), top, below


def test_a_prefix_split_across_tiers_is_found_whole(tmp_path):
    stack, top, below = two_tiers(tmp_path)
    k = keys(4)
    below.put(k[:2], 0, segment(2, 1), {})  # the older chunks, only further away
    top.put(k[2:], 2, segment(2, 2), {})
    a, b = segment_name(k[:2], 0), segment_name(k[2:], 2)
    assert stack.locate(k) == [a, a, b, b]
    assert stack.get_verified(a).equal(segment(2, 1)) and stack.served_by(a) == 1
    assert stack.get_verified(b).equal(segment(2, 2)) and stack.served_by(b) == 0
    stack.close()


def test_a_lower_tiers_hit_is_promoted_and_the_next_comes_from_the_top(tmp_path):
    stack, top, below = two_tiers(tmp_path)
    k, snap = keys(3), segment(3, 3)
    below.put(k, 0, snap, {"vllm.first_chunk": 0})
    name = stack.locate(k)[0]
    stack.get_verified(name)
    assert stack.served_by(name) == 1 and top.locate(k) == [None] * 3
    assert stack.promote(name, k) is True
    stack.settle()
    assert top.get_verified(top.locate(k)[0]).equal(snap)
    assert stack.counts["promotions"] == [1, 0]
    # no lookup in between (a connector's worker reads what its scheduler looked up):
    # the promoted copy is read all the same
    assert stack.get_verified(name).equal(snap) and stack.served_by(name) == 0
    assert stack.counts["hits"] == [1, 1]
    # a segment whose keys the caller does not have whole is not promoted
    assert stack.promote(name, k[:2]) is False
    stack.close()


class Gate(MemoryChunks):
    """A memory tier whose writes wait for ``gate`` (a slow tier)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate, self.entered = threading.Event(), threading.Event()

    def put(self, *a, **kw) -> None:
        self.entered.set()
        assert self.gate.wait(30)
        super().put(*a, **kw)


class SlowGet(MemoryChunks):
    """A memory tier whose next read (after ``hold`` is set) waits for ``gate``."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.hold, self.gate, self.entered = False, threading.Event(), threading.Event()

    def get(self, name: str):
        if self.hold:
            self.hold = False
            self.entered.set()
            assert self.gate.wait(30)
        return super().get(name)


def test_a_read_that_ends_after_a_promotion_leaves_the_promoted_copy_remembered():
    """A read from the lower tier that was under way when the promotion into the top
    ended does not send the next read back down (nor promote it again)."""
    top, below = mem(), SlowGet(f"stack-{next(_pools)}", max_bytes=1 << 30)
    stack = StackedChunks([top, below], queue_depth=0)  # promotions made at once
    k, snap = keys(2), segment(2, 4)
    below.put(k, 0, snap, {})
    name = stack.locate(k)[0]
    assert stack.served_by(name) == 1
    below.hold = True
    reader = threading.Thread(target=stack.get, args=(name,))
    reader.start()  # from the lower tier, held there
    assert below.entered.wait(10)
    assert stack.promote(name, k) is True and stack.served_by(name) == 0
    below.gate.set()
    reader.join(10)
    assert not reader.is_alive() and stack.served_by(name) == 0
    hits = list(stack.counts["hits"])
    assert stack.get_verified(name).equal(snap)
    assert stack.counts["hits"] == [hits[0] + 1, hits[1]]  # from the top
    stack.close()


def test_promotions_past_the_queue_are_skipped_and_counted(tmp_path):
    top = Gate(f"stack-{next(_pools)}", max_bytes=1 << 30)
    below = open_store((tmp_path / "kv").as_uri())
    stack = StackedChunks([top, below], queue_depth=1)
    stored = [(keys(1), segment(1, i)) for i in range(4)]
    for k, snap in stored:
        below.put(k, 0, snap, {})
    outcomes = []
    for i, (k, _) in enumerate(stored):
        name = stack.locate(k)[0]
        stack.get(name)
        outcomes.append(stack.promote(name, k))
        if i == 0:
            assert top.entered.wait(30)  # the worker holds the first
    # one on the worker (waiting for the slow tier), one queued, the rest skipped
    assert outcomes[:2] == [True, True] and outcomes[2:] == [False, False]
    assert stack.counts["promotions_skipped"] == [2, 0]
    top.gate.set()
    stack.settle()
    assert stack.counts["promotions"] == [2, 0]
    stack.close()


def test_write_through_writes_the_first_tier_at_once_and_the_others_after(tmp_path):
    top, below = mem(), Gate(f"stack-{next(_pools)}", max_bytes=1 << 30)
    stack = StackedChunks([top, below])
    k, snap = keys(2), segment(2, 5)
    stack.put(k, 0, snap, {})  # returns while the lower tier's copy waits
    assert top.locate(k)[0] is not None and below.locate(k) == [None, None]
    below.gate.set()
    stack.settle()
    assert below.get_verified(below.locate(k)[0]).equal(snap)
    assert stack.counts["writes"] == [1, 1]
    stack.close()


def test_a_put_given_tiers_writes_those_the_first_of_them_at_once(tmp_path):
    """The tiers whose ``store_threshold`` admitted a segment (the connector's planner):
    the first of them written before ``put`` returns, the others after, no other tier."""
    top, middle = mem(), Gate(f"stack-{next(_pools)}", max_bytes=1 << 30)
    below = open_store((tmp_path / "kv").as_uri())
    stack = StackedChunks([top, middle, below])
    k, snap = keys(2), segment(2, 9)
    middle.gate.set()
    stack.put(k, 0, snap, {}, tiers=(1,))
    assert middle.locate(k)[0] is not None and top.locate(k) == [None, None]
    stack.settle()
    assert below.locate(k) == [None, None] and stack.counts["writes"] == [0, 1, 0]
    middle.gate.clear()
    k2 = keys(1)
    stack.put(k2, 0, segment(1, 10), {}, tiers=(2, 0))  # in any order: the fastest first
    assert top.locate(k2)[0] is not None
    stack.settle()
    assert below.locate(k2)[0] is not None and middle.locate(k2) == [None]
    assert stack.counts["writes"] == [1, 1, 1]
    for wrong in [(), (3,), (-1, 0)]:
        with pytest.raises(HurrayError, match="a put into tiers"):
            stack.put(keys(1), 0, segment(1, 11), {}, tiers=wrong)
    stack.close()
    back = StackedChunks([mem(), below], write_policy="write_back")
    with pytest.raises(HurrayError, match="the first of them 0 under write_back"):
        back.put(keys(1), 0, segment(1, 12), {}, tiers=(1,))
    back.close()


class Down(ChunkStore):
    """A tier that is down: every call fails as a lost connection does."""

    url = "down://"

    def locate(self, keys):
        raise ConnectionError("connection refused")

    def put(self, keys, first, snapshot, metadata):
        raise ConnectionError("connection refused")

    def get(self, name):
        raise ConnectionError("connection refused")

    def catalog(self):
        raise ConnectionError("connection refused")


def test_a_tier_down_never_fails_the_stack_the_others_serve(tmp_path):
    top, below = mem(), open_store((tmp_path / "kv").as_uri())
    stack = StackedChunks([Down(), top, below])
    k, snap = keys(2), segment(2, 6)
    below.put(k, 0, snap, {})
    name = stack.locate(k)[0]
    assert name is not None and stack.get_verified(name).equal(snap)
    assert stack.counts["outages"][0] >= 1
    assert [s.name for s in stack.catalog()] == [name]
    with pytest.raises(ConnectionError):  # the first tier is the one a save must reach
        stack.put(keys(1), 0, segment(1, 7), {})
    stack.close()


def test_a_lower_tiers_failed_write_is_counted_and_the_put_stands(tmp_path):
    top = mem()
    stack = StackedChunks([top, Down()], queue_depth=0)
    k = keys(1)
    stack.put(k, 0, segment(1, 8), {})
    assert top.locate(k)[0] is not None
    assert stack.counts["writes"] == [1, 0] and stack.counts["writes_failed"] == [0, 1]
    stack.close()


def test_write_back_sends_what_the_memory_tier_drops_down(tmp_path):
    size = copied(segment(2, 0).with_info(metadata={}))[1]
    top, below = mem(2 * size), open_store((tmp_path / "kv").as_uri())
    stack = StackedChunks([top, below], write_policy="write_back")
    stored = [(keys(2), segment(2, 10 + i)) for i in range(3)]
    for k, snap in stored:
        stack.put(k, 0, snap, {})
    stack.settle()
    k0, snap0 = stored[0]
    assert top.locate(k0) == [None, None]  # dropped to make room ...
    assert below.get_verified(below.locate(k0)[0]).equal(snap0)  # ... and kept below
    assert below.locate(stored[2][0]) == [None, None]  # the others only in memory
    with pytest.raises(HurrayError, match="write_back needs a first tier"):
        StackedChunks([below, top], write_policy="write_back")
    with pytest.raises(HurrayError, match="write_policy is 'write_around'"):
        StackedChunks([top, below], write_policy="write_around")
    stack.close()


class Hung(MemoryChunks):
    """A memory tier that stops answering lookups while ``hang`` is set (a tier hung)."""

    hang = threading.Event()

    def locate(self, keys):
        while self.hang.is_set():
            time.sleep(0.01)
        return super().locate(keys)



def test_a_hung_tier_costs_its_deadline_only_and_its_breaker_recovers(tmp_path):
    """Each tier behind its own deadline and breaker (``GuardedTier``, as the connector
    opens them): a tier that hangs answers misses within its deadline while the others
    serve, is skipped once down (no wait at all), and serves again by itself."""
    pool = f"stack-{next(_pools)}"
    below = open_store((tmp_path / "kv").as_uri())
    hung = GuardedTier(lambda: Hung(pool, max_bytes=1 << 30), url=f"mem://{pool}",
                       timeouts={"lookup": 0.2, "load": 0.2, "save": 1.0},
                       log=logging.getLogger("test"), failures=2, max_backoff=0.5)
    hung.guard._backoff0 = hung.guard._backoff = 0.2  # probes soon, for the test
    stack = StackedChunks([hung, below])
    top_keys, low_keys = keys(1), keys(1)
    Hung(pool, max_bytes=1 << 30).put(top_keys, 0, segment(1, 1), {})
    below.put(low_keys, 0, segment(1, 2), {})
    Hung.hang.set()
    try:
        started = time.monotonic()
        assert stack.locate(low_keys)[0] is not None  # the other tier serves
        assert time.monotonic() - started < 1.0
        time.sleep(0.5)  # the hung call runs past a second deadline: charged again
        assert stack.locate(low_keys)[0] is not None
        assert hung.guard.down
        started = time.monotonic()
        assert stack.locate(top_keys) == [None]  # skipped: no wait for it
        assert time.monotonic() - started < 0.1
    finally:
        Hung.hang.clear()
    assert until(lambda: stack.locate(top_keys)[0] is not None, 10)  # back by itself
    assert not hung.guard.down
    stack.close()


def test_the_stack_reports_each_tiers_writes_and_what_it_learns_each_dropped(tmp_path):
    """``report(kind, name, tier)`` (the connector's KV events per tier): a write once
    that tier's put returned, a copy through the queue once it is made, a promotion, a
    write-back; what a memory tier drops to make room, a discard and a removal in each
    tier."""
    size = copied(segment(2, 0).with_info(metadata={}))[1]
    told: list[tuple[str, str, int]] = []
    top, below = mem(2 * size), Gate(f"stack-{next(_pools)}", max_bytes=1 << 30)
    stack = StackedChunks([top, below], report=lambda *r: told.append(r))
    k = [keys(2) for _ in range(3)]
    n = [segment_name(ks, 0) for ks in k]
    stack.put(k[0], 0, segment(2, 20), {})
    assert told == [("stored", n[0], 0)]  # the lower tier's copy waits
    below.gate.set()
    stack.settle()
    assert told[1:] == [("stored", n[0], 1)]
    stack.put(k[1], 0, segment(2, 21), {}, tiers=(0,))
    stack.put(k[2], 0, segment(2, 22), {}, tiers=(0,))  # memory drops the oldest
    assert told[2:] == [("stored", n[1], 0), ("removed", n[0], 0), ("stored", n[2], 0)]
    del told[:]
    assert stack.locate(k[0])[0] == n[0] and stack.get(n[0]) is not None  # from below
    assert stack.promote(n[0], k[0])
    stack.settle()
    assert told == [("removed", n[1], 0), ("stored", n[0], 0)]  # room made for it
    del told[:]
    stack.discard(n[0])
    assert told == [("removed", n[0], 0), ("removed", n[0], 1)]
    del told[:]
    assert stack.remove(n[2]) and told == [("removed", n[2], 0)]  # where it was
    stack.close()

    told.clear()
    back = StackedChunks([mem(2 * size), open_store((tmp_path / "kv").as_uri())],
                         write_policy="write_back", report=lambda *r: told.append(r))
    for i, ks in enumerate(k):
        back.put(ks, 0, segment(2, 30 + i), {})
    back.settle()
    assert told[:3] == [("stored", n[0], 0), ("stored", n[1], 0), ("removed", n[0], 0)]
    assert sorted(told[3:]) == sorted([("stored", n[0], 1), ("stored", n[2], 0)])  # any order
    back.close()


def test_a_segment_past_its_lifetime_in_memory_is_reported_gone_and_not_written_down(
        tmp_path):
    """A ``mem://`` tier drops a segment whose lifetime ended at its next put: reported
    removed from that tier, and under ``write_back`` not sent down (its lifetime is over;
    only what is dropped to make room goes down)."""
    size = copied(segment(2, 0).with_info(metadata={}))[1]
    told: list[tuple[str, str, int]] = []
    below = open_store((tmp_path / "kv").as_uri())
    stack = StackedChunks([mem(4 * size), below], write_policy="write_back",
                          report=lambda *r: told.append(r))
    k = [keys(2) for _ in range(2)]
    n = [segment_name(ks, 0) for ks in k]
    stack.put(k[0], 0, segment(2, 40), {})
    assert stack.retain([n[0]], pin=None, ttl_s=0.05) == [n[0]]
    time.sleep(0.1)
    stack.put(k[1], 0, segment(2, 41), {})
    stack.settle()
    assert told == [("stored", n[0], 0), ("removed", n[0], 0), ("stored", n[1], 0)]
    assert below.exists(n) == [False, False]
    stack.close()
