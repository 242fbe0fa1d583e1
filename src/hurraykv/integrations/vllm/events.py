"""KV cache events for ``HurrayConnector``: what hurraykv holds, told to KV-aware routers.

vLLM (0.32) publishes connector events only from its scheduler: after each step
``Scheduler.update_from_output`` drains ``self.connector.take_events()`` into the same
``KVEventBatch`` as the GPU prefix cache's events and hands it to the ``EventPublisher``
(ZMQ PUB, msgpack) configured by ``--kv-events-config``
(``vllm/v1/core/sched/scheduler.py:2370-2384``).  Workers can only contribute through
``get_kv_connector_kv_cache_events()`` -> ``KVConnectorOutput.kv_cache_events``
(``vllm/v1/worker/kv_connector_model_runner_mixin.py:103``), merged across workers by
``KVOutputAggregator`` (``kv_connector/utils.py:155-166``) and handed to the scheduler
connector's ``update_connector_output`` (``scheduler.py:3219``), as LMCache does.

A router (llm-d's kv-cache indexer, Dynamo) matches the ``block_hashes`` of a
``BlockStored`` against the hashes it computes for a prompt, i.e. vLLM's own prefix-cache
hashes: ``request.block_hashes`` (chained sha256 per block of ``hash_block_size``
tokens), seen at the KV cache block size through ``resolve_block_hashes`` and converted
by ``maybe_convert_block_hash`` (bytes, or a 64-bit int under
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), with the previous block's hash as
``parent_block_hash``, the blocks' ``token_ids``, ``block_size`` and the LoRA fields --
exactly what ``BlockPool.cache_full_blocks`` publishes for GPU blocks
(``vllm/v1/core/block_pool.py:263-345``, ``_build_block_stored_event`` 346-374) and what
the offloading connector publishes for its CPU/storage tiers
(``kv_connector/v1/offloading/events.py:272-400``).  Only the scheduler has the
``Request`` (its hashes and tokens), so the events are built there:

* when the scheduler decides to store a segment (``HurrayConnector._saves``) it calls
  ``expect(segment, request, first_chunk, chunks)``: the payload is kept, keyed by the
  segment's id (its first chunk key);
* the worker that wrote it (``HurrayConnector._put``) records the id in a
  ``SavedSegments`` (``get_kv_connector_kv_cache_events`` returns it) and the scheduler
  side's ``update_connector_output`` passes the ids to ``confirm``: a ``BlockStored`` is
  queued once every tensor-parallel rank has written its part (a segment a worker
  dropped is never announced, ``forget`` it or let the bounded table age it out);
* a stored chunk found gone (a failed load, a lookup finding fewer chunks than were
  announced) is ``removed(request, first_chunk, chunks)``: a ``BlockRemoved`` for the
  hashes announced before;
* ``take_events()`` (the connector's ``take_events``) returns and clears the queue.

The same worker-to-scheduler channel carries ``("loaded", request id)`` for each request
whose load a worker ran in the step (``WorkerSegments.loaded``): vLLM hands the scheduler
a step's records together with the blocks whose load failed, from every worker at once,
so the scheduler counts a load's tokens as hit or failed exactly (``split_records``);
and, with tiers, ``("tier", kind, segment name, tier)`` for each write a tier
acknowledged and each removal a stack learned of (``tier_events.py``: events per tier).

``medium`` is vLLM's ``MEDIUM_STORAGE`` ("STORAGE", the tier the offloading connector's
file/object tiers use) so routers that score tiers by medium understand it (with tiers,
each tier's: ``tier_events.py``);
``ownership`` (vLLM: "Secondary offloading tier identifier") says "hurraykv", and
``locality`` is "REMOTE" for a shared store (``hurray://``, ``redis://``) or "LOCAL" for
one on this host, whose store class says ``LOCAL`` (``file://``;
``vllm/v1/kv_offload/base.py:54``).  vLLM is imported inside the methods
only: this module imports without torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ...chunks.registry import is_local

MEDIUM = "STORAGE"  # vllm.distributed.kv_events.MEDIUM_STORAGE
OWNERSHIP = "hurraykv"


def locality_of(url: str) -> str:
    """vLLM's ``Locality`` value for a store URL: a store whose class is ``LOCAL`` (a
    directory, ``file://``) is this host's."""
    return "LOCAL" if is_local(url) else "REMOTE"


