"""What stays cached, as the scheduler part sees it: vLLM's reset, and the watch that
tells routers when a segment they were told of is gone.

*Reset.*  vLLM's ``reset_prefix_cache(reset_connector=True)`` (what
``/reset_prefix_cache?reset_external=true``, ``pause_generation(clear_cache=True)`` and
reinforcement-learning weight updates call) ends in the scheduler connector's
``reset_cache()`` (``vllm/v1/core/sched/scheduler.py:2885-2898``; a False answer fails
the reset).  ``SchedulerSide.reset`` removes every segment stored under this engine's
cache identity - every rank's, every LoRA adapter's and ``cache_salt``'s (they share the
identity) - and no other identity's (another model, dtype or store format), through
``ChunkStore.clear``, which lists the store again afterwards: True only when none is
left.  Then what the engine knew of the store is forgotten (lookups answered, chunks
known stored), and the segments announced to routers are announced removed.

Two races are closed.  A segment planned before the reset may be written after it (the
writer thread runs behind the scheduler): it holds KV of the old weights, so it is
*stale*: removed when its write is reported, and never announced.  A request running
through the reset holds blocks computed before it: nothing more of it is stored.  A
load already under way reads a segment that is gone and fails; vLLM recomputes it.

*Pins and lifetimes* (``Keep``), asked per request with ``kv_transfer_params`` (the
OpenAI API's top-level field; vLLM hands it to the connector as ``request
.kv_transfer_params``, ``vllm/v1/request.py:120``): ``{"hurraykv": {"pin": true, "ttl_s":
3600}}``.  ``pin``: the segments the request stores, and those its prompt was found in,
are never evicted to make room (within the store's ``max_pinned_bytes``); ``ttl_s``: they
are a miss that many seconds after the request (each request asking again renews it).
The worker retains what it writes (``saves.py``); the hit's segments are retained off the
scheduler thread (``Retainer``).  A malformed ask is refused with a warning naming the
field, and counted; the request runs unretained.

*The watch* (``Watch``, with KV events on): the segments announced stored are checked
on a thread of their own every ``removal_check_s`` with one batched ``exists`` per
thousand (a stat per file, one pipelined EXISTS per Redis node, one HAS on a server);
one found gone - evicted by this engine or another sharing the directory, by a server's
memory or persist budget, by Redis's ``maxmemory``, removed by an operator - is handed
to the scheduler thread, which announces its blocks removed at the next
``take_events``.  A router therefore sees a prefix that is gone for at most
``removal_check_s`` plus one check (the staleness window, measured by
``benchmarks/bench_vllm.py --only removals``).  With tiers it watches each (segment,
tier) announced and asks that tier alone (``tier_events.py``), a tier that fails
skipped for that pass.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ...chunks.suffixed import suffixed
from ...errors import HurrayError, did_you_mean
from ...io.retention import ttl_seconds
from .common import log

BATCH = 1000  # names per exists call
PARAMS = "hurraykv"  # the key of kv_transfer_params the connector reads
KEEP_FIELDS = ("pin", "ttl_s")


@dataclass(frozen=True)
class Keep:
    """How long a request's segments stay: pinned, and for how many seconds."""

    pin: bool = False
    ttl_s: float | None = None


