"""KV chunks by content: the keys and the stores the engine connectors share.

A chunk is ``chunk_size`` consecutive tokens of one sequence (whole engine blocks), kept
as a KVCacheSnapshot of one sequence: every layer's key and value pages for those tokens.
Its key chains a 128-bit BLAKE2b digest over all tokens from the start of the sequence to
the chunk's end, seeded with the cache's identity (model, dtype, geometry, chunk size)::

    h_0 = BLAKE2b-128("hurraykv-chunks-v1" | identity)
    h_k = BLAKE2b-128(h_(k-1) | tokens of chunk k as int64 little-endian)

so two requests that share their first N tokens share the keys of their first
``N // chunk_size`` chunks, and chunks of another model or dtype never match.

Stores, by URL: ``file:///DIR`` (``DIR/KEY.hrry``, each a .hrry snapshot that
``hurraykv inspect`` and ``hk.load_snapshot`` read), ``hurray://HOST:PORT`` (a ``hurraykv
serve``, keys ``PREFIX/KEY``), ``redis://HOST:PORT`` and ``redis+cluster://HOST:PORT`` (the
PageStore: identical pages of different chunks stored once).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from ..errors import HurrayError, TransportError
from ..io.snapshots import load_snapshot, save_snapshot
from ..snapshot import KVCacheSnapshot

SEED = b"hurraykv-chunks-v1"
DIGEST = 16


def identity_digest(identity: str) -> bytes:
    return hashlib.blake2b(SEED + identity.encode("utf-8"), digest_size=DIGEST).digest()


def chain(previous: bytes, tokens: Sequence[int] | np.ndarray, chunk_size: int) -> list[bytes]:
    """The chained digests of each whole chunk of ``tokens``, continuing ``previous``."""
    full = len(tokens) // chunk_size
    data = np.ascontiguousarray(np.asarray(tokens[:full * chunk_size], dtype="<i8"))
    out = []
    for row in data.reshape(full, chunk_size) if full else ():
        previous = hashlib.blake2b(previous + row.tobytes(), digest_size=DIGEST).digest()
        out.append(previous)
    return out


class ChunkKeys:
    """The keys of one growing sequence, computed once per chunk."""

    def __init__(self, seed: bytes, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._digests: list[bytes] = []
        self._seed = seed

    def upto(self, tokens: Sequence[int], count: int) -> list[str]:
        """Keys of the first ``count`` chunks (``tokens`` holds at least that many)."""
        have = len(self._digests)
        if count > have:
            start = have * self.chunk_size
            prev = self._digests[-1] if self._digests else self._seed
            self._digests += chain(prev, tokens[start:count * self.chunk_size], self.chunk_size)
        return [d.hex() for d in self._digests[:count]]


class ChunkStore(ABC):
    """Where chunks live.  ``get`` raises a HurrayError for a chunk that is missing,
    truncated or does not parse; ``put`` of a key already stored may be skipped."""

    url: str

    @abstractmethod
    def has(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def put(self, key: str, snapshot: KVCacheSnapshot, metadata: dict[str, Any]) -> None: ...

    @abstractmethod
    def get(self, key: str) -> KVCacheSnapshot: ...

    def close(self) -> None:
        return None


class FileChunks(ChunkStore):
    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.url = self.dir.resolve().as_uri()

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.hrry"

    def has(self, keys: Sequence[str]) -> list[bool]:
        return [self.path(k).is_file() for k in keys]

    def put(self, key: str, snapshot: KVCacheSnapshot, metadata: dict[str, Any]) -> None:
        # No fsync: a chunk lost in a crash is a future cache miss, and the atomic rename
        # still means a reader sees a whole file or none.
        save_snapshot(snapshot, self.path(key), metadata=metadata, fsync=False)

    def get(self, key: str) -> KVCacheSnapshot:
        try:
            return load_snapshot(self.path(key))
        except FileNotFoundError:
            raise HurrayError(f"chunk {key} is not in {self.dir}", field="key",
                              value=key, rule="a stored chunk") from None
        except OSError as e:
            raise HurrayError(f"chunk {key} in {self.dir}: {e.strerror}", field="key",
                              value=key) from None


class ServerChunks(ChunkStore):
    def __init__(self, address: str, prefix: str = "hurraykv-chunks/", **client: Any) -> None:
        self.address, self.prefix, self._opts = address, prefix, client
        self.url = f"hurray://{address}"
        self._client: Any = None

    def _call(self, fn: Any) -> Any:
        from ..net.client import KVClient

        for attempt in (0, 1):  # one reconnect: the server may have restarted
            try:
                if self._client is None:
                    self._client = KVClient(self.address, **self._opts)
                return fn(self._client)
            except TransportError:
                self.close()
                if attempt:
                    raise
        raise AssertionError

    def has(self, keys: Sequence[str]) -> list[bool]:
        return self._call(lambda c: c.has([self.prefix + k for k in keys]))

    def put(self, key: str, snapshot: KVCacheSnapshot, metadata: dict[str, Any]) -> None:
        self._call(lambda c: c.push(self.prefix + key, snapshot))

    def get(self, key: str) -> KVCacheSnapshot:
        return self._call(lambda c: c.pull(self.prefix + key))

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None


class RedisChunks(ChunkStore):
    def __init__(self, url: str, prefix: str = "hurraykv-chunks/") -> None:
        from ..store import PageStore

        self.url, self.prefix = url, prefix
        self.store = PageStore.from_url(url)

    def has(self, keys: Sequence[str]) -> list[bool]:
        return self.store.contains_many([self.prefix + k for k in keys])

    def put(self, key: str, snapshot: KVCacheSnapshot, metadata: dict[str, Any]) -> None:
        self.store.put(self.prefix + key, snapshot)

    def get(self, key: str) -> KVCacheSnapshot:
        return self.store.get(self.prefix + key)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.client.close()


def open_store(url: str, **options: Any) -> ChunkStore:
    """``file:///DIR``, ``hurray://HOST:PORT``, ``redis://...`` or ``redis+cluster://...``."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise HurrayError(f"url {url!r}: a file URL names a local directory, "
                              "file:///DIR", field="url", value=url, rule="file:///DIR")
        return FileChunks(unquote(parsed.path))
    if parsed.scheme == "hurray":
        return ServerChunks(parsed.netloc or unquote(parsed.path), **options)
    if parsed.scheme in ("redis", "rediss", "redis+cluster"):
        return RedisChunks(url)
    raise HurrayError(f"url {url!r}: the chunk store is file:///DIR, hurray://HOST:PORT, "
                      "redis://HOST:PORT or redis+cluster://HOST:PORT", field="url",
                      value=url, rule="a supported URL scheme")


__all__ = ["ChunkKeys", "ChunkStore", "chain", "identity_digest", "open_store"]