@dataclass(frozen=True)
class EventAPI:
    """What the events are built with: vLLM's ``BlockStored`` and ``BlockRemoved``
    (``vllm/distributed/kv_events.py``), and its ``resolve_block_hashes`` and
    ``maybe_convert_block_hash`` (``vllm/v1/core/kv_cache_utils.py``).  ``vllm_api()``
    imports them on first use, so this module imports without torch; a test without
    vLLM passes its own with the same signatures."""

    stored: Callable[..., Any]
    removed: Callable[..., Any]
    resolve: Callable[[Any, int, int], Any]
    convert: Callable[[Any], Any]


def vllm_api() -> EventAPI:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

    return EventAPI(BlockStored, BlockRemoved, resolve_block_hashes, maybe_convert_block_hash)


class _Payload:
    __slots__ = ("hashes", "lora_id", "lora_name", "name", "parent", "seen", "session",
                 "tokens")

    def __init__(self, hashes: list[Any], parent: Any, tokens: list[int], lora_id: Any,
                 lora_name: Any, session: Any) -> None:
        self.hashes, self.parent, self.tokens = hashes, parent, tokens
        self.lora_id, self.lora_name, self.session = lora_id, lora_name, session
        self.seen = 0  # ranks that reported the segment written
        self.name = ""  # the segment's name in the store