def keep_of(request: Any) -> Keep | None:
    """What ``request.kv_transfer_params["hurraykv"]`` asks (None: nothing); a
    ``HurrayError`` naming the field for a malformed ask."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or PARAMS not in params:
        return None
    ours = params[PARAMS]
    if not isinstance(ours, dict):
        raise HurrayError(f"kv_transfer_params[{PARAMS!r}] is a {type(ours).__name__}; it "
                          f"is an object with {' and '.join(KEEP_FIELDS)}",
                          field=f"kv_transfer_params.{PARAMS}", value=type(ours).__name__,
                          rule="a JSON object")
    unknown = sorted(set(ours) - set(KEEP_FIELDS), key=repr)
    if unknown:
        raise HurrayError(f"kv_transfer_params[{PARAMS!r}] has unknown key(s) {unknown}"
                          f"{did_you_mean(unknown[0], KEEP_FIELDS)}; known: "
                          f"{', '.join(KEEP_FIELDS)}",
                          field=f"kv_transfer_params.{PARAMS}", value=unknown,
                          rule="pin and ttl_s only")
    pin, ttl = ours.get("pin", False), ours.get("ttl_s")
    if not isinstance(pin, bool):
        raise HurrayError(f"kv_transfer_params[{PARAMS!r}]['pin'] is {pin!r}; it is true "
                          "or false", field=f"kv_transfer_params.{PARAMS}.pin", value=pin,
                          rule="a boolean")
    if ttl is not None:
        ttl = ttl_seconds(ttl, f"kv_transfer_params.{PARAMS}.ttl_s")
    return Keep(pin, ttl) if pin or ttl is not None else None


def retain(store: Any, names: list[str], keep: Keep, stats: Any) -> None:
    """``store.retain`` as a request's ``keep`` asks (merged with what the segments keep:
    a pin only added, a lifetime only made later), counted.  A pin refused (past the
    pinned budget, or a store that cannot pin) still gives the lifetime asked; it is
    logged (first, then every 100th).  A store that fails raises."""
    try:
        done = store.retain(names, pin=True if keep.pin else None, ttl_s=keep.ttl_s,
                            extend=True)
    except HurrayError as e:  # past max_pinned_bytes, or a store that cannot pin
        if not keep.pin or e.field not in ("max_pinned_bytes", "pin"):
            raise
        stats.add(pins_refused=len(names))
        if stats.pins_refused <= len(names) or stats.pins_refused % 100 < len(names):
            log.warning("pin refused (%d segments so far): %s", stats.pins_refused, e)
        if keep.ttl_s is None:
            return
        done = store.retain(names, pin=None, ttl_s=keep.ttl_s, extend=True)
    stats.add(segments_retained=len(done))


class Retainer:
    """Store work off vLLM's scheduler thread, in order, on a thread of its own over a
    connection to every rank's objects: the segments a hit was found in retained
    (``ask``), the segments written after a reset removed (``remove``: their segment ids
    come back through ``take_removed``)."""

    def __init__(self, open_store: Callable[[], Any], ranks: int, stats: Any) -> None:
        self._open, self.ranks, self.stats = open_store, ranks, stats
        self._queue: list[Callable[[Any], None]] = []
        self._removed: list[str] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._busy = False

    def ask(self, names: Iterable[str], keep: Keep) -> None:
        named = [r for n in dict.fromkeys(names) for r in rank_names(n, self.ranks)]
        if named:
            self._submit(lambda store: retain(store, named, keep, self.stats))

    def remove(self, segment: str, name: str) -> None:
        """Remove every rank's ``name``; ``segment`` is then handed to ``take_removed``."""
        def work(store: Any) -> None:
            for r in rank_names(name, self.ranks):
                store.remove(r)
            with self._cv:
                self._removed.append(segment)

        self._submit(work)

    def take_removed(self) -> list[str]:
        with self._cv:
            out, self._removed = self._removed, []
        return out

    def _submit(self, work: Callable[[Any], None]) -> None:
        with self._cv:
            self._queue.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="hurraykv-retain")
                self._thread.start()
            self._cv.notify()

    def wait_idle(self, timeout: float) -> bool:
        """Until everything asked is done (tests)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _run(self) -> None:
        store = None
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    break
                work = self._queue.pop(0)
                self._busy = True
            try:
                if store is None:
                    store = self._open()
                work(store)
            except Exception as e:  # the store down: a later ask tries again
                log.warning("store work off the scheduler thread failed (%s: %s)",
                            type(e).__name__, e)
                with contextlib.suppress(Exception):
                    if store is not None:
                        store.close()
                store = None
            with self._cv:
                self._busy = False
                self._cv.notify_all()
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def rank_names(name: str, ranks: int) -> list[str]:
    """Segment ``name`` as each tensor-parallel rank stores it (``chunks.Suffixed``)."""
    return [name] if ranks <= 1 else [suffixed(name, f".tp{r}") for r in range(ranks)]


class Watch:
    """The segments announced stored (at most ``limit``, the oldest dropped), checked
    every ``every`` seconds over a connection of its own (``open_store()``); a name, or
    with a stack of tiers a ``(name, tier)``, checked in that tier."""

    def __init__(self, open_store: Callable[[], Any], every: float,
                 limit: int = 100_000) -> None:
        self._open, self.every, self.limit = open_store, every, limit
        # name -> how many times it was watched: a name watched again while a check runs
        # (stored again) is not the one the check found gone
        self._names: OrderedDict[str, int] = OrderedDict()
        self._gone: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.checks = 0  # passes over the names, for tests and the benchmark

    def watch(self, names: Iterable[str]) -> None:
        if not self.every:
            return
        with self._lock:
            for name in names:
                self._names[name] = self._names.get(name, 0) + 1
                self._names.move_to_end(name)
            while len(self._names) > self.limit:
                self._names.popitem(last=False)
            if self._thread is None and self._names and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="hurraykv-removal-watch")
                self._thread.start()

    def forget(self) -> None:
        """Stop watching everything (a reset announced it all removed)."""
        with self._lock:
            self._names.clear()
            self._gone.clear()

    def gone_now(self, names: list[str]) -> None:
        """Segments a store told of as it removed them (``ChunkStore.removals``)."""
        with self._lock:
            for name in names:
                if self._names.pop(name, None) is not None:
                    self._gone.append(name)

    def take_gone(self) -> list[str]:
        """The names found gone since the last call."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def check(self, store: Any) -> None:
        """One pass: every name watched asked about, those gone moved to ``take_gone``;
        a tier that fails is skipped (its error raised after the others were asked)."""
        with self._lock:
            seen = dict(self._names)
        by_tier: dict[int | None, list[Any]] = {}
        for entry in seen:
            by_tier.setdefault(entry[1] if isinstance(entry, tuple) else None,
                               []).append(entry)
        gone: list[Any] = []
        failed: Exception | None = None
        for tier, entries in by_tier.items():
            asked = store if tier is None else store.tiers[tier]
            names = [e[0] if isinstance(e, tuple) else e for e in entries]
            try:
                for at in range(0, len(names), BATCH):
                    alive = asked.exists(names[at:at + BATCH])
                    gone += [e for e, ok in zip(entries[at:at + BATCH], alive, strict=True)
                             if not ok]
            except Exception as e:  # the other tiers are still asked
                failed = e
        with self._lock:
            for name in gone:
                # neither forgotten nor watched again (stored again) meanwhile
                if self._names.get(name) == seen[name]:
                    del self._names[name]
                    self._gone.append(name)
        self.checks += 1
        if failed is not None:
            raise failed

    def _run(self) -> None:
        store, subscribed, wait = None, False, 0.0  # the first look at once
        while not self._stop.wait(wait):
            wait = self.every
            try:
                if store is None:
                    store = self._open()
                if not subscribed:  # a store that tells of removals as they happen
                    store.removals(self.gone_now, self._stop)  # (Redis keyspace events)
                    subscribed = True
                self.check(store)
                if self._failing:
                    log.info("removal watch: the store answers again")
                self._failing = False
            except Exception as e:  # a store down: checked again next time
                if not self._failing:
                    log.warning("removal watch: the store did not answer (%s: %s); "
                                "removals are announced once it does", type(e).__name__, e)
                self._failing = True
                if store is not None:
                    with contextlib.suppress(Exception):
                        store.close()
                store, subscribed = None, False
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


__all__ = ["PARAMS", "Keep", "Retainer", "Watch", "keep_of", "rank_names", "retain"]
