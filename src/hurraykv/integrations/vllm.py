"""``HurrayConnector``: vLLM stores and loads KV through hurraykv.

Selected with::

    kv_transfer_config = {"kv_connector": "HurrayConnector",
                          "kv_connector_module_path": "hurraykv.integrations.vllm",
                          "kv_role": "kv_both",            # or kv_producer / kv_consumer
                          "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": {"url": "file:///var/cache/kv"}}

``url``: ``file:///DIR``, ``hurray://HOST:PORT`` or ``redis[+cluster]://HOST:PORT`` (see
``chunks.py``); every other key, its type and default: ``vllm_config.ConnectorConfig``
(unknown keys are refused).  Every store call runs behind a deadline and a circuit
breaker (``guard.py``), and every exception is caught at this class's boundary: a store
that is down, hung or full is a miss or a recompute, never an engine that dies or waits.

Scheduler side: ``get_num_new_matched_tokens`` finds the longest run of stored chunks
at the start of the prompt (one existence query), ``build_connector_meta`` tells the
workers which chunks to load into which blocks and which newly computed chunks to store.
Worker side: ``start_load_kv`` fetches the chunks, ``wait_for_layer_load`` writes each
layer's pages into the blocks vLLM allocated (in place, through ``adapters.vllm``),
``save_kv_layer`` copies each layer's newly computed blocks out as the forward pass goes,
and ``wait_for_save`` hands the finished segments to one writer thread (so the engine's
blocks are free to reuse when it returns, and the store's latency stays off the next
forward pass; ``shutdown`` and ``drain`` wait for the writes, in order).  A chunk that is
missing, truncated or does not parse is never written into the cache: its blocks (and the
blocks after them) are reported by ``get_block_ids_with_load_errors`` so vLLM recomputes
them, and one line is logged.  Multimodal requests and hybrid (several KV cache groups)
models are passed through without storing or loading.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from .. import threads
from ..adapters.vllm import LayerView, backend_kind, cpu_isa, ordered_layers, pages_to_numpy
from ..errors import HurrayError, TransportError
from ..io import checksums
from ..io.checksums import ChecksumError
from ..snapshot import KVCacheSnapshot
from . import vllm_events, vllm_metrics
from .chunks import ChunkKeys, identity_digest, open_store, segment_first
from .guard import Guarded
from .request_keys import passed_through, request_seed
from .vllm_config import ConnectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

FP8_NAMES = {"fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3", "fp8_e5m2": "float8_e5m2"}
# Under vLLM's "vllm" logger, so its handler and format apply (level, time, process,
# file:line): our lines line up with the engine's, and its VLLM_LOGGING_LEVEL governs them.
log = init_logger("vllm.hurraykv")


@dataclass
class Transfer:
    """Chunks of one request and the engine blocks that hold their pages.

    A save is one segment: chunks ``keys`` from index ``first_chunk`` on, chunk ``i`` in
    engine blocks ``blocks[i]``.  A load reads chunk ``i``'s pages from segment
    ``names[i]`` starting at its page ``pages[i]`` into ``blocks[i]``."""

    req_id: str
    first_chunk: int = 0
    keys: list[str] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)


@dataclass
class HurrayConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # blocks to report as load errors


@dataclass
class _Request:
    request: Any
    keys: ChunkKeys
    local: int = 0  # tokens vLLM had cached itself when matching
    matched: int = 0  # tokens the store holds for this prompt
    load: int = 0  # tokens to load (0: none)
    located: list[str] = field(default_factory=list)  # segment of each matched chunk
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    stored: int = 0  # chunks known to be in the store
    rewrite: bool = False  # a load from the store failed: store again, present or not


class HurrayConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.config = conf = ConnectorConfig.from_extra(cfg.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_size = conf.chunk_size or self.block_size
        if self.chunk_size % self.block_size:
            raise HurrayError(f"chunk_size {self.chunk_size} is not a positive multiple of "
                              f"the block size {self.block_size}", field="chunk_size",
                              value=self.chunk_size)
        self.save_decode = conf.save_decode
        self.kv_cache_dtype = vllm_config.cache_config.cache_dtype
        self.model_dtype = vllm_config.model_config.dtype
        # the element type of the segments this engine writes, and the only one it loads
        self._segment_dtype = FP8_NAMES.get(self.kv_cache_dtype) or str(
            self.model_dtype).removeprefix("torch.")
        self.can_save = cfg.is_kv_producer
        self.can_load = cfg.is_kv_consumer
        tp = vllm_config.parallel_config.tensor_parallel_size
        # Each tensor-parallel rank holds its own heads: it stores and loads its own
        # objects; the scheduler looks for rank 0's (every rank saves the same chunks).
        rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        tls = {k: getattr(conf, k) for k in ("tls_cert", "tls_key", "tls_ca",
                                             "server_hostname") if getattr(conf, k)}
        self.url = conf.url
        self._open_store = lambda: open_store(conf.url, suffix=f".tp{rank}" if tp > 1 else "",
                                              timeout=conf.load_timeout_ms / 1000 + 5,
                                              max_bytes=conf.max_bytes, **tls)
        # Stores open lazily, each behind its own deadline and breaker (guard.py): an
        # unreachable store at start is a miss, not an engine that fails to start.
        guard = {"url": conf.url, "log": log, "failures": conf.failures_before_down,
                 "max_backoff": conf.max_backoff_s}
        self.lookups = Guarded(self._open_store, what="lookup",
                               timeout=conf.lookup_timeout_ms / 1000, **guard)
        self.loads = Guarded(self._open_store, what="load",
                             timeout=conf.load_timeout_ms / 1000, **guard)
        self.saves = Guarded(self._open_store, what="save",
                             timeout=conf.save_timeout_ms / 1000, **guard)
        if role == KVConnectorRole.SCHEDULER:
            self.lookups.warm()
        else:
            for needed, guarded in ((self.can_load, self.loads), (self.can_save, self.saves)):
                if needed:
                    guarded.warm()
        self.async_save = conf.async_save
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._dropped_since = 0  # segments the writer had no room for since it last stored
        self._stats_lock = threading.Lock()
        self.identity = self._identity(vllm_config, kv_cache_config, conf)
        self.seed = identity_digest(self.identity)
        self.disabled = self._why_disabled(kv_cache_config)
        log.info("HurrayConnector (%s side, %s) with chunks of %d tokens in %s; identity %s; "
                 "deadlines: lookup %g ms, load %g ms, save %g ms", role.name.lower(),
                 cfg.kv_role, self.chunk_size, conf.url, self.identity,
                 conf.lookup_timeout_ms, conf.load_timeout_ms, conf.save_timeout_ms)
        if self.disabled:
            log.warning("HurrayConnector passes requests through: %s", self.disabled)
        if conf.url.startswith("file:") and conf.max_bytes is None and self.can_save:
            log.warning("HurrayConnector: %s has no capacity and grows without bound; set "
                        "kv_connector_extra_config max_bytes (e.g. \"64G\") to evict the "
                        "least recently used segments", conf.url)
        if role == KVConnectorRole.SCHEDULER and cfg.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy is %r: a damaged stored chunk fails its request"
                        " instead of being recomputed; set it to 'recompute'",
                        cfg.kv_load_failure_policy)
        self._requests: dict[str, _Request] = {}
        # worker state
        self._layers: list[tuple[str, LayerView]] = []
        self._index: dict[str, int] = {}
        self._scales: list[tuple[float, float]] | None = None
        self._fetched: list[tuple[list[int], KVCacheSnapshot, int]] = []
        self._written: set[str] = set()
        self._staged: dict[int, list[list[np.ndarray]]] = {}
        self._templates: dict[int, KVCacheSnapshot] = {}  # segment snapshots by page count
        self._failed: set[int] = set()
        self.stats = {"chunks_loaded": 0, "chunks_saved": 0, "chunks_failed": 0,
                      "lookups_missed": 0, "saves_dropped": 0, "hook_errors": 0,
                      "chunks_corrupt": 0, "verify_seconds": 0.0, "evictions": 0,
                      "segments_loaded": 0, "segments_saved": 0, "layers_written": 0,
                      "bytes_loaded": 0, "bytes_saved": 0, "save_seconds": 0.0,
                      "load_seconds": 0.0, "fetch_seconds": 0.0, "write_seconds": 0.0,
                      "lookups": 0, "lookup_hits": 0, "lookup_misses": 0, "tokens_hit": 0}
        # vLLM's /metrics: what changed since the last report (vllm_metrics.py)
        self._deltas = vllm_metrics.CounterDeltas(
            self.stats, chunk_size=self.chunk_size, rank=rank, lock=self._stats_lock,
            extra=lambda: {"store_outages": sum(g.stats["outages"] for g in (
                self.lookups, self.loads, self.saves))})
        # KV events for routers (vllm_events.py): announced by the scheduler once every
        # worker has written the segment
        events = getattr(vllm_config, "kv_events_config", None)
        self.events = vllm_events.HurrayKVEvents(
            self.block_size, self.chunk_size,
            hash_block_size=getattr(kv_cache_config, "hash_block_size", None),
            ranks=tp, locality=vllm_events.locality_of(conf.url),
            enabled=bool(events and events.enable_kv_cache_events)
            and role == KVConnectorRole.SCHEDULER)
        self._saved = vllm_events.WorkerSegments()

    # ------------------------------------------------------------------ identity
    def _identity(self, vllm_config: Any, kv_cache_config: Any, conf: ConnectorConfig) -> str:
        spec = self._spec(kv_cache_config)
        parallel = vllm_config.parallel_config
        cache_dtype = self.kv_cache_dtype if self.kv_cache_dtype != "auto" else str(
            self.model_dtype).removeprefix("torch.")
        parts = {"model": conf.model_id or vllm_config.model_config.model,
                 "cache_dtype": cache_dtype, "chunk_size": self.chunk_size,
                 "tp_size": parallel.tensor_parallel_size}
        if spec is not None:
            parts |= {"layers": len(kv_cache_config.kv_cache_groups[0].layer_names),
                      "kv_heads": getattr(spec, "num_kv_heads", None),
                      "head_size": getattr(spec, "head_size", None),
                      "head_size_v": getattr(spec, "head_size_v", None)}
        return ";".join(f"{k}={v}" for k, v in parts.items())

    @staticmethod
    def _spec(kv_cache_config: Any) -> Any:
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        return groups[0].kv_cache_spec if len(groups) == 1 else None

    def _why_disabled(self, kv_cache_config: Any) -> str:
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) != 1:
            return f"{len(groups)} KV cache groups (hybrid model): not supported"
        if self._vllm_config.parallel_config.pipeline_parallel_size > 1:
            return "pipeline parallelism (each stage holds other layers): not supported"
        return ""

    # ------------------------------------------------------------------ scheduler side
    def _state(self, request: Request) -> _Request:
        st = self._requests.get(request.request_id)
        if st is None:
            keys = ChunkKeys(request_seed(self.seed, request), self.chunk_size)
            st = _Request(request, keys)
            self._requests[request.request_id] = st
        return st

    # vLLM calls these on its scheduler thread: whatever goes wrong in them (a bug of ours,
    # a store answering nonsense) is a miss or a request not stored, never an exception.
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._safely("get_num_new_matched_tokens", (0, False),
                            self._matched, request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._safely("update_state_after_alloc", None, self._after_alloc, request,
                     num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._safely("build_connector_meta", None, self._build_meta, scheduler_output)
        if meta is None:  # nothing stored this step, and what vLLM expects us to load is
            meta = HurrayConnectorMetadata()  # reported failed by the worker: recomputed
            for new in getattr(scheduler_output, "scheduled_new_reqs", None) or []:
                st = self._requests.get(new.req_id)
                if st is not None and st.load > 0 and new.block_ids:
                    meta.failed += list(new.block_ids[0])[st.local // self.block_size:]
                    st.load = 0
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._safely("update_connector_output", None, self._output, connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(getattr(request, "request_id", None), None)
        return False, None

    # -------------------------------------------------- metrics and events (both sides)
    def get_kv_connector_stats(self) -> Any:
        return self._deltas.take()  # None when nothing changed

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return vllm_metrics.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        return vllm_metrics.build_prom_metrics(vllm_config, metric_types, labelnames,
                                               per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self) -> Any:  # worker: segments written
        return self._saved.take()

    def take_events(self) -> Any:  # scheduler: what vLLM publishes to routers
        return self.events.take_events()

    def _safely(self, hook: str, default: Any, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            self.stats["hook_errors"] += 1
            if self.stats["hook_errors"] == 1 or self.stats["hook_errors"] % 1000 == 0:
                log.warning("%s failed (%s: %s; %d so far): computing instead", hook,
                            type(e).__name__, e, self.stats["hook_errors"])
            return default

    def _matched(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        st.local = num_computed_tokens
        if not self.can_load or self.disabled or passed_through(request):
            return 0, False
        prompt = request.prompt_token_ids or []
        chunks = (len(prompt) - 1) // self.chunk_size  # the last token is always computed
        keys = st.keys.upto(prompt, chunks)
        self.stats["lookups"] += 1
        located = self.lookups.call("locate", lambda store: store.locate(keys), None)
        if located is None:  # store down, late or failing: a miss (guard.py logs it)
            self.stats["lookups_missed"] += 1
            return 0, False
        # a chunk counts only behind a well-formed name whose first chunk is not after it
        found = next((i for i, name in enumerate(located) if not _holds(name, i)),
                     len(located))
        st.located = [str(name) for name in located[:found]]
        st.matched = found * self.chunk_size
        st.stored = max(st.stored, found)
        new = max(0, st.matched - num_computed_tokens)
        self.stats["lookup_hits" if new else "lookup_misses"] += 1
        self.stats["tokens_hit"] += new
        return new, False

    def _after_alloc(self, request: Request, num_external_tokens: int) -> None:
        st = self._state(request)
        st.load = num_external_tokens

    def _build_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HurrayConnectorMetadata()
        scheduled: list[_Request] = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self._requests.get(new.req_id)
            if st is None:
                continue
            st.blocks = list(new.block_ids[0]) if new.block_ids else []
            st.computed = new.num_computed_tokens
            if st.load > 0:
                meta.loads.append(self._transfer(st, st.local, st.local + st.load))
                st.load = 0
            scheduled.append(st)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._requests.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.blocks = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                st.blocks.extend(new_blocks[0])
            st.computed = cached.num_computed_tokens[i]
            scheduled.append(st)
        if self.can_save and not self.disabled:
            for st in scheduled:
                meta.saves += self._saves(st, scheduler_output.num_scheduled_tokens.get(
                    st.request.request_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        return meta

    def _transfer(self, st: _Request, start: int, end: int) -> Transfer:
        """The chunks covering tokens ``[start, end)`` (whole blocks) and their blocks."""
        out = Transfer(st.request.request_id)
        per = self.chunk_size // self.block_size
        first_block, last_block = start // self.block_size, end // self.block_size
        for c in range(first_block // per, -(-last_block // per)):
            lo, hi = max(c * per, first_block), min((c + 1) * per, last_block)
            name = st.located[c]
            out.names.append(name)
            out.blocks.append(st.blocks[lo:hi])
            out.pages.append((c - segment_first(name)) * per + lo - c * per)
        return out

    def _saves(self, st: _Request, scheduled: int) -> list[Transfer]:
        """Segments of the chunks this step completes that the store lacks (one per run
        of consecutive chunks)."""
        request = st.request
        if passed_through(request):
            return []
        upto = st.computed + scheduled
        if not self.save_decode:
            upto = min(upto, len(request.prompt_token_ids or []))
        known = len(request.all_token_ids)  # async scheduling runs ahead of the tokens
        chunks = min(upto, len(st.blocks) * self.block_size, known) // self.chunk_size
        if chunks <= st.stored:
            return []
        keys = st.keys.upto(request.all_token_ids, chunks)
        todo = list(range(st.stored, chunks))
        present = [False] * len(todo) if st.rewrite else self.lookups.call(
            "has", lambda store: store.has([keys[c] for c in todo]), None)
        if present is None:  # the store cannot say: not storing now (guard.py logs it)
            return []
        st.stored, st.rewrite = chunks, False
        per = self.chunk_size // self.block_size
        out: list[Transfer] = []
        for c, here in zip(todo, present, strict=True):
            if here:
                continue
            if not out or out[-1].first_chunk + len(out[-1].keys) != c:
                out.append(Transfer(request.request_id, first_chunk=c))
            out[-1].keys.append(keys[c])
            out[-1].blocks.append(st.blocks[c * per:(c + 1) * per])
        for t in out:  # announced to routers once the workers say it is stored
            self.events.expect(f"{t.req_id}/{t.keys[0]}", request, t.first_chunk,
                               len(t.keys))
        return out

    def _output(self, connector_output: Any) -> None:
        """Chunks whose load failed are stored again once recomputed (the damaged object
        is replaced), instead of failing every later request that finds them."""
        saved = getattr(connector_output, "kv_cache_events", None)
        if saved:
            self.events.confirm(saved.get_all_events())
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        per = self.chunk_size // self.block_size
        for st in self._requests.values():
            hits = [i for i, b in enumerate(st.blocks) if b in invalid]
            if hits:
                first = hits[0] // per
                # what could not be loaded is gone from the store, as far as a router knows
                self.events.removed(st.request, first, max(0, len(st.located) - first))
                st.stored = min(st.stored, first)
                st.rewrite = True

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.disabled:
            return
        try:
            self._register(kv_caches)
        except Exception as e:  # a layout we cannot read: the engine runs without us
            self._layers, self._index = [], {}
            self.disabled = f"the KV cache cannot be read ({type(e).__name__}: {e})"
            log.warning("HurrayConnector passes requests through on this worker: %s; "
                        "every matched chunk is recomputed", self.disabled)

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = ordered_layers(kv_caches)
        context = self._vllm_config.compilation_config.static_forward_context
        first = context.get(layers[0][0])
        backend = first.attn_backend.get_name() if first is not None else "CPU_ATTN"
        head_size = getattr(self._spec(self._kv_cache_config), "head_size", None)
        isa = None
        if backend == "CPU_ATTN":
            isa = cpu_isa(self.model_dtype, self.block_size, head_size, self.kv_cache_dtype)
        kind = backend_kind(backend, kv_cache_dtype=self.kv_cache_dtype, isa=isa)
        self._layers = [(name, LayerView(t, kind, kv_cache_dtype=self.kv_cache_dtype,
                                         head_size=head_size if kind != "mla" else None,
                                         isa=isa))
                        for name, t in layers]
        self._index = {name: i for i, (name, _) in enumerate(self._layers)}
        if self.kv_cache_dtype != "auto":
            self._scales = []
            for name, _ in self._layers:
                layer = context.get(name)
                self._scales.append((float(getattr(layer, "_k_scale_float", 1.0)),
                                     float(getattr(layer, "_v_scale_float", 1.0))))
        self.backend = backend
        checksums.warm()  # compiled now, not inside the first load's time
        log.info("HurrayConnector: %d layers of %s (%s), chunks of %d tokens in %s; "
                 "segments read on %d core(s) %s", len(self._layers), backend, kind,
                 self.chunk_size, self.url, threads.workers(), sorted(os.sched_getaffinity(0)))

    def _check_segment(self, snap: KVCacheSnapshot) -> None:
        view = self._layers[0][1]
        want = (len(self._layers), self.block_size, view.heads, *view.dims)
        have = (snap.num_layers, snap.page_size, snap.num_kv_heads,
                *(t.head_dim for t in snap.layer(0)))
        dtype = self._segment_dtype
        if snap.model != self.identity or snap.dtype != dtype:
            # same geometry is not the same cache: another model's KV would load silently
            raise HurrayError(f"a stored segment of identity {snap.model!r} and dtype "
                              f"{snap.dtype} is not this engine's ({self.identity!r}, "
                              f"{dtype})", field="segment.model", value=snap.model,
                              rule="the cache identity")
        if want != have or snap.num_seqs != 1 or snap.total_tokens % self.chunk_size:
            raise HurrayError(f"a stored segment holds (layers, page_size, heads, dims) "
                              f"{list(have)} and {snap.total_tokens} tokens in "
                              f"{snap.num_seqs} sequences, this engine needs {list(want)} "
                              f"in whole chunks of {self.chunk_size}", field="segment",
                              value=list(have), rule="the cache identity")
        snap.tensors()  # builds every member: index buffers and token counts checked

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._fetched, self._written = [], set()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, HurrayConnectorMetadata)
        self._failed.update(meta.failed)
        started = time.perf_counter()
        segments: dict[str, KVCacheSnapshot] = {}
        for load in meta.loads:
            if self.disabled:  # the scheduler matched, but this worker cannot write blocks
                self._fail([b for blocks in load.blocks for b in blocks], load.req_id,
                           f"not loaded: {self.disabled}")
                continue
            try:
                self._fetch(load, segments)
            except Exception as e:  # a bug of ours is a recompute too, never a dead engine
                self._fail([b for blocks in load.blocks for b in blocks], load.req_id,
                           f"{type(e).__name__}: {e}")
        self.stats["fetch_seconds"] += time.perf_counter() - started
        self.stats["load_seconds"] += time.perf_counter() - started

    def _fetch(self, load: Transfer, segments: dict[str, KVCacheSnapshot]) -> None:
        """Fetch and check a load's segments; from the first chunk that cannot be
        loaded on, its blocks are recomputed."""
        for i, name in enumerate(load.names):
            snap = segments.get(name)
            if snap is None:
                got = self.loads.call("get", lambda store, n=name: self._get_checked(store, n),
                                      None)
                if not isinstance(got, KVCacheSnapshot):
                    why = str(got) if got is not None else "the store did not answer in time"
                    self._fail([b for blocks in load.blocks[i:] for b in blocks], load.req_id,
                               f"segment {name} could not be loaded ({why})")
                    return
                snap = segments[name] = got
                self.stats["segments_loaded"] += 1
            first = load.pages[i]
            if first + len(load.blocks[i]) > snap.tensor(0, snap.roles[0]).num_pages:
                self._fail([b for blocks in load.blocks[i:] for b in blocks], load.req_id,
                           f"segment {name} holds fewer pages than chunk {i} needs")
                return
            last = self._fetched[-1] if self._fetched else None
            if last is not None and last[1] is snap and last[2] + len(last[0]) == first:
                last[0].extend(load.blocks[i])  # one write per run of a segment's pages
            else:
                self._fetched.append((list(load.blocks[i]), snap, first))
            self.stats["chunks_loaded"] += 1

    def _get_checked(self, store: Any, name: str) -> KVCacheSnapshot | HurrayError:
        """A segment that fits this engine, or the error that says why the object is bad
        (the store answered: not a store failure)."""
        before = store.verify_seconds
        try:
            snap = store.get_verified(name)
            self._check_segment(snap)
            return snap
        except TransportError:
            raise
        except ChecksumError as e:  # damaged: out of the store, stored again once computed
            self.stats["chunks_corrupt"] += 1
            with contextlib.suppress(Exception):
                store.discard(name)
            return e
        except HurrayError as e:
            return e
        finally:
            self.stats["verify_seconds"] += store.verify_seconds - before

    def _fail(self, blocks: list[int], req_id: str, why: str) -> None:
        self._failed.update(blocks)
        self.stats["chunks_failed"] += 1
        log.warning("request %s: %s; %d blocks will be recomputed", req_id, why, len(blocks))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._fetched or layer_name in self._written or layer_name not in self._index:
            return
        started = time.perf_counter()
        layer = self._index[layer_name]
        view = self._layers[layer][1]
        try:
            for blocks, snap, first in self._fetched:
                pages = [t.page_pool[first:first + len(blocks)] for t in snap.layer(layer)]
                view.write(blocks, pages)
                self.stats["bytes_loaded"] += sum(p.nbytes for p in pages)
        except Exception as e:  # e.g. a file changed underneath: every loaded block again
            blocks = [b for fetched in self._fetched for b in fetched[0]]
            self._fetched = []
            self._fail(blocks, "(this step)", f"writing layer {layer_name} failed "
                       f"({type(e).__name__}: {e})")
            return
        self._written.add(layer_name)
        self.stats["layers_written"] += 1
        self.stats["load_seconds"] += time.perf_counter() - started

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if not self.has_connector_metadata() or layer_name not in self._index:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, HurrayConnectorMetadata)
        if not meta.saves:
            return
        started = time.perf_counter()
        layer = self._index[layer_name]
        view = self._layers[layer][1]
        try:
            for i, save in enumerate(meta.saves):
                blocks = [b for chunk in save.blocks for b in chunk]
                staged = self._staged.setdefault(i, [[] for _ in self._layers])
                staged[layer] = pages_to_numpy(view.read(blocks))
                self.stats["bytes_saved"] += sum(p.nbytes for p in staged[layer])
        except Exception as e:  # nothing stored this step; the engine goes on
            self._staged.clear()
            self.stats["saves_dropped"] += len(meta.saves)
            log.warning("copying layer %s out failed (%s: %s); this step's chunks are not "
                        "stored", layer_name, type(e).__name__, e)
        self.stats["save_seconds"] += time.perf_counter() - started

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, HurrayConnectorMetadata)
        started = time.perf_counter()
        for i, save in enumerate(meta.saves):
            staged = self._staged.pop(i, None)
            if staged is None or any(not parts for parts in staged):
                continue
            try:
                segment = self._segment(staged)  # owns copies: the blocks may be reused now
            except Exception as e:
                self.stats["saves_dropped"] += 1
                log.warning("request %s: building a segment failed (%s: %s); not stored",
                            save.req_id, type(e).__name__, e)
                continue
            if not self.async_save:
                self._put(save, segment)
                continue
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="hurraykv-save")
            self._pending = [f for f in self._pending if not f.done()]
            if len(self._pending) >= self.config.max_pending_saves:
                self._drop_save(save)  # a slow store never grows the queue without bound
                continue
            self._pending.append(self._writer.submit(self._put, save, segment))
        self._staged.clear()
        self.stats["save_seconds"] += time.perf_counter() - started

    def _drop_save(self, save: Transfer) -> None:
        with self._stats_lock:
            self.stats["saves_dropped"] += 1
            self._dropped_since += 1
            if self._dropped_since > 1 or self.saves.down:
                return  # logged once per episode (guard.py logs a store that is down)
        log.warning("the writer to %s has %d segments waiting: new chunks are not stored "
                    "until it catches up (request %s first)", self.url, len(self._pending),
                    save.req_id)

    def _put(self, save: Transfer, segment: KVCacheSnapshot) -> None:
        started = time.perf_counter()
        # checksummed here, on the writer's thread: off the forward pass
        evicted = [0]

        def put(store: Any) -> bool:
            before = store.evictions
            try:
                store.put(save.keys, save.first_chunk, checksums.with_checksums(segment),
                          {"vllm.identity": self.identity})
            finally:
                evicted[0] = store.evictions - before
            return True

        done = self.saves.call("put", put, False)
        with self._stats_lock:
            self.stats["evictions"] += evicted[0]
            if not done:
                self.stats["saves_dropped"] += 1
                return
            self.stats["chunks_saved"] += len(save.keys)
            self.stats["segments_saved"] += 1
            self._saved.saved(f"{save.req_id}/{save.keys[0]}")
            self.stats["write_seconds"] += time.perf_counter() - started
            caught_up, self._dropped_since = self._dropped_since, 0
        if caught_up:
            log.warning("the writer to %s caught up; %d segments were not stored meanwhile",
                        self.url, caught_up)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every segment handed to the writer is stored or dropped."""
        pending, self._pending = self._pending, []
        for f in pending:
            with contextlib.suppress(Exception):
                f.result(timeout=timeout)

    def _segment(self, pools: list[list[np.ndarray]]) -> KVCacheSnapshot:
        """A segment snapshot of these pages: built and validated once per length, then
        the same structure over each new segment's pools (``with_pools``)."""
        pages = pools[0][0].shape[0]
        template = self._templates.get(pages)
        if template is None:
            fused = len(pools[0]) == 1
            keys = [p[0] for p in pools]
            values = None if fused else [p[1] for p in pools]
            scales = None if self._scales is None else np.array(self._scales, np.float32)
            first = KVCacheSnapshot.from_arrays(keys, values, np.arange(pages), [0, pages],
                                                [pages * self.block_size], kv_scales=scales,
                                                model=self.identity)
            if len(self._templates) >= 64:
                self._templates.clear()
            self._templates[pages] = first.skeleton()
            return first
        roles = template.roles
        return template.with_pools({(layer, role): parts[r] for layer, parts in
                                    enumerate(pools) for r, role in enumerate(roles)})

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        self.drain(timeout=self.config.save_timeout_ms / 1000)
        if self._writer is not None:
            self._writer.shutdown(wait=False, cancel_futures=True)
        for guard in (self.lookups, self.loads, self.saves):
            guard.close()


def _holds(name: Any, chunk: int) -> bool:
    """``name`` can hold chunk ``chunk``: a segment name whose first chunk is not after it
    (a store that answers anything else is not believed)."""
    try:
        return name is not None and 0 <= segment_first(name) <= chunk
    except HurrayError:
        return False


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised: a single worker
        return 0


__all__ = ["HurrayConnector", "HurrayConnectorMetadata"]
