"""vLLM's configuration turned into the connector's ``Context``, once per connector.

No vLLM import: the configuration objects are read by their attributes (``vllm_config
.cache_config.block_size``, ``.parallel_config``, ``.model_config``, ``kv_cache_config
.kv_cache_groups``), so this is tested with plain objects of the same shape; the facade
(``connector.py``) hands it vLLM's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from ...chunks.guard import Guarded
from ...chunks.guarded_tier import GuardedTier
from ...chunks.keys import identity_digest
from ...chunks.stack import StackedChunks, tier_counts
from ...chunks.urls import open_store
from ...errors import HurrayError
from .common import Context, log
from .config import ConnectorConfig
from .groups import FULL, MAMBA, SLIDING, GroupLayout, layout_of
from .store_format import StoreFormat, check_cache_dtype
from .tier_events import TierReports


def build_context(vllm_config: Any, kv_cache_config: Any, *, rank: int = 0) -> Context:
    """The typed config, the cache identity, the three guarded store connections (opened
    lazily) and the counters of a connector of this engine; ``rank``: its
    tensor-parallel rank (0 on the scheduler side)."""
    cfg = vllm_config.kv_transfer_config
    conf = ConnectorConfig.from_extra(cfg.kv_connector_extra_config)
    block_size = vllm_config.cache_config.block_size
    chunk_size = conf.chunk_size or block_size
    if chunk_size % block_size:
        raise HurrayError(f"chunk_size {chunk_size} is not a positive multiple of "
                          f"the block size {block_size}", field="chunk_size",
                          value=chunk_size)
    layout = layout_for(vllm_config, kv_cache_config)
    if layout.mamba and not layout.unsupported and chunk_size != block_size:
        raise HurrayError(f"chunk_size {chunk_size}: a model with Mamba layers stores chunks "
                          f"of one block ({block_size} tokens here, vLLM's choice): their "
                          f"states exist where a step ended, on a block boundary",
                          field="chunk_size", value=chunk_size, rule="the block size")
    tp = vllm_config.parallel_config.tensor_parallel_size
    # Each tensor-parallel rank holds its own heads: it stores and loads its own
    # objects; the scheduler looks for rank 0's (every rank saves the same chunks).

    counts = tier_counts(len(conf.tiers)) if conf.tiers else None
    # the stacks' reports of each tier's writes and removals, for the KV events per tier:
    # none when vLLM publishes no events (nothing to carry to the scheduler each step)
    wanted = getattr(vllm_config, "kv_events_config", None)
    reports = TierReports() if conf.tiers and getattr(
        wanted, "enable_kv_cache_events", False) else None

    def open_one(ranked: bool = True) -> Any:
        """A new connection; ``ranked``: to this rank's objects, else to every rank's;
        with ``tiers``, a stack of one connection to each (``chunks/stack.py``)."""
        suffix = f".tp{rank}" if tp > 1 and ranked else ""
        timeout = conf.load_timeout_ms / 1000 + 5
        if conf.tiers:
            return open_stack(conf, suffix, timeout, counts, reports and reports.add)
        return open_store(conf.url, suffix=suffix, timeout=timeout, **conf.store_options)

    # Stores open lazily, each behind its own deadline and breaker (guard.py): an
    # unreachable store at start is a miss, not an engine that fails to start.
    guard = {"url": conf.url, "log": log, "failures": conf.failures_before_down,
             "max_backoff": conf.max_backoff_s}
    # The store format is part of the identity: an engine finds the chunks of its own
    # format and of those accept_store_dtypes lists, nothing else (store_format.py).
    formats = conf.accepted_formats()
    disabled = why_disabled(vllm_config, kv_cache_config, layout)
    for i, fmt in enumerate(formats):  # (a model passed through stores nothing to check)
        check_cache_dtype(fmt, vllm_config.cache_config.cache_dtype,
                          "store_dtype" if i == 0 else "accept_store_dtypes",
                          None if disabled else block_size)
    identities = {identity_of(vllm_config, kv_cache_config, conf, chunk_size, fmt, layout): fmt
                  for fmt in formats}
    identity = next(iter(identities))
    return Context(
        conf, block_size, chunk_size, identity, identity_digest(identity),
        can_load=cfg.is_kv_consumer, can_save=cfg.is_kv_producer,
        lookups=Guarded(open_one, what="lookup", timeout=conf.lookup_timeout_ms / 1000,
                        **guard),
        loads=Guarded(open_one, what="load", timeout=conf.load_timeout_ms / 1000, **guard),
        saves=Guarded(open_one, what="save", timeout=conf.save_timeout_ms / 1000, **guard),
        disabled=disabled, formats=identities, layout=layout, open=open_one,
        tier_counts=counts, tier_reports=reports)


def open_stack(conf: ConnectorConfig, suffix: str = "", timeout: float | None = None,
               counts: dict[str, list[int]] | None = None,
               report: Callable[[str, str, int], None] | None = None) -> StackedChunks:
    """A stack of ``conf.tiers``, each tier behind its own deadline and breaker
    (``chunks/guarded_tier.py``): a call asks the tiers in turn, so each gets a share of
    the connector's deadline (saves excepted: the first tier's is the save's);
    ``report``: told each tier's writes and removals (``chunks/stack.py``)."""
    share = len(conf.tiers or ()) + 1
    deadlines = {"lookup": conf.lookup_timeout_ms / 1000 / share,
                 "load": conf.load_timeout_ms / 1000 / share,
                 "save": conf.save_timeout_ms / 1000}
    return StackedChunks([GuardedTier(
        lambda t=t: open_store(t.url, suffix=suffix, timeout=timeout, **t.options),
        url=t.url, timeouts=deadlines, log=log, failures=conf.failures_before_down,
        max_backoff=conf.max_backoff_s) for t in conf.tiers or ()],
        write_policy=conf.write_policy, counts=counts, report=report)


