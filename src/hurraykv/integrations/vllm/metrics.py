"""``HurrayConnector``'s counters through vLLM's own connector-stats interface.

vLLM (0.32) moves a connector's statistics like this:

* worker side: after every forward pass the model runner calls
  ``connector.get_kv_connector_stats()`` and puts the object in ``KVConnectorOutput``
  (``vllm/v1/worker/kv_connector_model_runner_mixin.py:102``,
  ``vllm/v1/worker/gpu/kv_connector.py:145``); with several workers the executor sums them
  with ``aggregate`` (``vllm/distributed/kv_transfer/kv_connector/utils.py:132-141``);
* scheduler side: ``Scheduler.update_from_output`` calls the scheduler connector's
  ``get_kv_connector_stats()`` too and aggregates it into the workers' object
  (``vllm/v1/core/sched/scheduler.py:2337-2351``), then ships ``to_dict()`` in
  ``SchedulerStats.kv_connector_stats`` (``scheduler.py:2937-2955``) to the front end;
* front end: ``KVConnectorLogging.observe`` rebuilds the object with the connector
  class's ``build_kv_connector_stats(data)`` and logs ``reduce()``
  (``kv_connector/v1/metrics.py:62-103``, ``v1/metrics/loggers.py:239``), and
  ``KVConnectorProm`` asks ``build_prom_metrics`` for a ``KVConnectorPromMetrics``
  whose ``observe(data, engine_idx)`` feeds Prometheus (``metrics.py:130-172``,
  ``loggers.py:1197-1200``) -- what ``vllm serve`` shows on ``/metrics``.

So the payload is a flat ``{name: number}`` dict of *deltas since the last report*
(msgspec-serialisable, summed by ``aggregate``).  ``CounterDeltas`` turns the connector's
cumulative ``self.stats`` dict into such deltas, so the connector keeps counting as it
does.  Metric names follow the connector-prefixed convention of vLLM's own connectors
(``vllm:nixl_*``, ``vllm:kv_offload_*``): ``vllm:hurraykv_*``; Prometheus' client adds
``_total`` to counters.

This module imports vLLM (its ``KVConnectorStats`` base lives in a module that imports
``vllm.config``, hence torch): it is for the engine's processes, like ``vllm.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

# name in the stats payload -> (Prometheus name, help text).  All are counters (sums of
# per-interval deltas).  Payload names are the connector's own ``self.stats`` keys;
# store_outages comes from its guards, tokens_saved is derived by CounterDeltas.  Each
# counts what its name says in the unit it names (issue 29: chunk counters went up once
# per segment, stored bytes counted dropped saves, hits counted failed loads).
METRICS: dict[str, tuple[str, str]] = {
    # scheduler side: lookups (get_num_new_matched_tokens)
    "lookups": ("vllm:hurraykv_lookups",
                "Prompts looked up in the hurraykv store."),
    "lookup_hits": ("vllm:hurraykv_lookup_hits",
                    "Lookups that found stored tokens beyond vLLM's own prefix cache."),
    "lookup_misses": ("vllm:hurraykv_lookup_misses",
                      "Lookups that found nothing to load."),
    "lookup_seconds": ("vllm:hurraykv_lookup_seconds",
                       "Seconds from asking the store about waiting prompts to its answer "
                       "(on the lookup thread: the requests looked up wait, no other)."),
    "lookups_missed": ("vllm:hurraykv_lookup_errors",
                       "Lookups not answered (store down, late or failing): counted as misses."),
    "tokens_hit": ("vllm:hurraykv_hit_tokens",
                   "Prompt tokens loaded from the store into the engine's cache, beyond "
                   "vLLM's own prefix cache (loads that failed are not counted)."),
    "tokens_failed": ("vllm:hurraykv_failed_tokens",
                      "Prompt tokens vLLM took from the store (its cached_tokens count them) "
                      "whose load failed: recomputed."),
    "store_outages": ("vllm:hurraykv_store_outages",
                      "Times a store connection was declared down by the circuit breaker."),
    "hook_errors": ("vllm:hurraykv_hook_errors",
                    "Connector hooks that raised and were answered with the safe default."),
    # worker side: loads
    "loads_async": ("vllm:hurraykv_loads_async",
                    "Requests whose hit was loaded across steps (WAITING_FOR_REMOTE_KVS)."),
    "loads_sync": ("vllm:hurraykv_loads_sync",
                   "Requests whose hit was loaded before the forward pass of their step."),
    "loads_cancelled": ("vllm:hurraykv_loads_cancelled",
                        "Asynchronous loads of requests that finished (were aborted) "
                        "before their load: nothing written into their blocks after."),
    "chunks_loaded": ("vllm:hurraykv_loaded_chunks",
                      "Chunks loaded from the store into the engine's cache (not failed)."),
    "tokens_loaded": ("vllm:hurraykv_loaded_tokens",
                      "Tokens loaded from the store into the engine's cache (not failed)."),
    "segments_loaded": ("vllm:hurraykv_loaded_segments",
                        "Segments some chunks of which were loaded into the engine's cache."),
    "bytes_loaded": ("vllm:hurraykv_loaded_bytes",
                     "Bytes of KV pages written into the engine's cache from the store."),
    "bytes_loaded_direct": ("vllm:hurraykv_loaded_direct_bytes",
                            "Of the bytes loaded, those read from a segment file straight "
                            "into the engine's blocks and verified there (one pass)."),
    "load_seconds": ("vllm:hurraykv_load_seconds",
                     "Seconds spent fetching and writing loaded KV (all workers)."),
    "chunks_failed": ("vllm:hurraykv_failed_chunks",
                      "Chunks whose load failed (recomputed instead), each chunk once."),
    "chunks_corrupt": ("vllm:hurraykv_corrupt_chunks",
                       "Of the failed chunks, those held by a segment that failed its "
                       "checksum or did not parse (cut short, mangled)."),
    # worker side: saves
    "chunks_saved": ("vllm:hurraykv_stored_chunks", "Chunks written to the store."),
    "tokens_saved": ("vllm:hurraykv_stored_tokens", "Tokens written to the store."),
    "segments_saved": ("vllm:hurraykv_stored_segments", "Segments written to the store."),
    "bytes_saved": ("vllm:hurraykv_stored_bytes",
                    "Bytes of KV pages (as stored: quantized where store_dtype says) of the "
                    "segments written to the store; dropped saves are not counted."),
    "save_seconds": ("vllm:hurraykv_save_seconds",
                     "Seconds the forward pass spent copying KV out for the store."),
    "write_seconds": ("vllm:hurraykv_write_seconds",
                      "Seconds the writer thread spent writing segments to the store."),
    "saves_present": ("vllm:hurraykv_present_saves",
                      "Segments not written because the store already held their chunks "
                      "(another request or engine stored them)."),
    "saves_attempted": ("vllm:hurraykv_attempted_saves",
                        "Segments the connector set out to store; each is stored, present, "
                        "dropped, deduplicated or pending: attempted = stored_segments + "
                        "present_saves + dropped_saves + deduplicated_saves + pending_saves "
                        "at every scrape."),
    "saves_deduplicated": ("vllm:hurraykv_deduplicated_saves",
                           "Runs of computed chunks not copied out because another request "
                           "of this engine was storing them (a burst sharing a prefix)."),
    "saves_pending": ("vllm:hurraykv_pending_saves",
                      "Segments taken to be stored and not yet stored, present or dropped "
                      "(a gauge: waiting for or in the writer)."),
    "chunks_unadmitted": ("vllm:hurraykv_unadmitted_chunks",
                          "Computed chunks not stored because they were computed fewer "
                          "times than store_threshold."),
    "saves_dropped": ("vllm:hurraykv_dropped_saves",
                      "Segments not stored (writer full, store down or failing)."),
    "evictions": ("vllm:hurraykv_evictions",
                  "Segments this engine evicted to stay within max_bytes."),
    "segments_retained": ("vllm:hurraykv_retained_segments",
                          "Segments pinned or given a lifetime as a request's "
                          "kv_transfer_params asked (stored or found by it)."),
    "pins_refused": ("vllm:hurraykv_refused_pins",
                     "Segments a request asked pinned that max_pinned_bytes could not hold "
                     "(stored unpinned)."),
    "retention_refused": ("vllm:hurraykv_refused_retention",
                          "Requests whose kv_transfer_params['hurraykv'] was malformed "
                          "(run without retention; the log names the field)."),
    "segments_cleared": ("vllm:hurraykv_cleared_segments",
                         "Segments of this engine's identity removed from the store by "
                         "reset_cache (vLLM's reset_prefix_cache with reset_connector)."),
}

# with tiers: what each tier counted (chunks/stack.py COUNTS), one counter family per
# kind labelled ``tier`` with the tier's URL; in the payload as ``tier_KIND.INDEX``
TIER_METRICS: dict[str, tuple[str, str]] = {
    "hits": ("vllm:hurraykv_tier_hits", "Segments a tier served (a lookup's tier first)."),
    "loaded_bytes": ("vllm:hurraykv_tier_loaded_bytes", "Bytes of the segments a tier served."),
    "stored_bytes": ("vllm:hurraykv_tier_stored_bytes",
                     "Bytes of the segments written into a tier (saves, write-through, "
                     "write-back and promotions)."),
    "promotions": ("vllm:hurraykv_tier_promotions",
                   "Segments a lower tier served, copied into this tier."),
    "promotions_skipped": ("vllm:hurraykv_tier_skipped_promotions",
                           "Promotions into this tier skipped: the stack's queue was full."),
    "promotions_refused": ("vllm:hurraykv_tier_refused_promotions",
                           "Promotions this tier refused (no room: its pins fill it) or "
                           "failed."),
    "writes": ("vllm:hurraykv_tier_writes", "Segments written into this tier."),
    "writes_dropped": ("vllm:hurraykv_tier_dropped_writes",
                       "Writes into this tier dropped: the stack's queue was full."),
    "writes_failed": ("vllm:hurraykv_tier_failed_writes",
                      "Writes into this tier that it refused or failed."),
    "outages": ("vllm:hurraykv_tier_outages",
                "Calls this tier failed or answered past its deadline (the others served)."),
    "unadmitted": ("vllm:hurraykv_tier_unadmitted_chunks",
                   "Computed chunks this tier did not store: computed fewer times than its "
                   "store_threshold."),
}


def tier_payload(counts: Mapping[str, list[int]] | None) -> dict[str, int]:
    """The tiers' cumulative counters as payload names (``tier_hits.0``)."""
    return {f"tier_{kind}.{i}": n for kind, per in (counts or {}).items()
            for i, n in enumerate(per)}


