"""``hurraykv serve``: an asyncio KV cache server speaking the Hurray interchange protocol.

This module holds the listening socket and the thread wrapper; the configuration is
``config.py`` (``ServerConfig``, importable from here too), what the server counts
``counts.py``, one client connection's protocol ``connection.py`` (which sees the server
as a ``session.ServerState``), the stored objects ``keystore.py``, tenants under mutual
TLS ``tenants.py``, the Prometheus endpoint ``metrics.py`` (imported only when
``metrics_listen`` is set).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from .. import units
from ..errors import ConfigError, TransportError
from . import extensions, handover, tls  # noqa: F401  (handover: hurraykv.share)
from .config import ServerConfig
from .connection import SCRATCH, Connection
from .counts import Counts, Latencies
from .handlers import REQUESTS
from .keystore import KeyStore
from .memory import ReceivePool

log = logging.getLogger("hurraykv.server")


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
    digits = port.isascii() and port.isdigit()  # int() also reads '٨٠'
    if not digits or not 0 <= int(port) < 65536:
        what = "is out of range" if digits else "is not a number"
        raise ConfigError(f"address {address!r}: port {port!r} {what}: a port is 0..65535",
                          field="address", value=address, rule="HOST:PORT or a path")
    return host.strip("[]") or "127.0.0.1", int(port)


def _cannot_listen(listen: str, why: str) -> TransportError:
    return TransportError(f"--listen {listen}: cannot listen: {why}", field="listen",
                          value=listen, rule="a free local HOST:PORT or a socket path the "
                          "server may create")


def clear_stale_socket(path: str, listen: str) -> None:
    """Remove the socket file a server that died left at ``path``, one no server answers
    on.  A socket a server answers on, or one it cannot tell, and anything that is not a
    socket (a symbolic link included) are left as they are: ``TransportError`` naming
    ``--listen``."""
    if path.startswith("\0"):
        return  # an abstract socket (Linux) has no file
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError:
        return  # binding there fails and says why
    if not stat.S_ISSOCK(mode):
        raise _cannot_listen(listen, f"{path} exists and is not a socket; it is left as "
                             "it is (remove it, or give another path)")
    probe = socket.socket(socket.AF_UNIX)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: what a killed server leaves behind
        return
    except OSError as e:
        raise _cannot_listen(listen, f"{path} is a socket the server cannot tell is "
                             f"unused: {e.strerror or e}") from None
    finally:
        probe.close()
    raise _cannot_listen(listen, f"{path}: a server answers on it")


class KVServer:
    """The server; ``await start()`` then ``serve_forever()``, or ``run_in_thread()``."""

    def __init__(self, config: ServerConfig | None = None, **kw: Any) -> None:
        self.config = config or ServerConfig(**kw)
        c = self.config
        # what the server says of its life (listening, metrics, stopped): logged, or
        # printed once by `hurraykv serve` (which sets its own)
        self.announce: Callable[[str], None] = lambda text: log.info("%s", text)
        for name in ("max_bytes_per_tenant", "max_connections_per_tenant"):
            value, option = getattr(c, name), "--" + name.replace("_", "-")
            if value is not None and not c.tls_ca:
                raise ConfigError(f"{option} {value}: tenants are the client identities of "
                                  "mutual TLS, and no --tls-ca is given", field=name,
                                  value=value, rule=f"{option} needs --tls-ca")
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
        # clients on this host's socket are handed segments (handover.py): each object
        # is sealed into its memory file as it is stored, off the load's path
        self.hands_over = isinstance(parse_address(c.listen), str) and self.ssl_context is None
        self.pool = ReceivePool(c.recycle_bytes, room=self.store.idle_room)
        self.store.pool = self.pool
        self.connections = 0
        self.open_connections: set[Connection] = set()
        self.tenant_connections: Counter[str] = Counter()
        self.over_share = 0
        self.started = time.monotonic()
        self.scratch = memoryview(bytearray(SCRATCH))
        self.counts = Counts(latencies=Latencies(REQUESTS))
        self._server: asyncio.AbstractServer | None = None
        self.address: str = ""
        self._socket_file: tuple[str, int, int] | None = None  # path, st_dev, st_ino
        self.metrics: Any = None  # a metrics.MetricsEndpoint once started
        self.metrics_address: str | None = None
        self.stopped = False

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """What ``hurraykv stat`` shows: objects, bytes, budget, connections; for a
        ``tenant`` (mutual TLS) its own objects, bytes and connections only (and how
        many it may hold, ``max_connections_per_tenant``), and whether the server
        persists rather than where."""
        from .. import __version__

        out = {"version": __version__, "address": self.address,
               "max_connections": self.config.max_connections,
               "uptime_s": round(time.monotonic() - self.started, 3)}
        if tenant is None:  # traffic counts are server-wide: a tenant sees none
            return {**out, "connections": self.connections, **self.store.stats(),
                    **self.counts.as_dict()}
        return {**out, "tenant": tenant, "connections": self.tenant_connections[tenant],
                "max_connections_per_tenant": self.config.tenant_share(),
                **self.store.stats(tenant)}

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        for problem in extensions.load_plugins():  # said at start, not at the first call
            log.warning("%s", problem)
        where = parse_address(self.config.listen)
        ctx = self.ssl_context
        try:
            if isinstance(where, str):
                clear_stale_socket(where, self.config.listen)
                self._server = await loop.create_unix_server(lambda: Connection(self),
                                                             where, ssl=ctx)
                if not where.startswith("\0"):
                    made = os.lstat(where)
                    self._socket_file = (where, made.st_dev, made.st_ino)
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
                self._remove_socket_file()
                raise
            self.metrics_address = self.metrics.address
        self.announce(f"listening on {self.address}")  # the first line ends in it
        if self.metrics is not None:
            self.announce(f"metrics on http://{self.metrics_address}/metrics, health on "
                          "/healthz")
        return self.address

    def _remove_socket_file(self) -> None:
        """Remove the Unix socket file this server made, if it is still that file (not
        one another server made at the path since)."""
        if self._socket_file is None:
            return
        path, dev, ino = self._socket_file
        self._socket_file = None
        try:
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (dev, ino):
                os.unlink(path)
        except OSError:
            pass  # gone already, or its directory with it

    def serving(self) -> bool:
        """Whether the server is listening (started and not stopped)."""
        return self._server is not None and self._server.is_serving()

    def close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def _close_connections(self) -> int:
        """Close every client connection (their PUTs in flight leave nothing); how many."""
        closing = list(self.open_connections)
        for c in closing:
            c.close()
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
        self._remove_socket_file()
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
