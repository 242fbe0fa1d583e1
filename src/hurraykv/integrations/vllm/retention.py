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

*The watch* (``Watch``, with KV events on): the segments announced stored are checked
on a thread of their own every ``removal_check_s`` with one batched ``exists`` per
thousand (a stat per file, one pipelined EXISTS per Redis node, one HAS on a server);
one found gone - evicted by this engine or another sharing the directory, by a server's
memory or persist budget, by Redis's ``maxmemory``, removed by an operator - is handed
to the scheduler thread, which announces its blocks removed at the next
``take_events``.  A router therefore sees a prefix that is gone for at most
``removal_check_s`` plus one check (the staleness window, measured by
``benchmarks/bench_vllm.py --only removals``).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from .common import log

BATCH = 1000  # names per exists call


def rank_names(name: str, ranks: int) -> list[str]:
    """Segment ``name`` as each tensor-parallel rank stores it (``chunks.Suffixed``)."""
    if ranks <= 1:
        return [name]
    key, _, first = name.rpartition("-")
    return [f"{key}.tp{r}-{first}" for r in range(ranks)]


class Watch:
    """The segments announced stored (at most ``limit``, the oldest dropped), checked
    every ``every`` seconds over a connection of its own (``open_store()``)."""

    def __init__(self, open_store: Callable[[], Any], every: float,
                 limit: int = 100_000) -> None:
        self._open, self.every, self.limit = open_store, every, limit
        self._names: OrderedDict[str, None] = OrderedDict()
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
                self._names[name] = None
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

    def take_gone(self) -> list[str]:
        """The names found gone since the last call."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def check(self, store: Any) -> None:
        """One pass: every name watched asked about, those gone moved to ``take_gone``."""
        with self._lock:
            names = list(self._names)
        gone: list[str] = []
        for at in range(0, len(names), BATCH):
            batch = names[at:at + BATCH]
            gone += [n for n, alive in zip(batch, store.exists(batch), strict=True)
                     if not alive]
        with self._lock:
            for name in gone:
                if self._names.pop(name, 0) is None:  # not forgotten meanwhile
                    self._gone.append(name)
        self.checks += 1

    def _run(self) -> None:
        store = None
        while not self._stop.wait(self.every):
            try:
                if store is None:
                    store = self._open()
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
                store = None
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


__all__ = ["Watch", "rank_names"]
