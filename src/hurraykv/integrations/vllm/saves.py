"""Saves of newly computed KV: copies out of the engine's blocks as the forward pass
goes, stored by one writer thread.

``save_kv_layer`` copies each layer's newly computed blocks out (quantized at once when
``store_dtype`` says so, while the copy is in cache); ``wait_for_save`` builds the
segments (so the engine's blocks are free when it returns) and hands them to the writer,
whose queue is bounded in **bytes** (``max_pending_save_bytes``; and in segments when
``max_pending_saves`` is set): a segment that would pass the bound is dropped (counted,
``WriterBacklog`` logs it), so a slow store never grows memory without bound and never
makes the forward pass wait.  The writer asks the store first whether it holds the
segment's chunks already (another request, or another engine, stored them meanwhile;
the scheduler no longer asks on its own thread): such a segment is counted
``saves_present`` and announced as stored, not written again (with tiers: held by any
tier, whichever tiers admit it now).  A segment whose load
failed is stored again whatever the store says (``Transfer.rewrite``).

A segment of whose chunks its request's lookup found one missing (``Transfer.absent``) is
stored without that question: the answer is known, and the round trip was a fifth of a
small save's work.  Chunks no lookup asked about (decoded tokens) are asked about.

Every segment of a plan is counted ``saves_attempted`` and ``saves_pending`` when
``wait_for_save`` takes it, and leaves ``saves_pending`` for exactly one outcome, in the
same update of the counters: ``segments_saved``, ``saves_present`` or ``saves_dropped``
(a copy or a build that failed, the writer's queue full, the store failing or late, the
writer shut down first).  So at any read of the counters, with the runs the scheduler
found another request storing (``saves_deduplicated``, attempted too)::

    saves_attempted == segments_saved + saves_present + saves_dropped
                       + saves_deduplicated + saves_pending
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ...adapters.vllm import LayerView, pages_to_numpy
from ...chunks.keys import segment_name
from ...errors import HurrayError
from ...io import checksums
from ...snapshot import KVCacheSnapshot
from . import hybrid
from .common import Context, Plan, Transfer, log
from .events import WorkerSegments
from .groups import NULL_BLOCK, KVGroup
from .retention import retain
from .store_format import StoreFormat


class WriterBacklog:
    """What the log says about the writer falling behind (its queue full: new segments
    dropped) and catching up.  A store at its limit (Redis at ``maxmemory``) makes the
    writer flap between the two many times a second, and a line per transition flooded
    the log (100 lines in 10 s, issue 29): a transition is told at once only when no line
    was written for ``interval`` seconds; otherwise it is counted, and the counts go out
    as one line at the first drop, store or step after the interval."""

    INTERVAL = 10.0

    def __init__(self, url: str, *, interval: float = INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url, self.interval, self.clock = url, interval, clock
        self.behind = False
        self._lock = threading.Lock()  # the engine's thread drops, the writer's stores
        self._last: float | None = None  # when the last line was written
        self._falls = self._catches = self._dropped = 0  # since that line
        self._episode = 0  # segments dropped since the writer last fell behind

    def dropped(self, waiting: int, req_id: str, *, quiet: bool = False) -> None:
        """A segment dropped because ``waiting`` segments wait; ``quiet``: the store is
        down, which ``guard.py`` logs, so the fall is not told on its own."""
        with self._lock:
            fell = not self.behind
            self.behind = True
            self._falls += fell
            self._dropped += 1
            self._episode = 1 if fell else self._episode + 1
            line = None if quiet else self._line(f"it is behind: {waiting} segments waiting",
                                                 (waiting, req_id) if fell else None)
        if line is not None:
            log.warning(*line)

    def stored(self) -> None:
        """A segment stored: the writer has caught up, if it was behind."""
        with self._lock:
            self._catches += self.behind
            self.behind = False
            line = self._line("it has caught up")
        if line is not None:
            log.warning(*line)

    def tick(self) -> None:
        """Counts older than the interval go out now (a step, with nothing else to say)."""
        with self._lock:
            line = self._line("it is still behind" if self.behind else "it has caught up")
        if line is not None:
            log.warning(*line)

    def _line(self, now: str, fall: tuple[int, str] | None = None) -> tuple[Any, ...] | None:
        """The line to write now, if any (its counts start again).  Drops while the
        writer stays behind are no news: the caught-up line counts them."""
        if not (self._falls or self._catches) or not self._due():
            return None
        if fall is not None and (self._falls, self._catches, self._dropped) == (1, 0, 1):
            line: tuple[Any, ...] = (
                "the writer to %s has %d segments waiting: new chunks are not stored until "
                "it catches up (request %s first)", self.url, *fall)
        elif not self.behind and self._falls <= 1 and self._catches == 1:
            line = ("the writer to %s caught up; %d segments were not stored meanwhile",
                    self.url, self._episode)
        else:
            since = "" if self._last is None else f" in the last {self.clock() - self._last:.0f} s"
            line = ("the writer to %s fell behind %d times and caught up %d times%s; %d "
                    "segments were not stored (%s)", self.url, self._falls, self._catches,
                    since, self._dropped, now)
        self._last = self.clock()
        self._falls = self._catches = self._dropped = 0
        return line

    def _due(self) -> bool:
        return self._last is None or self.clock() - self._last >= self.interval


class Saver:
    def __init__(self, ctx: Context, fmt: StoreFormat, saved: WorkerSegments) -> None:
        self.ctx, self.format, self.saved = ctx, fmt, saved
        self.layers: list[tuple[str, LayerView]] = []
        self.index: dict[str, int] = {}
        self.scales: list[tuple[float, float]] | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[tuple[Future, int, Transfer]] = []  # (the write, its bytes)
        self._copy_failed = False  # a layer of this step's saves could not be copied
        self.backlog = WriterBacklog(ctx.url)
        self._staged: dict[int, list[list[Any]]] = {}
        self._templates: dict[int, KVCacheSnapshot] = {}  # segment snapshots by page count
        # their checksum entries from the staged pools alone (one compiled call a segment)
        self._digests: dict[int, checksums.PoolDigests] = {}
        # a hybrid model's (groups.py): each attention layer's group, the Mamba layers'
        # states with their group, the group map segments carry
        self.groups: list[KVGroup] = []
        self.states: list[tuple[Any, KVGroup]] = []
        self.group_map: dict[str, Any] = {}

    def save_kv_layer(self, layer_name: str, plan: Plan | None) -> None:
        if plan is None or not plan.saves or layer_name not in self.index or \
                self._copy_failed:
            return
        started = time.perf_counter()
        layer = self.index[layer_name]
        view = self.layers[layer][1]
        try:
            for i, save in enumerate(plan.saves):
                staged = self._staged.setdefault(i, [[] for _ in self.layers])
                if self.groups:  # a hybrid model: the pages its group keeps
                    staged[layer] = self._kept_pages(save, layer, view)
                    continue
                parts = pages_to_numpy(view.read([b for chunk in save.blocks for b in chunk]))
                if not self.format.auto:  # quantized now, while the copy is in cache
                    roles = ("fused",) if len(parts) == 1 else ("key", "value")
                    parts = [self.format.encode(p, role, layer)
                             for p, role in zip(parts, roles, strict=True)]
                staged[layer] = parts
        except Exception as e:  # nothing stored this step (counted by wait_for_save)
            self._staged.clear()
            self._copy_failed = True
            log.warning("copying layer %s out failed (%s: %s); this step's chunks are not "
                        "stored", layer_name, type(e).__name__, e)
        self.ctx.stats.add(save_seconds=time.perf_counter() - started)

    def wait_for_save(self, plan: Plan | None) -> None:
        self.backlog.tick()
        if plan is None or not plan.saves:  # most decode steps: no bookkeeping at all
            self._copy_failed = False
            return
        config, stats = self.ctx.config, self.ctx.stats
        started = time.perf_counter()
        copy_failed, self._copy_failed = self._copy_failed, False
        for i, save in enumerate(plan.saves):
            staged = self._staged.pop(i, None)
            # pending until it lands in exactly one outcome (_settle), so that a read of
            # the counters meanwhile still adds up
            stats.add(saves_attempted=1, saves_pending=1)
            if copy_failed or staged is None or any(not parts for parts in staged):
                self._settle(save, saves_dropped=1)  # a layer not copied: no segment
                continue
            nbytes = sum(_nbytes(p) for parts in staged for p in parts)
            try:  # owns copies: the blocks may be reused now
                segment = self._hybrid(save, staged) if self.groups else self._segment(staged)
            except Exception as e:
                self._settle(save, saves_dropped=1)
                log.warning("request %s: building a segment failed (%s: %s); not stored",
                            save.req_id, type(e).__name__, e)
                continue
            pools = None if self.groups or not self.format.auto else [
                p for parts in staged for p in parts]
            if not self.ctx.config.async_save:
                self._put(save, segment, nbytes, pools)
                continue
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="hurraykv-save")
            self._pending = [p for p in self._pending if not p[0].done()]
            waiting = sum(n for _, n, _ in self._pending)
            if (waiting + nbytes > config.max_pending_save_bytes and self._pending) or (
                    config.max_pending_saves is not None
                    and len(self._pending) >= config.max_pending_saves):
                self._drop_save(save)  # a slow store never grows the queue without bound
                continue
            self._pending.append((self._writer.submit(self._put, save, segment, nbytes,
                                                      pools), nbytes, save))
        self._staged.clear()
        stats.add(save_seconds=time.perf_counter() - started)

    def _settle(self, save: Transfer, **outcome: float) -> None:
        """``save`` is no longer pending: ``outcome`` (``segments_saved``,
        ``saves_present`` or ``saves_dropped``, with what else it counts) in the same
        update of the counters; the scheduler is told it was written or not."""
        self.ctx.stats.add(saves_pending=-1, **outcome)
        if outcome.get("saves_dropped"):
            self.saved.dropped(save.segment_id)  # another request may store it
        else:
            self.saved.saved(save.segment_id)

    def _drop_save(self, save: Transfer) -> None:
        self._settle(save, saves_dropped=1)
        # guard.py logs a store that is down: the backlog is its consequence
        self.backlog.dropped(len(self._pending), save.req_id, quiet=self.ctx.saves.down)

    def _put(self, save: Transfer, segment: KVCacheSnapshot, nbytes: int,
             pools: list[np.ndarray] | None = None) -> None:
        """Store one segment unless the store holds its chunks already (``nbytes``: its
        pages' bytes, counted once it is stored; ``pools``: its staged pools, when it is
        its template's ``with_pools`` over them)."""
        ctx = self.ctx
        started = time.perf_counter()
        evicted = [0]

        def put(store: Any) -> str:
            # the lookup found a chunk missing: no round trip to ask what it answered
            if not (save.rewrite or save.absent) and all(store.has(save.keys)):
                return "present"
            before = store.evictions
            # a stack of tiers writes those whose store_threshold admits it
            tiers = {} if save.tiers is None else {"tiers": save.tiers}
            try:  # checksummed here, on the writer's thread: off the forward pass
                store.put(save.keys, save.first_chunk, self._checksummed(segment, pools),
                          {"vllm.identity": ctx.identity, "vllm.tenant": save.tenant}
                          if save.tenant else {"vllm.identity": ctx.identity}, **tiers)
            finally:
                evicted[0] = store.evictions - before
            return "stored"

        done = ctx.saves.call("put", put, None)
        if done is None:
            self._settle(save, evictions=evicted[0], saves_dropped=1)
            return
        if done == "stored" and save.keep is not None:  # as its request asked, under a
            name = segment_name(save.keys, save.first_chunk)  # deadline of its own
            ctx.saves.call("retain", lambda store: retain(store, [name], save.keep,
                                                          ctx.stats), None)
        if done == "present":
            self._settle(save, saves_present=1)
        else:
            self._settle(save, evictions=evicted[0], chunks_saved=len(save.keys),
                         segments_saved=1, bytes_saved=nbytes,
                         write_seconds=time.perf_counter() - started)
        self.backlog.stored()

    def _checksummed(self, segment: KVCacheSnapshot, pools: list[np.ndarray] | None
                     ) -> KVCacheSnapshot:
        """``segment`` with its checksum entry: from its staged pools when its template's
        digests are known, else by a walk over its members."""
        digests = None if pools is None else self._digests.get(len(pools[0]))
        if digests is None:
            return checksums.with_checksums(segment)
        return digests.with_checksums(segment, pools)

    def _segment(self, pools: list[list[np.ndarray]]) -> KVCacheSnapshot:
        """A segment snapshot of these pages: built and validated once per length, then
        the same structure over each new segment's pools (``with_pools``)."""
        if not self.format.auto:  # encoded tensors: from_tensors takes their fp8 scales too
            return self.format.segment(pools, self.ctx.identity)
        pages = pools[0][0].shape[0]
        template = self._templates.get(pages)
        if template is None:
            fused = len(pools[0]) == 1
            keys = [p[0] for p in pools]
            values = None if fused else [p[1] for p in pools]
            scales = None if self.scales is None else np.array(self.scales, np.float32)
            first = KVCacheSnapshot.from_arrays(keys, values, np.arange(pages), [0, pages],
                                                [pages * self.ctx.block_size],
                                                kv_scales=scales, model=self.ctx.identity)
            if len(self._templates) >= 64:
                self._templates.clear()
                self._digests.clear()
            self._templates[pages] = skeleton = first.skeleton()
            self._digests[pages] = checksums.PoolDigests(skeleton)
            return first
        roles = template.roles
        return template.with_pools({(layer, role): parts[r] for layer, parts in
                                    enumerate(pools) for r, role in enumerate(roles)})

    def _kept_pages(self, save: Transfer, layer: int, view: LayerView) -> list[Any]:
        """A hybrid model's layer: the pages of its group's blocks the segment keeps,
        encoded (``hybrid.encode_layer``)."""
        group = self.groups[layer]
        flat = np.asarray(save.groups[group.index], np.int64)
        kept = group.kept(save.first_block, len(flat), self.ctx.per)
        if (flat[kept] == NULL_BLOCK).any():  # never computed here: never stored as KV
            raise HurrayError(f"request {save.req_id}: layer {layer} ({group.kind}) would "
                              f"store vLLM's null block as a page", field="blocks",
                              value=flat.tolist(), rule="pages vLLM computed")
        parts = pages_to_numpy(view.read(flat[kept]))
        return hybrid.encode_layer(self.format, parts, kept, layer)

    def _hybrid(self, save: Transfer, staged: list[list[Any]]) -> KVCacheSnapshot:
        """A hybrid model's segment (``hybrid.py``): the staged attention members, and the
        Mamba layers' states at its end (read now: the forward pass has run)."""
        states = None
        if save.state:
            blocks = [save.groups[group.index][-1] for _, group in self.states]
            if NULL_BLOCK in blocks:  # no state was kept there
                end = save.first_block + len(save.groups[self.states[0][1].index])
                raise HurrayError(f"request {save.req_id}: no Mamba state in block {end - 1} "
                                  f"of its state groups (vLLM's null block)", field="blocks",
                                  value=blocks, rule="a state at the segment's end")
            states = [view.read(b) for (view, _), b in zip(self.states, blocks, strict=True)]
        tokens = len(save.groups[self.groups[0].index]) * self.ctx.block_size
        # an fp8 cache's scales, kept as they are (a quantized format carries its own)
        scales = np.array(self.scales, np.float32) if self.scales is not None and \
            self.format.auto else None
        return hybrid.segment([t for parts in staged for t in parts], states, self.group_map,
                              self.ctx.identity, tokens, kv_scales=scales)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every segment handed to the writer is stored or dropped."""
        pending, self._pending = self._pending, []
        for f, _, _ in pending:
            with contextlib.suppress(Exception):
                f.result(timeout=timeout)

    def shutdown(self) -> None:
        pending = list(self._pending)
        self.drain(timeout=self.ctx.config.save_timeout_ms / 1000)
        if self._writer is not None:
            self._writer.shutdown(wait=False, cancel_futures=True)
        for f, _, save in pending:  # never written: dropped, not pending for ever
            if f.cancelled():
                self._settle(save, saves_dropped=1)


def _nbytes(part: Any) -> int:
    """Bytes of a staged part: pages, or an encoded tensor's pool and parameters."""
    if isinstance(part, np.ndarray):
        return part.nbytes
    return sum(memoryview(b).nbytes for b in part.buffers()[:1]) + sum(
        p.nbytes for p in part.quant_params)


__all__ = ["Saver", "WriterBacklog"]
