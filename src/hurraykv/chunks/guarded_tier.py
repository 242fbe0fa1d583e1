"""One tier of a stack behind its own deadline and circuit breaker (``guard.Guarded``), so
that a tier down, hung or slow costs the stack that tier's answer and nothing else.

Each call runs on the tier's guard thread and waits at most its deadline (``timeouts``:
the operation's share of the connector's deadline); a tier that fails ``failures`` calls
in a row is skipped for a backoff that doubles, then probed, and comes back by itself once
it answers (``guard.py`` says how).  A segment the tier does not hold is its answer, not
a failure: a read's ``HurrayError`` comes back as itself (a ``ChecksumError`` too, for
the caller to discard the damaged copy); a tier that did not answer is a
``TransportError`` naming it, or misses for a lookup."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import HurrayError, TransportError
from ..io import checksums
from ..snapshot import KVCacheSnapshot
from .guard import Guarded
from .registry import ChunkStore, Stored, store_class

_NO_ANSWER = object()


class GuardedTier(ChunkStore):
    """``open_store()`` opens the tier (again, after a failure); ``timeouts``: seconds per
    operation, ``lookup``, ``load`` and ``save`` (the rest take ``save``'s)."""

    BOUNDED = True  # its guard's deadline

    def __init__(self, open_store: Callable[[], ChunkStore], *, url: str,
                 timeouts: Mapping[str, float], log: logging.Logger, failures: int = 3,
                 max_backoff: float = 30.0) -> None:
        self.url, self.timeouts = url, dict(timeouts)
        self._evicted: Callable[..., None] | None = None

        def opened() -> ChunkStore:
            store = open_store()
            if self._evicted is not None:
                store.watch_evictions(self._evicted)  # type: ignore[attr-defined]
            return store

        self.guard = Guarded(opened, url=url, what="tier", timeout=self.timeouts["save"],
                             log=log, failures=failures, max_backoff=max_backoff)

    def _call(self, op: str, kind: str, fn: Callable[[ChunkStore], Any]) -> Any:
        """``fn(store)``'s answer; a ``HurrayError`` other than a transport's is the
        tier's answer (raised here), anything else or no answer in time a
        ``TransportError``."""
        def run(store: ChunkStore) -> Any:
            try:
                return fn(store)
            except TransportError:
                raise
            except HurrayError as e:  # the tier answered: not a failure of it
                return _Raised(e)

        got = self.guard.call(op, run, _NO_ANSWER, timeout=self.timeouts[kind])
        if got is _NO_ANSWER:
            raise TransportError(f"tier {self.url} did not answer a {op} (down, or past its "
                                 f"deadline of {self.timeouts[kind] * 1000:.0f} ms)",
                                 field="url", value=self.url, rule="a tier that answers")
        if isinstance(got, _Raised):
            raise got.error
        return got

    def watch_evictions(self, callback: Callable[..., None]) -> bool:
        """Whether the tier's store tells of the segments it drops (``mem://``); if so it
        tells ``callback``, from the store's opening on (reopened too)."""
        cls = store_class(self.url.partition(":")[0])
        if cls is None or not hasattr(cls, "watch_evictions"):
            return False
        self._evicted = callback
        return True

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        return self._call("locate", "lookup", lambda s: s.locate(keys))

    def get(self, name: str) -> KVCacheSnapshot:
        return self._call("get", "load", lambda s: s.get(name))

    def get_verified(self, name: str) -> KVCacheSnapshot:
        return self._call("get", "load", lambda s: s.get_verified(name))

    def get_checked(self, name: str, later: frozenset[str] = frozenset()
                    ) -> tuple[KVCacheSnapshot, checksums.Pending | None]:
        return self._call("get", "load", lambda s: self.checked_from(s, name, later))

    def get_pages(self, name: str, members: frozenset[str]) -> Any:
        got = self._call("get", "load", lambda s: s.get_pages(name, members)
                         if hasattr(s, "get_pages") else None)
        if got is not None and getattr(got[1], "fill", None) is not None:
            got[1].fill = self.guard.watched("fill", got[1].fill)  # this tier's breaker
        return got

    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        self._call("put", "save", lambda s: s.put(keys, first, snapshot, metadata))

    def catalog(self) -> list[Stored]:
        return self._call("catalog", "save", lambda s: s.catalog())

    def remove(self, name: str) -> bool:
        return self._call("remove", "save", lambda s: s.remove(name))

    def exists(self, names: Sequence[str]) -> list[bool]:
        return self._call("exists", "save", lambda s: s.exists(names))

    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        return self._call("retain", "save", lambda s: s.retain(names, pin=pin, ttl_s=ttl_s,
                                                                extend=extend))

    def discard(self, name: str) -> None:
        self._call("discard", "save", lambda s: s.discard(name))

    def close(self) -> None:
        self.guard.close()


class _Raised:
    """A tier's own refusal, carried out of the guard (which takes exceptions for
    failures)."""

    def __init__(self, error: HurrayError) -> None:
        self.error = error


__all__ = ["GuardedTier"]
