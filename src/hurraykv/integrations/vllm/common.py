"""What the connector's scheduler and worker parts share (no vLLM, no torch imports).

``Context`` is built once by the facade (``connector.py``) from vLLM's configuration and
handed to whichever part the role needs; ``Plan`` is the content of the metadata the
scheduler sends the workers each step.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, fields
from typing import Any

from ...chunks.guard import Guarded
from ...chunks.keys import identity_digest, segment_first
from ...errors import HurrayError
from .config import ConnectorConfig

# Under vLLM's "vllm" logger, so its handler and format apply (level, time, process,
# file:line): our lines line up with the engine's, and its VLLM_LOGGING_LEVEL governs them.
log = logging.getLogger("vllm.hurraykv")

FP8_NAMES = {"fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3", "fp8_e5m2": "float8_e5m2"}


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
    rewrite: bool = False  # a save stored even if the store has it (its load failed)
    # a save of which its request's lookup found a chunk missing: stored without asking
    # the store first (``has``) whether it holds them all
    absent: bool = False
    failed: str = ""  # a load that cannot be tried (why): all its blocks reported failed
    # a hybrid model's (groups.py): per KV cache group, the blocks of the transfer's
    # pages in that group (the engine block of its page ``j`` is ``groups[g][j]``)
    groups: list[list[int]] = field(default_factory=list)
    first_block: int = 0  # the request's block index of the transfer's first page
    state: bool = False  # a save of a model with Mamba layers: it holds their end states
    keep: Any = None  # retention.Keep: what the request asked of its segments' retention
    tenant: str = ""  # a save's: its request's cache_salt, as a digest (request_keys.py)
    # a load's, with tiers: each segment's chunk keys, from its first, where the request's
    # lookup had them all (a lower tier's hit is promoted under them: chunks/stack.py)
    promote: dict[str, list[str]] = field(default_factory=dict)
    # a save's, with tiers: the tiers whose store_threshold admits it (None: every tier);
    # the stack writes the first of them before the save is done, the others after
    tiers: tuple[int, ...] | None = None

    @property
    def segment_id(self) -> str:
        """A save's name in the workers' reports (written, dropped) and in the events."""
        return f"{self.req_id}/{self.keys[0]}"


IDLE_WAIT = 0.002  # seconds a step without a forward pass waits for lookups or loads


@dataclass
class Plan:
    """One step's work for the workers: what to load before the forward pass (``loads``)
    or across steps (``async_loads``, reported finished by ``get_finished``), what to
    store, and the blocks to report failed without trying (the scheduler could not plan
    their load)."""

    loads: list[Transfer] = field(default_factory=list)
    async_loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    # no forward pass this step: the workers wait a moment for their loader (vLLM's
    # in-process engine loop steps again at once, and a thread spinning on the GIL
    # starves the loader's: a 64 MiB hit took 5x longer)
    idle: bool = False

    @property
    def empty(self) -> bool:
        """Nothing to load, store or report failed: the workers have nothing to do."""
        return not (self.loads or self.async_loads or self.saves or self.failed)


@dataclass(slots=True)
class Counters:
    """What the connector counts (cumulative; ``metrics.py`` names each for Prometheus).
    A field, not a string key: a misspelt counter is an ``AttributeError`` where it is
    written, not a ``KeyError`` caught at a hook's boundary as a recompute."""

    # scheduler side
    lookups: int = 0
    lookup_hits: int = 0
    lookup_misses: int = 0
    lookups_missed: int = 0  # not answered: counted as misses
    lookup_seconds: float = 0.0  # from asking the store to its answer, summed
    tokens_hit: int = 0
    tokens_failed: int = 0
    hook_errors: int = 0
    # worker side: loads
    loads_sync: int = 0  # requests loaded before their forward pass
    loads_async: int = 0  # requests loaded across steps
    loads_cancelled: int = 0  # async loads of requests finished (aborted) before them
    chunks_loaded: int = 0
    chunks_failed: int = 0
    chunks_corrupt: int = 0
    tokens_loaded: int = 0
    segments_loaded: int = 0
    layers_written: int = 0
    bytes_loaded: int = 0
    bytes_loaded_direct: int = 0  # of them, read from the file into the blocks (direct.py)
    load_seconds: float = 0.0
    fetch_seconds: float = 0.0
    verify_seconds: float = 0.0
    # worker side: saves
    chunks_saved: int = 0
    segments_saved: int = 0
    saves_present: int = 0  # segments not written: the store had every chunk already
    # every segment set out to store, and the ones not landed yet (saves.py: attempted =
    # saved + present + dropped + deduplicated + pending at every read)
    saves_attempted: int = 0
    saves_pending: int = 0
    saves_deduplicated: int = 0  # runs of chunks another request of this engine stores
    chunks_unadmitted: int = 0  # computed chunks below store_threshold (every tier's)
    bytes_saved: int = 0
    saves_dropped: int = 0
    evictions: int = 0
    segments_cleared: int = 0  # removed by reset_cache (vLLM's reset_prefix_cache)
    segments_retained: int = 0  # pinned or given a lifetime as a request asked
    pins_refused: int = 0  # segments a request asked pinned past max_pinned_bytes
    retention_refused: int = 0  # requests whose kv_transfer_params ask was malformed
    save_seconds: float = 0.0
    write_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: float) -> None:
        """Add ``deltas`` at once (threads share the counters)."""
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def __getitem__(self, name: str) -> float:
        if name not in STATS:
            raise KeyError(f"{name!r} is not a connector counter; they are {', '.join(STATS)}")
        return getattr(self, name)

    def keys(self) -> tuple[str, ...]:  # dict(counters): a plain snapshot by name
        return STATS

    def items(self) -> list[tuple[str, float]]:
        with self._lock:
            return [(name, getattr(self, name)) for name in STATS]


