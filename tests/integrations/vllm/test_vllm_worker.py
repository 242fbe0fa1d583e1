"""The connector's worker part without an engine (``integrations/vllm/worker.py``): its
loads, saves and counters over a real ``file://`` store in a temporary directory, with
real damaged segment files (one cut short, bytes flipped in layer 0 and in layer 1).
The engine's KV cache is what vLLM's CPU backend hands ``register_kv_caches``: one
``[blocks, heads, block_size, 2 * head_size]`` tensor per layer.  Issue 29, items 10
(counters that mean what their names say) and 11 (a flapping writer is one log line
per interval)."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hurraykv.chunks.guard import Guarded
from hurraykv.chunks.keys import ChunkKeys, identity_digest, segment_first
from hurraykv.chunks.urls import open_store
from hurraykv.integrations.vllm.common import Context, Plan, Transfer
from hurraykv.integrations.vllm.config import ConnectorConfig
from hurraykv.integrations.vllm.events import HurrayKVEvents
from hurraykv.integrations.vllm.scheduler import SchedulerSide
from hurraykv.integrations.vllm.worker import WorkerSide
from tests.integrations.vllm.test_vllm_scheduler import alloc, match, request, step

BLOCK, CHUNK, LAYERS, HEADS, HEAD = 16, 32, 2, 2, 32
PER = CHUNK // BLOCK
IDENTITY = "model=tiny;cache_dtype=float32;chunk_size=32;tp_size=1"
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PAGE_BYTES = BLOCK * HEADS * HEAD * 4  # one role's page of one layer, float32


class Side:
    """A worker (and, on demand, a scheduler) over ``url``, their guards closed after."""

    def __init__(self) -> None:
        self.guards: list[Guarded] = []
        self.workers: list[WorkerSide] = []

    def context(self, url: str, open_one=None, **extra) -> Context:
        opener = open_one or (lambda: open_store(url))
        guards = [Guarded(opener, url=url, what=what, timeout=5.0,
                          log=logging.getLogger("test")) for what in ("lookup", "load", "save")]
        self.guards += guards
        return Context(ConnectorConfig.from_extra({"url": url, **extra}), BLOCK, CHUNK,
                       IDENTITY, identity_digest(IDENTITY), can_load=True, can_save=True,
                       lookups=guards[0], loads=guards[1], saves=guards[2])

    def worker(self, url: str, open_one=None, **extra) -> WorkerSide:
        w = WorkerSide(self.context(url, open_one, **extra), spec=None, context={},
                       model_dtype=torch.float32, kv_cache_dtype="auto",
                       segment_dtype="float32")
        w.caches = {name: torch.zeros(64, HEADS, BLOCK, 2 * HEAD) for name in LAYER_NAMES}
        w.register(w.caches)
        assert not w.ctx.disabled, w.ctx.disabled
        self.workers.append(w)
        return w

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        for g in self.guards:
            g.close()


@pytest.fixture
def side():
    s = Side()
    yield s
    s.close()


def fill(w: WorkerSide, blocks: list[int], value: float) -> None:
    """Layer L of ``blocks`` holds ``value + L``: each layer's pages findable in a file."""
    for layer, name in enumerate(LAYER_NAMES):
        w.caches[name][blocks] = value + layer


def save(w: WorkerSide, req_id: str, keys: list[str], first_chunk: int,
         blocks: list[int]) -> None:
    """Store chunks ``keys`` (from ``first_chunk``) from ``blocks`` as one segment, as a
    step's ``save_kv_layer`` calls and ``wait_for_save`` do."""
    chunks = [blocks[i:i + PER] for i in range(0, len(blocks), PER)]
    plan = Plan(saves=[Transfer(req_id, first_chunk, list(keys), chunks)])
    for name in LAYER_NAMES:
        w.save_kv_layer(name, plan)
    w.wait_for_save(plan)
    w.drain()


def load_of(req_id: str, names: list[str], first_chunk: int, blocks: list[int]) -> Transfer:
    """A load of the chunks ``first_chunk..`` held by the segments ``names`` (one a chunk)
    into ``blocks``, as ``SchedulerSide._transfer`` builds it."""
    t = Transfer(req_id)
    for i, name in enumerate(names):
        c = first_chunk + i
        t.names.append(name)
        t.blocks.append(blocks[i * PER:(i + 1) * PER])
        t.pages.append((c - segment_first(name)) * PER)
    return t