class HurrayKVEvents:
    """The scheduler side's collector (one per scheduler connector).

    ``block_size``: the engine's KV cache block size (the granularity of the events);
    ``chunk_size``: hurraykv's chunk size (a multiple of it); ``hash_block_size``: the
    granularity of ``request.block_hashes`` (``kv_cache_config.hash_block_size``, which
    vLLM sets before creating the scheduler's connector: ``vllm/v1/engine/core.py:371-374``;
    default ``block_size``); ``ranks``: tensor-parallel ranks that each write their own
    part of a segment; ``enabled``: ``vllm_config.kv_events_config.enable_kv_cache_events``
    (when False every method is a no-op, as vLLM's own block pool does); ``api``: what
    the events are built with (default: vLLM's, ``vllm_api``)."""

    def __init__(self, block_size: int, chunk_size: int, *, hash_block_size: int | None = None,
                 ranks: int = 1, enabled: bool = True, medium: str = MEDIUM,
                 ownership: str | None = OWNERSHIP, locality: str | None = None,
                 group_idx: int = 0, spec_kind: str | None = None,
                 max_tracked: int = 100_000, api: EventAPI | None = None) -> None:
        if chunk_size % block_size:
            raise ValueError(f"chunk_size {chunk_size} is not a multiple of {block_size}")
        self.block_size, self.chunk_size = block_size, chunk_size
        self.hash_block_size = hash_block_size or block_size
        self.ranks, self.enabled = max(1, ranks), enabled
        self.medium, self.ownership, self.locality = medium, ownership, locality
        # a hybrid model's chunks are announced as its full-attention group's blocks
        self.group_idx, self.spec_kind, self.max_tracked = group_idx, spec_kind, max_tracked
        self._pending: OrderedDict[str, _Payload] = OrderedDict()
        self._announced: OrderedDict[Any, None] = OrderedDict()  # hashes told stored
        # segment name -> the hashes announced with it (the removal watch finds names)
        self._segments: OrderedDict[str, list[Any]] = OrderedDict()
        self._events: list[Any] = []
        self.removed_blocks = 0  # blocks announced removed (for the "evictions" counter)
        self._api = api

    @property
    def api(self) -> EventAPI:
        if self._api is None:
            self._api = vllm_api()
        return self._api

    # ---------------------------------------------------------------- building
    def _payload(self, request: Any, first_chunk: int, chunks: int) -> _Payload | None:
        convert = self.api.convert
        per = self.chunk_size // self.block_size
        first, end = first_chunk * per, (first_chunk + chunks) * per
        hashes = self.api.resolve(request.block_hashes, self.hash_block_size, self.block_size)
        if chunks <= 0 or end > len(hashes):
            return None  # not hashed that far (should not happen: chunks are full blocks)
        lora = getattr(request, "lora_request", None)
        return _Payload(
            [convert(hashes[b]) for b in range(first, end)],
            convert(hashes[first - 1]) if first else None,
            list(request.all_token_ids[first * self.block_size:end * self.block_size]),
            lora.adapter_id if lora else None, lora.name if lora else None,
            getattr(request, "session_id", None))

    def _stored(self, p: _Payload) -> Any:
        for h in p.hashes:
            self._announced[h] = None
            self._announced.move_to_end(h)
        while len(self._announced) > self.max_tracked:
            self._announced.popitem(last=False)
        return self.api.stored(block_hashes=p.hashes, parent_block_hash=p.parent,
                               token_ids=p.tokens, block_size=self.block_size,
                               lora_id=p.lora_id, medium=self.medium, lora_name=p.lora_name,
                               group_idx=self.group_idx, kv_cache_spec_kind=self.spec_kind,
                               locality=self.locality, ownership=self.ownership,
                               session_id=p.session)

    # ---------------------------------------------------------------- feeding
    def stored(self, request: Any, first_chunk: int, chunks: int) -> None:
        """Announce chunks ``[first_chunk, first_chunk + chunks)`` of ``request`` stored
        now (no confirmation from the workers)."""
        if not self.enabled:
            return
        p = self._payload(request, first_chunk, chunks)
        if p is not None:
            self._events.append(self._stored(p))

    def expect(self, segment: str, request: Any, first_chunk: int, chunks: int,
               name: str = "") -> None:
        """A segment (id ``segment``, stored as ``name``) is being written: announce it on
        ``confirm``."""
        if not self.enabled:
            return
        p = self._payload(request, first_chunk, chunks)
        if p is None:
            return
        p.name = name
        self._pending[segment] = p
        while len(self._pending) > self.max_tracked:
            self._pending.popitem(last=False)  # never confirmed (dropped): forgotten

    def confirm(self, segments: Iterable[str]) -> list[str]:
        """Segments a worker reports written (once per rank that wrote its part); the
        names of those announced now."""
        named = []
        for segment in segments:
            p = self._pending.get(segment)
            if p is None:
                continue
            p.seen += 1
            if p.seen >= self.ranks:
                del self._pending[segment]
                self._events.append(self._stored(p))
                if p.name:
                    self._segments[p.name] = p.hashes
                    self._segments.move_to_end(p.name)
                    named.append(p.name)
        while len(self._segments) > self.max_tracked:
            self._segments.popitem(last=False)
        return named

    def forget(self, segments: Iterable[str]) -> None:
        """Segments that will not be written (dropped): never announced."""
        for segment in segments:
            self._pending.pop(segment, None)

    # with tiers, what tier_events.TierKVEvents announces per tier; one store has none
    def known(self, request: Any, first_chunk: int, chunks: int, name: str) -> None:
        return None

    def tier_stored(self, name: str, tier: int) -> bool:
        return False

    def tier_removed(self, name: str, tier: int) -> int:
        return 0

    def removed(self, request: Any, first_chunk: int, chunks: int) -> int:
        """Chunks of ``request`` found gone from the store: a ``BlockRemoved`` for those
        of their blocks announced stored before.  Returns how many blocks."""
        if not self.enabled:
            return 0
        p = self._payload(request, first_chunk, chunks)
        return self.removed_hashes(p.hashes) if p is not None else 0

    def removed_segments(self, names: Iterable[str]) -> int:
        """Segments found gone from the store (the removal watch): a ``BlockRemoved``
        for their blocks still announced.  Returns how many blocks."""
        hashes = [h for name in names for h in self._segments.pop(name, ())]
        return self.removed_hashes(hashes) if self.enabled else 0

    def cleared(self) -> int:
        """The store was cleared of this engine's identity (``reset_cache``): every
        block announced is announced removed.  Returns how many."""
        self._segments.clear()
        self._pending.clear()
        return self.removed_hashes(list(self._announced)) if self.enabled else 0

    def removed_hashes(self, hashes: Iterable[Any]) -> int:
        gone = [h for h in hashes if self._announced.pop(h, 0) is None]
        if gone:
            self._events.append(self.api.removed(block_hashes=gone, medium=self.medium,
                                                 group_idx=self.group_idx,
                                                 locality=self.locality,
                                                 ownership=self.ownership))
            self.removed_blocks += len(gone)
        return len(gone)

    def take_events(self) -> list[Any]:
        """The events since the last call (what the connector's ``take_events`` returns)."""
        events, self._events = self._events, []
        return events


