"""Loads of stored KV into the engine's blocks: one ``LoadJob`` per request.

A job goes through explicit states::

    queued -> fetching -> fetched -> writing -> written
                 \\            \\          \\-> failed (from some chunk on) / cancelled

* **fetching**: each segment the request's chunks live in is read once (``get_checked``:
  checksums of its small buffers and layer 0 verified, the other layers' left in a
  ``Pending``) and checked against this engine's cache (``Target.check_segment``);
* **writing**: layer by layer, the layer's pages are verified (``Pending.check``), decoded
  when quantized, and written into the request's blocks (``LayerView.write``): no byte
  reaches a block before it is verified;
* a chunk that is missing, damaged or does not fit fails the job **from that chunk on**
  (vLLM recomputes a request from its first failed block): its blocks, and those after
  them, are reported by ``failed_blocks``, the chunks before it stay loaded;
* **cancelled**: the request finished (aborted) while its job ran; nothing more is
  written into its blocks (``cancel`` waits for a layer being written, a few ms) so vLLM
  may free them at once, even while a fetch still waits on a hung store.

Two drivers run jobs.  ``StepLoads`` (``load_mode`` sync): the step's jobs are fetched in
``start_load_kv`` and written layer by layer in ``wait_for_layer_load``, before the
forward pass reads each layer.  ``Loader`` (async): jobs run on a thread of their own,
beside the forward passes of the running requests; vLLM keeps the request in
``WAITING_FOR_REMOTE_KVS`` until ``finished`` reports it, with its failed blocks in the
same step (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``,
``get_block_ids_with_load_errors``: "no later than that same pass").
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...chunks.keys import segment_first
from ...errors import HurrayError, TransportError
from ...io.checksums import DAMAGED, ChecksumError, Pending
from ...io.scatter import Destination, PageSource
from ...snapshot import KVCacheSnapshot
from ...snapshot_members import member_name
from . import direct, hybrid
from .common import Context, Transfer, log
from .decode_buffers import DecodeBuffers
from .groups import METADATA_KEY, NULL_BLOCK, SLIDING, KVGroup
from .store_format import StoreFormat

if TYPE_CHECKING:  # no torch import here: loads are tested without an engine
    from ...adapters.vllm import LayerView

ROLES = ("key", "value", "fused")
STATES = ("queued", "fetching", "fetched", "writing", "written", "failed", "cancelled")


def later_members(layers: int) -> frozenset[str]:
    """The members a read leaves to ``Pending`` (every layer's but layer 0's): each is
    verified just before its layer is written."""
    return frozenset(member_name(layer, role) for layer in range(1, layers) for role in ROLES)


def layer_members(layer: int) -> frozenset[str]:
    return frozenset(member_name(layer, role) for role in ROLES)


@dataclass
class Target:
    """The engine's KV cache as loads see it: its layers, and what a segment must be to
    be written into them."""

    ctx: Context
    layers: list[tuple[str, LayerView]]
    segment_dtype: str  # the cache's dtype in a segment of format auto
    format: StoreFormat  # this engine's own store format
    # a hybrid model's (groups.py): each attention layer's group, the Mamba layers'
    # states (adapters.vllm.StateView) with their group, the group map of its segments
    groups: list[KVGroup] = field(default_factory=list)
    states: list[tuple[Any, KVGroup]] = field(default_factory=list)
    group_map: dict[str, Any] = field(default_factory=dict)
    # each layer's parts' memory, where a load reads pages straight into the blocks
    # (direct.py; None: a segment is read whole first)
    destinations: list[list[Destination]] | None = None

    def __post_init__(self) -> None:
        if self.destinations is None and not self.groups and not self.states:
            self.destinations = direct.destinations(self.layers)

    @property
    def later(self) -> frozenset[str]:
        return later_members(len(self.layers))

    @property
    def pools(self) -> frozenset[str]:
        return later_members(len(self.layers)) | layer_members(0)

    def format_of(self, snap: KVCacheSnapshot) -> StoreFormat | None:
        """The store format of an identity this engine loads (None: not one of them)."""
        if snap.model == self.ctx.identity:
            return self.format
        return self.ctx.formats.get(snap.model)

    def check_segment(self, snap: KVCacheSnapshot, name: str | None = None) -> None:
        ctx = self.ctx
        view = self.layers[0][1]
        want = (len(self.layers), ctx.block_size, view.heads, *view.dims)
        have = (snap.num_layers, snap.page_size, snap.num_kv_heads,
                *(t.head_dim for t in snap.layer(0)))
        fmt = self.format_of(snap)
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
        # quantization and scales as the format says; the pages kept in order
        fmt.check(snap, self.segment_dtype, self._tables(snap, name))
        if self.groups:
            have = hybrid.groups_of(snap)
            if have != self.group_map:
                raise HurrayError(f"a stored segment's KV cache groups {have} are not this "
                                  f"engine's {self.group_map}",
                                  field=f"metadata.{METADATA_KEY}", value=have,
                                  rule="the cache identity")
        snap.tensors()  # builds every member: index buffers and token counts checked

    def _tables(self, snap: KVCacheSnapshot, name: str | None) -> dict[int, Any] | None:
        """A hybrid model's sliding-window layers' block tables, as ``hybrid.page_table``
        makes them for a segment of this name and length."""
        if not self.groups or name is None:
            return None
        per = self.ctx.per
        pages = snap.total_tokens // snap.page_size
        first = segment_first(name) * per
        out = {}
        for layer, group in enumerate(self.groups):
            if group.kind == SLIDING:
                table = hybrid.page_table(group.kept(first, pages, per))
                if table is not None:
                    out[layer] = table
        return out

    def get_checked(self, store: Any, name: str) -> Fetched:
        """A segment that fits this engine (and the checks its read left, or its pages
        left in its file: ``PageSource``), or the error that says why the object is bad
        (the store answered: not a store failure)."""
        before = store.verify_seconds
        source = None
        try:
            got = None
            if self.destinations is not None and self.format.auto and hasattr(
                    store, "get_pages"):
                got = store.get_pages(name, self.pools)
            if got is not None:
                snap, source = got
                fmt = self.format_of(snap)
                if fmt is None or not fmt.auto:  # decoded on the way: read it whole
                    source.close()
                    got = source = None
            snap, pending = got if got is not None else store.get_checked(name, self.later)
            self.check_segment(snap, name)
            source = None  # the job's now
            return snap, pending
        except TransportError:
            raise
        except ChecksumError as e:  # damaged: out of the store, stored again once computed
            with contextlib.suppress(Exception):
                store.discard(name)
            return e
        except HurrayError as e:
            return e
        finally:
            if source is not None:
                source.close()
            self.ctx.stats.add(verify_seconds=store.verify_seconds - before)


@dataclass
class Run:
    """Consecutive pages of one segment going to ``blocks``; ``chunk``: the load's index
    of the first chunk they hold."""

    blocks: list[int]
    snap: KVCacheSnapshot
    first: int  # the segment's page of blocks[0]
    chunk: int
    at: int = 0  # the load's page of blocks[0] (a hybrid model's other groups)
    name: str = ""  # the segment's


# a fetched segment, or what was wrong with it (shared by the jobs of one step)
Fetched = tuple[KVCacheSnapshot, Pending | PageSource | None] | HurrayError


@dataclass
class LoadJob:
    """One request's load (see the module text).  Chunks ``[0, ok)`` are loaded or
    loadable; ``corrupt``: its chunks held by a segment that failed its checksum or did
    not parse."""

    transfer: Transfer
    ok: int = -1
    _state: str = "queued"
    cancelled: bool = False  # sticky: no state after it
    corrupt: int = 0
    runs: list[Run] = field(default_factory=list)
    pending: dict[str, Pending] = field(default_factory=dict)
    sources: dict[str, PageSource] = field(default_factory=dict)  # read as written
    written: int = 0  # layers written
    # the segments of its step (sync) or the damage known to the loader (async): a
    # segment found damaged is told once, by the job that found it
    segments: dict[str, Fetched] = field(default_factory=dict, repr=False)
    # (segment, group index) -> the blocks a hybrid segment keeps of that group's layers
    _kept: dict[tuple[str, int], Any] = field(default_factory=dict, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.ok < 0:
            self.ok = len(self.transfer.names)

    @property
    def req_id(self) -> str:
        return self.transfer.req_id

    @property
    def state(self) -> str:
        return "cancelled" if self.cancelled else self._state

    @property
    def done(self) -> bool:
        return self.state in ("written", "failed", "cancelled")

    # ------------------------------------------------------------------ fetching
    def fetch(self, target: Target, segments: dict[str, Fetched]) -> None:
        """Fetch and check the segments (``segments``: those read by other jobs of the
        same step, or the damage found in them)."""
        self._state = "fetching"
        self.segments = segments
        t, ctx = self.transfer, target.ctx
        at = 0  # the load's page of chunk i's first block
        for i, name in enumerate(t.names):
            got = segments.get(name)
            told = got is not None  # damage found by another job: told by that one
            if got is None:
                got = ctx.loads.call("get", lambda s, n=name: target.get_checked(s, n), None)
                if got is not None:
                    segments[name] = got
            if got is None or isinstance(got, HurrayError):
                if isinstance(got, DAMAGED):  # every chunk of the load it holds
                    self.corrupt += t.names[i:].count(name)
                why = ("the store did not answer in time" if got is None
                       else "damaged" if told and isinstance(got, DAMAGED) else str(got))
                self.fail(i, f"segment {name} could not be loaded ({why})")
                return
            snap, pending = got
            if isinstance(pending, PageSource):
                self.sources[name] = pending
            elif pending is not None:
                self.pending[name] = pending
            first = t.pages[i]
            if first + len(t.blocks[i]) > snap.total_tokens // snap.page_size:
                self.fail(i, f"segment {name} holds fewer pages than chunk {i} needs")
                return
            last = self.runs[-1] if self.runs else None
            if last is not None and last.snap is snap and last.first + len(last.blocks) == first:
                last.blocks.extend(t.blocks[i])  # one write per run of a segment's pages
            else:
                self.runs.append(Run(list(t.blocks[i]), snap, first, i, at, name))
            at += len(t.blocks[i])
        if target.states and self.ok == len(t.names) and t.names:
            last = self.runs[-1].snap  # the states are those at its end: the hit's end too
            if not hybrid.has_states(last) or t.pages[-1] + len(t.blocks[-1]) != \
                    last.total_tokens // last.page_size:
                self.fail(len(t.names) - 1, f"segment {t.names[-1]} holds no Mamba states "
                          "at the hit's end")
        if self._state == "fetching":
            self._state = "fetched"

    # ------------------------------------------------------------------ writing
    def verify_layer(self, layer: int) -> dict[str, HurrayError]:
        """The segments whose layer ``layer`` does not match its checksums (any thread:
        nothing changes here; ``write_layer`` acts on the answer)."""
        bad = {}
        for name, pending in list(self.pending.items()):
            try:
                pending.check(layer_members(layer))
            except HurrayError as e:
                bad[name] = e
        return bad

    def write_layer(self, target: Target, layer: int, buffers: DecodeBuffers,
                    checked: dict[str, HurrayError] | None = None) -> int:
        """Verify (unless ``checked`` is ``verify_layer``'s answer, computed on another
        thread while the previous layer was written), decode and write layer ``layer`` of
        every run still loadable; returns the bytes written (as stored).  Nothing is
        written once cancelled."""
        with self.lock:
            if self.cancelled or not self.ok:
                return 0
            self._state = "writing"
            bad = self.verify_layer(layer) if checked is None else checked
            for name in [*self.pending, *self.sources]:
                known = self.segments.get(name)
                if isinstance(known, HurrayError):  # another job of the step found it
                    self._damaged_at_layer(target, name, layer, known, told=True)
                elif name in bad:
                    self.segments[name] = bad[name]
                    self._damaged_at_layer(target, name, layer, bad[name])
            view = target.layers[layer][1]
            nbytes = 0
            if self.sources:  # read, verified and placed in one pass (direct.py)
                nbytes, bad = direct.scatter_layer(self, target, layer)
                target.ctx.stats.add(bytes_loaded_direct=nbytes)
                for name, error in bad.items():
                    self.segments[name] = error
                    self._damaged_at_layer(target, name, layer, error)
            for run in self.runs:
                if run.name in self.sources:
                    continue
                n, blocks, first = len(run.blocks), run.blocks, run.first
                tensors = run.snap.layer(layer)
                if target.groups:  # this layer's group's blocks and the pages it needs
                    blocks, first = self._group_pages(target, layer, run, tensors[0])
                    n = len(blocks)
                    if not n:
                        continue
                if target.format_of(run.snap).auto:
                    pages = [t.page_pool[first:first + n] for t in tensors]
                    nbytes += sum(p.nbytes for p in pages)
                else:  # decoded into the cache dtype; write() copies them
                    pages = [buffers.pages(r, t, first, n) for r, t in enumerate(tensors)]
                    nbytes += sum(run.snap.descriptor(layer, role).buffers[0].byte_size * n //
                                  max(t.num_pages, 1) for t, role in zip(
                                      tensors, run.snap.roles, strict=True))
                view.write(blocks, pages)
            self.written = layer + 1
            # a model with Mamba layers is written once its states are (write_states)
            if self.written == len(target.layers) and self._state == "writing" and \
                    not target.states:
                self._state = "written"
            return nbytes

    def _group_pages(self, target: Target, layer: int, run: Run, tensor: Any
                     ) -> tuple[list[int], int]:
        """A hybrid model's layer: the engine blocks of ``run`` in the layer's group that
        the hit needs (a sliding window's last ``need`` blocks), and the page of the
        segment's pool holding the first of them."""
        t, group = self.transfer, target.groups[layer]
        flat = t.groups[group.index]
        skip = 0
        if group.kind == SLIDING:
            skip = min(len(run.blocks), max(0, len(flat) - group.need - run.at))
        n = len(run.blocks) - skip
        blocks = flat[run.at + skip:run.at + skip + n]
        logical = run.first + skip
        if not n:
            return [], 0
        if NULL_BLOCK in blocks:  # shared by every request: never written
            raise HurrayError(f"request {self.req_id}: vLLM gave pages of layer {layer} "
                              f"({group.kind}) its null block", field="blocks", value=blocks,
                              rule="a block of the request's own")
        kept = self._kept.get((run.name, group.index))
        if kept is None:  # the same for every layer of the group
            per, pages = target.ctx.per, run.snap.total_tokens // run.snap.page_size
            kept = self._kept[(run.name, group.index)] = group.kept(
                segment_first(run.name) * per, pages, per)
        phys = hybrid.physical_run(tensor, logical, n)
        if not kept[logical:logical + n].all() or phys is None:
            raise HurrayError(f"segment {run.name} does not hold pages {logical}.."
                              f"{logical + n - 1} of layer {layer} ({group.kind}) where a "
                              "hit needs them",
                              field="block_table", value=logical, rule="a hybrid segment")
        return blocks, phys

    def write_states(self, target: Target) -> int:
        """A model with Mamba layers: the states at the hit's end, from the segment of its
        last chunk, into the blocks vLLM gave them (``N / block_size - 1``)."""
        with self.lock:
            if self.cancelled or self.ok < len(self.transfer.names) or not target.states:
                return 0
            states = hybrid.states_of(self.runs[-1].snap,
                                      [(v.shapes, v.dtypes) for v, _ in target.states])
            blocks = [self.transfer.groups[group.index][-1] for _, group in target.states]
            if NULL_BLOCK in blocks:
                raise HurrayError(f"request {self.req_id}: vLLM gave the states at the hit's "
                                  f"end its null block", field="blocks", value=blocks,
                                  rule="a block of the request's own")
            nbytes = 0
            for (view, _), block, layer in zip(target.states, blocks, states, strict=True):
                view.write(block, layer)
                nbytes += view.nbytes
            if self._state == "writing":
                self._state = "written"
            return nbytes

    def _damaged_at_layer(self, target: Target, name: str, layer: int,
                          error: HurrayError, *, told: bool = False) -> None:
        """Segment ``name`` fails its checks at ``layer``: written no further, its chunks
        (and those after) recomputed, and taken out of the store (by the job that found
        it; ``told``: another job did)."""
        chunk = next((i for i, n in enumerate(self.transfer.names[:self.ok]) if n == name),
                     None)
        self.pending.pop(name, None)  # a source stays (closed by release; shared in a
        # step): its runs are cut below, and the pages under its snapshot were never read
        if chunk is None:
            return
        self.corrupt += self.transfer.names[chunk:self.ok].count(name)
        why = "damaged" if told else f"at layer {layer}: {error}"
        self.fail(chunk, f"segment {name} could not be loaded ({why})")
        if not told:
            target.ctx.loads.call("discard", lambda store: store.discard(name), None)

    # ------------------------------------------------------------------ outcome
    def fail(self, chunk: int, why: str) -> None:
        """Chunks from ``chunk`` on are recomputed: written no further, their blocks
        reported.  A hybrid model's load fails whole: vLLM recomputes it from its start
        (failed_recving), so nothing more of it is written."""
        if self.transfer.groups:
            chunk = 0
        if chunk >= self.ok:
            return  # failed from an earlier chunk already
        blocks = sum(len(b) for b in self.transfer.blocks[chunk:self.ok])
        self.ok = chunk
        self.runs = [r for r in self.runs if r.chunk < chunk]
        for r in self.runs:  # a run reaching into the failed chunks is cut there
            keep = sum(len(b) for b in self.transfer.blocks[r.chunk:chunk])
            del r.blocks[keep:]
        if chunk == 0:
            self._state = "failed"
        log.warning("request %s: %s; %d blocks will be recomputed", self.req_id, why, blocks)

    def fail_all(self, why: str) -> None:
        """Not tried: every block of the transfer reported failed (a transfer the
        scheduler could not plan has none: the request is reported a failed receive)."""
        self.ok = len(self.transfer.blocks)
        if self.ok:
            self.fail(0, why)
        else:
            log.warning("request %s: %s; it will be recomputed", self.req_id, why)
        self._state = "failed"

    def failed_blocks(self) -> list[int]:
        if self.transfer.groups:  # a hybrid model's: reported by request (failed_recving)
            return []
        return [b for bs in self.transfer.blocks[self.ok:] for b in bs]

    @property
    def failed_whole(self) -> bool:
        """Reported to vLLM as a failed receive: planned without blocks, or a hybrid
        model's load that failed anywhere (vLLM recomputes it from the start)."""
        t = self.transfer
        return not self.cancelled and bool(t.failed or (t.groups and self.ok < len(t.names)))

    def finish(self) -> None:
        """After the last layer (or none): a job that loaded nothing has failed."""
        if self._state in ("fetched", "writing", "queued", "fetching"):
            self._state = "written" if self.ok else "failed"

    def cancel(self) -> None:
        """Nothing more is written (waits for a layer being written)."""
        with self.lock:
            self.cancelled = True

    def release(self) -> None:
        """The segment files it still holds open, closed (written or not)."""
        with self.lock:
            direct.close(self.sources)

    def count(self, ctx: Context) -> None:
        """The job's chunks counted loaded or failed, per chunk."""
        t = self.transfer
        ctx.stats.add(chunks_loaded=self.ok, chunks_failed=len(t.names) - self.ok,
                      chunks_corrupt=self.corrupt,
                      tokens_loaded=ctx.block_size * sum(map(len, t.blocks[:self.ok])),
                      segments_loaded=len(set(t.names[:self.ok])))


def run_job(job: LoadJob, target: Target, buffers: DecodeBuffers,
            segments: dict[str, Fetched] | None = None,
            verifier: ThreadPoolExecutor | None = None) -> None:
    """A whole job, fetch to last layer (the async driver's work, and a test's); with a
    ``verifier``, layer L+1 is verified on its thread while layer L is written (hashing
    and writing are each a pass over the bytes, and neither holds the GIL)."""
    stats = target.ctx.stats
    started = time.perf_counter()
    layers = len(target.layers)
    try:
        job.fetch(target, {} if segments is None else segments)
        stats.add(fetch_seconds=time.perf_counter() - started)
        ahead = verifier.submit(job.verify_layer, 0) if verifier and job.ok else None
        for layer in range(layers):
            if job.cancelled or not job.ok:
                break
            waited = time.perf_counter()
            checked = ahead.result() if ahead is not None else None
            stats.add(verify_seconds=time.perf_counter() - waited)  # what it added
            ahead = (verifier.submit(job.verify_layer, layer + 1)
                     if verifier is not None and layer + 1 < layers else None)
            stats.add(bytes_loaded=job.write_layer(target, layer, buffers, checked),
                      layers_written=1)
        if target.states and not job.cancelled:
            stats.add(bytes_loaded=job.write_states(target))
    except Exception as e:  # a bug of ours, a file changed underneath: a recompute
        job.fail(0, f"{type(e).__name__}: {e}")
    job.release()
    job.finish()
    stats.add(load_seconds=time.perf_counter() - started)


class StepLoads:
    """Synchronous loads: fetched before the forward pass, each layer written just before
    the forward pass reads it."""

    def __init__(self, target_of: Callable[[], Target | None], dtype: Any) -> None:
        self._target_of = target_of
        self._buffers = DecodeBuffers(dtype)
        self.jobs: list[LoadJob] = []
        self.failed: set[int] = set()  # blocks to report (plan.failed and failed chunks)
        self._verifier: ThreadPoolExecutor | None = None
        # layer -> its checks of every job of the step, started after the fetch: they run
        # on another core while the forward pass writes and computes the layers before
        self._checks: dict[int, Future] = {}

    def start(self, transfers: Iterable[Transfer], disabled: str) -> list[LoadJob]:
        target = self._target_of()
        segments: dict[str, Fetched] = {}
        jobs = [LoadJob(t) for t in transfers]
        for job in jobs:
            why = job.transfer.failed or disabled or ("no KV cache registered"
                                                      if target is None else "")
            if why:  # the scheduler matched; this worker cannot write
                job.fail_all(f"not loaded: {why}")
                continue
            started = time.perf_counter()
            try:
                job.fetch(target, segments)
            except Exception as e:  # a bug of ours is a recompute too, never a dead engine
                job.fail(0, f"{type(e).__name__}: {e}")
            elapsed = time.perf_counter() - started
            target.ctx.stats.add(fetch_seconds=elapsed, load_seconds=elapsed)
        self.jobs += jobs
        if target is not None and any(j.pending for j in self.jobs):
            if self._verifier is None:
                self._verifier = ThreadPoolExecutor(1, thread_name_prefix="hurraykv-verify")
            step = list(self.jobs)
            for layer in range(1, len(target.layers)):
                self._checks[layer] = self._verifier.submit(
                    lambda L=layer: {id(j): j.verify_layer(L) for j in step})
        return jobs

    def write_layer(self, layer: int) -> None:
        target = self._target_of()
        if target is None or not self.jobs:
            return
        started = time.perf_counter()
        nbytes = 0
        try:
            ahead = self._checks.pop(layer, None)
            checked = ahead.result() if ahead is not None else {}
            target.ctx.stats.add(verify_seconds=time.perf_counter() - started)
            for job in self.jobs:
                if job.ok:
                    nbytes += job.write_layer(target, layer, self._buffers,
                                              checked.get(id(job)))
        except Exception as e:  # e.g. a file changed underneath: every loaded block again
            for job in self.jobs:
                job.fail(0, f"writing layer {layer} failed ({type(e).__name__}: {e})")
            return
        target.ctx.stats.add(bytes_loaded=nbytes, layers_written=1,
                             load_seconds=time.perf_counter() - started)

    def close(self) -> None:
        if self._verifier is not None:
            self._verifier.shutdown(wait=False, cancel_futures=True)

    def settle(self, ctx: Context) -> tuple[list[LoadJob], set[int]]:
        """The step's jobs, counted, and every block to report failed."""
        jobs, self.jobs = self.jobs, []
        failed, self.failed = self.failed, set()
        for ahead in self._checks.values():  # layers never written (a step without them)
            ahead.cancel()
        self._checks.clear()
        for job in jobs:
            job.release()
            job.finish()
            job.count(ctx)
            failed.update(job.failed_blocks())
        return jobs, failed


class Loader:
    """Asynchronous loads on a thread of their own, one job at a time in the order the
    scheduler planned them (the store connection serves one call at a time anyway)."""


    def __init__(self, target_of: Callable[[], Target | None], dtype: Any) -> None:
        self._target_of = target_of
        self._buffers = DecodeBuffers(dtype)
        self._cv = threading.Condition()
        self._queue: list[LoadJob] = []
        self._jobs: dict[str, LoadJob] = {}  # not yet reported finished
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="hurraykv-verify")
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, transfers: Iterable[Transfer], disabled: str) -> None:
        damaged: dict[str, Fetched] = {}  # shared by the jobs of one step
        with self._cv:
            for t in transfers:
                job = LoadJob(t, segments=damaged)
                self._jobs[t.req_id] = job
                why = t.failed or disabled or ("no KV cache registered"
                                               if self._target_of() is None else "")
                if why:
                    job.fail_all(f"not loaded: {why}")
                    continue
                self._queue.append(job)
            if self._queue and self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="hurraykv-load")
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.pop(0)
            target = self._target_of()
            if not job.cancelled and target is not None:
                # the damage found by the jobs planned in the same step: a segment is
                # told damaged (and its chunks counted corrupt) by each, fetched by one,
                # as the jobs of one synchronous step share it; not its pages (memory)
                damaged = job.segments
                known: dict[str, Fetched] = dict(damaged)
                run_job(job, target, self._buffers, known, self._verifier)
                damaged.update((n, e) for n, e in known.items() if isinstance(e, DAMAGED))
            with self._cv:
                job.finish()
                self._cv.notify_all()

    def finished(self, finished_req_ids: Iterable[str], ctx: Context
                 ) -> tuple[list[LoadJob], set[int]]:
        """Jobs done since the last call, counted, and the blocks they failed; jobs of
        requests vLLM finished (aborted) meanwhile are cancelled and reported done (vLLM
        frees their blocks once told, ``scheduler.py`` ``_update_from_kv_xfer_finished``)."""
        for req_id in finished_req_ids:
            job = self._jobs.get(req_id)
            if job is not None and not job.done:
                job.cancel()  # no write after this returns
                ctx.stats.add(loads_cancelled=1)
        out, failed = [], set()
        with self._cv:
            for req_id, job in list(self._jobs.items()):
                if not job.done:
                    continue
                del self._jobs[req_id]
                out.append(job)
                if job.state == "cancelled":
                    continue  # its blocks are freed: nothing of it is reported failed
                job.count(ctx)
                failed.update(job.failed_blocks())
        return out, failed

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def wait_any(self, timeout: float) -> None:
        """Wait until a job is done, at most ``timeout`` (a step with no forward pass)."""
        with self._cv:
            if self._jobs and not any(j.done for j in self._jobs.values()):
                self._cv.wait(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every job submitted is done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while any(not j.done for j in self._jobs.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Let a job being written finish (bounded), cancel the rest, stop the thread."""
        self.wait_idle(min(timeout, 1.0))
        with self._cv:
            for job in self._jobs.values():
                job.cancel()
            self._queue.clear()
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._verifier.shutdown(wait=False, cancel_futures=True)


__all__ = ["STATES", "LoadJob", "Loader", "StepLoads", "Target", "later_members",
           "layer_members", "run_job"]
