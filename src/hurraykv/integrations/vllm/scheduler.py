"""The connector's scheduler part: which prompt tokens the store holds, what each step's
workers load and store (no vLLM or torch import: tested without an engine,
``tests/integrations/vllm/test_vllm_scheduler.py``).

``matched`` finds the longest run of stored chunks at the start of a prompt: it starts a
lookup on the lookup thread (``lookups.py``) and answers ``None`` ("ask again") until the
store has answered, so vLLM's scheduler thread never waits on the store.  A hit is
loaded asynchronously (vLLM holds the request in ``WAITING_FOR_REMOTE_KVS`` while the
workers' loader fetches it, ``loads.py``) or, for a small ``file://`` hit under
``load_mode`` auto (or always under sync), before the forward pass of the step that
schedules it.  ``plan`` turns a step's ``SchedulerOutput`` into a ``Plan``: the chunks to
load into the blocks vLLM allocated, and the newly computed chunks not known to be
stored, one segment per run of consecutive chunks (``save_plans.py``; the writer skips a
segment the store already holds).  A failed load (reported back by the workers) makes the
chunks from it on stored again once recomputed, and the request is never offered a load
again.

``tokens_hit`` counts the tokens a load actually put into the engine's cache, when the
workers report the step that ran it (``output``): vLLM counts a load in its
``cached_tokens`` when it schedules it, before it knows whether the load fails; the
tokens of a failed load, which vLLM recomputes, are ``tokens_failed``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ...chunks.keys import (
    ChunkKeys,
    identity_key,
    segment_ends_at,
    segment_first,
    segment_keys,
)
from ...chunks.registry import is_local
from ...errors import HurrayError
from .common import IDLE_WAIT, Context, Plan, Transfer, holds, log
from .events import HurrayKVEvents, split_records
from .lookups import PENDING, Lookups
from .request_keys import passed_through, request_seed
from .request_state import RequestState
from .retention import Retainer, Watch, keep_of
from .save_plans import SavePlanner
from .tier_events import REMOVED, STORED, in_process


class SchedulerSide:
    MAX_LOADING = 100_000  # loads whose step was never reported (aborted) are forgotten

    def __init__(self, ctx: Context, events: HurrayKVEvents,
                 new_plan: Callable[[], Plan] = Plan) -> None:
        self.ctx, self.events, self.new_plan = ctx, events, new_plan
        self.requests: dict[str, RequestState] = {}
        # request id -> (tokens, the blocks) of a load planned and not yet reported; kept
        # apart from ``requests`` because vLLM finishes a request (max_tokens=1) before it
        # hands the connector the output of the step that loaded it
        self.loading: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()
        self.lookups = Lookups(ctx.lookups, ctx.stats)
        self.async_loads: list[Transfer] = []  # allocated, for the next plan
        self.async_pending: set[str] = set()  # async loads not reported finished yet
        self.save_planner = SavePlanner(ctx, events)  # what each step stores
        self.steps = 0  # plans made
        # the plan of a step with nothing to load or store (idle or not), made once and
        # never changed: most decode steps, which need no plan of their own
        self._nothing: dict[bool, Plan] = {}
        # segment id -> name of segments planned before a reset (retention.py)
        self.stale: OrderedDict[str, str] = OrderedDict()
        self.watch = Watch(ctx.open or (lambda: None), ctx.config.removal_check_s
                           if events.enabled and ctx.open else 0.0, events.max_tracked)
        self.retainer = Retainer(lambda: ctx.open(ranked=False), events.ranks, ctx.stats)
        # with tiers: those the watch checks (a mem:// pool is a worker process's own
        # with tensor parallelism: its workers report what it drops)
        self.polled = {t for t, tier in enumerate(ctx.config.tiers or ())
                       if events.ranks == 1 or not in_process(tier.url)}

    def state(self, request: Any) -> RequestState:
        st = self.requests.get(request.request_id)
        if st is None:
            size = self.ctx.chunk_size
            st = RequestState(request, ChunkKeys(request_seed(self.ctx.seed, request), size),
                              others=[ChunkKeys(request_seed(seed, request), size)
                                      for seed in self.ctx.other_seeds])
            try:
                st.keep = keep_of(request)
            except HurrayError as e:
                self.ctx.stats.add(retention_refused=1)
                log.warning("request %s runs without retention: %s", request.request_id, e)
            self.requests[request.request_id] = st
        return st

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        ctx, stats = self.ctx, self.ctx.stats
        st = self.state(request)
        st.local = num_computed_tokens
        if not ctx.can_load or ctx.disabled or passed_through(request) or st.load_failed:
            return 0, False
        if ctx.hybrid and num_computed_tokens % ctx.block_size:
            # vLLM's own hit ends inside a block (finer prefix hashes): the block it copied
            # for the request is being written; a hybrid load starts on a block boundary
            return 0, False
        prompt = request.prompt_token_ids or []
        chunks = (len(prompt) - 1) // ctx.chunk_size  # the last token is always computed
        if st.asked is None:  # this engine's keys, then each accepted other format's
            st.asked = [k for chain in (st.keys, *st.others) for k in chain.upto(prompt, chunks)]
        located = self.lookups.ask(request.request_id, st.asked)
        if located is PENDING:
            return None, False  # vLLM asks again at a later step
        if located is None:  # store down, late or failing: a miss (guard.py logs it)
            if not st.counted:
                st.counted = True
                stats.add(lookups=1, lookups_missed=1)
            return 0, False
        # a chunk counts only behind a well-formed name whose first chunk is not after it,
        # and not written after a reset before it is removed (the old weights' KV); the
        # longest run from the start wins, this engine's own format on a tie
        stale = self._stale_names()
        # what it lacks is stored without the writer asking again (Transfer.absent) if
        # this step plans it; later, another engine may have stored it meanwhile
        st.absent, st.absent_plan = [name is None for name in located[:chunks]], self.steps + 1
        found, best = 0, 0
        for at in range(0, len(located), max(chunks, 1)):
            run = located[at:at + chunks]
            n = next((i for i, name in enumerate(run) if not holds(name, i) or name in stale),
                     len(run))
            if n > found:
                found, best = n, at
        if ctx.hybrid and ctx.layout.mamba:
            # a Mamba state is stored at the end of a segment only (groups.py): the hit
            # ends at the last matched chunk that ends its segment
            found = next((n for n in range(found, 0, -1) if segment_ends_at(
                str(located[best + n - 1]), st.asked[best + n - 1])), 0)
        st.located = [str(name) for name in located[best:best + found]]
        st.tiers = (self.lookups.tiers(request.request_id) or [])[best:best + found]
        # chunks loaded from another format are never stored as this engine's, nor is
        # what it computes on top of them (that KV attended to the other precision)
        st.foreign = st.foreign or (best > 0 and found > 0)
        st.matched = found * ctx.chunk_size
        st.stored = max(st.stored, found)
        new = max(0, st.matched - num_computed_tokens)
        if not st.counted:  # once per lookup, however often vLLM asks
            st.counted = True
            stats.add(lookups=1, lookup_hits=int(new > 0), lookup_misses=int(new == 0))
            if st.keep is not None and st.located and ctx.open is not None:
                self.retainer.ask(st.located, st.keep)  # what it found stays too
        st.async_load = new > 0 and self._async(new)
        return new, st.async_load

    def _async(self, tokens: int) -> bool:
        """Whether a hit of ``tokens`` loads across steps (``load_mode``)."""
        config = self.ctx.config
        if self.ctx.hybrid:
            # vLLM takes no block-level load failure from a model with several KV cache
            # groups (their block ids overlap: Scheduler._handle_invalid_blocks raises);
            # an asynchronous load reports a failure by request (failed_recving)
            return True
        if config.load_mode != "auto":
            return config.load_mode == "async"
        return not (is_local(self.ctx.url) and tokens <= config.sync_load_max_tokens)

    def hit_tiers(self, request: Any, tokens: int) -> dict[int | None, int]:
        """The ``tokens`` the connector supplies ``request`` (those after vLLM's own hit,
        as its load takes them), by the tier its lookup found each chunk in (None: not a
        stack, or unknown)."""
        st = self.requests.get(request.request_id)
        if st is None or tokens <= 0:
            return {None: tokens} if tokens > 0 else {}
        size, start, end = self.ctx.chunk_size, st.local, st.local + tokens
        if end > st.matched:  # not the tokens of its lookup: unknown
            return {None: tokens}
        out: dict[int | None, int] = {}
        for c in range(len(st.located)):
            n = min((c + 1) * size, end) - max(c * size, start)
            if n > 0:
                tier = st.tiers[c] if c < len(st.tiers) else None
                out[tier] = out.get(tier, 0) + n
        return out

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self.state(request)
        self.lookups.forget(request.request_id)  # used: a later ask looks up again
        st.asked, st.counted = None, False
        if num_external_tokens <= 0 or not st.async_load:
            st.load = num_external_tokens
            return
        # async: the request is not scheduled this step; its blocks are known only here.
        # vLLM now waits for the workers to report it: whatever goes wrong, it is
        # reported (its blocks failed), or it would wait forever.
        st.load, st.async_load = num_external_tokens, False
        try:
            self._set_blocks(st, blocks.get_block_ids())
            transfer = self._transfer(st, st.local, st.local + st.load)
        except Exception as e:
            # reported as a failed receive: vLLM recomputes the whole request
            transfer = Transfer(request.request_id, failed=f"{type(e).__name__}: {e}")
            self.ctx.stats.add(hook_errors=1)
        self._loading(st)
        self.async_loads.append(transfer)
        self.async_pending.add(request.request_id)

    def plan(self, scheduler_output: Any) -> Plan:
        self.steps += 1
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        if idle:  # nothing runs this step: give the lookup thread a moment
            self.lookups.wait_any(IDLE_WAIT)
        loads: list[Transfer] = []
        scheduled: list[RequestState] = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self.requests.get(new.req_id)
            if st is None:
                continue
            self._set_blocks(st, new.block_ids)
            st.computed = new.num_computed_tokens
            self._plan_load(loads, st)
            scheduled.append(st)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # a preempted request back from the waiting queue: vLLM asked for its
                # matched tokens again and counts them computed, so they load like a
                # new request's (vllm/v1/core/sched/scheduler.py, schedule(): the
                # connector is asked when num_computed_tokens == 0, preempted included)
                self._set_blocks(st, new_blocks)
                self._plan_load(loads, st)
            elif new_blocks:
                for have, more in zip(st.groups, new_blocks, strict=False):
                    have.extend(more or ())
            st.computed = cached.num_computed_tokens[i]
            scheduled.append(st)
        saves: list[Transfer] = []
        if self.ctx.can_save and not self.ctx.disabled:
            size, tokens = self.ctx.chunk_size, scheduler_output.num_scheduled_tokens
            for st in scheduled:
                n = tokens.get(st.request.request_id, 0)
                if (st.computed + n) // size > st.stored:  # a chunk may be complete
                    saves += self.save_planner.plan(st, n, self.steps)
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        async_loads, self.async_loads = self.async_loads, []
        if not (loads or saves or async_loads):
            return self._empty(idle)
        plan = self.new_plan()
        plan.loads, plan.saves, plan.async_loads, plan.idle = loads, saves, async_loads, idle
        return plan

    def _empty(self, idle: bool) -> Plan:
        """The plan of a step without loads or saves (shared: never changed)."""
        plan = self._nothing.get(idle)
        if plan is None:
            plan = self._nothing[idle] = self.new_plan()
            plan.idle = idle
        return plan

    def _set_blocks(self, st: RequestState, block_ids: Any) -> None:
        """The request's blocks as vLLM allocated them: one list per KV cache group."""
        st.groups = [list(b or ()) for b in block_ids or ()] or [[]]
        ref = self.ctx.layout.ref if self.ctx.hybrid else 0
        st.blocks = st.groups[ref] if ref < len(st.groups) else []

    def _plan_load(self, loads: list[Transfer], st: RequestState) -> None:
        """The load of the external tokens vLLM took for ``st`` at its allocation."""
        if st.load <= 0:
            return
        loads.append(self._transfer(st, st.local, st.local + st.load))
        self._loading(st)

    def _loading(self, st: RequestState) -> None:
        """``st``'s load is planned: counted when the workers report it."""
        block, req_id = self.ctx.block_size, st.request.request_id
        self.loading[req_id] = (st.load, st.blocks[st.local // block:
                                                   (st.local + st.load) // block])
        self.loading.move_to_end(req_id)
        while len(self.loading) > self.MAX_LOADING:
            self.loading.popitem(last=False)
        st.load = 0

    def failed_plan(self, scheduler_output: Any) -> Plan:
        """When planning failed: nothing stored this step, and what vLLM expects loaded
        is reported failed by the workers, so it is recomputed."""
        plan = self.new_plan()
        # async loads already have their blocks: the workers report them as usual
        plan.async_loads, self.async_loads = self.async_loads, []
        allocated = [(new.req_id, new.block_ids) for new in
                     getattr(scheduler_output, "scheduled_new_reqs", None) or []]
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            allocated += [(r, cached.new_block_ids[i]) for i, r in enumerate(cached.req_ids)
                          if r in cached.resumed_req_ids]
        for req_id, block_ids in allocated:
            st = self.requests.get(req_id)
            if st is not None and st.load > 0 and block_ids:
                ref = self.ctx.layout.ref if self.ctx.hybrid else 0
                plan.failed += list(block_ids[ref])[st.local // self.ctx.block_size:]
                self.ctx.stats.add(tokens_failed=st.load)
                st.load = 0
        return plan

    def _transfer(self, st: RequestState, start: int, end: int) -> Transfer:
        """The chunks covering tokens ``[start, end)`` (whole blocks) and their blocks."""
        out = Transfer(st.request.request_id)
        per, block = self.ctx.per, self.ctx.block_size
        first_block, last_block = start // block, end // block
        if last_block > len(st.blocks):
            raise HurrayError(f"request {out.req_id} has {len(st.blocks)} blocks, its load of "
                              f"tokens [{start}, {end}) needs {last_block}", field="blocks",
                              value=len(st.blocks), rule="a block for every loaded token")
        for c in range(first_block // per, -(-last_block // per)):
            lo, hi = max(c * per, first_block), min((c + 1) * per, last_block)
            name = st.located[c]
            out.names.append(name)
            out.blocks.append(st.blocks[lo:hi])
            out.pages.append((c - segment_first(name)) * per + lo - c * per)
            if self.ctx.config.tiers and not st.foreign and name not in out.promote:
                keys = segment_keys(name, st.keys.known())
                if keys:
                    out.promote[name] = keys
                    # the tiers it is promoted into announce it with this payload
                    self.events.known(st.request, segment_first(name), len(keys), name)
        if self.ctx.hybrid:
            out.first_block = first_block
            out.groups = [g[first_block:last_block] for g in st.groups]
        return out
    def output(self, connector_output: Any) -> None:
        """Chunks whose load failed are stored again once recomputed (the damaged object
        is replaced), instead of failing every later request that finds them."""
        saved = getattr(connector_output, "kv_cache_events", None)
        segments, loaded, dropped, tiers = split_records(
            saved.get_all_events() if saved else ())
        for sid in dict.fromkeys(s for s in segments if s in self.stale):
            self.retainer.remove(sid, self.stale[sid])  # off this thread; a miss till then
        segments = [s for s in segments if s not in self.stale]
        for sid in dropped:  # never written: nothing stale to keep away
            self.stale.pop(sid, None)
        if segments:
            self.watch.watch(self.events.confirm(segments))
        self._tier_reports(tiers)
        self.save_planner.done((*segments, *dropped))  # their chunks may be planned again
        invalid = getattr(connector_output, "invalid_block_ids", None)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        self._loads_done(loaded, invalid or set(), failed)
        for req_id in failed if self.ctx.hybrid else ():  # its load failed: all recomputed
            st = self.requests.get(req_id)
            if st is not None:
                self.events.removed(st.request, 0, len(st.located))
                st.stored, st.rewrite = 0, True
                st.load_failed = True
        if not invalid:
            return
        per = self.ctx.per
        for st in self.requests.values():
            hits = [i for i, b in enumerate(st.blocks) if b in invalid]
            if hits:
                first = hits[0] // per
                # what could not be loaded is gone from the store, as far as a router knows
                self.events.removed(st.request, first, max(0, len(st.located) - first))
                st.stored = min(st.stored, first)
                st.rewrite = st.load_failed = True

    def _loads_done(self, req_ids: set[str], invalid: set[int], failed: set[str]) -> None:
        """The loads of ``req_ids`` ran in the step whose failed blocks are ``invalid``:
        vLLM recomputes a request from its first failed block on, so the tokens before it
        are hits and the rest failed; a request in ``failed`` (vLLM's
        ``failed_recving``) is recomputed whole."""
        stats, block = self.ctx.stats, self.ctx.block_size
        for req_id in req_ids:
            self.async_pending.discard(req_id)
            done = self.loading.pop(req_id, None)
            if done is None:
                continue
            tokens, blocks = done
            bad = 0 if req_id in failed else next(
                (i for i, b in enumerate(blocks) if b in invalid), None)
            hit = tokens if bad is None else min(tokens, bad * block)
            stats.add(tokens_hit=hit, tokens_failed=tokens - hit)

    def _tier_reports(self, reports: list[tuple[str, str, int]]) -> None:
        """What the stacks reported per tier (``tier_events.py``): a write there announced
        once every rank's part is (and watched there), a removal there announced."""
        stale = self._stale_names() if reports else set()
        for kind, name, tier in reports:
            if kind == STORED and name not in stale:
                if self.events.tier_stored(name, tier) and tier in self.polled:
                    self.watch.watch([(name, tier)])
            elif kind == REMOVED:
                self.events.tier_removed(name, tier)

    def take_events(self) -> list[Any]:
        """The KV events since the last call, with the segments the watch found gone (a
        stack's: in a tier) and what this side's own stacks reported."""
        if self.ctx.tier_reports is not None:
            self._tier_reports(self.ctx.tier_reports.take())
        gone = self.watch.take_gone()
        if gone:
            self.events.removed_segments(n for n in gone if isinstance(n, str))
            for entry in gone:
                if isinstance(entry, tuple):
                    self.events.tier_removed(*entry)
        return self.events.take_events()

    def reset(self) -> bool:
        """vLLM's ``reset_cache``: every segment of this engine's identity removed from
        the store, and everything known of it forgotten (``retention.py``); False (vLLM
        then fails the reset) when the store could not be cleared, all of it."""
        ctx = self.ctx
        removed, failed = [], ""
        try:
            store = ctx.open(ranked=False)
            try:
                removed = store.clear(identity_key(ctx.identity))
            finally:
                store.close()
        except Exception as e:  # forgotten all the same: part may have been removed
            failed = f"{type(e).__name__}: {e}"
        self.stale.update(self.save_planner.forget())  # written after the reset: stale
        while len(self.stale) > self.save_planner.MAX_PLANNED:
            self.stale.popitem(last=False)
        self.lookups.forget_all()
        for st in self.requests.values():
            # what it found is gone; what it holds was computed before the reset
            st.asked, st.counted, st.located, st.tiers = None, False, [], []
            st.foreign = st.foreign or bool(st.blocks)
        self.watch.forget()
        self.events.cleared()
        ctx.stats.add(segments_cleared=len(removed))
        if failed:
            log.warning("reset_cache: %s was not cleared of identity %s (%s)", ctx.url,
                        ctx.identity, failed)
            return False
        log.info("reset_cache: removed %d segments (%d bytes) of identity %s from %s",
                 len(removed), sum(s.nbytes for s in removed), ctx.identity, ctx.url)
        return True

    def _stale_names(self) -> set[str]:
        """The names of the segments written after a reset and not removed yet."""
        for sid in self.retainer.take_removed():
            self.stale.pop(sid, None)
        return set(self.stale.values()) if self.stale else set()

    def finished(self, request: Any) -> None:
        req_id = getattr(request, "request_id", None)
        self.requests.pop(req_id, None)
        self.lookups.forget(req_id)
        if req_id in self.async_pending:  # aborted while loading: neither hit nor failure
            self.async_pending.discard(req_id)
            self.loading.pop(req_id, None)

    def close(self) -> None:
        self.lookups.close()
        self.watch.close()
        self.retainer.close()


__all__ = ["RequestState", "SchedulerSide"]
