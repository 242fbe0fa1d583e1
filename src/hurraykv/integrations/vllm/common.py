"""What the connector's scheduler and worker parts share (no vLLM, no torch imports).

``Context`` is built once by the facade (``connector.py``) from vLLM's configuration and
handed to whichever part the role needs; ``Plan`` is the content of the metadata the
scheduler sends the workers each step.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ...errors import HurrayError
from ..chunks import identity_digest, segment_first
from ..guard import Guarded
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


@dataclass
class Plan:
    """One step's work for the workers: what to load, what to store, and the blocks to
    report failed without trying (the scheduler could not plan their load)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)


STATS = ("chunks_loaded", "chunks_saved", "chunks_failed", "lookups_missed", "saves_dropped",
         "hook_errors", "chunks_corrupt", "verify_seconds", "evictions", "segments_loaded",
         "segments_saved", "layers_written", "bytes_loaded", "bytes_saved", "save_seconds",
         "load_seconds", "fetch_seconds", "write_seconds", "lookups", "lookup_hits",
         "lookup_misses", "tokens_hit", "tokens_failed", "tokens_loaded")


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
    stats: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(STATS, 0))
    stats_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def other_seeds(self) -> list[bytes]:
        """Seeds of the accepted identities other than this engine's own."""
        return [identity_digest(i) for i in self.formats if i != self.identity]

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


__all__ = ["FP8_NAMES", "STATS", "Context", "Plan", "Transfer", "holds", "log"]
