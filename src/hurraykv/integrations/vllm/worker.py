"""The connector's worker part: the engine's KV cache layers, loads into them, and the
copies out of them that one writer thread stores.

``start_load`` fetches (and verifies) a step's segments before the forward pass;
``wait_for_layer_load`` writes each layer's pages into the blocks vLLM allocated (in
place, through ``adapters.vllm``); ``save_kv_layer`` copies each layer's newly computed
blocks out as the forward pass goes, and ``wait_for_save`` hands the finished segments to
the writer (so the engine's blocks are free when it returns, and the store's latency
stays off the next forward pass).  A chunk that is missing, damaged or does not fit is
never written into the cache: its blocks (and those after them) are reported by
``load_errors`` so vLLM recomputes them, and one line is logged.

The counters mean what ``metrics.py`` names them: a load's chunks are counted loaded or
failed once vLLM has asked which failed (``load_errors``), per chunk; stored bytes once
the writer has stored them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import threads
from ...adapters._torch import numpy_dtype
from ...adapters.vllm import LayerView, backend_kind, cpu_isa, ordered_layers, pages_to_numpy
from ...errors import (
    ContainerError,
    DescriptorError,
    ElementTypeError,
    HurrayBufferError,
    HurrayError,
    LayoutError,
    QuantizationError,
    SnapshotError,
    StreamError,
    TransportError,
)
from ...io import checksums
from ...io.checksums import ChecksumError
from ...snapshot import KVCacheSnapshot
from .common import Context, Plan, Transfer, log
from .events import WorkerSegments
from .layer_checks import LayerChecks, later_members
from .store_format import DecodeBuffers, StoreFormat
from .store_format import warm as warm_formats

# What a segment that was read but does not parse raises (cut short, mangled structure):
# damaged, as a checksum failure is.  Not damage: a missing segment, a store error, one
# of another identity or geometry (plain HurrayError), a format this build cannot read.
DAMAGED = (ChecksumError, ContainerError, DescriptorError, ElementTypeError,
           HurrayBufferError, LayoutError, QuantizationError, SnapshotError, StreamError)


@dataclass
class _Load:
    """One request's load in this step.  vLLM recomputes a request from its first failed
    block on (it truncates the computed tokens there), so chunks ``[0, ok)`` are loaded
    and the rest failed."""

    transfer: Transfer
    ok: int
    corrupt: int = 0  # its chunks held by a segment that failed its checksum or parse


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


class WorkerSide:
    def __init__(self, ctx: Context, *, spec: Any, context: dict[str, Any], model_dtype: Any,
                 kv_cache_dtype: str, segment_dtype: str) -> None:
        self.ctx, self.spec, self.forward_context = ctx, spec, context
        self.model_dtype, self.kv_cache_dtype = model_dtype, kv_cache_dtype
        self.segment_dtype = segment_dtype  # the cache's dtype in a segment of format auto
        self.format: StoreFormat = ctx.formats.get(ctx.identity, StoreFormat())  # saves
        self.saved = WorkerSegments()
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self.backlog = WriterBacklog(ctx.url)
        self._layers: list[tuple[str, LayerView]] = []
        self._index: dict[str, int] = {}
        self._scales: list[tuple[float, float]] | None = None
        self._fetched: list[tuple[list[int], KVCacheSnapshot, int]] = []
        self._loads: list[_Load] = []  # this step's, counted by _settle
        self._origin: dict[int, tuple[_Load, int]] = {}  # id of a _fetched entry -> its
        # load and the index of its first chunk there
        self._written: set[str] = set()
        self._staged: dict[int, list[list[np.ndarray]]] = {}
        self._templates: dict[int, KVCacheSnapshot] = {}  # segment snapshots by page count
        self._failed: set[int] = set()
        self._checks = LayerChecks()
        self._later: frozenset[str] = frozenset()  # members verified beside the forward pass
        self._unchecked: dict[str, Any] = {}  # segment name -> its Pending checks
        self._names: dict[int, str] = {}  # id of a fetched snapshot -> its segment's name
        self._decoded: tuple[DecodeBuffers, DecodeBuffers] | None = None  # by layer parity
        self._decoder: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future] | None = None  # the next layer's decode, started

    # ------------------------------------------------------------------ layers
    def register(self, kv_caches: dict[str, Any]) -> None:
        if self.ctx.disabled:
            return
        try:
            self._register(kv_caches)
        except Exception as e:  # a layout we cannot read: the engine runs without us
            self._layers, self._index = [], {}
            self.ctx.disabled = f"the KV cache cannot be read ({type(e).__name__}: {e})"
            log.warning("HurrayConnector passes requests through on this worker: %s; "
                        "every matched chunk is recomputed", self.ctx.disabled)

    def _register(self, kv_caches: dict[str, Any]) -> None:
        ctx = self.ctx
        layers = ordered_layers(kv_caches)
        first = self.forward_context.get(layers[0][0])
        backend = first.attn_backend.get_name() if first is not None else "CPU_ATTN"
        head_size = getattr(self.spec, "head_size", None)
        isa = None
        if backend == "CPU_ATTN":
            isa = cpu_isa(self.model_dtype, ctx.block_size, head_size, self.kv_cache_dtype)
        kind = backend_kind(backend, kv_cache_dtype=self.kv_cache_dtype, isa=isa)
        self._layers = [(name, LayerView(t, kind, kv_cache_dtype=self.kv_cache_dtype,
                                         head_size=head_size if kind != "mla" else None,
                                         isa=isa))
                        for name, t in layers]
        self._index = {name: i for i, (name, _) in enumerate(self._layers)}
        if self.kv_cache_dtype != "auto":
            self._scales = []
            for name, _ in self._layers:
                layer = self.forward_context.get(name)
                self._scales.append((float(getattr(layer, "_k_scale_float", 1.0)),
                                     float(getattr(layer, "_v_scale_float", 1.0))))
        self._later = later_members(len(self._layers))
        checksums.warm()  # compiled now, not inside the first load's time
        dtype = numpy_dtype(self._layers[0][1].parts[0].dtype)
        self._decoded = (DecodeBuffers(dtype), DecodeBuffers(dtype))
        warm_formats(set(ctx.formats.values()), dtype)
        log.info("HurrayConnector: %d layers of %s (%s), chunks of %d tokens in %s; "
                 "segments read on %d core(s) %s", len(self._layers), backend, kind,
                 ctx.chunk_size, ctx.url, threads.workers(), sorted(os.sched_getaffinity(0)))

    def _layer(self, layer_name: str) -> tuple[int, LayerView]:
        layer = self._index[layer_name]
        return layer, self._layers[layer][1]

    def _check_segment(self, snap: KVCacheSnapshot) -> None:
        ctx = self.ctx
        view = self._layers[0][1]
        want = (len(self._layers), ctx.block_size, view.heads, *view.dims)
        have = (snap.num_layers, snap.page_size, snap.num_kv_heads,
                *(t.head_dim for t in snap.layer(0)))
        fmt = self._format_of(snap)
        if fmt is None or snap.dtype != fmt.segment_dtype(self.segment_dtype):
            # same geometry is not the same cache: another model's KV would load silently
            raise HurrayError(f"a stored segment of identity {snap.model!r} and dtype "
                              f"{snap.dtype} is not this engine's ({ctx.identity!r}, "
                              f"{self.format.segment_dtype(self.segment_dtype)}; or one of "
                              f"accept_store_dtypes)", field="segment.model",
                              value=snap.model, rule="the cache identity")
        if want != have or snap.num_seqs != 1 or snap.total_tokens % ctx.chunk_size:
            raise HurrayError(f"a stored segment holds (layers, page_size, heads, dims) "
                              f"{list(have)} and {snap.total_tokens} tokens in "
                              f"{snap.num_seqs} sequences, this engine needs {list(want)} "
                              f"in whole chunks of {ctx.chunk_size}", field="segment",
                              value=list(have), rule="the cache identity")
        fmt.check(snap, self.segment_dtype)  # quantization and scales as the format says
        snap.tensors()  # builds every member: index buffers and token counts checked

    def _format_of(self, snap: KVCacheSnapshot) -> StoreFormat | None:
        """The store format of an identity this engine loads (None: not one of them)."""
        if snap.model == self.ctx.identity:
            return self.format
        return self.ctx.formats.get(snap.model)

    # ------------------------------------------------------------------ loads
    def start_load(self, plan: Plan | None) -> None:
        self._settle()  # a step whose load errors vLLM did not ask for
        self._settle_decoder()
        self._fetched, self._written, self._unchecked, self._names = [], set(), {}, {}
        self._origin = {}
        self._checks.settle()
        if plan is None:
            return
        stats = self.ctx.stats
        self._failed.update(plan.failed)
        started = time.perf_counter()
        segments: dict[str, KVCacheSnapshot | HurrayError] = {}
        for transfer in plan.loads:
            load = _Load(transfer, len(transfer.names))
            self._loads.append(load)
            # the scheduler counts a hit once it knows whether this load failed
            self.saved.loaded(transfer.req_id)
            if self.ctx.disabled:  # the scheduler matched, but this worker cannot write
                self._fail_logged(load, 0, f"not loaded: {self.ctx.disabled}")
                continue
            try:
                self._fetch(load, segments)
            except Exception as e:  # a bug of ours is a recompute too, never a dead engine
                self._fail_logged(load, 0, f"{type(e).__name__}: {e}")
        self._checks.start(self._unchecked, len(self._layers))
        stats["fetch_seconds"] += time.perf_counter() - started
        stats["load_seconds"] += time.perf_counter() - started

    def _fetch(self, load: _Load, segments: dict[str, KVCacheSnapshot | HurrayError]
               ) -> None:
        """Fetch and check a load's segments (``segments``: those of this step so far, or
        the damage found in them); from the first chunk that cannot be loaded on, its
        blocks are recomputed."""
        t = load.transfer
        for i, name in enumerate(t.names):
            snap = segments.get(name)
            if isinstance(snap, HurrayError):  # told once, by the load that found it
                load.corrupt += t.names[i:].count(name)
                self._fail_logged(load, i, f"segment {name} could not be loaded (damaged)")
                return
            if snap is None:
                got = self.ctx.loads.call(
                    "get", lambda store, n=name: self._get_checked(store, n), None)
                if not isinstance(got, KVCacheSnapshot):
                    if isinstance(got, DAMAGED):  # every chunk of the load it holds
                        load.corrupt += t.names[i:].count(name)
                        segments[name] = got  # other loads of this step: damaged, not gone
                    why = str(got) if got is not None else "the store did not answer in time"
                    self._fail_logged(load, i, f"segment {name} could not be loaded ({why})")
                    return
                snap = segments[name] = got
            first = t.pages[i]
            if first + len(t.blocks[i]) > snap.tensor(0, snap.roles[0]).num_pages:
                self._fail_logged(load, i, f"segment {name} holds fewer pages than chunk {i} "
                                  "needs")
                return
            last = self._fetched[-1] if self._fetched else None
            if (last is not None and last[1] is snap and last[2] + len(last[0]) == first
                    and self._origin[id(last)][0] is load):
                last[0].extend(t.blocks[i])  # one write per run of a segment's pages
            else:  # runs stay within a load: a failure drops that request's chunks only
                entry = (list(t.blocks[i]), snap, first)
                self._fetched.append(entry)
                self._origin[id(entry)] = (load, i)

    def _get_checked(self, store: Any, name: str) -> KVCacheSnapshot | HurrayError:
        """A segment that fits this engine, or the error that says why the object is bad
        (the store answered: not a store failure)."""
        stats = self.ctx.stats
        before = store.verify_seconds
        try:
            snap, pending = store.get_checked(name, self._later)
            self._check_segment(snap)
            if pending is not None:  # layers 1.. are checked beside the forward pass
                self._unchecked[name] = pending
                self._names[id(snap)] = name
            return snap
        except TransportError:
            raise
        except ChecksumError as e:  # damaged: out of the store, stored again once computed
            with contextlib.suppress(Exception):
                store.discard(name)
            return e
        except HurrayError as e:
            return e
        finally:
            stats["verify_seconds"] += store.verify_seconds - before

    def _fail(self, load: _Load, chunk: int) -> int:
        """``load``'s chunks from ``chunk`` on are recomputed: their blocks reported, their
        fetched pages written no further.  Returns how many blocks that adds."""
        if chunk >= load.ok:
            return 0  # failed from an earlier chunk already
        blocks = [b for bs in load.transfer.blocks[chunk:load.ok] for b in bs]
        self._failed.update(blocks)
        load.ok = chunk
        self._fetched = [f for f in self._fetched if not (
            self._origin[id(f)][0] is load and self._origin[id(f)][1] >= chunk)]
        return len(blocks)

    def _fail_logged(self, load: _Load, chunk: int, why: str) -> None:
        blocks = self._fail(load, chunk)
        log.warning("request %s: %s; %d blocks will be recomputed", load.transfer.req_id,
                    why, blocks)

    def _settle(self) -> None:
        """Count the step's loads, once vLLM has asked which failed (a chunk checked
        beside the forward pass may fail after its fetch): per chunk, as the names say."""
        loads, self._loads = self._loads, []
        if not loads:
            return
        stats, names = self.ctx.stats, set()
        for load in loads:
            t = load.transfer
            stats["chunks_loaded"] += load.ok
            stats["tokens_loaded"] += self.ctx.block_size * sum(map(len, t.blocks[:load.ok]))
            stats["chunks_failed"] += len(t.names) - load.ok
            stats["chunks_corrupt"] += load.corrupt
            names.update(t.names[:load.ok])
        stats["segments_loaded"] += len(names)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._fetched or layer_name in self._written or layer_name not in self._index:
            return
        stats, started = self.ctx.stats, time.perf_counter()
        layer, view = self._layer(layer_name)
        self._drop_unverified(layer)
        try:
            decoded = self._decoded_layer(layer)
            for fetched in self._fetched:
                blocks, snap, first = fetched
                n = len(blocks)
                if self._format_of(snap).auto:
                    pages = [t.page_pool[first:first + n] for t in snap.layer(layer)]
                    stored = sum(p.nbytes for p in pages)
                else:  # decoded into the cache dtype; write() copies them
                    pages = decoded[id(fetched)]
                    stored = sum(snap.descriptor(layer, role).buffers[0].byte_size * n //
                                 max(t.num_pages, 1) for t, role in zip(
                                     snap.layer(layer), snap.roles, strict=True))
                view.write(blocks, pages)
                stats["bytes_loaded"] += stored
        except Exception as e:  # e.g. a file changed underneath: every loaded block again
            blocks = sum(self._fail(load, 0) for load in self._loads)
            log.warning("writing layer %s failed (%s: %s); %d blocks of this step will be "
                        "recomputed", layer_name, type(e).__name__, e, blocks)
            return
        self._written.add(layer_name)
        stats["layers_written"] += 1
        stats["load_seconds"] += time.perf_counter() - started

    def _decoded_layer(self, layer: int) -> dict[int, list[np.ndarray]]:
        """Layer ``layer``'s stored pages of every quantized run, decoded into the cache
        dtype (by run: ``id`` of its ``_fetched`` entry); then the next layer's decode is
        started on the decoder thread, so that it runs while this layer is written (the
        write is the engine's kernel: decoding beside it hides most of the decode).  Two
        sets of buffers, by layer parity: a layer's pages are never overwritten before the
        next layer's wait, which comes after its write."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == layer:
            decoded = ahead[1].result()
        else:
            decoded = self._decode(layer, list(self._fetched))
        if layer + 1 < len(self._layers) and any(
                not self._format_of(snap).auto for _, snap, _ in self._fetched):
            if self._decoder is None:
                self._decoder = ThreadPoolExecutor(1, thread_name_prefix="hurraykv-decode")
            self._ahead = (layer + 1, self._decoder.submit(self._decode, layer + 1,
                                                           list(self._fetched)))
        return decoded

    def _decode(self, layer: int, fetched: list) -> dict[int, list[np.ndarray]]:
        buffers = self._decoded[layer % 2]
        out, k = {}, 0
        for entry in fetched:
            blocks, snap, first = entry
            if not self._format_of(snap).auto:
                out[id(entry)] = [buffers.pages(2 * k + r, t, first, len(blocks))
                                  for r, t in enumerate(snap.layer(layer))]
                k += 1
        return out

    def _settle_decoder(self) -> None:
        """Wait for a decode started ahead (its buffers are about to be reused)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            with contextlib.suppress(Exception):
                ahead[1].result()

    def _drop_unverified(self, layer: int) -> None:
        """Wait for layer ``layer``'s checks; a segment that fails them is written no
        further and its blocks recomputed (``layer_checks.py``)."""
        bad, waited = self._checks.wait(layer)
        self.ctx.stats["verify_seconds"] += waited
        for name, error in bad:
            first: dict[int, tuple[_Load, int]] = {}  # per load, its first chunk in `name`
            for f in self._fetched:
                if self._names.get(id(f[1])) == name:
                    load, chunk = self._origin[id(f)]
                    if id(load) not in first or chunk < first[id(load)][1]:
                        first[id(load)] = (load, chunk)
            blocks = 0
            for load, chunk in first.values():
                load.corrupt += load.transfer.names[chunk:load.ok].count(name)
                blocks += self._fail(load, chunk)
            log.warning("segment %s could not be loaded (%s); %d blocks of this step will be "
                        "recomputed", name, error, blocks)
            self.ctx.loads.call("discard", lambda store, n=name: store.discard(n), None)

    def load_errors(self) -> set[int]:
        self._settle()  # vLLM asks once the forward pass is done: every check has answered
        failed, self._failed = self._failed, set()
        return failed

    # ------------------------------------------------------------------ saves
    def save_kv_layer(self, layer_name: str, plan: Plan | None) -> None:
        if plan is None or not plan.saves or layer_name not in self._index:
            return
        stats, started = self.ctx.stats, time.perf_counter()
        layer, view = self._layer(layer_name)
        try:
            for i, save in enumerate(plan.saves):
                blocks = [b for chunk in save.blocks for b in chunk]
                staged = self._staged.setdefault(i, [[] for _ in self._layers])
                parts = pages_to_numpy(view.read(blocks))
                if not self.format.auto:  # quantized now, while the copy is in cache
                    roles = ("fused",) if len(parts) == 1 else ("key", "value")
                    parts = [self.format.encode(p, role, layer)
                             for p, role in zip(parts, roles, strict=True)]
                staged[layer] = parts
        except Exception as e:  # nothing stored this step; the engine goes on
            self._staged.clear()
            stats["saves_dropped"] += len(plan.saves)
            log.warning("copying layer %s out failed (%s: %s); this step's chunks are not "
                        "stored", layer_name, type(e).__name__, e)
        stats["save_seconds"] += time.perf_counter() - started

    def wait_for_save(self, plan: Plan | None) -> None:
        self.backlog.tick()
        if plan is None:
            return
        stats = self.ctx.stats
        started = time.perf_counter()
        for i, save in enumerate(plan.saves):
            staged = self._staged.pop(i, None)
            if staged is None or any(not parts for parts in staged):
                continue
            nbytes = sum(_nbytes(p) for parts in staged for p in parts)
            try:
                segment = self._segment(staged)  # owns copies: the blocks may be reused now
            except Exception as e:
                stats["saves_dropped"] += 1
                log.warning("request %s: building a segment failed (%s: %s); not stored",
                            save.req_id, type(e).__name__, e)
                continue
            if not self.ctx.config.async_save:
                self._put(save, segment, nbytes)
                continue
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="hurraykv-save")
            self._pending = [f for f in self._pending if not f.done()]
            if len(self._pending) >= self.ctx.config.max_pending_saves:
                self._drop_save(save)  # a slow store never grows the queue without bound
                continue
            self._pending.append(self._writer.submit(self._put, save, segment, nbytes))
        self._staged.clear()
        stats["save_seconds"] += time.perf_counter() - started

    def _drop_save(self, save: Transfer) -> None:
        with self.ctx.stats_lock:
            self.ctx.stats["saves_dropped"] += 1
        # guard.py logs a store that is down: the backlog is its consequence
        self.backlog.dropped(len(self._pending), save.req_id, quiet=self.ctx.saves.down)

    def _put(self, save: Transfer, segment: KVCacheSnapshot, nbytes: int) -> None:
        """Store one segment (``nbytes``: its pages' bytes, counted once it is stored)."""
        ctx, stats = self.ctx, self.ctx.stats
        started = time.perf_counter()
        evicted = [0]

        def put(store: Any) -> bool:
            before = store.evictions
            try:  # checksummed here, on the writer's thread: off the forward pass
                store.put(save.keys, save.first_chunk, checksums.with_checksums(segment),
                          {"vllm.identity": ctx.identity})
            finally:
                evicted[0] = store.evictions - before
            return True

        done = ctx.saves.call("put", put, False)
        with ctx.stats_lock:
            stats["evictions"] += evicted[0]
            if not done:
                stats["saves_dropped"] += 1
                return
            stats["chunks_saved"] += len(save.keys)
            stats["segments_saved"] += 1
            stats["bytes_saved"] += nbytes
            self.saved.saved(f"{save.req_id}/{save.keys[0]}")
            stats["write_seconds"] += time.perf_counter() - started
        self.backlog.stored()

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
            scales = None if self._scales is None else np.array(self._scales, np.float32)
            first = KVCacheSnapshot.from_arrays(keys, values, np.arange(pages), [0, pages],
                                                [pages * self.ctx.block_size],
                                                kv_scales=scales, model=self.ctx.identity)
            if len(self._templates) >= 64:
                self._templates.clear()
            self._templates[pages] = first.skeleton()
            return first
        roles = template.roles
        return template.with_pools({(layer, role): parts[r] for layer, parts in
                                    enumerate(pools) for r, role in enumerate(roles)})

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every segment handed to the writer is stored or dropped."""
        pending, self._pending = self._pending, []
        for f in pending:
            with contextlib.suppress(Exception):
                f.result(timeout=timeout)

    def shutdown(self) -> None:
        self.drain(timeout=self.ctx.config.save_timeout_ms / 1000)
        self._checks.close()
        self._settle_decoder()
        if self._decoder is not None:
            self._decoder.shutdown(wait=False)
        if self._writer is not None:
            self._writer.shutdown(wait=False, cancel_futures=True)


def _nbytes(part: Any) -> int:
    """Bytes of a staged part: pages, or an encoded tensor's pool and parameters."""
    if isinstance(part, np.ndarray):
        return part.nbytes
    return sum(memoryview(b).nbytes for b in part.buffers()[:1]) + sum(
        p.nbytes for p in part.quant_params)


__all__ = ["WorkerSide"]
