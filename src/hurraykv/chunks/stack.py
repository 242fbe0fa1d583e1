"""A stack of chunk stores, fastest first (``mem://`` over ``file://`` over ``s3://`` or a
server): one ``ChunkStore`` to the connector, its tiers each a store of its own.

*Lookups* ask the tiers in order, each only for the keys the tiers above it miss, so a
prefix split across tiers is found whole (its first chunks in one tier, the rest in
another) and loads from each.  A tier that fails (raises) answers misses: the others keep
serving.

*Reads* take a segment from the tier that the last lookup found it in, else from the
first that has it.  A segment a lower tier served is *promoted*: copied into every tier
above it, off the caller's path, through a bounded queue; when the queue is full the
promotion is skipped and counted (``promotions_skipped``), never waited for.  A promotion
needs the segment's chunk keys (a tier stores a segment under its keys): the caller that
knows them (the connector's load: its scheduler has the request's keys) hands them to
``promote``, and the segment is read again from its tier, verified, off the path.  A
tier's refusal (no room: its pinned segments fill it) is counted, and no pinned segment
is ever evicted for it, as the tier's own ``put`` guarantees.

*Writes* follow ``write_policy``.  ``write_through`` (the default): the first tier is
written before ``put`` returns, the tiers below asynchronously, through a bounded queue
that drops a write when full (``writes_dropped``); a ``put`` given ``tiers`` (those whose
admission took the segment: the connector's ``store_threshold`` per tier) writes the
first of them so and the others through the queue, and no other tier.  ``write_back``:
only the first tier is written; the second receives a segment when the first drops it to
make room (so the first tier must be one whose evictions the stack sees: a ``mem://``
pool).  A segment is present in a tier only once that tier's ``put`` returned.
``queue_depth`` 0 makes every copy (writes and promotions) before the call returns, for
a stack whose lower tiers must hold what it stored when ``put`` returns.

The catalog is every tier's, each segment once (the first tier that holds it), and
``remove``, ``retain`` and ``clear`` act on every tier.

*Reports* (``report(kind, name, tier)``, for the connector's KV events per tier): each
tier's ``put`` that returned (a save's first tier, a write-through, write-back or
promotion copy) is ``"stored"``, and what the stack learns a tier no longer holds is
``"removed"``: what a tier that tells of its evictions dropped (``watch_evictions``: a
``mem://`` pool making room), and ``discard``/``remove`` in each tier.  What a tier drops
without telling (a ``file://`` or ``s3://`` cap, a lifetime) the connector's removal
watch finds.  ``report`` is called on the thread that did the work: it must not block.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import HurrayError
from ..io import checksums
from ..snapshot import KVCacheSnapshot
from .keys import segment_first, segment_name
from .registry import ChunkStore, Stored

log = logging.getLogger("hurraykv.chunks")
POLICIES = ("write_through", "write_back")
# what a stack counts, per tier (the connector's vllm:hurraykv_tier_* metrics)
COUNTS = ("hits", "loaded_bytes", "stored_bytes", "promotions", "promotions_skipped",
          "promotions_refused", "writes", "writes_dropped", "writes_failed", "outages",
          "unadmitted")  # unadmitted: chunks a tier's store_threshold kept out (the planner's)


def tier_counts(tiers: int) -> dict[str, list[int]]:
    """Zeroed counters for a stack of ``tiers`` (several stacks may share one)."""
    return {kind: [0] * tiers for kind in COUNTS}


class StackedChunks(ChunkStore):
    """``tiers`` fastest first; ``names`` their URLs (for counters and messages)."""

    REMEMBERED = 65536  # segments whose tier the stack remembers from lookups and reads

    def __init__(self, tiers: Sequence[ChunkStore], *, write_policy: str = "write_through",
                 queue_depth: int = 64, counts: dict[str, list[int]] | None = None,
                 report: Callable[[str, str, int], None] | None = None) -> None:
        if not tiers:
            raise HurrayError("a stack of stores has no tier", field="tiers", value=[],
                              rule="one tier or more")
        if write_policy not in POLICIES:
            raise HurrayError(f"write_policy is {write_policy!r}; it is one of "
                              f"{', '.join(POLICIES)}", field="write_policy",
                              value=write_policy, rule=" or ".join(POLICIES))
        self.tiers = list(tiers)
        # bounded when each tier is (the connector's: each behind a deadline and breaker
        # of its own, a share of the connector's deadline each, ``GuardedTier``)
        self.BOUNDED = all(getattr(t, "BOUNDED", False) for t in self.tiers)
        self.url = " > ".join(t.url for t in self.tiers)
        self.write_policy = write_policy
        self._where: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self.counts = counts if counts is not None else tier_counts(len(self.tiers))
        self.inline = queue_depth == 0  # the lower tiers written before put returns
        self._queue: queue.Queue[tuple[int, Callable[[ChunkStore], int | None], str, str]
                                 | None] = queue.Queue(max(queue_depth, 1))
        self._report = report
        self._discarded: set[str] = set()  # damaged: queued copies of them are not made
        self._worker: threading.Thread | None = None
        # every tier that tells of what it drops tells the stack (reports, write_back)
        watched = [getattr(t, "watch_evictions", lambda _: False)(
            functools.partial(self._evicted, i)) for i, t in enumerate(self.tiers)]
        if write_policy == "write_back" and len(self.tiers) > 1 and not watched[0]:
            raise HurrayError(f"write_policy write_back needs a first tier whose evictions "
                              f"the stack sees (mem://), not {self.tiers[0].url}",
                              field="write_policy", value=write_policy,
                              rule="write_back over mem://")

    # -- lookups and reads ---------------------------------------------------------------
    def _remember(self, name: str, tier: int, unless_faster_than: set[int] | None = None
                  ) -> None:
        """``name`` was found in ``tier`` (a lookup's answer); with ``unless_faster_than``
        (the tiers a read tried; none for a copy just made), a faster tier remembered that
        it did not try stays remembered (a promotion into it ended while the read ran)."""
        with self._lock:
            now = self._where.get(name)
            if unless_faster_than is not None and now is not None and now < tier and \
                    now not in unless_faster_than:
                return
            self._where[name] = tier
            self._where.move_to_end(name)
            while len(self._where) > self.REMEMBERED:
                self._where.popitem(last=False)

    def _outage(self, tier: int, op: str, e: BaseException) -> None:
        self.counts["outages"][tier] += 1
        log.warning("tier %d (%s) failed a %s: %s: %s; the other tiers serve", tier,
                    self.tiers[tier].url, op, type(e).__name__, e)

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        out: list[str | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for tier, store in enumerate(self.tiers):
            if not missing:
                break
            try:
                found = store.locate([keys[i] for i in missing])
            except Exception as e:  # a tier down answers misses; the others serve
                self._outage(tier, "lookup", e)
                continue
            for i, name in zip(missing, found, strict=True):
                if name is not None:
                    out[i] = name
                    self._remember(name, tier)
            missing = [i for i in missing if out[i] is None]
        return out

    def _order(self, name: str) -> list[int]:
        with self._lock:
            first = self._where.get(name)
        rest = [t for t in range(len(self.tiers)) if t != first]
        return ([first] if first is not None else []) + rest

    def _read(self, name: str, read: Callable[[ChunkStore], Any]) -> Any:
        """``read`` of the first tier (the remembered one first) that has ``name``."""
        last: BaseException | None = None
        tried: set[int] = set()
        for tier in self._order(name):
            tried.add(tier)
            try:
                got = read(self.tiers[tier])
            except checksums.ChecksumError:
                raise  # damaged in that tier: the caller discards it there
            except HurrayError as e:  # not in this tier (or it failed): the next
                last = e
                continue
            except Exception as e:
                self._outage(tier, "read", e)
                last = e
                continue
            if got is not None:  # None: a tier that cannot read so (get_pages)
                self._remember(name, tier, unless_faster_than=tried)
                self.counts["hits"][tier] += 1
                self.counts["loaded_bytes"][tier] += _nbytes(got)
            return got
        if isinstance(last, HurrayError):
            raise last
        raise HurrayError(f"segment {name} is in no tier of {self.url}", field="segment",
                          value=name, rule="a stored segment")

    def get(self, name: str) -> KVCacheSnapshot:
        return self._read(name, lambda s: s.get(name))

    def get_verified(self, name: str) -> KVCacheSnapshot:
        return self.get_checked(name)[0]

    def get_checked(self, name: str, later: frozenset[str] = frozenset()
                    ) -> tuple[KVCacheSnapshot, checksums.Pending | None]:
        return self._read(name, lambda s: self.checked_from(s, name, later))

    def get_pages(self, name: str, members: frozenset[str]) -> Any:
        """The pages left in the tier's file where its store reads so (``file://``,
        ``hurray://`` on this host), or where a ``mem://`` pool holds them; None: read the
        segment whole (``get_checked``)."""
        def pages(store: ChunkStore) -> Any:
            read = getattr(store, "get_pages", None)
            return None if read is None else read(name, members)

        try:
            return self._read(name, pages)
        except checksums.ChecksumError:
            raise
        except HurrayError:  # in no tier: get_checked says so
            return None

    def served_by(self, name: str) -> int | None:
        """The tier that last answered for ``name`` (0: the fastest)."""
        with self._lock:
            return self._where.get(name)

    # -- promotion ------------------------------------------------------------------------
    def promote(self, name: str, keys: Sequence[str]) -> bool:
        """Copy segment ``name`` (``keys``: its chunk keys, from its first) from the tier
        that served it into the tiers above, off the caller's path: read again there,
        verified (a caller may hold only the pages it placed), then stored.  False when
        nothing was queued: it came from the first tier, ``keys`` are not the segment's,
        or the queue is full."""
        tier = self.served_by(name)
        if not tier or not keys or segment_name(keys, segment_first(name)) != name:
            return False
        first, keys = segment_first(name), list(keys)
        source = self.tiers[tier]
        got: list[KVCacheSnapshot] = []  # read once for all the tiers above

        def copy(store: ChunkStore) -> int | None:
            if name in self._discarded:
                return None
            if not got:
                got.append(source.get_verified(name))
            store.put(keys, first, got[0], dict(got[0].metadata))
            self._remember(name, self.tiers.index(store), set())  # next read from there
            return got[0].nbytes

        queued = [self._enqueue(t, copy, "promotions", name) for t in range(tier)]
        return any(queued)

    def _enqueue(self, tier: int, work: Callable[[ChunkStore], int | None], kind: str,
                 name: str) -> bool:
        """``work(tier's store)`` (segment ``name``'s copy: its bytes stored, None when
        it was not made) now, or on the stack's thread."""
        if self.inline:
            self._done(self.tiers[tier], work, kind, tier, name)
            return True
        self._start()
        try:
            self._queue.put_nowait((tier, work, kind, name))
        except queue.Full:
            self.counts["promotions_skipped" if kind == "promotions" else
                        "writes_dropped"][tier] += 1
            return False
        return True

    def _done(self, store: ChunkStore, work: Callable[[ChunkStore], int | None], kind: str,
              tier: int, name: str) -> None:
        try:
            stored = work(store)
        except HurrayError as e:  # no room (pins fill it), refused: counted
            self.counts["promotions_refused" if kind == "promotions" else
                        "writes_failed"][tier] += 1
            log.info("tier %d (%s) refused a %s: %s", tier, store.url, kind[:-1], e)
        except Exception as e:
            self.counts["promotions_refused" if kind == "promotions" else
                        "writes_failed"][tier] += 1
            self._outage(tier, kind[:-1], e)
        else:
            if stored is None:  # not made (its segment was discarded meanwhile)
                return
            self.counts[kind][tier] += 1
            self.counts["stored_bytes"][tier] += stored
            self._told("stored", name, tier)

    def _start(self) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, daemon=True,
                                                name="hurraykv-tiers")
                self._worker.start()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._done(self.tiers[item[0]], item[1], item[2], item[0], item[3])
            finally:
                self._queue.task_done()

    def settle(self) -> None:
        """Wait until the queued promotions and writes are done."""
        if self._worker is not None:
            self._queue.join()

    # -- writes ---------------------------------------------------------------------------
    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any], *, tiers: Sequence[int] | None = None) -> None:
        """``tiers``: the tiers that take the segment (None: every tier), the first of
        them written before this returns; under ``write_back`` the first tier only."""
        chosen = range(len(self.tiers)) if tiers is None else sorted(set(tiers))
        if not chosen or not 0 <= chosen[0] <= chosen[-1] < len(self.tiers) or (
                self.write_policy == "write_back" and chosen[0] != 0):
            raise HurrayError(f"a put into tiers {list(chosen)} of {self.url}: they are "
                              f"some of 0 to {len(self.tiers) - 1}, the first of them 0 "
                              f"under write_back", field="tiers", value=list(chosen),
                              rule="tiers of the stack; the first under write_back")
        name, top = segment_name(keys, first), chosen[0]
        self._discarded.discard(name)  # computed again: stored again
        self.tiers[top].put(keys, first, snapshot, metadata)
        self.counts["writes"][top] += 1
        self.counts["stored_bytes"][top] += snapshot.nbytes
        self._remember(name, top)
        self._told("stored", name, top)
        if self.write_policy == "write_through":
            keys, metadata = list(keys), dict(metadata)

            def copy(store: ChunkStore) -> int | None:
                if name in self._discarded:
                    return None
                store.put(keys, first, snapshot, metadata)
                return snapshot.nbytes

            for tier in chosen[1:]:
                self._enqueue(tier, copy, "writes", name)

    def _evicted(self, tier: int, keys: Sequence[str], first: int,
                 segment: Callable[[], KVCacheSnapshot] | None) -> None:
        """``tier`` dropped a segment (reported): to make room (``segment`` makes it), or
        past its lifetime (None); under ``write_back``, what the first tier dropped to make
        room goes down to the second."""
        name = segment_name(keys, first)
        self._told("removed", name, tier)
        if tier or self.write_policy != "write_back" or len(self.tiers) < 2 or \
                segment is None:
            return
        snapshot = segment()
        keys, metadata = list(keys), dict(snapshot.metadata)

        def copy(store: ChunkStore) -> int:
            store.put(keys, first, snapshot, metadata)
            return snapshot.nbytes

        self._enqueue(1, copy, "writes", name)

    def _told(self, kind: str, name: str, tier: int) -> None:
        if self._report is not None:
            self._report(kind, name, tier)

    # -- what is stored -------------------------------------------------------------------
    def catalog(self) -> list[Stored]:
        return merged(self.catalogs())

    def catalogs(self) -> list[list[Stored]]:
        """Each tier's catalog (``hurraykv cache ls`` per tier); a tier that fails lists
        nothing."""
        out: list[list[Stored]] = []
        for tier, store in enumerate(self.tiers):
            try:
                out.append(store.catalog())
            except Exception as e:
                self._outage(tier, "catalog", e)
                out.append([])
        return out

    def remove(self, name: str) -> bool:
        removed = False
        for tier, store in enumerate(self.tiers):
            if store.remove(name):
                removed = True
                self._told("removed", name, tier)
        return removed

    def exists(self, names: Sequence[str]) -> list[bool]:
        out = [False] * len(names)
        for tier, store in enumerate(self.tiers):
            try:
                there = store.exists(names)
            except Exception as e:
                self._outage(tier, "exists", e)
                continue
            out = [a or b for a, b in zip(out, there, strict=True)]
        return out

    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        """Every tier's; the first tier's refusal is the caller's (a pin past its
        budget), a lower tier's is logged (Redis keeps no pins)."""
        done: set[str] = set()
        for tier, store in enumerate(self.tiers):
            try:
                done.update(store.retain(names, pin=pin, ttl_s=ttl_s, extend=extend))
            except HurrayError as e:
                if tier == 0:
                    raise
                log.info("tier %d (%s) did not retain: %s", tier, store.url, e)
        return [n for n in dict.fromkeys(names) if n in done]

    def discard(self, name: str) -> None:
        """Out of every tier (its copies are the same bytes), and no queued copy of it
        made."""
        self._discarded.add(name)
        for tier, store in enumerate(self.tiers):
            store.discard(name)
            self._told("removed", name, tier)

    def connect(self) -> None:
        for store in self.tiers:
            store.connect()

    def close(self) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(30)
        for store in self.tiers:
            store.close()


def merged(catalogs: list[list[Stored]]) -> list[Stored]:
    """The tiers' catalogs as one: each segment once, as the first tier holding it lists
    it."""
    seen: dict[str, Stored] = {}
    for listed in catalogs:
        for s in listed:
            seen.setdefault(s.name, s)
    return list(seen.values())


def _nbytes(got: Any) -> int:
    """The bytes of what a read gave: a snapshot, or a tuple that starts with one."""
    snap = got[0] if isinstance(got, tuple) else got
    return getattr(snap, "nbytes", 0)


__all__ = ["COUNTS", "POLICIES", "StackedChunks", "merged", "tier_counts"]