STATS = tuple(f.name for f in fields(Counters) if not f.name.startswith("_"))


@dataclass
class Context:
    """The connector as both parts see it: its configuration, the cache identity and the
    seed of its chunk keys, the three guarded store connections, and its counters."""

    config: ConnectorConfig
    block_size: int
    chunk_size: int
    identity: str
    seed: bytes
    can_load: bool
    can_save: bool
    lookups: Guarded
    loads: Guarded
    saves: Guarded
    disabled: str = ""  # why requests pass through ("": they do not)
    # identity -> store format (store_format.StoreFormat) of every identity this engine
    # loads: its own first, then those of accept_store_dtypes
    formats: dict[str, Any] = field(default_factory=dict)
    layout: Any = None  # groups.GroupLayout: the KV cache groups (None: one, unchecked)
    # a new store connection of its own, outside the guards (reset, the removal watch):
    # open(ranked=True) to this rank's objects, open(ranked=False) to every rank's
    open: Any = None
    stats: Counters = field(default_factory=Counters)
    # with tiers: what every stack of this connector counted, per tier (chunks/stack.py)
    tier_counts: dict[str, list[int]] | None = None
    # with tiers: where its stacks report each tier's writes and removals, for the KV
    # events per tier (tier_events.TierReports)
    tier_reports: Any = None

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def other_seeds(self) -> list[bytes]:
        """Seeds of the accepted identities other than this engine's own."""
        return [identity_digest(i) for i in self.formats if i != self.identity]

    @property
    def hybrid(self) -> bool:
        """KV cache groups other than one of full attention (``groups.py``)."""
        return self.layout is not None and bool(self.layout.groups) and not self.layout.plain

    @property
    def per(self) -> int:
        """Engine blocks per chunk."""
        return self.chunk_size // self.block_size


def holds(name: Any, chunk: int) -> bool:
    """``name`` can hold chunk ``chunk``: a segment name whose first chunk is not after it
    (a store that answers anything else is not believed)."""
    try:
        return name is not None and 0 <= segment_first(name) <= chunk
    except HurrayError:
        return False


__all__ = ["FP8_NAMES", "IDLE_WAIT", "STATS", "Context", "Counters", "Plan", "Transfer", "holds",
           "log"]
