"""``s3://BUCKET/PREFIX``: segments as ``.hrry`` objects in an S3 bucket (AWS S3, or any
server that speaks its API: MinIO, SeaweedFS, Ceph), through ``obstore`` (the Rust
``object_store`` crate's bindings: ``pip install 'hurraykv[s3]'``, imported when a store
opens).

*Where.*  Path-style requests to ``endpoint`` (an ``http://`` endpoint is plain HTTP, for
a server on a trusted network or the test suite's; ``https://`` is TLS), or to the
standard ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, or to AWS itself in ``region``
(default ``AWS_REGION``, ``AWS_DEFAULT_REGION``, then ``us-east-1``).  *Credentials* come
only from the standard chain (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, web identity, the container or instance role): never from the URL
(a userinfo part is refused), never written in a message or a log.

*Objects*, under ``PREFIX/``:

* ``segments/NAME.hrry``: the segment, a whole ``.hrry`` file (``hurraykv inspect`` reads
  a downloaded one), written once with ``If-None-Match: *`` (a second engine storing the
  same chunks finds it there and stores nothing); one past ``MULTIPART`` bytes goes up
  as a multipart upload (parts in parallel; S3 shows it only once complete), after a
  HEAD that finds it absent.
  A load fetches only the structure and the pages it places, in ranged GETs, once this
  process knows the layout of segments of that size (``s3_pages.py``).
* ``aliases/KEY``: a chunk key's alias, its body the segment's name, written after the
  segment (an alias never names a segment that is not whole yet).
* ``index/NAME/ID``: the keys a segment's aliases were written for (its body) and its
  identity (``ID``: its ``identity_key``, ``-`` for none), so a removal takes its
  aliases back and one listing gives every segment's identity.
* ``used/NAME``: written (empty) on a load; its time is the segment's last use.
* ``kept/NAME``: a pin or lifetime (``io/retention.py``): ``[pinned, expiry, bytes]``.

*Capacity.*  ``max_bytes`` bounds the segments' bytes: before a put that would pass it,
the expired segments, then the least recently used unpinned ones are deleted (real
deletes) down to 90% of it.  A store counts from its last listing of the prefix plus what
it wrote since, listing again when that count would pass the cap or is ``RESCAN_S`` old:
one engine holds the cap exactly; engines sharing a prefix may pass it together by what
the others wrote since the last listing, and the last use is as fresh as the loads
(a load writes ``used/NAME`` at most once a second per store).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import ParseResult

from ..errors import ConfigError, HurrayError, TransportError, require
from ..io import retention
from ..io.hrry import HrryFile
from ..io.snapshots import save_snapshot, snapshot_from_file
from ..snapshot import KVCacheSnapshot
from .keys import SEGMENT_NAME, check_name, identity_key, segment_name, valid_name
from .registry import ChunkStore, Stored
from .s3_pages import RangedReads, memory_file
from .settings import Option

T = TypeVar("T")
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's rule for a new bucket
PREFIX = re.compile(r"[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*")  # S3's "safe" set
SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
NO_ID = "-"


class S3Chunks(ChunkStore, RangedReads):
    """``s3://BUCKET/PREFIX`` (the module docstring)."""

    SCHEMES = ("s3",)
    FORM = "s3://BUCKET/PREFIX"
    URL_PARTS = ("path",)
    OPTIONS = (
        Option("endpoint", "str", "The S3 server of an ``s3://`` store: ``https://HOST"
               "[:PORT]`` (TLS) or ``http://`` (plain HTTP, a local server).  Default: "
               "``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, else AWS in ``region``."),
        Option("region", "str", "The region of an ``s3://`` store's bucket.  Default: "
               "``AWS_REGION``, ``AWS_DEFAULT_REGION``, else ``us-east-1``."),
        Option("max_bytes", "size", "Capacity of an ``s3://`` prefix: past it the least "
               "recently used segments are deleted.  Default: unbounded (a warning at "
               "start; a bucket lifecycle rule may bound it instead)."),
        Option("max_pinned_bytes", "size", "Of an ``s3://`` prefix's ``max_bytes``, the "
               "most that pinned segments may hold.  Default: a quarter of ``max_bytes``."),
    )
    CAPACITY = "max_bytes"

    MULTIPART = 64 << 20  # segments past it go up in parts (no If-None-Match: a HEAD first)
    PART = 8 << 20  # a part's bytes
    RESCAN_S = 30.0  # a capacity count older than this is listed again
    LOW_WATER = 0.9  # an eviction frees down to this share of max_bytes
    TOUCH_S = 1.0  # a segment's last use is written at most this often by one store

    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str | None = None,
                 region: str | None = None, max_bytes: int | None = None,
                 max_pinned_bytes: int | None = None, timeout: float | None = None) -> None:
        obstore = require("obstore", "s3", "an s3:// chunk store")
        from obstore.store import S3Store

        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.bucket, self._p = bucket, f"{prefix}/" if prefix else ""
        self.max_bytes = max_bytes
        self.max_pinned = max_pinned_bytes if max_pinned_bytes is not None else (
            max_bytes // 4 if max_bytes is not None else None)
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL")
        region = region or os.environ.get("AWS_REGION") or os.environ.get(
            "AWS_DEFAULT_REGION") or "us-east-1"
        wait = timeout if timeout is not None else 30.0
        self._deadline = wait  # a load's page fetch too (s3_pages), outside any guard
        config: dict[str, Any] = {"region": region, "virtual_hosted_style_request": False}
        if endpoint:
            _check_endpoint(endpoint)
            config["endpoint"] = endpoint.rstrip("/")
        self._ob = obstore
        try:
            self._s3 = S3Store(bucket, config=config, client_options={
                "allow_http": bool(endpoint and endpoint.startswith("http://")),
                "timeout": timedelta(seconds=wait),
                "connect_timeout": timedelta(seconds=min(wait, 5.0))},
                retry_config={"max_retries": 2, "retry_timeout": timedelta(seconds=wait),
                              "backoff": {"init_backoff": timedelta(milliseconds=50),
                                          "max_backoff": timedelta(seconds=1), "base": 2}})
        except Exception as e:  # a setting obstore refuses
            raise ConfigError(f"{self.url}: the S3 client refuses its settings: "
                              f"{_first_line(e)}", field="endpoint", value=endpoint,
                              rule="an S3 endpoint and region obstore takes") from None
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="hurraykv-s3")
        self._lock = threading.Lock()
        self._touched: dict[str, float] = {}
        # this process's writes and loads, to the microsecond: an object's Last-Modified
        # has whole seconds, which left segments used in one second in any order
        self._last_use: dict[str, float] = {}
        self._count: tuple[float, int] | None = None  # (listed at, bytes) for max_bytes
        self.evictions = 0
        self.evicted_bytes = 0
        self._init_pages()

    # -- the URL --------------------------------------------------------------------------
    @classmethod
    def url_problem(cls, parsed: ParseResult) -> str:
        if ":" in parsed.netloc or parsed.netloc != parsed.netloc.lower() or \
                BUCKET.fullmatch(parsed.netloc) is None or ".." in parsed.netloc:
            return (f"its bucket {parsed.netloc[:80]!r} is not an S3 bucket name (3-63 "
                    "lowercase letters, digits, '.' and '-'; no port: the server is the "
                    "option endpoint)")
        prefix = parsed.path.strip("/")
        if prefix and (PREFIX.fullmatch(prefix) is None or "/../" in f"/{prefix}/"
                       or "/./" in f"/{prefix}/" or len(prefix) > 512):
            return (f"its prefix {prefix[:80]!r} is not '/'-separated parts of letters, "
                    "digits and !_.*'()- (at most 512 characters)")
        return ""

    @classmethod
    def check_options(cls, options: Mapping[str, Any], named: Callable[[str], str]) -> None:
        if "endpoint" in options:
            _check_endpoint(options["endpoint"], named("endpoint"))

    @classmethod
    def open(cls, url: str, parsed: ParseResult, *, timeout: float | None,
             **options: Any) -> S3Chunks:
        return cls(parsed.netloc, parsed.path.strip("/"), timeout=timeout, **options)

    # -- the requests, their errors ---------------------------------------------------------
    def _key(self, kind: str, name: str) -> str:
        return f"{self._p}{kind}/{name}.hrry" if kind == "segments" else \
            f"{self._p}{kind}/{name}"

    def _call(self, what: str, fn: Callable[[], T], absent: bool = False,
              keep: tuple[type[BaseException], ...] = ()) -> T | None:
        """``fn()`` (one obstore call); its failures as HurrayErrors naming the store and
        the request, never a credential: a ``TransportError``, except a missing object
        where ``absent`` says that is an answer (None)."""
        try:
            return fn()
        except (HurrayError, *keep):
            raise
        except Exception as e:
            from obstore import exceptions as ox

            if absent and isinstance(e, FileNotFoundError):  # obstore's NotFoundError
                return None
            why = _first_line(e)
            if isinstance(e, ox.PermissionDeniedError | ox.UnauthenticatedError):
                why = ("access denied (the credentials are the standard AWS ones: "
                       "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, a role): " + why)
            raise TransportError(f"{self.url}: {what}: {why}", field="url", value=self.url,
                                 rule="an S3 bucket that answers") from None

    def _map(self, fn: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
        items = list(items)
        if len(items) <= 1:
            return [fn(i) for i in items]
        return list(self._pool.map(fn, items))

    def _read(self, kind: str, name: str, path: str | None = None) -> bytes | None:
        """A small object's bytes, None where it is absent."""
        key = path or self._key(kind, name)
        return self._call(f"GET {key}", lambda: bytes(self._ob.get(self._s3, key).bytes()),
                          absent=True)

    def _head(self, name: str) -> Any:
        key = self._key("segments", name)
        return self._call(f"HEAD {key}", lambda: self._ob.head(self._s3, key), absent=True)

    def _list(self, kind: str, under: str = "") -> list[Any]:
        at = f"{self._p}{kind}/{under}"
        return self._call(f"LIST {at}", lambda: [
            m for chunk in self._ob.list(self._s3, at) for m in chunk]) or []

    def _put(self, key: str, data: Any, **kw: Any) -> Any:
        return self._call(f"PUT {key}", lambda: self._ob.put(self._s3, key, data, **kw))

    def _delete(self, keys: Sequence[str]) -> None:
        if keys:
            self._call(f"DELETE {keys[0]}", lambda: self._ob.delete(self._s3, list(keys)))

    def connect(self) -> None:
        self._list("segments", "~")  # answers (nothing) where the bucket can be read

    # -- lookups and reads ------------------------------------------------------------------
    def _kept(self, name: str) -> retention.Kept | None:
        raw = self._read("kept", name)
        if raw is None:
            return None
        try:
            pinned, expiry, nbytes = json.loads(raw)
            return retention.Kept(bool(pinned), None if expiry is None else float(expiry),
                                  int(nbytes))
        except (ValueError, TypeError):  # damaged: no pin honoured, never a wrong keep
            return None

    def _live(self, names: Sequence[str]) -> dict[str, Any]:
        """Of ``names``, those stored and not past their lifetime: name -> HEAD's meta."""
        def one(name: str) -> tuple[str, Any]:
            meta = self._head(name)
            if meta is None:
                return name, None
            self._saw(name, meta)
            k = self._kept(name)
            return name, None if k is not None and k.expired(time.time()) else meta

        return {n: m for n, m in self._map(one, dict.fromkeys(names)) if m is not None}

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        raw = self._map(lambda k: self._read("aliases", k), keys)
        names = [valid_name(None if r is None else r.decode("ascii", "replace"))
                 for r in raw]
        live = self._live([n for n in names if n is not None])
        return [n if n in live else None for n in names]

    def get(self, name: str) -> KVCacheSnapshot:
        key = self._key("segments", check_name(name))
        data = self._call(f"GET {key}", lambda: self._ob.get(self._s3, key).bytes(),
                          absent=True)
        if data is None:
            raise HurrayError(f"segment {name} is not in {self.url}", field="segment",
                              value=name, rule="a stored segment")
        self._received(len(data))
        snap = snapshot_from_file(HrryFile.from_bytes(memoryview(data), f"{self.url}/{key}"))
        self._touch(name)
        return snap

    def _used_now(self, name: str) -> None:
        with self._lock:
            self._last_use[name] = time.time()
            if len(self._last_use) > 65536:  # the newest half kept
                newest = sorted(self._last_use.items(), key=lambda i: i[1])[32768:]
                self._last_use = dict(newest)

    def _touch(self, name: str) -> None:
        """Record a use of ``name`` (``used/NAME``), in the background, at most once a
        ``TOUCH_S``; a failure only leaves the last use older."""
        self._used_now(name)
        now = time.monotonic()
        with self._lock:
            if now - self._touched.get(name, -1e9) < self.TOUCH_S:
                return
            self._touched[name] = now
            if len(self._touched) > 4096:
                self._touched = {n: t for n, t in self._touched.items()
                                 if now - t < self.TOUCH_S}
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self._pool.submit(self._quiet_put, self._key("used", name), b"")

    def _quiet_put(self, key: str, data: bytes) -> None:
        with contextlib.suppress(Exception):
            self._ob.put(self._s3, key, data)

    def exists(self, names: Sequence[str]) -> list[bool]:
        live = self._live([check_name(n) for n in names])
        return [n in live for n in names]

    # -- writes -------------------------------------------------------------------------------
    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        name = check_name(segment_name(keys, first))
        key = self._key("segments", name)
        fd = memory_file(name)
        try:
            # the saver hashed the segment already (checksums.with_checksums)
            save_snapshot(snapshot, f"{self.url}/{key}", metadata=metadata, fsync=False,
                          checksums="keep", into=fd)
            size = os.fstat(fd).st_size
            if self.max_bytes is not None:
                self._make_room(size, name)
            stored = self._upload(key, fd, size)
        finally:
            os.close(fd)
        if not stored:  # there already: the same chunks, stored by an engine before
            k = self._kept(name)
            if k is not None and k.expired(time.time()):  # stored again: a new segment
                self._delete([self._key("kept", name)])
        else:
            self._used_now(name)
            if self._count is not None:
                with self._lock:
                    self._count = (self._count[0], self._count[1] + size)
        model = snapshot.model
        ident = identity_key(model) if model else NO_ID
        self._put(self._key("index", f"{name}/{ident}"), "\n".join(keys).encode())
        self._map(lambda k: self._put(self._key("aliases", k), name.encode()), keys)

    def _upload(self, key: str, fd: int, size: int) -> bool:
        """The segment's bytes (memory file ``fd``) to ``key``, unless an object is there
        (False)."""
        from obstore.exceptions import AlreadyExistsError

        if size <= self.MULTIPART:
            data = os.pread(fd, size, 0)
            try:
                self._call(f"PUT {key}", lambda: self._ob.put(self._s3, key, data,
                                                              mode="create"),
                           keep=(AlreadyExistsError,))
            except AlreadyExistsError:
                return False
            return True
        if self._head(key.rpartition("/")[2].removesuffix(".hrry")) is not None:
            return False
        with os.fdopen(os.dup(fd), "rb") as f:  # the offset shared: at the end, written
            f.seek(0)
            self._put(key, f, use_multipart=True, chunk_size=self.PART, max_concurrency=8)
        return True

    # -- capacity -----------------------------------------------------------------------------
    def _make_room(self, nbytes: int, keep: str) -> None:
        """Delete what is past its lifetime, then the least recently used unpinned
        segments, until ``nbytes`` more fit under ``max_bytes`` (down to ``LOW_WATER``
        of it); refused (a ``HurrayError`` naming max_bytes) where they cannot."""
        assert self.max_bytes is not None
        if nbytes > self.max_bytes:
            raise HurrayError(f"segment {keep} of {nbytes} bytes is larger than max_bytes "
                              f"{self.max_bytes}: not stored", field="max_bytes",
                              value=nbytes, rule="a segment fits in max_bytes")
        with self._lock:
            count = self._count
        if count is not None and time.monotonic() - count[0] < self.RESCAN_S and \
                count[1] + nbytes <= self.max_bytes:
            return
        segments = self._segments()
        now = time.time()
        kept = self._all_kept()
        expired = [n for n, k in kept.items() if k.expired(now) and n in segments
                   and n != keep]
        for n in expired:
            self._remove(n)
            segments.pop(n)
        total = sum(s.nbytes for s in segments.values())
        if total + nbytes > self.max_bytes:
            need = total + nbytes - int(self.max_bytes * self.LOW_WATER)
            used = self._used()
            victims, freed = [], 0
            with self._lock:
                mine = dict(self._last_use)
            for s in sorted(segments.values(), key=lambda s: max(
                    s.created or 0, used.get(s.name, 0), mine.get(s.name, 0))):
                k = kept.get(s.name)
                if s.name == keep or (k is not None and k.pinned):
                    continue
                victims.append(s)
                freed += s.nbytes
                if freed >= need:
                    break
            if total - freed + nbytes > self.max_bytes:
                raise HurrayError(f"no room for segment {keep} of {nbytes} bytes in "
                                  f"max_bytes {self.max_bytes}: pinned segments hold the "
                                  "rest; not stored", field="max_bytes", value=nbytes,
                                  rule="pinned segments and a new one fit in max_bytes")
            self._map(lambda s: self._remove(s.name), victims)
            self.evictions += len(victims)
            self.evicted_bytes += freed
            total -= freed
        with self._lock:
            self._count = (time.monotonic(), total)

    def _segments(self) -> dict[str, Stored]:
        """Every segment object: name -> Stored (bytes, when written, its ETag)."""
        out = {}
        for m in self._list("segments"):
            name = m["path"].rpartition("/")[2].removesuffix(".hrry")
            if SEGMENT_NAME.fullmatch(name):
                out[name] = Stored(name, m["size"], created=m["last_modified"].timestamp(),
                                   version=m.get("e_tag"))
        return out

    def _used(self) -> dict[str, float]:
        return {m["path"].rpartition("/")[2]: m["last_modified"].timestamp()
                for m in self._list("used")}

    def _all_kept(self) -> dict[str, retention.Kept]:
        names = [m["path"].rpartition("/")[2] for m in self._list("kept")]
        got = self._map(self._kept, names)
        return {n: k for n, k in zip(names, got, strict=True) if k is not None}

    # -- what is stored -----------------------------------------------------------------------
    def catalog(self) -> list[Stored]:
        """Every segment (one listing of each object kind; a GET of each pin or
        lifetime): its identity key from its index object (the identity string is not
        kept), created when written, last used when last loaded."""
        segments = self._segments()
        idents = {}
        for m in self._list("index"):
            name, _, ident = m["path"][len(self._p) + len("index/"):].partition("/")
            idents[name] = None if ident == NO_ID else ident
        used, kept, now = self._used(), self._all_kept(), time.time()
        out = []
        for name, s in sorted(segments.items()):
            k = kept.get(name)
            if k is not None and k.expired(now):
                continue
            out.append(Stored(name, s.nbytes, idents.get(name), None, s.created,
                              max(s.created or 0, used.get(name, 0)),
                              pinned=bool(k and k.pinned), expiry=k.expiry if k else None,
                              version=s.version))
        return out

    def remove(self, name: str) -> bool:
        check_name(name)
        if self._head(name) is None:
            return False
        self._remove(name)
        return True

    def _remove(self, name: str) -> None:
        """Delete segment ``name`` (its aliases then reach nothing), then what belongs to
        it: its aliases that still name it, its index, last use and pin."""
        self._forget(name)  # a segment stored again under the name is another version
        self._delete([self._key("segments", name)])
        index = [m["path"] for m in self._list("index", f"{name}/")]
        for path in index:
            keys = (self._read("index", "", path) or b"").decode("ascii", "replace").split()

            def mine(k: str) -> bool:
                return self._read("aliases", k) == name.encode()

            taken = [self._key("aliases", k) for k, m in zip(
                keys, self._map(mine, keys), strict=True) if m]
            self._delete(taken)
        self._delete(index + [self._key("used", name), self._key("kept", name)])

    def discard(self, name: str) -> None:
        self.remove(name)

    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        """Pins and lifetimes as ``io/retention.py`` says, each a ``kept/NAME`` object;
        the pinned budget is checked against them all (two engines pinning at the same
        moment may pass it together by their own pins)."""
        checked = [check_name(n) for n in names]
        retention.expiry_of(ttl_s)  # refused before anything is asked
        now = time.time()
        present = {n: m["size"] for n, m in self._live(checked).items()}
        kept = self._all_kept()
        after = retention.updated(kept, present, pin=pin, ttl_s=ttl_s,
                                  max_pinned=self.max_pinned, now=now, extend=extend)
        for name in present:
            k = after.get(name)
            if k is None:
                if name in kept:
                    self._delete([self._key("kept", name)])
            elif k != kept.get(name):
                self._put(self._key("kept", name),
                          json.dumps([k.pinned, k.expiry, k.nbytes]).encode())
        return list(present)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _check_endpoint(endpoint: Any, named: str = "endpoint") -> None:
    if not isinstance(endpoint, str) or re.fullmatch(r"https?://[^/?#@\s]+/?", endpoint) \
            is None:
        raise ConfigError(f"{named} is {endpoint!r}; it is http://HOST[:PORT] or "
                          "https://HOST[:PORT] (no path, no credentials)", field="endpoint",
                          value=endpoint, rule="http(s)://HOST[:PORT]")


def _first_line(e: BaseException) -> str:
    """An obstore error's first line (its debug dump left out), shortened, any secret of
    the environment's blanked."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = text[:300]
    for var in SECRETS:
        secret = os.environ.get(var)
        if secret:
            text = text.replace(secret, "***")
    return text


__all__ = ["S3Chunks"]
