"""KV events per tier (issue 49): with ``tiers``, which tier holds what, told to routers.

A stack (``chunks/stack.py``) reports, per tier, each write that tier acknowledged (a
save's first admitting tier, a write-through, write-back or promotion copy) and what it
learns the tier dropped (a ``mem://`` pool making room, a damaged copy discarded, a
segment removed).  The stacks of a connector report into one bounded ``TierReports``;
a worker's go to the scheduler with its other records (``WorkerSegments``: the same
channel as the segments written, ``events.py``), the scheduler's own (its resets and
removals) are read where it takes its events.  ``TierKVEvents`` turns them into one
``BlockStored`` per tier that holds a segment, once every tensor-parallel rank reported
its part there, and a ``BlockRemoved`` per tier that lost it; the removal watch
(``retention.Watch``) checks each announced (segment, tier) in that tier, so what a tier
drops without telling (a ``file://`` or ``s3://`` cap, a lifetime, another engine, an
operator) is announced too.

*Medium and ownership* (``TierTag``), as vLLM tells its own tiers apart.  vLLM names
three media, ``MEDIUM_GPU``, ``MEDIUM_CPU`` and ``MEDIUM_STORAGE``
(``vllm/distributed/kv_events.py:51-53``): its offloading connector's CPU tier is
``CPU`` (``vllm/v1/kv_offload/cpu/manager.py:67``), its file and object tiers
``STORAGE`` (``v1/kv_offload/tiering/fs/manager.py:107``, ``tiering/obj/manager.py:104``).
So a ``mem://`` tier (this process's memory) is ``CPU`` and every other tier
``STORAGE``.  Beyond the medium, ``BlockStored`` and ``BlockRemoved`` carry
``ownership``, "Secondary offloading tier identifier" (``kv_events.py:87-88``,
``122-123``; ``OffloadingEvent.ownership``, ``v1/kv_offload/base.py:172-173``; the KVCR
tier sets ``"kvcr"``, ``tiering/kvcr/manager.py:623``), and vLLM's own tracker keeps a
block's residencies by ``(medium, ownership)``
(``kv_connector/v1/offloading/events.py:382``, ``418``).  A tier's ownership is
``hurraykv:INDEX:SCHEME`` (``hurraykv:0:mem``, ``hurraykv:1:file``, ``hurraykv:2:s3``): a
router tells ``file://`` from ``s3://`` (both ``STORAGE``), and two tiers of one scheme
apart, and a prefix match on ``hurraykv`` still finds every tier.  One store (no
``tiers``) keeps ``hurraykv``.  ``locality`` is each tier's (``LOCAL`` for ``mem://``
and ``file://``, ``REMOTE`` otherwise).

*Bounds.*  ``TierReports`` holds at most ``LIMIT`` reports between two reads (the
oldest dropped, counted); a report costs an append under a lock.  A later tier's
``BlockStored`` needs the segment's payload (hashes, tokens, LoRA), which only the
scheduler's request has: the payloads of the segments planned for storing, and of those
a load will promote, are kept in a table bounded by ``MAX_TOKENS`` tokens (and
``max_tracked`` segments), the least recently used out; a report of a segment no longer
in it is not announced (counted ``unknown``).  A save the writer found present (another
request or engine stored it meanwhile) is announced by the write that stored it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from ...chunks.registry import store_class
from .events import HurrayKVEvents, locality_of

STORED, REMOVED = "stored", "removed"  # the kinds of a stack's report


@dataclass(frozen=True)
class TierTag:
    """How a tier's events name it: vLLM's medium, the ownership, the locality."""

    medium: str
    ownership: str
    locality: str


def in_process(url: str) -> bool:
    """A tier in this process's memory (``mem://``): vLLM's CPU medium."""
    cls = store_class(urlparse(url).scheme)
    return bool(cls is not None and cls.IN_PROCESS)


def tier_tags(urls: Sequence[str]) -> list[TierTag]:
    """Each tier's ``TierTag``, fastest first (the module docstring says why these)."""
    return [TierTag("CPU" if in_process(url) else "STORAGE",  # MEDIUM_CPU, MEDIUM_STORAGE
                    f"hurraykv:{i}:{urlparse(url).scheme}", locality_of(url))
            for i, url in enumerate(urls)]


class TierReports:
    """The reports of a connector's stacks (``StackedChunks(report=reports.add)``), until
    ``take``; at most ``LIMIT``, the oldest dropped (``dropped``)."""

    LIMIT = 65536

    def __init__(self, limit: int = LIMIT) -> None:
        self._lock = threading.Lock()
        self._reports: deque[tuple[str, str, int]] = deque()
        self.limit, self.dropped = limit, 0

    def add(self, kind: str, name: str, tier: int) -> None:
        with self._lock:
            if len(self._reports) >= self.limit:
                self._reports.popleft()
                self.dropped += 1
            self._reports.append((kind, name, tier))

    def take(self) -> list[tuple[str, str, int]]:
        with self._lock:
            out = list(self._reports)
            self._reports.clear()
        return out