def _connector_kv_events_base() -> type:
    from vllm.distributed.kv_events import KVConnectorKVEvents

    return KVConnectorKVEvents


LOADED = "loaded"  # the tag of a load record: (LOADED, request id)
DROPPED = "dropped"  # a worker's record of a segment not stored: (DROPPED, segment id)
TIER = "tier"  # a stack's report: (TIER, "stored" or "removed", segment name, tier)


def split_records(records: Iterable[Any]) -> tuple[list[str], set[str], list[str],
                                                   list[tuple[str, str, int]]]:
    """A step's worker records: the ids of the segments written, the ids of the requests
    whose load ran, the ids of the segments the writer dropped, and the tiers' reports
    (kind, segment name, tier)."""
    segments: list[str] = []
    loaded: set[str] = set()
    dropped: list[str] = []
    tiers: list[tuple[str, str, int]] = []
    for r in records:
        if isinstance(r, str):
            segments.append(r)
        elif isinstance(r, tuple) and len(r) == 2 and r[0] == LOADED:
            loaded.add(r[1])
        elif isinstance(r, tuple) and len(r) == 2 and r[0] == DROPPED:
            dropped.append(r[1])
        elif isinstance(r, tuple) and len(r) == 4 and r[0] == TIER:
            tiers.append((r[1], r[2], r[3]))
    return segments, loaded, dropped, tiers


class SavedSegments:
    """Worker side: ids of the segments written since the last step (and the load
    records, ``split_records``), carried to the
    scheduler in ``KVConnectorOutput.kv_cache_events``.  It implements vLLM's
    ``KVConnectorKVEvents`` interface (``vllm/distributed/kv_events.py:227-258``), which
    ``KVOutputAggregator`` uses to merge the workers' (``add_events``,
    ``increment_workers``, ``get_all_events``); it is registered as a virtual subclass
    of it on first use (``SavedSegments.register()``) so this module stays torch-free.
    The ids are plain strings: they never reach the publisher (the scheduler connector
    turns them into ``BlockStored`` through ``HurrayKVEvents.confirm``)."""

    def __init__(self, segments: Iterable[str] = (), workers: int = 1) -> None:
        self.segments, self.workers = list(segments), workers

    @classmethod
    def register(cls) -> None:
        _connector_kv_events_base().register(cls)

    def add_events(self, events: list[Any]) -> None:
        self.segments.extend(events)

    def aggregate(self) -> SavedSegments:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.segments)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.segments = []
        self.workers = 1

    def merge(self, other: Any) -> SavedSegments:
        self.add_events(other.get_all_events())
        return self

    def __bool__(self) -> bool:  # KVConnectorOutput.is_empty tests ``not kv_cache_events``
        return bool(self.segments)

    def __repr__(self) -> str:
        return f"SavedSegments({len(self.segments)} segments, {self.workers} workers)"


class WorkerSegments:
    """Worker-side recorder, fed from the writer thread: ``saved(id)`` after a segment is
    written, and from the engine's: ``loaded(request id)`` when a request's load runs;
    ``take()`` (what ``get_kv_connector_kv_cache_events`` returns) hands them over as a
    ``SavedSegments``, or None when there are none.  ``tiers``: where this worker's stacks
    report (``tier_events.TierReports``), read at each ``take``."""

    def __init__(self, tiers: Any = None) -> None:
        import threading

        self._lock = threading.Lock()
        self._saved: list[Any] = []
        self._tiers = tiers

    def saved(self, segment: str) -> None:
        with self._lock:
            self._saved.append(segment)

    def loaded(self, req_id: str) -> None:
        with self._lock:
            self._saved.append((LOADED, req_id))

    def dropped(self, segment: str) -> None:
        with self._lock:
            self._saved.append((DROPPED, segment))

    def take(self) -> SavedSegments | None:
        with self._lock:
            saved, self._saved = self._saved, []
        if self._tiers is not None:
            saved += [(TIER, *report) for report in self._tiers.take()]
        return SavedSegments(saved) if saved else None


__all__ = ["DROPPED", "LOADED", "MEDIUM", "OWNERSHIP", "TIER", "EventAPI", "HurrayKVEvents",
           "SavedSegments", "WorkerSegments", "locality_of", "split_records", "vllm_api"]
