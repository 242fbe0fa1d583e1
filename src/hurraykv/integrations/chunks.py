"""KV chunks by content: the keys and the stores the engine connectors share.

A chunk is ``chunk_size`` consecutive tokens of one sequence (whole engine blocks).  Its
key chains a 128-bit BLAKE2b digest over all tokens from the start of the sequence to the
chunk's end, seeded with the cache's identity (model, dtype, geometry, chunk size)::

    h_0 = BLAKE2b-128("hurraykv-chunks-v1" | identity)
    h_k = BLAKE2b-128(h_(k-1) | tokens of chunk k as int64 little-endian)

so two requests that share their first N tokens share the keys of their first
``N // chunk_size`` chunks, and chunks of another model or dtype never match.

Chunks are stored in *segments*: one KVCacheSnapshot of one sequence holding a run of
consecutive chunks (every layer's key and value pages), named ``LASTKEY-FIRST`` after the
key of its last chunk and the index of its first, with every chunk key of the run made an
alias of it.  A request's new chunks cost one object however many there are, and a later
request sharing any whole-chunk prefix still finds each chunk by its own key.

Stores, by URL: ``file:///DIR`` (``DIR/NAME.hrry``, each a .hrry snapshot that
``hurraykv inspect`` and ``hk.load_snapshot`` read; the aliases are symbolic links
``DIR/KEY.hrry``), ``hurray://HOST:PORT`` (a ``hurraykv serve``; aliases with its LINK and
LOCATE messages), ``redis://HOST:PORT`` and ``redis+cluster://HOST:PORT`` (the PageStore,
identical pages of different segments stored once; aliases as small keys).
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


def segment_name(keys: Sequence[str], first: int) -> str:
    return f"{keys[-1]}-{first}"


def segment_first(name: str) -> int:
    """The index of a segment's first chunk, from its name."""
    return int(name.rsplit("-", 1)[1])


class ChunkStore(ABC):
    """Where chunks live.  ``get`` raises a HurrayError for a segment that is missing,
    truncated or does not parse."""

    url: str

    @abstractmethod
    def locate(self, keys: Sequence[str]) -> list[str | None]:
        """The segment holding each chunk key (None: not stored)."""

    @abstractmethod
    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        """Store a segment of the chunks ``keys`` (``first``: the index of ``keys[0]``)."""

    @abstractmethod
    def get(self, name: str) -> KVCacheSnapshot: ...

    def has(self, keys: Sequence[str]) -> list[bool]:
        return [name is not None for name in self.locate(keys)]

    def close(self) -> None:
        return None


class FileChunks(ChunkStore):
    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.url = self.dir.resolve().as_uri()

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.hrry"

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        out: list[str | None] = []
        for key in keys:
            try:
                target = os.readlink(self.path(key))
            except OSError:  # missing (or not an alias)
                out.append(None)
                continue
            name = target.removesuffix(".hrry")
            out.append(name if self.path(name).is_file() else None)
        return out

    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        # No fsync: a segment lost in a crash is a future cache miss, and the atomic
        # renames still mean a reader sees whole files and links, or none.
        name = segment_name(keys, first)
        save_snapshot(snapshot, self.path(name), metadata=metadata, fsync=False)
        for key in keys:
            tmp = self.dir / f".{key}.{os.getpid()}.link"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            try:
                os.symlink(f"{name}.hrry", tmp)
                os.replace(tmp, self.path(key))
            except OSError as e:
                raise HurrayError(f"cannot link chunk {key} in {self.dir}: {e.strerror}",
                                  field="key", value=key) from None

    def get(self, name: str) -> KVCacheSnapshot:
        try:
            return load_snapshot(self.path(name))
        except FileNotFoundError:
            raise HurrayError(f"segment {name} is not in {self.dir}", field="segment",
                              value=name, rule="a stored segment") from None
        except OSError as e:
            raise HurrayError(f"segment {name} in {self.dir}: {e.strerror}", field="segment",
                              value=name) from None


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

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        if not keys:
            return []
        names = self._call(lambda c: c.locate([self.prefix + k for k in keys]))
        return [None if n is None else n.removeprefix(self.prefix) for n in names]

    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        name = self.prefix + segment_name(keys, first)
        self._call(lambda c: (c.push(name, snapshot),
                              c.link([(self.prefix + k, name) for k in keys])))

    def get(self, name: str) -> KVCacheSnapshot:
        return self._call(lambda c: c.pull(self.prefix + name))

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

    def _alias(self, key: str) -> str:
        return f"hkv:a:{{{self.prefix}{key}}}"

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        if not keys:
            return []
        pipe = self.store.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._alias(key))
        names = [None if n is None else n.decode("utf-8") for n in pipe.execute()]
        alive = self.store.contains_many([self.prefix + n for n in names if n is not None])
        it = iter(alive)
        return [n if n is not None and next(it) else None for n in names]

    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        name = segment_name(keys, first)
        self.store.put(self.prefix + name, snapshot)
        pipe = self.store.client.pipeline(transaction=False)
        for key in keys:
            pipe.set(self._alias(key), name)
        pipe.execute()

    def get(self, name: str) -> KVCacheSnapshot:
        return self.store.get(self.prefix + name)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.client.close()


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

    def _named(self, name: str) -> str:
        key, _, first = name.rpartition("-")
        return f"{key}{self.suffix}-{first}"

    def _plain(self, name: str) -> str:
        key, _, first = name.rpartition("-")
        return f"{key.removesuffix(self.suffix)}-{first}"

    def close(self) -> None:
        self.inner.close()


def open_store(url: str, *, suffix: str = "", **options: Any) -> ChunkStore:
    """``file:///DIR``, ``hurray://HOST:PORT``, ``redis://...`` or ``redis+cluster://...``;
    ``suffix`` marks every key and name (tensor-parallel ranks)."""
    store = _open(url, **options)
    return Suffixed(store, suffix) if suffix else store


def _open(url: str, **options: Any) -> ChunkStore:
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise HurrayError(f"url {url!r}: a file URL names a local directory, "
                              "file:///DIR", field="url", value=url, rule="file:///DIR")
        return FileChunks(unquote(parsed.path))
    if parsed.scheme == "hurray":
        return ServerChunks(parsed.netloc or unquote(parsed.path), **options)
    if parsed.scheme in ("redis", "rediss", "redis+cluster"):
        if options:
            raise HurrayError(f"url {url!r}: {sorted(options)} apply to hurray:// servers",
                              field="url", value=url, rule="TLS options for hurray://")
        return RedisChunks(url)
    raise HurrayError(f"url {url!r}: unknown scheme {parsed.scheme!r}; the chunk store is "
                      "file:///DIR, hurray://HOST:PORT, redis://HOST:PORT or "
                      "redis+cluster://HOST:PORT", field="url",
                      value=url, rule="a supported URL scheme")


__all__ = ["ChunkKeys", "ChunkStore", "chain", "identity_digest", "open_store",
           "segment_first", "segment_name"]
