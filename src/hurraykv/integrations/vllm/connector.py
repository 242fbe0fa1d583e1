"""``HurrayConnector``: vLLM stores and loads KV through hurraykv.

Selected with (the name is registered by the ``vllm.general_plugins`` entry point,
``vllm_plugin.py``; ``"kv_connector_module_path": "hurraykv.integrations.vllm"`` works
too)::

    kv_transfer_config = {"kv_connector": "HurrayConnector",
                          "kv_role": "kv_both",            # or kv_producer / kv_consumer
                          "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": {"url": "file:///var/cache/kv"}}

``url``: ``file:///DIR``, ``hurray://HOST:PORT`` or ``redis[+cluster]://HOST:PORT`` (see
``chunks.py``; a store from outside the package registers its own scheme); every other
key, its type and default: ``config.ConnectorConfig``, and the options of the store the URL
names, declared by its class (``ChunkStore.OPTIONS``; unknown keys are refused).  Every
store call runs behind a deadline and a circuit breaker (``guard.py``), and every
exception is caught at this class's boundary: a store that is down, hung or full is a
miss or a recompute, never an engine that dies or waits.

This class is a facade, as vLLM's ``OffloadingConnector`` is: it reads vLLM's
configuration once (``context.build_context``: the typed config, the cache identity, the
guarded store connections, the counters) and delegates, by role, to
``scheduler.SchedulerSide`` (lookups off the scheduler thread, what to load and store;
no vLLM or torch import) or ``worker.WorkerSide`` (layers; ``loads.py``: one load job per
request, across steps or before the forward pass; ``saves.py``: copies out and the
writer thread).  Metrics reach vLLM's ``/metrics``
through ``metrics.py``, KV events for routers through ``events.py``.  It is a
``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, and a hybrid model's groups
(sliding window, Mamba / Gated DeltaNet states) are stored as ``groups.py`` says;
multimodal requests and layouts ``groups.py`` refuses pass through without storing or
loading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...chunks.registry import is_local, store_class
from . import events as kv_events
from . import metrics, tier_events
from .common import FP8_NAMES, Plan, log
from .context import build_context, spec_of
from .groups import SPEC_KINDS
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class HurrayConnectorMetadata(Plan, KVConnectorMetadata):
    """A step's ``Plan`` as the metadata vLLM hands from the scheduler to the workers."""


def hit_source(url: str) -> CacheHitSource:
    """Where vLLM says hits from store ``url`` came from: this process's memory
    (``mem://``) is the host's, a ``LOCAL`` store (``file://``) this host's disk, a
    server, Redis or S3 a remote store (vLLM's ``external_unspecified``)."""
    if url.startswith("mem:"):
        return CacheHitSource.HOST
    return CacheHitSource.DISK if is_local(url) else CacheHitSource.EXTERNAL_UNSPECIFIED


class HurrayConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.ctx = ctx = build_context(vllm_config, kv_cache_config, rank=rank)
        conf, cfg, chunk_size = ctx.config, self._kv_transfer_config, ctx.chunk_size
        # where vLLM says hits came from (vllm:prompt_tokens_cached_by_source): a LOCAL
        # store (file://) is this host's disk; a server or Redis is a remote store, which
        # vLLM's CacheHitSource names external_unspecified
        store = store_class(urlparse(conf.url).scheme)
        self._cache_hit_source = hit_source(conf.url)
        # with tiers, each tier's (get_external_cache_hit_sources)
        self._tier_sources = [hit_source(t.url) for t in conf.tiers or ()]
        tp = vllm_config.parallel_config.tensor_parallel_size
        # vLLM's /metrics: what changed since the last report (metrics.py)
        self._deltas = metrics.CounterDeltas(
            ctx.stats, chunk_size=chunk_size, rank=rank,
            extra=lambda: {"store_outages": sum(g.stats["outages"] for g in (
                ctx.lookups, ctx.loads, ctx.saves)), **metrics.tier_payload(ctx.tier_counts)})
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            ctx.lookups.warm()
            # KV events for routers (events.py): announced once every worker wrote a
            # segment; with tiers, in each tier that holds it (tier_events.py)
            wanted = getattr(vllm_config, "kv_events_config", None)
            per_tier = {"tiers": tier_events.tier_tags([t.url for t in conf.tiers])} \
                if conf.tiers else {}
            events = tier_events.TierKVEvents if conf.tiers else kv_events.HurrayKVEvents
            self.scheduler = SchedulerSide(ctx, events(
                ctx.block_size, chunk_size, **per_tier,
                hash_block_size=getattr(kv_cache_config, "hash_block_size", None),
                ranks=tp, locality=kv_events.locality_of(conf.url),
                enabled=bool(wanted and wanted.enable_kv_cache_events),
                group_idx=ctx.layout.ref if ctx.hybrid else 0,
                spec_kind=SPEC_KINDS[ctx.layout.groups[ctx.layout.ref].kind]
                if ctx.hybrid else None),
                new_plan=HurrayConnectorMetadata)
        else:
            for needed, guarded in ((ctx.can_load, ctx.loads), (ctx.can_save, ctx.saves)):
                if needed:
                    guarded.warm()
            kv_cache_dtype = vllm_config.cache_config.cache_dtype
            model_dtype = vllm_config.model_config.dtype
            self.worker = WorkerSide(
                ctx, spec=spec_of(kv_cache_config),
                context=vllm_config.compilation_config.static_forward_context,
                model_dtype=model_dtype, kv_cache_dtype=kv_cache_dtype,
                segment_dtype=FP8_NAMES.get(kv_cache_dtype) or str(model_dtype).removeprefix(
                    "torch."))
        log.info("HurrayConnector (%s side, %s) with chunks of %d tokens in %s; identity %s; "
                 "stored as %s (loads %s); deadlines: lookup %g ms, load %g ms, save %g ms",
                 role.name.lower(), cfg.kv_role, chunk_size, conf.url, ctx.identity,
                 conf.store_format().name, ", ".join(f.name for f in ctx.formats.values()),
                 conf.lookup_timeout_ms, conf.load_timeout_ms, conf.save_timeout_ms)
        if ctx.disabled:
            log.warning("HurrayConnector passes requests through: %s", ctx.disabled)
        elif ctx.hybrid and conf.load_mode == "sync":
            log.warning("HurrayConnector: load_mode is 'sync', but a hybrid model's loads are "
                        "asynchronous: vLLM takes no block-level load failure from a model "
                        "with several KV cache groups")
        capacity = store.CAPACITY if store is not None else None  # an option of its own
        if capacity and conf.store_options.get(capacity) is None and ctx.can_save:
            log.warning("HurrayConnector: %s has no capacity and grows without bound; set "
                        "kv_connector_extra_config %s (e.g. \"64G\") to evict the "
                        "least recently used segments", conf.url, capacity)
        if role == KVConnectorRole.SCHEDULER and cfg.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy is %r: a damaged stored chunk fails its request"
                        " instead of being recomputed; set it to 'recompute'",
                        cfg.kv_load_failure_policy)

    # What tests and operators read: the shared state, by its old names.
    stats = property(lambda self: self.ctx.stats)
    identity = property(lambda self: self.ctx.identity)
    seed = property(lambda self: self.ctx.seed)
    disabled = property(lambda self: self.ctx.disabled)
    lookups = property(lambda self: self.ctx.lookups)
    loads = property(lambda self: self.ctx.loads)
    saves = property(lambda self: self.ctx.saves)

    # ------------------------------------------------------------------ scheduler side
    # vLLM calls these on its scheduler thread: whatever goes wrong in them (a bug of ours,
    # a store answering nonsense) is a miss or a request not stored, never an exception.
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._safely("get_num_new_matched_tokens", (0, False),
                            self.scheduler.matched, request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        """vLLM's hits by source (``vllm:prompt_tokens_cached_by_source``): with tiers,
        each chunk's tier's (``hit_source``); one store: its own."""
        if not self._tier_sources or num_external_tokens <= 0:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        by_tier = self._safely("get_external_cache_hit_sources",
                               {None: num_external_tokens}, self.scheduler.hit_tiers,
                               request, num_external_tokens)
        out: dict[CacheHitSource, int] = {}
        for tier, n in by_tier.items():
            source = CacheHitSource.EXTERNAL_UNSPECIFIED if tier is None or not \
                0 <= tier < len(self._tier_sources) else self._tier_sources[tier]
            out[source] = out.get(source, 0) + n
        return out

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._safely("update_state_after_alloc", None, self.scheduler.after_alloc, request,
                     blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._safely("build_connector_meta", None, self.scheduler.plan,
                            scheduler_output)
        return meta if meta is not None else self.scheduler.failed_plan(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._safely("update_connector_output", None, self.scheduler.output,
                     connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.finished(request)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call when its hybrid KV cache manager is on (every model then): nothing
        is sent from the blocks after the request ends, so they are freed at once."""
        self.scheduler.finished(request)
        return False, None

    def take_events(self) -> Any:  # what vLLM publishes to routers
        return self._safely("take_events", [], self.scheduler.take_events)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: this engine's identity
        cleared from the store (``retention.py``); False when it could not be."""
        return bool(self._safely("reset_cache", False, self.scheduler.reset))

    def _safely(self, hook: str, default: Any, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            stats = self.ctx.stats
            stats.add(hook_errors=1)
            if stats.hook_errors == 1 or stats.hook_errors % 1000 == 0:
                log.warning("%s failed (%s: %s; %d so far): computing instead", hook,
                            type(e).__name__, e, stats.hook_errors)
            return default

    # ------------------------------------------------------------------ worker side
    def _plan(self) -> Plan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, HurrayConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, self._plan())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        """Requests whose asynchronous load is over (loaded, failed or cancelled); their
        failed blocks come from ``get_block_ids_with_load_errors`` in the same step
        (``WorkerSide.get_finished``: vLLM's order, sending then receiving)."""
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``, plus the loads that failed as a whole (``failed_recving``:
        vLLM recomputes those requests from their first token)."""
        done, failed = self.worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def get_kv_connector_kv_cache_events(self) -> Any:  # segments written
        return self.worker.saved.take()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every segment handed to the writer is stored or dropped."""
        if self.worker is not None:
            self.worker.drain(timeout)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.close()
        # a lookup or fetch still running no longer matters: not waited for; a write is
        # (the writer was drained up to save_timeout_ms)
        self.ctx.lookups.close(wait=0)
        self.ctx.loads.close(wait=0)
        self.ctx.saves.close()

    # -------------------------------------------------- metrics (both sides)
    def get_kv_connector_stats(self) -> Any:
        return self._deltas.take()  # None when nothing changed

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return metrics.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        return metrics.build_prom_metrics(vllm_config, metric_types, labelnames,
                                          per_engine_labelvalues)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised: a single worker
        return 0


__all__ = ["HurrayConnector", "HurrayConnectorMetadata"]