def run_step(w: WorkerSide, plan: Plan) -> set[int]:
    """One forward pass as vLLM drives the worker: the blocks it reports failed."""
    w.start_load(plan)
    for name in LAYER_NAMES:
        w.wait_for_layer_load(name)
    w.wait_for_save(plan)
    return w.load_errors()


def flip(path: Path, value: float) -> None:
    """Flip one bit of the first page holding ``value`` (a layer's pages, see ``fill``)."""
    data = bytearray(path.read_bytes())
    at = bytes(data).find(np.full(HEAD, value, np.float32).tobytes())
    assert at > 0, f"{value} not in {path}"
    data[at + 1] ^= 0x10
    path.write_bytes(bytes(data))


def cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


# ---------------------------------------------------------------- item 10: loads
def test_failed_and_corrupt_chunks_are_counted_per_chunk_and_loaded_ones_only_if_loaded(
        side, tmp_path, caplog):
    """Four requests load in one step: one from a segment cut short (a parse failure),
    one from a segment with a byte flipped in layer 0 (found by the read), one whose
    second segment has a byte flipped in layer 1 (found beside the forward pass, after
    its chunks were fetched), one intact.  Each damaged segment holds 3 chunks: the
    counters go up by chunks, not by segments, and a chunk fetched and then found
    damaged is failed, not loaded."""
    kv = tmp_path / "kv"
    w = side.worker(kv.as_uri(), async_save=False)
    store = open_store(kv.as_uri())
    keys = {r: ChunkKeys(identity_digest(f"{IDENTITY};{r}"), CHUNK).upto(list(range(200)), 6)
            for r in ("cut", "flip0", "flip1", "good")}
    segments = {}
    for n, r in enumerate(("cut", "flip0", "flip1", "good")):
        src = list(range(1 + 12 * n, 13 + 12 * n))  # 6 chunks of 2 blocks
        fill(w, src[:6], 100.0 * n + 10)
        fill(w, src[6:], 100.0 * n + 50)
        save(w, r, keys[r][:3], 0, src[:6])
        if r == "flip1":  # a second segment, stored a step later
            save(w, r, keys[r][3:], 3, src[6:])
        segments[r] = store.locate(keys[r][:6 if r == "flip1" else 3])
    assert w.ctx.stats["segments_saved"] == 5
    cut(kv / f"{segments['cut'][0]}.hrry")
    flip(kv / f"{segments['flip0'][0]}.hrry", 100.0 * 1 + 10)  # layer 0
    flip(kv / f"{segments['flip1'][3]}.hrry", 100.0 * 2 + 50 + 1)  # layer 1, 2nd segment

    # sources: blocks 1-6 (cut), 13-18 (flip0), 25-36 (flip1), 37-42 (good); loads go
    # to blocks none of them uses
    dst = {"cut": list(range(7, 13)), "flip0": list(range(19, 25)),
           "flip1": list(range(43, 55)), "good": list(range(55, 61))}
    # another request sharing flip0's first chunk: failed and corrupt too, and the damage
    # is told once
    plan = Plan(loads=[load_of(r, segments[r], 0, dst[r]) for r in dst]
                + [load_of("share", segments["flip0"][:1], 0, [61, 62])])
    caplog.set_level(logging.WARNING, logger="vllm.hurraykv")
    failed = run_step(w, plan)

    stats = w.ctx.stats
    assert failed == set(dst["cut"]) | set(dst["flip0"]) | set(dst["flip1"][6:]) | {61, 62}
    assert stats["chunks_failed"] == 3 + 3 + 3 + 1  # was 4: one per failed request
    assert stats["chunks_corrupt"] == 3 + 3 + 3 + 1  # was 2: per segment, the cut one not at all
    assert stats["chunks_loaded"] == 3 + 3  # "good" and flip1's first segment; was 9
    assert stats["tokens_loaded"] == 6 * CHUNK
    assert stats["segments_loaded"] == 2
    src_good = list(range(37, 43))
    for name in LAYER_NAMES:  # what was loaded is what was stored
        assert torch.equal(w.caches[name][dst["good"]], w.caches[name][src_good])
    log = caplog.text
    assert "does not match its checksum" in log and "will be recomputed" in log
    assert "layers.1.key does not match" in log  # flip1's, found beside the forward pass
    assert log.count("layers.0.key does not match") == 1


