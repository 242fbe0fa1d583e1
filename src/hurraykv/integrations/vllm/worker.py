"""The connector's worker part: the engine's KV cache layers, and the loads into them
(``loads.py``) and saves out of them (``saves.py``) that vLLM's worker hooks drive.

Per step: ``start_load`` fetches the step's synchronous loads (``StepLoads``) and hands
its asynchronous ones to the ``Loader``'s thread; ``wait_for_layer_load`` writes each
layer of the synchronous ones just before the forward pass reads it; ``save_kv_layer``
and ``wait_for_save`` copy newly computed blocks out for the writer; ``finished``
reports the asynchronous loads done (vLLM's ``get_finished``) and ``load_errors`` the
blocks that could not be loaded, both in the same step, as vLLM requires.

The counters mean what ``metrics.py`` names them: a load's chunks are counted loaded or
failed once the step reporting them is over, per chunk; stored bytes once the writer has
stored them.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from ... import threads
from ...adapters._torch import numpy_dtype
from ...adapters.vllm import LayerView, StateView, backend_kind, cpu_isa, ordered_layers
from ...chunks import memory
from ...chunks.registry import store_class
from ...io import checksums, scatter
from .common import IDLE_WAIT, Context, Plan, log
from .decode_buffers import warm as warm_formats
from .events import WorkerSegments
from .groups import MAMBA
from .loads import Loader, LoadJob, StepLoads, Target
from .saves import Saver
from .store_format import StoreFormat


class WorkerSide:
    def __init__(self, ctx: Context, *, spec: Any, context: dict[str, Any], model_dtype: Any,
                 kv_cache_dtype: str, segment_dtype: str) -> None:
        self.ctx, self.spec, self.forward_context = ctx, spec, context
        self.model_dtype, self.kv_cache_dtype = model_dtype, kv_cache_dtype
        self.segment_dtype = segment_dtype  # the cache's dtype in a segment of format auto
        self.format: StoreFormat = ctx.formats.get(ctx.identity, StoreFormat())  # saves
        self.saved = WorkerSegments(ctx.tier_reports)  # with tiers: their reports too
        self.saver = Saver(ctx, self.format, self.saved)
        self.target: Target | None = None
        self.step: StepLoads | None = None
        self.loader: Loader | None = None
        self._idle = False  # this step runs no forward pass (Plan.idle)

    @property
    def backlog(self) -> Any:
        return self.saver.backlog

    # ------------------------------------------------------------------ layers
    def register(self, kv_caches: dict[str, Any]) -> None:
        if self.ctx.disabled:
            return
        try:
            self._register(kv_caches)
        except Exception as e:  # a layout we cannot read: the engine runs without us
            self.target = None
            self.saver.layers, self.saver.index = [], {}
            self.ctx.disabled = f"the KV cache cannot be read ({type(e).__name__}: {e})"
            log.warning("HurrayConnector passes requests through on this worker: %s; "
                        "every matched chunk is recomputed", self.ctx.disabled)

    def _register(self, kv_caches: dict[str, Any]) -> None:
        ctx = self.ctx
        layers = ordered_layers(kv_caches)
        states: list[tuple[Any, Any]] = []
        if ctx.hybrid:  # attention layers as pages; Mamba layers' states (groups.py)
            layout = ctx.layout
            names = [n for n, _ in layers]
            self.saver.group_map = layout.describe(names)
            states = [(StateView(t, g.shapes, g.dtypes, where=f"kv_caches[{n!r}]"), g)
                      for n, t in layers if (g := layout.group_of(n)).kind == MAMBA]
            layers = [(n, t) for n, t in layers if layout.group_of(n).kind != MAMBA]
            self.saver.groups = [layout.group_of(n) for n, _ in layers]
            self.saver.states = states
        first = self.forward_context.get(layers[0][0])
        backend = first.attn_backend.get_name() if first is not None else "CPU_ATTN"
        head_size = getattr(self.spec, "head_size", None)
        isa = None
        if backend == "CPU_ATTN":
            isa = cpu_isa(self.model_dtype, ctx.block_size, head_size, self.kv_cache_dtype)
        kind = backend_kind(backend, kv_cache_dtype=self.kv_cache_dtype, isa=isa)
        views = [(name, LayerView(t, kind, kv_cache_dtype=self.kv_cache_dtype,
                                  head_size=head_size if kind != "mla" else None, isa=isa))
                 for name, t in layers]
        self.saver.layers = views
        self.saver.index = {name: i for i, (name, _) in enumerate(views)}
        if self.kv_cache_dtype != "auto":
            self.saver.scales = []
            for name, _ in views:
                layer = self.forward_context.get(name)
                self.saver.scales.append((float(getattr(layer, "_k_scale_float", 1.0)),
                                          float(getattr(layer, "_v_scale_float", 1.0))))
        checksums.warm()  # compiled now, not inside the first load's time
        dtype = numpy_dtype(views[0][1].parts[0].dtype)
        warm_formats(set(ctx.formats.values()), dtype)
        self.target = Target(ctx, views, self.segment_dtype, self.format,
                             list(self.saver.groups), states, self.saver.group_map)
        if self.target.destinations is not None:  # compiled for this cache's elements
            scatter.warm([d.geometry for parts in self.target.destinations for d in parts])
        # a mem:// tier holds pages as these blocks do (CPU_ATTN's keys transposed): its
        # hits are copies (chunks/memory.py); an engine of another layout resets it
        roles = ("fused",) if kind == "mla" else ("key", "value")
        forms = {role: form for role, d in zip(roles, (self.target.destinations or [[]])[0],
                                               strict=False)
                 if (form := scatter.engine_form(d.geometry)) is not None}
        for url in [t.url for t in ctx.config.tiers or ()] or [ctx.url]:
            memory.hold_as(url, forms if self.format.auto else {})
        if self.target.destinations is not None:
            # the stored segments' structures known before a hit (a store that can; asked
            # only then, so that a store away costs no start-up wait and no failure)
            cls = store_class(urlparse(ctx.url).scheme)
            if hasattr(cls, "learn_layouts"):
                pools = self.target.pools
                ctx.loads.call("learn", lambda store: store.learn_layouts(pools), 0)
        self.step = StepLoads(lambda: self.target, dtype)
        self.loader = Loader(lambda: self.target, dtype)
        log.info("HurrayConnector: %d layers of %s (%s)%s, chunks of %d tokens in %s; "
                 "segments read on %d core(s) %s", len(views), backend, kind,
                 f" and {len(states)} Mamba layers" if states else "",
                 ctx.chunk_size, ctx.url, threads.workers(), sorted(os.sched_getaffinity(0)))

    # ------------------------------------------------------------------ loads
    def start_load(self, plan: Plan | None) -> None:
        self._idle = plan is not None and plan.idle
        if plan is None or plan.empty:
            return
        disabled = self.ctx.disabled
        if self.step is None:  # nothing registered: every load fails
            disabled = disabled or "no KV cache registered"
            self.step = StepLoads(lambda: None, "float32")
            self.loader = Loader(lambda: None, "float32")
        self.step.failed.update(plan.failed)
        if plan.loads:
            self.ctx.stats.add(loads_sync=len(plan.loads))
            self.step.start(plan.loads, disabled)
        if plan.async_loads:
            self.ctx.stats.add(loads_async=len(plan.async_loads))
            self.loader.submit(plan.async_loads, disabled)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.step is None or self.target is None:
            return
        layer = self.saver.index.get(layer_name)
        if layer is not None:
            self.step.write_layer(layer)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose asynchronous load is over (loaded, failed or cancelled)."""
        return self.transfer_results(finished_req_ids)[0]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        """vLLM's ``get_finished``: ``(finished_sending, finished_recving)`` in that
        order (``vllm/distributed/kv_transfer/kv_connector/v1/base.py:383-398``).  A
        load over is a receive; nothing is ever sent from the blocks after a request
        ends (``request_finished`` answers False), so sending is always None."""
        return None, self.finished(finished_req_ids) or None

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous load is over (loaded, failed or cancelled), and
        those of them that failed as a whole without known blocks (vLLM recomputes them
        from the start: ``failed_recving``)."""
        if self.loader is None:
            return set(), set()
        if self._idle:  # nothing else to do this step: let the loader's thread run
            self.loader.wait_any(IDLE_WAIT)
        jobs, failed = self.loader.finished(finished_req_ids, self.ctx)
        self.step.failed.update(failed)
        self._report(j for j in jobs if not j.cancelled)
        return {j.req_id for j in jobs}, {j.req_id for j in jobs if j.failed_whole}

    def load_errors(self) -> set[int]:
        """Blocks of this step's loads (and of asynchronous loads reported finished) that
        were not loaded: vLLM recomputes them."""
        if self.step is None:
            return set()
        jobs, failed = self.step.settle(self.ctx)
        self._report(jobs)
        return failed

    def _report(self, jobs: Any) -> None:
        for job in jobs:  # the scheduler counts a hit once it knows what failed
            assert isinstance(job, LoadJob)
            self.saved.loaded(job.req_id)

    # ------------------------------------------------------------------ saves
    def save_kv_layer(self, layer_name: str, plan: Plan | None) -> None:
        self.saver.save_kv_layer(layer_name, plan)

    def wait_for_save(self, plan: Plan | None) -> None:
        self.saver.wait_for_save(plan)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every segment handed to the writer is stored or dropped."""
        self.saver.drain(timeout)

    def shutdown(self) -> None:
        """Loads in flight are cancelled (a fetch waiting on a store is not waited for
        past ``load_timeout_ms``), saves drained up to ``save_timeout_ms``."""
        if self.loader is not None:
            self.loader.close(self.ctx.config.load_timeout_ms / 1000)
        if self.step is not None:
            self.step.close()
        self.saver.shutdown()


__all__ = ["WorkerSide"]
