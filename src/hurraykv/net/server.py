"""``hurraykv serve``: an asyncio KV cache server speaking the Hurray interchange protocol.

This module holds the configuration, the listening socket, what the server counts and
the thread wrapper; one client connection's protocol is ``connection.py``, the stored
objects ``keystore.py``, tenants under mutual TLS ``tenants.py``, the Prometheus endpoint
``metrics.py`` (imported only when ``metrics_listen`` is set).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import units
from ..errors import ConfigError, HurrayError, TransportError
from . import tls
from .connection import SCRATCH, Connection
from .handlers import REQUESTS
from .keystore import KeyStore
from .memory import ReceivePool
from .messages import ErrorCode

log = logging.getLogger("hurraykv.server")


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:0"  # HOST:PORT, or a Unix socket path
    memory_budget: int | None = None
    persist: str | None = None
    persist_budget: int | None = None  # bytes of .hrry files under persist, LRU beyond
    max_pinned_bytes: int | None = None  # pinned (RETAIN); default a quarter of a budget
    max_bytes_per_tenant: int | None = None  # memory per mutual-TLS tenant, LRU within
    max_message_size: int = 16 << 20
    read_timeout: float = 30.0  # a message started must keep arriving
    idle_timeout: float = 600.0  # between messages
    max_connections: int = 256
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    zero_unused: bool = True
    frame_bytes: int = 4 << 20
    recycle_bytes: int = 1 << 30  # idle received memory kept for the next PUTs
    store: str | None = None  # redis://HOST:PORT or redis+cluster://...: the backing tier
    metrics_listen: str | None = None  # HOST:PORT of the HTTP /metrics and /healthz


# seconds: a small control request is well under a millisecond, a push or pull of a few
# GiB takes seconds over a fast link
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)


class Latencies:
    """Seconds from a request's arrival to its answer, per request (``handlers.REQUESTS``:
    push, pull, and the private messages answered at once, by name), in
    ``LATENCY_BUCKETS``: a push from its first TENSOR_PUT to its ACK, a pull from its
    TENSOR_REQUEST to its last TENSOR_DATA_END, any other request from its message to its
    reply.  Requests answered with ERROR are counted by ``Counts.errors`` instead.  Bumped
    on the event loop; a scrape copies one request's buckets at a time."""

    def __init__(self) -> None:
        self.buckets = {name: [0] * (len(LATENCY_BUCKETS) + 1) for name in REQUESTS}
        self.sums = dict.fromkeys(REQUESTS, 0.0)

    def observe(self, request: str, seconds: float) -> None:
        self.buckets[request][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sums[request] += seconds

    def read(self, request: str) -> tuple[list[int], float]:
        """``request``'s count per bucket (the last: over every bound) and their sum."""
        return list(self.buckets[request]), self.sums[request]


@dataclass
class Counts:
    """What the server counts as it runs: plain integers bumped on the event loop where
    the work is done (a scrape reads them from another thread: each read is one value)."""

    pushes: int = 0  # PUTs acknowledged
    pulls: int = 0  # objects sent whole
    bytes_received: int = 0  # on every connection, framing included
    bytes_sent: int = 0
    errors: Counter[int] = field(default_factory=Counter)  # ERROR messages sent, by code
    latencies: Latencies = field(default_factory=Latencies)

    def as_dict(self) -> dict[str, Any]:
        errors = dict(self.errors)  # one copy: the loop may add a code meanwhile
        return {"pushes": self.pushes, "pulls": self.pulls,
                "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent,
                "errors": {_code_name(c): n for c, n in sorted(errors.items())}}


def _code_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"0x{code:02x}"


DEFAULT_PORT = 7878


def _after_subject(message: str) -> str:
    """``"store url 'x': why"`` -> ``"why"``: a message's reason once its subject is
    named otherwise."""
    head, sep, rest = message.partition(": ")
    return rest if sep and head.startswith(("store url", "redis store")) else message


def parse_address(address: str) -> tuple[str, int] | str:
    """``HOST:PORT``, ``HOST`` (port 7878), ``[v6]:PORT``, ``hurray://HOST:PORT`` (or
    ``tcp://``), a Unix socket path or ``unix:///path``; ``ConfigError`` naming the address
    and the rule otherwise."""
    text = address.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme in ("http", "https"):
            raise ConfigError(f"address {address!r}: hurraykv serve speaks the Hurray protocol "
                              f"over TCP, not HTTP; give HOST:PORT, e.g. {rest.rstrip('/')}",
                              field="address", value=address, rule="HOST:PORT or a path")
        if scheme == "unix":
            return rest
        if scheme not in ("hurray", "tcp"):
            raise ConfigError(f"address {address!r}: unknown scheme {scheme!r}; use HOST:PORT, "
                              "hurray://HOST:PORT or a Unix socket path", field="address",
                              value=address, rule="HOST:PORT or a path")
        text = rest.rstrip("/")
    elif "/" in text or text.endswith(".sock"):
        return text
    if text.startswith("[") and text.endswith("]"):
        return text[1:-1], DEFAULT_PORT
    host, sep, port = text.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):
        host, port = text, str(DEFAULT_PORT)  # no port (a bare IPv6 address included)
    if not port.isdigit() or not 0 <= int(port) < 65536:
        what = "is out of range" if port.isdigit() else "is not a number"
        raise ConfigError(f"address {address!r}: port {port!r} {what}: a port is 0..65535",
                          field="address", value=address, rule="HOST:PORT or a path")
    return host.strip("[]") or "127.0.0.1", int(port)


