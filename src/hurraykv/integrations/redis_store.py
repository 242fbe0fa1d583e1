"""``redis://``, ``rediss://`` and ``redis+cluster://``: segments in the PageStore
(identical pages of different segments stored once), aliases as small keys.  Capacity is
Redis's own ``maxmemory`` (decision H91)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import ParseResult

from ..snapshot import KVCacheSnapshot
from .chunks import ChunkStore, _valid, check_name, segment_name


class RedisChunks(ChunkStore):
    SCHEMES = ("redis", "rediss", "redis+cluster")
    FORM = "redis://HOST:PORT or redis+cluster://HOST:PORT"

    @classmethod
    def open(cls, url: str, parsed: ParseResult, *, timeout: float | None,
             **options: Any) -> RedisChunks:
        return cls(url, timeout=timeout)

    def __init__(self, url: str, prefix: str = "hurraykv-chunks/",
                 timeout: float | None = None) -> None:
        from ..store import PageStore

        self.url, self.prefix = url, prefix
        # a segment Redis evicted a page of is removed on its first failed get: found by
        # no later lookup, stored again once recomputed (decision H91)
        self.store = PageStore.from_url(_with_timeout(url, timeout), drop_damaged=True)

    def connect(self) -> None:
        self.store.client.ping()

    def _alias(self, key: str) -> str:
        return f"hkv:a:{{{self.prefix}{key}}}"

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        if not keys:
            return []
        pipe = self.store.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._alias(key))
        names = [_valid(None if n is None else n.decode("utf-8", "replace"))
                 for n in pipe.execute()]
        alive = self.store.contains_many([self.prefix + n for n in names if n is not None])
        it = iter(alive)
        return [n if n is not None and next(it) else None for n in names]

    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        from ..store.capacity import full_error, is_full

        name = segment_name(keys, first)
        self.store.put(self.prefix + name, snapshot.with_info(metadata=metadata))
        pipe = self.store.client.pipeline(transaction=False)
        for key in keys:
            pipe.set(self._alias(key), name)
        try:
            pipe.execute()
        except Exception as e:  # Redis full (noeviction): no segment that no alias reaches
            if not is_full(e):
                raise
            with contextlib.suppress(Exception):
                self.store.delete(self.prefix + name)
            raise full_error(self.store.client, f"segment {name}",
                             "it was taken back") from None

    def get(self, name: str) -> KVCacheSnapshot:
        return self.store.get(self.prefix + name)

    def discard(self, name: str) -> None:
        self.store.delete(self.prefix + check_name(name))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.client.close()


def _with_timeout(url: str, timeout: float | None) -> str:
    """``url`` with redis-py's socket timeouts (seconds) unless it sets its own."""
    if timeout is None or "socket_timeout" in url:
        return url
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}socket_timeout={timeout:g}&socket_connect_timeout={timeout:g}"


__all__ = ["RedisChunks"]
