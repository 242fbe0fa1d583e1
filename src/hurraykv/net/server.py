"""``hurraykv serve``: an asyncio KV cache server speaking the Hurray interchange protocol.

This module holds the configuration, the listening socket, what the server counts and
the thread wrapper; one client connection's protocol is ``connection.py``, the stored
objects ``keystore.py``, tenants under mutual TLS ``tenants.py``, the Prometheus endpoint
``metrics.py`` (imported only when ``metrics_listen`` is set).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..errors import HurrayError
from .connection import SCRATCH, Connection
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


@dataclass
class Counts:
    """What the server counts as it runs: plain integers bumped on the event loop where
    the work is done (a scrape reads them from another thread: each read is one value)."""

    pushes: int = 0  # PUTs acknowledged
    pulls: int = 0  # objects sent whole
    bytes_received: int = 0  # on every connection, framing included
    bytes_sent: int = 0
    errors: Counter[int] = field(default_factory=Counter)  # ERROR messages sent, by code

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


def parse_address(address: str) -> tuple[str, int] | str:
    """``HOST:PORT``, ``HOST`` (port 7878), ``[v6]:PORT``, ``hurray://HOST:PORT`` (or
    ``tcp://``), a Unix socket path or ``unix:///path``."""
    text = address.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme in ("http", "https"):
            raise HurrayError(f"address {address!r}: hurraykv serve speaks the Hurray protocol "
                              f"over TCP, not HTTP; give HOST:PORT, e.g. {rest.rstrip('/')}",
                              field="address", value=address, rule="HOST:PORT or a path")
        if scheme == "unix":
            return rest
        if scheme not in ("hurray", "tcp"):
            raise HurrayError(f"address {address!r}: unknown scheme {scheme!r}; use HOST:PORT, "
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
        raise HurrayError(f"address {address!r}: port {port!r} is not a number in 0..65535",
                          field="address", value=address, rule="HOST:PORT or a path")
    return host.strip("[]") or "127.0.0.1", int(port)


class KVServer:
    """The server; ``await start()`` then ``serve_forever()``, or ``run_in_thread()``."""

    def __init__(self, config: ServerConfig | None = None, **kw: Any) -> None:
        self.config = config or ServerConfig(**kw)
        backing = None
        if self.config.store:
            from ..store import PageStore

            backing = PageStore.from_url(self.config.store)
        if self.config.max_bytes_per_tenant is not None and not self.config.tls_ca:
            raise HurrayError(
                f"max_bytes_per_tenant {self.config.max_bytes_per_tenant}: tenants are the "
                "client identities of mutual TLS, and no --tls-ca is given",
                field="max_bytes_per_tenant", value=self.config.max_bytes_per_tenant,
                rule="--max-bytes-per-tenant needs --tls-ca")
        self.store = KeyStore(self.config.memory_budget, self.config.persist,
                              self.config.zero_unused, backing,
                              persist_budget=self.config.persist_budget,
                              max_pinned_bytes=self.config.max_pinned_bytes,
                              max_bytes_per_tenant=self.config.max_bytes_per_tenant)
        self.pool = ReceivePool(self.config.recycle_bytes, room=self.store.idle_room)
        self.store.pool = self.pool
        self.connections = 0
        self.tenant_connections: Counter[str] = Counter()
        self.started = time.monotonic()
        self.scratch = memoryview(bytearray(SCRATCH))
        self.counts = Counts()
        self._server: asyncio.AbstractServer | None = None
        self.address: str = ""
        self.metrics: Any = None  # a metrics.MetricsEndpoint once started
        self.metrics_address: str | None = None

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

    def _ssl(self) -> ssl.SSLContext | None:
        c = self.config
        if not c.tls_cert:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(c.tls_cert, c.tls_key)
        if c.tls_ca:
            ctx.load_verify_locations(c.tls_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: the subject scopes the keys
        return ctx

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        where = parse_address(self.config.listen)
        ctx = self._ssl()
        if isinstance(where, str):
            if os.path.exists(where):
                os.unlink(where)
            self._server = await loop.create_unix_server(lambda: Connection(self), where,
                                                         ssl=ctx)
            self.address = where
        else:
            self._server = await loop.create_server(lambda: Connection(self), where[0],
                                                    where[1], ssl=ctx)
            host, port = self._server.sockets[0].getsockname()[:2]
            self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("listening on %s%s", self.address, " (mutual TLS)" if ctx else "")
        if self.config.metrics_listen:
            from .metrics import MetricsEndpoint

            try:
                self.metrics = MetricsEndpoint(self, self.config.metrics_listen, loop)
            except BaseException:
                self._server.close()
                raise
            self.metrics_address = self.metrics.address
            log.info("metrics on http://%s/metrics, health on /healthz", self.metrics_address)
        return self.address

    def close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    async def serve_forever(self) -> None:
        assert self._server is not None
        try:
            async with self._server:
                await self._server.serve_forever()
        finally:
            self.close_metrics()
            self.store.close()

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
            for task in asyncio.all_tasks(self.loop):
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.server.close_metrics()
        self.server.store.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()