class KVServer:
    """The server; ``await start()`` then ``serve_forever()``, or ``run_in_thread()``."""

    def __init__(self, config: ServerConfig | None = None, **kw: Any) -> None:
        self.config = config or ServerConfig(**kw)
        c = self.config
        # what the server says of its life (listening, metrics, stopped): logged, or
        # printed once by `hurraykv serve` (which sets its own)
        self.announce: Callable[[str], None] = lambda text: log.info("%s", text)
        if c.max_bytes_per_tenant is not None and not c.tls_ca:
            raise HurrayError(
                f"max_bytes_per_tenant {c.max_bytes_per_tenant}: tenants are the "
                "client identities of mutual TLS, and no --tls-ca is given",
                field="max_bytes_per_tenant", value=c.max_bytes_per_tenant,
                rule="--max-bytes-per-tenant needs --tls-ca")
        self.ssl_context = tls.server_context(c.tls_cert, c.tls_key, c.tls_ca)
        backing = None
        if c.store:
            from ..store import PageStore

            try:
                backing = PageStore.from_url(c.store)
            except (ConfigError, TransportError) as e:  # the same class, naming the option
                raise type(e)(f"--store {c.store}: {_after_subject(str(e))}", field="store",
                              value=c.store, rule=e.rule) from None
        try:
            self.store = KeyStore(c.memory_budget, c.persist, c.zero_unused, backing,
                                  persist_budget=c.persist_budget,
                                  max_pinned_bytes=c.max_pinned_bytes,
                                  max_bytes_per_tenant=c.max_bytes_per_tenant)
        except OSError as e:  # the directory, or a file in it (aliases, pins)
            where = e.filename if e.filename and str(e.filename) != str(c.persist) else None
            raise ConfigError(f"--persist {c.persist}: " + (f"{where}: " if where else "")
                              + f"cannot use it: {e.strerror or e}", field="persist",
                              value=c.persist, rule="a directory the server can create, "
                              "read and write") from None
        self.pool = ReceivePool(c.recycle_bytes, room=self.store.idle_room)
        self.store.pool = self.pool
        self.connections = 0
        self.open_connections: set[Connection] = set()
        self.tenant_connections: Counter[str] = Counter()
        self.started = time.monotonic()
        self.scratch = memoryview(bytearray(SCRATCH))
        self.counts = Counts()
        self._server: asyncio.AbstractServer | None = None
        self.address: str = ""
        self.metrics: Any = None  # a metrics.MetricsEndpoint once started
        self.metrics_address: str | None = None
        self.stopped = False

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """What ``hurraykv stat`` shows: objects, bytes, budget, connections; for a
        ``tenant`` (mutual TLS) its own objects, bytes and connections only, and whether
        the server persists rather than where."""
        from .. import __version__

        out = {"version": __version__, "address": self.address,
               "max_connections": self.config.max_connections,
               "uptime_s": round(time.monotonic() - self.started, 3)}
        if tenant is None:  # traffic counts are server-wide: a tenant sees none
            return {**out, "connections": self.connections, **self.store.stats(),
                    **self.counts.as_dict()}
        return {**out, "tenant": tenant, "connections": self.tenant_connections[tenant],
                **self.store.stats(tenant)}

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        where = parse_address(self.config.listen)
        ctx = self.ssl_context
        try:
            if isinstance(where, str):
                if os.path.exists(where):
                    os.unlink(where)
                self._server = await loop.create_unix_server(lambda: Connection(self),
                                                             where, ssl=ctx)
                self.address = where
            else:
                self._server = await loop.create_server(lambda: Connection(self), where[0],
                                                        where[1], ssl=ctx)
                host, port = self._server.sockets[0].getsockname()[:2]
                self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        except OSError as e:  # in use, not this machine's address, a socket path refused
            why = os.strerror(e.errno) if e.errno else str(e)  # asyncio's says it twice
            raise TransportError(f"--listen {self.config.listen}: cannot listen: {why}",
                                 field="listen",
                                 value=self.config.listen, rule="a free local HOST:PORT "
                                 "or a socket path the server may create") from None
        if self.config.metrics_listen:  # before "listening": a server that says it
            from .metrics import MetricsEndpoint  # listens is one that started

            try:
                self.metrics = MetricsEndpoint(self, self.config.metrics_listen, loop)
            except BaseException:
                self._server.close()
                raise
            self.metrics_address = self.metrics.address
        self.announce(f"listening on {self.address}")  # the first line ends in it
        if self.metrics is not None:
            self.announce(f"metrics on http://{self.metrics_address}/metrics, health on "
                          "/healthz")
        return self.address

    def close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def _close_connections(self) -> int:
        """Close every client connection (their PUTs in flight leave nothing); how many."""
        closing = list(self.open_connections)
        for c in closing:
            c._close()
        return len(closing)

    def held(self) -> str:
        """What the server holds, in a phrase: objects and bytes in memory, on disk."""
        s = self.store.stats()
        line = (f"{units.plural(s['objects_in_memory'], 'object')} "
                f"({units.size(s['memory_bytes'])}) in memory")
        if self.store.persist:
            line += (f", {units.plural(s['persisted_objects'], 'object')} "
                     f"({units.size(s['persisted_bytes'])}) in {self.store.persist}")
        return line

    def stop(self) -> None:
        """Stop listening, close every connection, the metrics endpoint and the store;
        announce what was held (once: later calls do nothing).  On the event loop."""
        if self.stopped:
            return
        self.stopped = True
        if self._server is not None:
            self._server.close()
        closed = self._close_connections()
        self.close_metrics()
        self.store.close()
        kept = ("the files kept for the next start" if self.store.persist
                else "every object kept in the backing store" if self.store.backing is not None
                else "memory only: gone with the process")
        self.announce(f"stopped after {time.monotonic() - self.started:.0f} s: closed "
                      f"{units.plural(closed, 'client connection')}; held {self.held()} "
                      f"({kept}); {units.plural(self.counts.pushes, 'push', 'pushes')}, "
                      f"{units.plural(self.counts.pulls, 'pull')} served")

    async def serve_forever(self) -> None:
        assert self._server is not None
        try:
            await self._server.serve_forever()
        finally:
            self.stop()

    def run_in_thread(self) -> ServerThread:
        return ServerThread(self)


class ServerThread:
    """A server on its own event loop in a daemon thread (tests, the demo)."""

    def __init__(self, server: KVServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(server.start())
            except BaseException as e:  # reported to the starting thread
                self.error = e
                ready.set()
                return
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True, name="hurraykv-server")
        self.thread.start()
        ready.wait(30)
        if self.error is not None:
            raise self.error
        self.address = server.address
        self.metrics_address = server.metrics_address

    def stop(self) -> None:
        async def shutdown() -> None:
            if self.server._server is not None:
                self.server._server.close()
            self.server._close_connections()
            for task in asyncio.all_tasks(self.loop):
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.server.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.server.stop()  # if the loop had stopped already

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()
