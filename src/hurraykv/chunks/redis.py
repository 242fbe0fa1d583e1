"""``redis://``, ``rediss://`` and ``redis+cluster://``: segments in the PageStore
(identical pages of different segments stored once), aliases as small keys.  Capacity is
Redis's own ``maxmemory`` (decision H91)."""

from __future__ import annotations

import contextlib
import inspect
import re
import time
from collections.abc import Sequence
from typing import Any, TypeVar
from urllib.parse import ParseResult, parse_qsl

from ..errors import HurrayError
from ..io import checksums
from ..snapshot import KVCacheSnapshot
from ..store.pages import reaching
from .keys import SEGMENT_NAME, check_name, identity_key, segment_name, valid_name
from .registry import ChunkStore, Stored

T = TypeVar("T")


class RedisChunks(ChunkStore):
    SCHEMES = ("redis", "rediss", "redis+cluster")
    FORM = "redis://HOST:PORT or redis+cluster://HOST:PORT"
    URL_PARTS = ("userinfo", "path", "query")  # redis-py's user, password, db, options

    @property
    def client(self) -> Any:  # what store.pages.reaching names a Redis that is away by
        return self.store.client

    @classmethod
    def url_problem(cls, parsed: ParseResult) -> str:
        """What redis-py would drop or fail on later: a path that is not a database number
        (dropped), a database in cluster mode, a query option it does not take."""
        cluster = parsed.scheme == "redis+cluster"
        if re.fullmatch(r"/?" if cluster else r"/?[0-9]*", parsed.path) is None:
            return (f"its path {parsed.path!r} is not " + (
                "empty: a cluster has database 0 only" if cluster else
                "a database number (/0, /1, ...)"))
        pairs = parse_qsl(parsed.query, keep_blank_values=True)
        for name, value in pairs:
            if not value:
                return f"its query gives {name!r} no value"
            if cluster and name == "db":
                return "its query sets db: a cluster has database 0 only"
        try:
            from redis import connection
        except ImportError:  # refused when the store opens, naming the extra to install
            return ""
        parsers = connection.URL_QUERY_ARGUMENT_PARSERS
        known = {name for c in (connection.AbstractConnection, connection.Connection,
                                connection.SSLConnection)
                 for name in inspect.signature(c.__init__).parameters}
        for name, value in pairs:
            if name in parsers:
                try:
                    parsers[name](value)
                except (TypeError, ValueError):
                    return f"its query sets {name}={value!r}, not a value redis-py takes"
            elif name not in known - {"self", "kwargs"}:
                return f"its query names {name!r}, an option redis-py does not take"
        return ""

    @classmethod
    def open(cls, url: str, parsed: ParseResult, *, timeout: float | None,
             **options: Any) -> RedisChunks:
        return cls(url, timeout=timeout)

    def __init__(self, url: str, prefix: str = "hurraykv-chunks/",
                 timeout: float | None = None) -> None:
        from ..store import PageStore
        from ..store.buffers import ReadBuffers

        self.url, self.prefix = url, prefix
        # a segment Redis evicted a page of is removed on its first failed get: found by
        # no later lookup, stored again once recomputed (decision H91)
        self.store = PageStore.from_url(_with_timeout(url, timeout), drop_damaged=True)
        # a segment's pages land in memory a get before used, once its snapshot is gone
        self._buffers = ReadBuffers()

    @reaching
    def connect(self) -> None:
        self.store.client.ping()

    def _alias(self, key: str) -> str:
        return f"hkv:a:{{{self.prefix}{key}}}"

    @reaching
    def locate(self, keys: Sequence[str]) -> list[str | None]:
        if not keys:
            return []
        pipe = self.store.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._alias(key))
        names = [valid_name(None if n is None else n.decode("utf-8", "replace"))
                 for n in pipe.execute()]
        alive = self.store.contains_many([self.prefix + n for n in names if n is not None])
        it = iter(alive)
        return [n if n is not None and next(it) else None for n in names]

    @reaching
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

    @reaching
    def get(self, name: str) -> KVCacheSnapshot:
        return self.store.get(self.prefix + name, buffers=self._buffers)

    def get_verified(self, name: str) -> KVCacheSnapshot:
        """``get`` in one pipelined pass into a recycled buffer, each page hashed as it
        lands (``PageStore.get_hashed``), then checked against the segment's checksums."""
        hashing = self.store.hash_seconds
        snap, digests = self._get_hashed(name)
        started = time.perf_counter()
        checksums.verify(snap, f"segment {name}", digests)
        self.verify_seconds += self.store.hash_seconds - hashing + \
            time.perf_counter() - started
        return snap

    def get_checked(self, name: str, later: frozenset[str] = frozenset()
                    ) -> tuple[KVCacheSnapshot, checksums.Pending | None]:
        return self.get_verified(name), None

    @reaching
    def _get_hashed(self, name: str) -> tuple[KVCacheSnapshot, Any]:
        return self.store.get_hashed(self.prefix + name, buffers=self._buffers)

    @reaching
    def catalog(self) -> list[Stored]:
        """Every segment's manifest (SCAN), its identity read from the info member it
        holds, stored when its generation was drawn, last used as Redis's ``OBJECT
        IDLETIME`` says (None under an LFU policy, where Redis keeps no idle time).  On
        Redis before 7.2 (no ``CLIENT NO-TOUCH``) the listing counts as a use of every
        manifest for ``allkeys-lru``."""
        from ..info import parse_info
        from ..store.manifest import manifest_generation, parse_manifest
        from ..store.scripts import generation_age, id_of, manifest_key

        client = self.store.client
        keys = list(client.scan_iter(match=manifest_key(self.prefix + "*"), count=1000))
        pipe = client.pipeline(transaction=False)
        # reading a manifest is a use of it to Redis's LRU: not from this connection
        # where Redis (7.2+) or Valkey takes NO-TOUCH; the idle time is asked first
        pipe.execute_command("CLIENT", "NO-TOUCH", "ON")
        for key in keys:
            pipe.object("idletime", key)
            pipe.get(key)
            pipe.pttl(key)
        pipe.execute_command("CLIENT", "NO-TOUCH", "OFF")
        replies = pipe.execute(raise_on_error=False)[1:-1]
        now, out = time.time(), []
        for key, idle, raw, ttl in zip(keys, replies[::3], replies[1::3], replies[2::3],
                                       strict=True):
            name = id_of(key, "m").removeprefix(self.prefix)
            if not isinstance(raw, bytes) or not SEGMENT_NAME.fullmatch(name):
                continue  # gone since the SCAN, or not a segment of this prefix
            try:
                items, _, _ = parse_manifest(name, raw)
            except HurrayError:  # damaged: listed, of no identity (fsck mends it)
                items = []
            model = next((info[0] for desc, bufs in items
                          if (info := _info(parse_info, desc, bufs)) is not None), None)
            generation = manifest_generation(raw)
            out.append(Stored(
                name, sum(h.byte_size for desc, _ in items for h in desc.buffers),
                identity_key(model) if model else None, model,
                now - generation_age(generation, now) if generation else None,
                now - idle if isinstance(idle, int) else None,
                expiry=now + ttl / 1000 if isinstance(ttl, int) and ttl >= 0 else None,
                version=generation.hex() if generation else None))
        return sorted(out, key=lambda s: s.name)

    @reaching
    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        """A lifetime is Redis's own: an ``EXPIRE`` on the segment's manifest (``extend``:
        set where it has none, else only made later); its pages, shared with other
        segments, go by eviction or ``hurraykv store fsck``.  A pin is refused: under an
        ``allkeys-*`` policy Redis may evict any key, and hurraykv cannot exempt one."""
        from ..io.retention import expiry_of
        from ..store.scripts import manifest_key

        if pin:
            raise HurrayError(f"{self.url}: Redis evicts by its own maxmemory-policy, which "
                              "no key can be exempted from: a pin is kept on file:// or "
                              "hurray:// stores only (nothing was changed)", field="pin",
                              value=True, rule="pins on file:// and hurray://")
        expiry_of(ttl_s)  # a positive number of seconds, or None
        keys = [manifest_key(self.prefix + check_name(n)) for n in names]
        pipe = self.store.client.pipeline(transaction=False)
        for key in keys:
            if ttl_s is not None:
                ms = max(1, round(ttl_s * 1000))
                if extend:
                    pipe.pexpire(key, ms, nx=True)  # none yet
                    pipe.pexpire(key, ms, gt=True)  # or later than it was
                else:
                    pipe.pexpire(key, ms)
            elif not extend:
                pipe.persist(key)
            pipe.exists(key)
        held = [r for r in pipe.execute() if isinstance(r, int)]
        per = len(held) // max(len(keys), 1)
        return [n for i, n in enumerate(names) if held[i * per + per - 1]]

    def removals(self, notify: Any, stop: Any) -> bool:
        """Where Redis publishes keyspace events (``notify-keyspace-events`` with ``E``
        and the evicted, expired and generic classes: ``Exeg`` or ``EA``), the manifests
        it evicts, expires or deletes are told as they go (``__keyevent@DB__:evicted``,
        ``:expired``, ``:del``).  Not on a cluster (each node publishes its own)."""
        import threading

        from ..store.scripts import id_of

        client = self.store.client
        if not hasattr(client, "pubsub") or type(client).__name__ == "RedisCluster":
            return False
        try:
            flags = str(client.config_get("notify-keyspace-events").get(
                "notify-keyspace-events", ""))
        except Exception:  # CONFIG refused (a managed service): the watch polls
            return False
        classes = set(flags.replace("A", "g$lshzxet"))
        if "E" not in flags or not {"x", "e", "g"} <= classes:
            return False
        db = client.connection_pool.connection_kwargs.get("db", 0)
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(*(f"__keyevent@{db}__:{kind}" for kind in ("evicted", "expired",
                                                                     "del")))
        head = f"hkv:m:{{{self.prefix}"

        def listen() -> None:
            try:
                while not stop.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    key = message and message.get("data")
                    if isinstance(key, bytes) and key.decode("utf-8", "replace").startswith(
                            head):
                        name = id_of(key, "m").removeprefix(self.prefix)
                        if SEGMENT_NAME.fullmatch(name):
                            notify([name])
            except Exception:  # the connection lost: the watch's polls go on
                pass
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()

        threading.Thread(target=listen, daemon=True, name="hurraykv-redis-removals").start()
        return True

    @reaching
    def remove(self, name: str) -> bool:
        from ..errors import StoreError

        try:
            self.store.delete(self.prefix + check_name(name))
        except StoreError as e:
            if e.field != "snapshot_id":
                raise
            return False
        return True

    @reaching
    def exists(self, names: Sequence[str]) -> list[bool]:
        return self.store.contains_many([self.prefix + check_name(n) for n in names])

    @reaching
    def discard(self, name: str) -> None:
        self.store.delete(self.prefix + check_name(name))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.client.close()


def _info(parse: Any, desc: Any, bufs: Any) -> Any:
    try:
        return parse(desc, bufs)
    except HurrayError:
        return None


def _with_timeout(url: str, timeout: float | None) -> str:
    """``url`` with redis-py's socket timeouts (seconds) unless it sets its own."""
    if timeout is None or "socket_timeout" in url:
        return url
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}socket_timeout={timeout:g}&socket_connect_timeout={timeout:g}"


__all__ = ["RedisChunks"]