# ---------------------------------------------------------------- item 10: saves
def test_stored_bytes_count_only_segments_that_were_stored(side, tmp_path):
    """A store that refuses writes (a full disk; here its directory replaced by a file):
    the dropped saves add nothing to stored bytes (120 counted for 37 stored before)."""
    kv = tmp_path / "kv"
    w = side.worker(kv.as_uri(), async_save=False)
    keys = ChunkKeys(identity_digest(IDENTITY), CHUNK).upto(list(range(400)), 12)
    save(w, "a", keys[:2], 0, [1, 2, 3, 4])
    one = LAYERS * 2 * 4 * PAGE_BYTES  # key and value pages of 4 blocks, each layer
    assert w.ctx.stats["bytes_saved"] == one
    assert sum(p.stat().st_size for p in kv.glob("*.hrry")) >= one
    shutil.rmtree(kv)
    kv.write_bytes(b"")
    for i in range(5):
        save(w, f"b{i}", keys[2 + 2 * i:4 + 2 * i], 2 + 2 * i, [5, 6, 7, 8])
    stats = w.ctx.stats
    assert stats["saves_dropped"] == 5 and stats["segments_saved"] == 1
    assert stats["bytes_saved"] == one  # was 6 * one


# ---------------------------------------------------------------- item 10: hit tokens
def test_hit_tokens_count_only_tokens_actually_loaded(side, tmp_path):
    """The scheduler matches 3 chunks; the worker loads the first segment (2 chunks) and
    finds the second (1 chunk) damaged.  vLLM counted 96 tokens as cached when it
    scheduled the request; hurraykv's hit tokens are the 64 loaded, the 32 recomputed are
    failed tokens.  The scheduler learns it from the worker's output of that step, as
    vLLM hands it over (``invalid_block_ids``, ``kv_cache_events``)."""
    kv = tmp_path / "kv"
    w = side.worker(kv.as_uri(), async_save=False)
    sched = SchedulerSide(side.context(kv.as_uri()), HurrayKVEvents(BLOCK, CHUNK,
                                                                     enabled=False))
    prompt = list(range(1, 101))  # 3 whole chunks before the last token
    keys = ChunkKeys(sched.ctx.seed, CHUNK).upto(prompt, 3)
    fill(w, [1, 2, 3, 4, 5, 6], 7.0)
    fill(w, [5, 6], 20.0)
    save(w, "s", keys[:2], 0, [1, 2, 3, 4])
    save(w, "s", keys[2:], 2, [5, 6])
    name = open_store(kv.as_uri()).locate(keys[2:])[0]
    flip(kv / f"{name}.hrry", 20.0)

    req = request("a", prompt)
    assert match(sched, req, 0) == (96, False)
    alloc(sched, req, 96)
    plan = sched.plan(step(new=[("a", range(10, 17), 0)], scheduled={"a": 100}))
    assert len(plan.loads) == 1 and plan.saves == []
    failed = run_step(w, plan)
    assert failed == {14, 15}
    sched.output(SimpleNamespace(invalid_block_ids=failed, kv_cache_events=w.saved.take()))
    stats = sched.ctx.stats
    assert stats["tokens_hit"] == 64  # was 96, counted at the lookup
    assert stats["tokens_failed"] == 32
    assert (w.ctx.stats["chunks_loaded"], w.ctx.stats["chunks_failed"],
            w.ctx.stats["chunks_corrupt"]) == (2, 1, 1)
    # a later step's output without the load's record changes nothing
    sched.output(SimpleNamespace(invalid_block_ids=set(), kv_cache_events=None))
    assert (stats["tokens_hit"], stats["tokens_failed"]) == (64, 32)


# ---------------------------------------------------------------- item 11: the log
class GatedStore:
    """The real file store, whose writes wait for ``gate``: a store at its limit that
    lets a write through now and then."""

    def __init__(self, url: str, gate: threading.Event) -> None:
        self.inner, self.gate = open_store(url), gate

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def put(self, *args) -> None:
        assert self.gate.wait(10)
        self.inner.put(*args)