# payload names whose values go up and down (sums of deltas all the same): gauges
GAUGES = frozenset({"saves_pending"})

# keys counted once per chunk (not per byte or second): with tensor parallelism every
# rank handles the same chunks, so only rank 0 reports them (see ``CounterDeltas``)
PER_CHUNK = frozenset({"chunks_loaded", "tokens_loaded", "segments_loaded", "chunks_saved",
                       "tokens_saved", "segments_saved", "loads_async", "loads_sync",
                       "loads_cancelled", "saves_present", "saves_attempted",
                       "saves_pending", "saves_deduplicated"})


@dataclass
class HurrayConnectorStats(KVConnectorStats):
    """Counters since the last report, ``data = {name: int | float}``; ``aggregate``
    sums (workers with each other, the scheduler's with the workers'), ``reduce`` gives
    the sums plus derived rates for vLLM's periodic log line.  Unknown names are summed
    and logged too (the connector may grow counters before ``METRICS`` lists them); only
    ``METRICS`` reach Prometheus."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> HurrayConnectorStats:
        if other is None or other.is_empty():
            return self
        for k, v in other.data.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in sorted(self.data.items()) if v}
        lookups = self.data.get("lookups", 0)
        if lookups:
            out["lookup_hit_rate"] = round(self.data.get("lookup_hits", 0) / lookups, 4)
        for way in ("loaded", "saved"):
            seconds = self.data.get("load_seconds" if way == "loaded" else "write_seconds", 0)
            nbytes = self.data.get(f"bytes_{way}", 0)
            if seconds and nbytes:
                out[f"{way}_MB_per_s"] = round(nbytes / seconds / 1e6, 1)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterDeltas:
    """Turns cumulative counters (the connector's ``self.stats`` dict, plus any extra
    sources) into the ``HurrayConnectorStats`` of what changed since the last call.

    ``take()`` is what ``get_kv_connector_stats`` returns: ``None`` when nothing changed
    (vLLM then sends nothing).  ``extra`` is a callable returning more cumulative
    counters (e.g. the store outages summed over the connector's ``Guarded`` objects).
    ``chunk_size`` derives ``tokens_loaded``/``tokens_saved`` from the chunk counts.
    ``rank`` > 0 (a tensor-parallel worker other than the first) leaves out the
    ``PER_CHUNK`` counts, which rank 0 already reports for the same chunks.  ``lock``
    is held while reading (the writer thread updates some counters)."""

    def __init__(self, counters: Mapping[str, int | float], *, chunk_size: int = 0,
                 rank: int = 0, lock: Any = None,
                 extra: Callable[[], Mapping[str, int | float]] | None = None) -> None:
        self._counters, self._chunk_size, self._rank = counters, chunk_size, rank
        self._lock = lock if lock is not None else threading.Lock()
        self._extra = extra
        self._last: dict[str, int | float] = {}

    def _now(self) -> dict[str, int | float]:
        with self._lock:
            now = {k: v for k, v in self._counters.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        if self._extra is not None:
            for k, v in self._extra().items():
                now[k] = now.get(k, 0) + v
        if self._chunk_size:
            for way in ("loaded", "saved"):
                if f"chunks_{way}" in now:
                    now.setdefault(f"tokens_{way}", now[f"chunks_{way}"] * self._chunk_size)
        if self._rank:
            now = {k: v for k, v in now.items() if k not in PER_CHUNK}
        return now

    def take(self) -> HurrayConnectorStats | None:
        now = self._now()
        delta = {k: v - self._last.get(k, 0) for k, v in now.items()
                 if v != self._last.get(k, 0)}
        self._last = now
        return HurrayConnectorStats(data=delta) if delta else None


class HurrayPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per ``METRICS`` entry (a gauge for ``GAUGES``, set to the
    sum of its deltas: Ray's gauge has ``set`` only), labelled like vLLM's own metrics
    (``model_name``, ``engine``), created through the metric classes vLLM passes in (so
    the Ray wrappers work too: ``vllm/v1/metrics/ray_wrappers.py:178``)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        self.levels: dict[tuple[str, int], float] = {}  # a gauge's value, per engine
        for key, (name, doc) in METRICS.items():
            family = self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                     multiprocess_mode="mostrecent") if key in GAUGES \
                else self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self.counters[key] = {idx: family.labels(*values)
                                  for idx, values in per_engine_labelvalues.items()}

        # with tiers: one family per kind, labelled with each tier's URL
        extra = getattr(getattr(vllm_config, "kv_transfer_config", None),
                        "kv_connector_extra_config", None) or {}
        urls = [t.get("url") for t in extra.get("tiers") or () if isinstance(t, Mapping)]
        for kind, (name, doc) in TIER_METRICS.items() if urls else ():
            family = self._counter_cls(name=name, documentation=doc,
                                       labelnames=[*labelnames, "tier"])
            for i, url in enumerate(urls):
                self.counters[f"tier_{kind}.{i}"] = {
                    idx: family.labels(*values, str(url))
                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self.counters.get(key)
            if per_engine is None or not isinstance(value, int | float) or not value:
                continue
            metric = per_engine.get(engine_idx)
            if metric is None:
                continue
            if key in GAUGES:
                level = self.levels[key, engine_idx] = self.levels.get(
                    (key, engine_idx), 0) + value
                metric.set(level)
            elif value > 0:  # Prometheus counters only go up
                metric.inc(value)


def build_kv_connector_stats(data: dict[str, Any] | None = None) -> HurrayConnectorStats:
    """What ``HurrayConnector.build_kv_connector_stats`` (a classmethod) returns."""
    return HurrayConnectorStats(data=dict(data) if data is not None else {})


def build_prom_metrics(vllm_config: Any, metric_types: dict, labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> HurrayPromMetrics:
    """What ``HurrayConnector.build_prom_metrics`` (a classmethod) returns."""
    return HurrayPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = ["GAUGES", "METRICS", "PER_CHUNK", "TIER_METRICS", "CounterDeltas",
           "HurrayConnectorStats", "HurrayPromMetrics", "build_kv_connector_stats",
           "build_prom_metrics", "tier_payload"]
