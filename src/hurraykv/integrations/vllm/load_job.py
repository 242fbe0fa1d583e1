"""One request's load of stored KV into the engine's blocks: a ``LoadJob``.

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

The drivers that run jobs are in ``loads.py``; what a segment must be to load,
``load_target.py``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ...chunks.keys import segment_first
from ...errors import HurrayError
from ...io.checksums import DAMAGED, Pending
from ...io.scatter import PageSource
from ...snapshot import KVCacheSnapshot
from . import direct, hybrid
from .common import Context, Transfer, log
from .decode_buffers import DecodeBuffers
from .groups import NULL_BLOCK, SLIDING
from .load_target import Fetched, Target, layer_members

STATES = ("queued", "fetching", "fetched", "writing", "written", "failed", "cancelled")


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
        """The job's chunks counted loaded or failed, per chunk; the segments it loaded
        from a lower tier promoted (``Transfer.promote``)."""
        t = self.transfer
        for name in dict.fromkeys(t.names[:self.ok]):
            keys = t.promote.get(name)
            if keys:
                ctx.loads.call("promote", lambda s, n=name, k=keys: getattr(
                    s, "promote", lambda *_: False)(n, k), False)
        ctx.stats.add(chunks_loaded=self.ok, chunks_failed=len(t.names) - self.ok,
                      chunks_corrupt=self.corrupt,
                      tokens_loaded=ctx.block_size * sum(map(len, t.blocks[:self.ok])),
                      segments_loaded=len(set(t.names[:self.ok])))


__all__ = ["STATES", "LoadJob", "Run"]
