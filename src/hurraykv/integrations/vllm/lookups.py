"""Lookups off vLLM's scheduler thread.

vLLM asks ``get_num_new_matched_tokens`` for every waiting request on its scheduler
thread, and the answer ``None`` means "ask again at a later step" (vLLM 0.32,
``vllm/v1/core/sched/scheduler.py``: the request is skipped for this step).  So a lookup
never blocks there: ``ask`` queues the request's chunk keys and answers ``PENDING``
until the lookup thread has the store's answer.  The thread takes every request queued
meanwhile and asks the store once for all their keys (one round trip per batch, however
many requests arrive in a step), behind the guard's deadline and circuit breaker
(``guard.py``): a slow or hung store delays only the requests it would serve, and a
lookup that fails or passes its deadline is a miss for its requests, never for others.

An answer is kept until the scheduler has used it (``forget``: the request was allocated
or finished); a request asked about again after that (a preempted one) is looked up again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ...chunks.guard import Guarded
from .common import Counters

PENDING = object()  # no answer yet


def _located(store: Any, keys: list[str]) -> tuple[list[Any], list[int | None] | None]:
    """``store.locate(keys)``, and for a stack the tier that answered each name."""
    located = store.locate(keys)
    served_by = getattr(store, "served_by", None)
    if served_by is None:
        return located, None
    return located, [None if name is None else served_by(name) for name in located]


class Lookups:
    def __init__(self, guarded: Guarded, stats: Counters) -> None:
        self._guarded, self._stats = guarded, stats
        self._cv = threading.Condition()
        self._queued: dict[str, list[str]] = {}  # request id -> its keys, not yet asked
        self._asking: set[str] = set()  # in the batch the thread is asking about
        self._answers: dict[str, list[Any] | None] = {}  # None: the store did not answer
        self._tiers: dict[str, list[int | None]] = {}  # a stack's: the tier of each name
        self._closed = False
        self._thread: threading.Thread | None = None

    def ask(self, req_id: str, keys: list[str]) -> Any:
        """The store's answer for ``keys`` (one located name or None per key; None when
        the store did not answer), or ``PENDING``."""
        with self._cv:
            if req_id in self._answers:
                return self._answers[req_id]
            if req_id not in self._queued and req_id not in self._asking:
                self._queued[req_id] = keys
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="hurraykv-lookup")
                    self._thread.start()
                self._cv.notify()
            return PENDING

    def tiers(self, req_id: str) -> list[int | None] | None:
        """With a stack of tiers: the tier each name of ``req_id``'s answer was found in
        (0: the fastest); None otherwise."""
        with self._cv:
            return self._tiers.get(req_id)

    def forget(self, req_id: str) -> None:
        with self._cv:
            self._answers.pop(req_id, None)
            self._tiers.pop(req_id, None)
            self._queued.pop(req_id, None)
            self._asking.discard(req_id)  # its answer, when it comes, is dropped

    def forget_all(self) -> None:
        """Every answer dropped, those in flight too (the store was cleared): the next
        ``ask`` of each request looks up again."""
        with self._cv:
            self._answers.clear()
            self._tiers.clear()
            self._asking = set()

    def wait_any(self, timeout: float) -> None:
        """Wait until a lookup in flight is answered, at most ``timeout`` (a step with
        nothing to run: vLLM's loop would step again at once, holding the GIL the lookup
        thread needs)."""
        with self._cv:
            if self._queued or self._asking:
                self._cv.wait(timeout)

    def wait(self, req_id: str, timeout: float) -> bool:
        """Wait until ``req_id`` has an answer (tests)."""
        with self._cv:
            return self._cv.wait_for(lambda: req_id in self._answers, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queued or self._closed)
                if self._closed:
                    return
                batch, self._queued = self._queued, {}
                self._asking = set(batch)
            keys = [k for ks in batch.values() for k in ks]
            started = time.perf_counter()
            got = self._guarded.call("locate", lambda store, k=keys: _located(store, k), None)
            self._stats.add(lookup_seconds=time.perf_counter() - started)
            located, tiers = got if got is not None else (None, None)
            if located is not None and len(located) != len(keys):
                located = None  # a store answering nonsense is not believed
            with self._cv:
                at = 0
                for req_id, ks in batch.items():
                    if req_id in self._asking:  # not forgotten meanwhile
                        self._answers[req_id] = (None if located is None
                                                 else list(located[at:at + len(ks)]))
                        if located is not None and tiers is not None:
                            self._tiers[req_id] = tiers[at:at + len(ks)]
                    at += len(ks)
                self._asking = set()
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


__all__ = ["PENDING", "Lookups"]