class TierKVEvents(HurrayKVEvents):
    """``HurrayKVEvents`` over a stack: ``tiers`` the tiers' tags, fastest first.  The
    segments written are announced by the tiers' reports (``tier_stored``), not by the
    writer's confirmation; removals are announced in each tier that held the blocks."""

    MAX_TOKENS = 1 << 20  # tokens of the payloads kept for later tiers' announcements

    def __init__(self, block_size: int, chunk_size: int, *, tiers: Sequence[TierTag],
                 **kw: Any) -> None:
        super().__init__(block_size, chunk_size, **kw)
        self.tiers = list(tiers)
        # segment name -> its payload, least recently used first
        self._known: OrderedDict[str, Any] = OrderedDict()  # events.py's payloads
        self._known_tokens = 0
        # per tier: the hashes announced stored there, and the ranks that reported each
        # segment written there since it was last announced
        self._held: list[OrderedDict[Any, None]] = [OrderedDict() for _ in self.tiers]
        self._acks: dict[tuple[str, int], int] = {}
        self.unknown = 0  # reports of segments whose payload was no longer kept

    # ---------------------------------------------------------------- payloads
    def expect(self, segment: str, request: Any, first_chunk: int, chunks: int,
               name: str = "") -> None:
        """A segment planned for storing: its payload kept, for each tier's report."""
        self.known(request, first_chunk, chunks, name)

    def known(self, request: Any, first_chunk: int, chunks: int, name: str) -> None:
        """Segment ``name`` holds chunks ``[first_chunk, first_chunk + chunks)`` of
        ``request``: kept for the reports of the tiers it reaches (a promotion)."""
        if not self.enabled or not name:
            return
        p = self._known.get(name)
        if p is None:
            p = self._payload(request, first_chunk, chunks)
            if p is None:
                return
            self._known[name] = p
            self._known_tokens += len(p.tokens)
        self._known.move_to_end(name)
        while len(self._known) > 1 and (self._known_tokens > self.MAX_TOKENS
                                        or len(self._known) > self.max_tracked):
            _, old = self._known.popitem(last=False)
            self._known_tokens -= len(old.tokens)

    def confirm(self, segments: Iterable[str]) -> list[str]:
        return []  # announced per tier, by the stacks' reports

    def forget(self, segments: Iterable[str]) -> None:
        return None

    # ---------------------------------------------------------------- reports
    def tier_stored(self, name: str, tier: int) -> bool:
        """A rank's stack wrote segment ``name`` into ``tier``: True when it is announced
        there now (every rank's part written)."""
        if not self.enabled or not 0 <= tier < len(self.tiers):
            return False
        p = self._known.get(name)
        if p is None:
            self.unknown += 1
            return False
        self._known.move_to_end(name)
        seen = self._acks.get((name, tier), 0) + 1
        if seen < self.ranks:
            self._acks[(name, tier)] = seen
            return False
        self._acks.pop((name, tier), None)
        held = self._held[tier]
        for h in p.hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_tracked:
            held.popitem(last=False)
        while len(self._acks) > self.max_tracked:
            self._acks.pop(next(iter(self._acks)))
        tag = self.tiers[tier]
        self._events.append(self.api.stored(
            block_hashes=p.hashes, parent_block_hash=p.parent, token_ids=p.tokens,
            block_size=self.block_size, lora_id=p.lora_id, medium=tag.medium,
            lora_name=p.lora_name, group_idx=self.group_idx,
            kv_cache_spec_kind=self.spec_kind, locality=tag.locality,
            ownership=tag.ownership, session_id=p.session))
        self._segments[name] = p.hashes
        self._segments.move_to_end(name)
        while len(self._segments) > self.max_tracked:
            self._segments.popitem(last=False)
        return True

    def tier_removed(self, name: str, tier: int) -> int:
        """``tier`` no longer holds segment ``name``: a ``BlockRemoved`` there for its
        blocks announced; how many."""
        self._acks.pop((name, tier), None)
        hashes = self._segments.get(name)
        if hashes is None or not self.enabled or not 0 <= tier < len(self.tiers):
            return 0
        return self._removed_in(hashes, [tier])

    def removed_hashes(self, hashes: Iterable[Any]) -> int:
        """Gone from every tier (a load that failed: the stack read each in turn)."""
        return self._removed_in(list(hashes), range(len(self.tiers)))

    def _removed_in(self, hashes: list[Any], tiers: Iterable[int]) -> int:
        n = 0
        for t in tiers:
            held = self._held[t]
            gone = [h for h in hashes if held.pop(h, 0) is None]
            if gone:
                tag = self.tiers[t]
                self._events.append(self.api.removed(
                    block_hashes=gone, medium=tag.medium, group_idx=self.group_idx,
                    locality=tag.locality, ownership=tag.ownership))
                n += len(gone)
        self.removed_blocks += n
        return n

    def cleared(self) -> int:
        """A reset: every block announced in any tier announced removed there, and
        every payload forgotten (what is written after it is stale)."""
        self._segments.clear()
        self._known.clear()
        self._known_tokens = 0
        self._acks.clear()
        if not self.enabled:
            return 0
        return sum(self._removed_in(list(held), [t]) for t, held in enumerate(self._held))


__all__ = ["REMOVED", "STORED", "TierKVEvents", "TierReports", "TierTag", "in_process",
           "tier_tags"]