def identity_of(vllm_config: Any, kv_cache_config: Any, conf: ConnectorConfig,
                chunk_size: int, fmt: StoreFormat, layout: GroupLayout | None = None) -> str:
    """What makes two engines' KV interchangeable, in every chunk key's seed: the cache
    and, unless ``auto``, the store format."""
    spec = spec_of(kv_cache_config)
    kv_cache_dtype = vllm_config.cache_config.cache_dtype
    cache_dtype = kv_cache_dtype if kv_cache_dtype != "auto" else str(
        vllm_config.model_config.dtype).removeprefix("torch.")
    model = vllm_config.model_config
    parts = {"model": conf.model_id or model.model,
             "cache_dtype": cache_dtype, "chunk_size": chunk_size,
             "tp_size": vllm_config.parallel_config.tensor_parallel_size}
    # other weights under one name compute other KV: a revision, quantized weights,
    # overridden config values (absent from the identity when unset, so keys of plain
    # engines do not change)
    for key, value in (("revision", getattr(model, "revision", None)),
                       ("weights", getattr(model, "quantization", None)),
                       ("hf_overrides", getattr(model, "hf_overrides", None))):
        if value and not callable(value):
            parts[key] = json.dumps(value, sort_keys=True, default=str) \
                if isinstance(value, dict) else value
    layout = layout or layout_for(vllm_config, kv_cache_config)
    if layout.groups and not layout.plain:  # which layer is of which kind is what KV means
        parts["groups"] = layout.identity(sorted_layers(layout))
    if spec is not None:
        parts |= {"layers": len(_group_of(kv_cache_config, spec).layer_names),
                  "kv_heads": getattr(spec, "num_kv_heads", None),
                  "head_size": getattr(spec, "head_size", None),
                  "head_size_v": getattr(spec, "head_size_v", None)}
    return ";".join(f"{k}={v}" for k, v in parts.items()) + fmt.identity_suffix()


def layout_for(vllm_config: Any, kv_cache_config: Any) -> GroupLayout:
    mode = getattr(getattr(vllm_config, "cache_config", None), "mamba_cache_mode", "none")
    return layout_of(kv_cache_config, mamba_cache_mode=mode or "none")


def sorted_layers(layout: GroupLayout) -> list[str]:
    """Every layer of every group in model order (``ordered_layers``' rule: the layer
    number in the name)."""
    names = [n for g in layout.groups for n in g.layers]
    numbers = [re.findall(r"\d+", n) for n in names]
    if all(numbers) and len({int(n[0]) for n in numbers}) == len(names):
        return sorted(names, key=lambda n: int(re.findall(r"\d+", n)[0]))
    return names


def spec_of(kv_cache_config: Any) -> Any:
    """The attention spec the pages of a segment follow: the only group's, or a hybrid
    model's first full-attention group's (its sliding-window groups have the same page
    shape, or the connector passes requests through)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) == 1:
        return groups[0].kv_cache_spec
    layout = layout_of(kv_cache_config)
    return groups[layout.ref].kv_cache_spec if any(g.kind in (FULL, SLIDING)
                                                    for g in layout.groups) else None


def _group_of(kv_cache_config: Any, spec: Any) -> Any:
    groups = kv_cache_config.kv_cache_groups
    return next(g for g in groups if g.kv_cache_spec is spec)


def why_disabled(vllm_config: Any, kv_cache_config: Any, layout: GroupLayout | None = None
                 ) -> str:
    layout = layout or layout_for(vllm_config, kv_cache_config)
    if layout.unsupported:
        n = len(layout.groups)
        return f"{n} KV cache group{'s' if n != 1 else ''}: {layout.unsupported}"
    pages = [g for g in layout.groups if g.kind != MAMBA]
    specs = [kv_cache_config.kv_cache_groups[g.index].kv_cache_spec for g in pages]
    if len({(getattr(s, "num_kv_heads", None), getattr(s, "head_size", None),
             str(getattr(s, "dtype", None))) for s in specs}) > 1:
        return "attention groups of different page shapes (heads, head size, dtype): " \
            "not supported"
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallelism (each stage holds other layers): not supported"
    return ""


__all__ = ["build_context", "identity_of", "layout_for", "sorted_layers", "spec_of",
           "why_disabled"]