def test_a_flapping_writer_is_one_log_line_per_interval_with_counts(side, tmp_path, caplog):
    """The writer falls behind (its one place taken: the next segment is dropped) and
    catches up (the write goes through) 50 times: one line, then one line with the
    counts once the interval has passed (it was 100 lines, a pair per flap)."""
    kv = tmp_path / "kv"
    gate = threading.Event()
    w = side.worker(kv.as_uri(), lambda: GatedStore(kv.as_uri(), gate), max_pending_saves=1)
    keys = ChunkKeys(identity_digest(IDENTITY), CHUNK).upto(list(range(3300)), 100)
    caplog.set_level(logging.WARNING, logger="vllm.hurraykv")
    started = time.monotonic()
    for flap in range(50):
        gate.clear()
        first, second = keys[2 * flap], keys[2 * flap + 1]
        save_async(w, f"r{flap}", [first], 2 * flap, [1, 2])  # the writer waits in put
        save_async(w, f"q{flap}", [second], 2 * flap + 1, [3, 4])  # no room: dropped
        gate.set()
        w.drain()
    elapsed = time.monotonic() - started
    stats = w.ctx.stats
    assert stats["saves_dropped"] == 50 and stats["segments_saved"] == 50
    lines = [r.getMessage() for r in caplog.records if "the writer to" in r.getMessage()]
    assert len(lines) <= 1 + int(elapsed // 10), lines[:6]  # was 100
    assert "has 1 segments waiting" in lines[0]

    # the interval passes: the next step says what happened meanwhile, in one line
    now = time.monotonic() + w.backlog.interval
    w.backlog.clock = lambda: now
    caplog.clear()
    w.wait_for_save(None)
    w.wait_for_save(None)
    lines = [r.getMessage() for r in caplog.records if "the writer to" in r.getMessage()]
    if elapsed < 10:
        assert len(lines) == 1, lines
        assert "fell behind 49 times and caught up 50 times" in lines[0]
        assert "49 segments were not stored (it has caught up)" in lines[0]


def save_async(w: WorkerSide, req_id: str, keys: list[str], first_chunk: int,
               blocks: list[int]) -> None:
    plan = Plan(saves=[Transfer(req_id, first_chunk, list(keys), [blocks])])
    for name in LAYER_NAMES:
        w.save_kv_layer(name, plan)
    w.wait_for_save(plan)


def test_backlog_lines_for_a_single_episode_and_for_flapping(caplog):
    """The state machine alone, on a clock of its own: a single fall and recovery are
    told as before (the recovery once the interval has passed since the fall's line);
    flapping is counted and told once per interval."""
    from hurraykv.integrations.vllm.saves import WriterBacklog

    now = [100.0]
    b = WriterBacklog("file:///kv", interval=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="vllm.hurraykv")

    def told() -> list[str]:
        out = [r.getMessage() for r in caplog.records]
        caplog.clear()
        return out

    b.dropped(16, "r1")
    b.dropped(16, "r2")
    assert told() == ["the writer to file:///kv has 16 segments waiting: new chunks are not "
                      "stored until it catches up (request r1 first)"]
    now[0] += 2
    b.stored()
    assert told() == []  # within the interval: counted
    now[0] += 9
    b.tick()
    assert told() == ["the writer to file:///kv caught up; 2 segments were not stored "
                      "meanwhile"]
    now[0] += 60  # quiet for a while: the next fall is told at once
    for _ in range(30):  # flapping, all within one interval
        b.dropped(16, "x")
        b.dropped(16, "y")
        b.stored()
        now[0] += 0.1
    assert len(told()) == 1
    b.dropped(16, "z")  # behind again when the interval ends
    now[0] += 10
    b.dropped(16, "z2")
    assert told() == ["the writer to file:///kv fell behind 30 times and caught up 30 times "
                      "in the last 13 s; 61 segments were not stored (it is behind: 16 "
                      "segments waiting)"]
    now[0] += 30
    b.dropped(16, "z3")  # behind all along: no news
    assert told() == []
    b.stored()
    assert told() == ["the writer to file:///kv caught up; 3 segments were not stored "
                      "meanwhile"]
    # a store that is down is logged by its guard: the fall is not told, the recovery is
    b.dropped(16, "d", quiet=True)
    now[0] += 20
    b.stored()
    assert told() == ["the writer to file:///kv caught up; 1 segments were not stored "
                      "meanwhile"]
