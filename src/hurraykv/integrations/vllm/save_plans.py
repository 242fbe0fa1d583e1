"""Which chunks a step stores, the scheduler's part of saves (``SavePlanner``): of the
chunks a scheduled request completes, those the store lacks, ``store_threshold`` admits
and no other request of this engine is storing, one segment (a ``Transfer``) per run of
consecutive chunks; the workers copy them out and store them (``saves.py``).  With tiers
of different thresholds a run also breaks where the tiers admitting it change, and each
segment names its tiers (``Transfer.tiers``: the stack writes those only).  A chunk
planned stays known as being stored until the workers report its segment written or
dropped (``done``), or ``PLANNED_SECONDS`` pass.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from ...chunks.keys import segment_first, segment_name
from .admission import Admission
from .common import Context, Transfer
from .events import HurrayKVEvents
from .request_keys import passed_through, tenant_of
from .request_state import RequestState


class SavePlanner:
    # chunk keys planned for storing lately (their writes may not have landed yet); the
    # writer itself skips a segment the store holds
    MAX_PLANNED = 4096
    PLANNED_SECONDS = 2.0

    def __init__(self, ctx: Context, events: HurrayKVEvents) -> None:
        self.ctx, self.events = ctx, events
        self.admission = Admission(ctx.config.thresholds(), ctx.config.max_tracker_size)
        # chunk key -> (step, time) it was planned for storing, oldest first
        self.planned: OrderedDict[str, tuple[int, float]] = OrderedDict()
        # segment id -> (its first chunk, its chunk keys), until written or dropped
        self.saving: dict[str, tuple[int, list[str]]] = {}

    def plan(self, st: RequestState, scheduled: int, step: int) -> list[Transfer]:
        """Segments of the chunks plan ``step`` completes of ``st`` (``scheduled``: its
        tokens this step) that the store lacks (one per run of consecutive chunks)."""
        ctx, request = self.ctx, st.request
        if passed_through(request) or st.foreign:
            return []
        upto = st.computed + scheduled
        if not ctx.config.save_decode:
            upto = min(upto, len(request.prompt_token_ids or []))
        known = len(request.all_token_ids)  # async scheduling runs ahead of the tokens
        chunks = min(upto, len(st.blocks) * ctx.block_size, known) // ctx.chunk_size
        if chunks <= st.stored:
            return []
        per = ctx.per
        # Mamba layers: a segment ends where every state layer holds a state (where a step
        # ended, or a prefill checkpoint), whole (a hit ends at a segment's end: matched);
        # without one, its chunks wait for a later segment that ends on a state
        mamba = ctx.hybrid and ctx.layout.mamba
        if mamba and not ctx.layout.states_at(st.groups, chunks, per):
            return []
        keys = st.keys.upto(request.all_token_ids, chunks)
        rewrite, first, st.stored, st.rewrite = st.rewrite, st.stored, chunks, False
        if ctx.hybrid:  # not the chunks whose window pages vLLM never computed
            first = ctx.layout.first_storable(st.groups, first, chunks, per)
        admitted = self._admitted(keys, first, chunks, rewrite, mamba)
        out: list[Transfer] = []
        now = time.monotonic()
        deduplicated, last = 0, -2  # runs of chunks another request is storing
        for c in range(first, chunks):
            tiers = admitted[c - first]  # None: every tier
            if tiers == ():
                continue
            if (not mamba or not out) and self._planned_elsewhere(keys[c], rewrite, now, step):
                deduplicated += last != c - 1
                last = c
                continue
            self.planned[keys[c]] = (step, now)
            self.planned.move_to_end(keys[c])
            # a new segment where the run breaks, and (storing again what failed to load)
            # where a segment it was found in began: a damaged segment is replaced under
            # its own name, not left beside its replacement
            boundary = rewrite and c < len(st.located) and segment_first(
                st.located[c]) == c and not mamba
            if not out or out[-1].first_chunk + len(out[-1].keys) != c or boundary or \
                    out[-1].tiers != tiers:
                out.append(Transfer(request.request_id, first_chunk=c, rewrite=rewrite,
                                    tiers=tiers))
            out[-1].keys.append(keys[c])
            out[-1].blocks.append(st.blocks[c * per:(c + 1) * per])
        if ctx.hybrid:
            for t in out:
                t.first_block, t.state = t.first_chunk * per, mamba
                end = (t.first_chunk + len(t.keys)) * per
                t.groups = [g[t.first_block:end] for g in st.groups]
        if deduplicated:  # attempted, and landed at once: counted with the segments saved
            ctx.stats.add(saves_attempted=deduplicated, saves_deduplicated=deduplicated)
        while len(self.planned) > self.MAX_PLANNED:
            self.planned.popitem(last=False)
        while len(self.saving) > self.MAX_PLANNED:
            self.saving.pop(next(iter(self.saving)))
        absent = st.absent if st.absent_plan == step and not rewrite else []
        for t in out:  # announced to routers once the workers say it is stored
            t.keep, t.tenant = st.keep, tenant_of(request)
            t.absent = any(absent[t.first_chunk:t.first_chunk + len(t.keys)])
            self.saving[t.segment_id] = (t.first_chunk, list(t.keys))
            self.events.expect(t.segment_id, request, t.first_chunk, len(t.keys),
                               segment_name(t.keys, t.first_chunk))
        return out

    def _admitted(self, keys: list[str], first: int, chunks: int, rewrite: bool,
                  mamba: bool) -> list[tuple[int, ...] | None]:
        """For each of chunks ``[first, chunks)``, the tiers whose ``store_threshold``
        lets it in: None for every tier, () for none (every tier when storing again what
        failed to load: it was stored, and asked for again).  A hit is a prefix: after a
        chunk a tier refused, none of this step's is stored there (a later chunk is no
        use without it); a Mamba segment ends on the step's last chunk (its state), so a
        tier stores it whole or not at all."""
        offered = self.admission.offer(keys[first:chunks])
        n, tiers = len(offered), len(self.admission.thresholds)
        if rewrite:
            return [None] * n
        runs = []  # per tier: how many of the step's chunks it admits, from the first
        for t in range(tiers):
            run = next((i for i, ok in enumerate(offered) if t not in ok), n)
            runs.append(0 if mamba and run < n else run)
        self.ctx.stats.add(chunks_unadmitted=n - max(runs))
        counts = self.ctx.tier_counts if self.ctx.config.tiers else None
        if counts is not None:
            for t, run in enumerate(runs):
                counts["unadmitted"][t] += n - run
        every = tuple(range(tiers))
        out: list[tuple[int, ...] | None] = []
        for i in range(n):
            chosen = tuple(t for t in every if i < runs[t])
            out.append(None if chosen == every else chosen)
        return out

    def _planned_elsewhere(self, key: str, rewrite: bool, now: float, step: int
                           ) -> bool:
        """Another request of this engine is storing chunk ``key`` (a burst sharing a new
        prefix): not copied out again.  Only until the workers report that segment
        written or dropped, and at most ``PLANNED_SECONDS`` (a report lost with a
        request): the store may lose a chunk (a restart, an operator, a dropped save),
        and the next request computing it must store it; storing again what failed to
        load, only another such request of the same step counts."""
        seen = self.planned.get(key)
        if seen is None:
            return False
        planned, when = seen
        return planned == step if rewrite else now - when < self.PLANNED_SECONDS

    def done(self, segment_ids: Iterable[str]) -> None:
        """Segments reported written or dropped: their chunks may be planned again."""
        for sid in segment_ids:
            for key in self.saving.pop(sid, (0, ()))[1]:
                self.planned.pop(key, None)

    def forget(self) -> dict[str, str]:
        """Everything planned forgotten (a reset); the segments still being saved, by id,
        with their names (written after the reset: stale)."""
        out = {sid: segment_name(keys, first) for sid, (first, keys) in self.saving.items()}
        self.saving.clear()
        self.planned.clear()
        return out


__all__ = ["SavePlanner"]
