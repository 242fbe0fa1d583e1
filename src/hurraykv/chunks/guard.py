"""A chunk store behind a deadline and a circuit breaker: the engine never waits on, nor
dies of, its cache.

The connector's lookups, loads and saves run on threads of their own (a lookup thread,
a loader, a writer; a synchronous load on the engine's), and a store that hangs must
hold none of them for long, nor one that raises kill anything.  ``Guarded`` runs each
store call on its own thread, one at a time in the order asked, and waits at most
``timeout`` for it (waiting behind an earlier call included).  A store whose calls
return within their deadlines by themselves (``ChunkStore.BOUNDED``: a ``mem://`` pool,
nothing to wait on; a stack of tiers each behind a guard of its own) is called on the
caller's thread instead, its answers and errors taken as below: two thread hand-overs
cost more than a hit from memory, and under the engine's own threads far more.

* an answer in time is the answer;
* a call that raises anything (a ``HurrayError``, redis-py's ``ConnectionError`` or
  ``TimeoutError``, an ``OSError``, a bug of ours) or outlasts its deadline gives the
  caller's ``default`` (a miss, a failed load: the engine computes instead);
* after ``failures`` such calls in a row the store counts as *down*: calls give the
  default at once, without touching the store, for a backoff that doubles from
  ``backoff`` up to ``max_backoff``; then one call probes it.  Its success brings it
  back; its failure starts the next, longer backoff;
* connections are (re)opened on the guard's thread, after the call that lost one has
  given its caller the default: a caller never waits past its deadline, except the very
  first call, which waits up to ``connect_timeout`` for the connection ``warm()`` opens
  at start;
* a call still running past its deadline (a hung store) makes the next calls give the
  default at once rather than queue behind it; they are not failures of their own (a
  call in flight is no sign of a sick store: counting them declared a healthy store
  down under load, issue 30), but the hung call is charged one more failure for each
  further deadline it runs past, so a store that stays hung is declared down; its
  connection is closed and reopened when it returns.

State changes are logged once each (down, with the error; back, with how long it was
down and how many calls were skipped), never once per call, and counted in ``stats``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")
CONSEQUENCE = {"lookup": "requests compute instead of loading",
               "load": "matched chunks are recomputed", "save": "new chunks are not stored",
               "tier": "the other tiers serve"}


class Guarded:
    def __init__(self, open_store: Callable[[], Any], *, url: str, what: str,
                 timeout: float, log: logging.Logger, failures: int = 3,
                 connect_timeout: float = 2.0,
                 backoff: float = 1.0, max_backoff: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._open, self.url, self.what, self.timeout = open_store, url, what, timeout
        self.connect_timeout = connect_timeout
        self._log, self._failures, self._clock = log, failures, clock
        self._backoff0, self._max_backoff = backoff, max_backoff
        self._store: Any = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"hurraykv-{what}")
        self._running: Future | None = None
        self._warming: Future | None = None
        self._lock = threading.Lock()
        self._stale = False  # the running call outlived its deadline: reconnect after it
        # calls past their deadline, maybe still running: future -> [started, failures
        # charged to it]
        self._late: dict[Future, list[float]] = {}
        self._in_a_row = 0
        self._backoff = backoff
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._skipped = 0
        self.stats = {"calls": 0, "failures": 0, "timeouts": 0, "skipped": 0, "outages": 0}

    def warm(self) -> None:
        """Open the store now, on the guard's thread (importing its client and connecting
        take longer than a lookup's deadline); a first call waits for this, bounded by
        ``connect_timeout``, instead of counting it against the store."""
        with self._lock:
            if self._running is None:
                self._running = self._warming = self._thread.submit(self._open_once)

    def _open_once(self) -> None:
        with contextlib.suppress(Exception):  # a store down at start: the calls will say
            if self._store is None:
                store = self._open()
                getattr(store, "connect", lambda: None)()
                self._store = store

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def call(self, op: str, fn: Callable[[Any], T], default: T,
             timeout: float | None = None) -> T:
        """``fn(store)`` within the deadline, else ``default`` (see the module text)."""
        warming = self._warming
        if warming is not None:
            self._warming = None
            with contextlib.suppress(Exception):
                warming.result(timeout=self.connect_timeout)
        now = self._clock()
        deadline = self.timeout if timeout is None else timeout
        with self._lock:
            for done in [f for f in self._late if f.done()]:
                del self._late[done]
            hung = next(iter(self._late.values()), None)  # the oldest
            skip = hung is not None or (self.down and now < self._retry_at)
            if skip:
                self._skipped += 1
                self.stats["skipped"] += 1
            overdue = (hung is not None and not self.down
                       and now - hung[0] >= deadline * (hung[1] + 1))
            if overdue:
                hung[1] += 1
        if overdue:  # the hung call passed one more deadline: one more failure
            self._failed(op, f"a call has not returned for {now - hung[0]:.1f} s")
        if skip:
            return default
        store = self._store
        if getattr(store, "BOUNDED", False):  # no thread to hand over to and back
            with self._lock:
                self.stats["calls"] += 1
            try:
                result = fn(store)
            except Exception as exc:
                self._failed(op, f"{type(exc).__name__}: {exc}")
                return default
            self._succeeded()
            return result
        with self._lock:
            self.stats["calls"] += 1
            future = self._thread.submit(self._run, fn)
            self._running = future
        try:
            result = future.result(timeout=deadline)
        except FutureTimeout:
            if not future.cancel():  # it runs (not merely queued): reconnect after it
                with self._lock:
                    self._stale = True
                    self._late[future] = [now, 1]
            self.stats["timeouts"] += 1
            self._failed(op, f"no answer within {deadline * 1000:.0f} ms")
            return default
        except Exception as exc:  # every error a store can raise is a miss
            self._failed(op, f"{type(exc).__name__}: {exc}")
            return default
        self._succeeded()
        return result

    def watched(self, op: str, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` whose errors count as this store's failures, and its returns as
        successes: a call the store's own objects make later, outside ``call`` (an
        ``s3://`` load's page fetch, bounded by the store's own deadline)."""
        def run(*args: Any) -> T:
            try:
                out = fn(*args)
            except Exception as exc:
                self._failed(op, f"{type(exc).__name__}: {exc}")
                raise
            self._succeeded()
            return out

        return run

    def _run(self, fn: Callable[[Any], T]) -> T:
        try:
            if self._store is None:
                self._store = self._open()
            return fn(self._store)
        except BaseException:
            self._reset()  # a connection that failed mid-call is not trusted again
            raise
        finally:
            with self._lock:
                stale, self._stale = self._stale, False
            if stale:
                self._reset()
            if self._store is None:  # reconnect here, off the caller's deadline
                self._open_once()

    def _reset(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(Exception):  # closing a broken connection may fail
                store.close()

    def _failed(self, op: str, why: str) -> None:
        with self._lock:  # callers on several threads (a loader's and the engine's)
            self._count_failure(op, why)

    def _count_failure(self, op: str, why: str) -> None:
        self.stats["failures"] += 1
        self._in_a_row += 1
        now = self._clock()
        if self.down:  # a probe failed: back off longer
            self._backoff = min(self._backoff * 2, self._max_backoff)
            self._retry_at = now + self._backoff
            return
        if self._in_a_row >= self._failures:
            self._down_since, self._backoff = now, self._backoff0
            self._retry_at = now + self._backoff
            self._skipped = 0
            self.stats["outages"] += 1
            self._log.warning("chunk store %s is failing (%s; %d failed %s calls in a row, "
                              "last: %s): %s; retrying in %.0f s, backing off up to %.0f s",
                              self.url, why, self._in_a_row, self.what, op,
                              CONSEQUENCE.get(self.what, "calls are skipped"), self._backoff,
                              self._max_backoff)

    def _succeeded(self) -> None:
        with self._lock:
            self._count_success()

    def _count_success(self) -> None:
        if self.down:
            self._log.warning("chunk store %s is back after %.1f s; %d %s calls were skipped "
                              "meanwhile", self.url, self._clock() - self._down_since,
                              self._skipped, self.what)
        self._in_a_row, self._down_since, self._backoff = 0, None, self._backoff0

    def close(self, wait: float = 5.0) -> None:
        """Stop the thread (waiting up to ``wait`` seconds for a running call) and close
        the store."""
        running = self._running
        if running is not None and not running.done():
            with contextlib.suppress(Exception):  # its outcome no longer matters
                running.result(timeout=wait)
        self._thread.shutdown(wait=False, cancel_futures=True)
        if running is None or running.done():
            self._reset()
