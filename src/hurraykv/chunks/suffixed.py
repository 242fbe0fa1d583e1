"""One tensor-parallel rank's view of a store: every key and segment name carries the
rank's suffix, so the ranks' objects sit side by side; callers see the plain names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..io import checksums
from ..snapshot import KVCacheSnapshot
from .registry import ChunkStore, Stored


def suffixed(name: str, suffix: str) -> str:
    """Segment ``name`` as a store whose keys carry ``suffix`` names it (a rank's)."""
    key, _, first = name.rpartition("-")
    return f"{key}{suffix}-{first}"


class Suffixed(ChunkStore):
    """A store whose keys and segment names all carry ``suffix`` (one tensor-parallel
    rank's objects beside the others'); callers see the plain names."""

    def __init__(self, store: ChunkStore, suffix: str) -> None:
        self.inner, self.suffix, self.url = store, suffix, store.url

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        names = self.inner.locate([k + self.suffix for k in keys])
        return [None if n is None else self._plain(n) for n in names]

    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        self.inner.put([k + self.suffix for k in keys], first, snapshot, metadata)

    def get(self, name: str) -> KVCacheSnapshot:
        return self.inner.get(self._named(name))

    @property
    def evictions(self) -> int:  # type: ignore[override]
        return self.inner.evictions

    def get_verified(self, name: str) -> KVCacheSnapshot:
        return self.get_checked(name)[0]

    def get_checked(self, name: str, later: frozenset[str] = frozenset()
                    ) -> tuple[KVCacheSnapshot, checksums.Pending | None]:
        return self.checked_from(self.inner, self._named(name), later)

    def connect(self) -> None:
        self.inner.connect()

    def catalog(self) -> list[Stored]:  # every rank's: a reset clears them all
        return self.inner.catalog()

    def remove(self, name: str) -> bool:
        return self.inner.remove(name)

    def exists(self, names: Sequence[str]) -> list[bool]:
        return self.inner.exists([self._named(n) for n in names])

    def removals(self, notify: Callable[[list[str]], None], stop: Any) -> bool:
        def mine(names: list[str]) -> None:
            notify([self._plain(n) for n in names if n.rpartition("-")[0].endswith(
                self.suffix)])

        return self.inner.removals(mine, stop)

    def watch_evictions(self, callback: Callable[[list[str], int, Any], None]) -> bool:
        """The inner store's evictions (a ``mem://`` pool's), told with the plain keys: a
        stack of one rank's tiers writes a segment back, and reports it, by them."""
        watch = getattr(self.inner, "watch_evictions", None)
        if watch is None:
            return False
        suffix = self.suffix
        return bool(watch(lambda keys, first, snapshot: callback(
            [k.removesuffix(suffix) for k in keys], first, snapshot)))

    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        done = self.inner.retain([self._named(n) for n in names], pin=pin, ttl_s=ttl_s,
                                 extend=extend)
        return [self._plain(n) for n in done]

    def discard(self, name: str) -> None:
        self.inner.discard(self._named(name))

    def _named(self, name: str) -> str:
        return suffixed(name, self.suffix)

    def _plain(self, name: str) -> str:
        key, _, first = name.rpartition("-")
        return f"{key.removesuffix(self.suffix)}-{first}"

    def close(self) -> None:
        self.inner.close()


