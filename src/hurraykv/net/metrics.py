"""``hurraykv serve --metrics-listen HOST:PORT``: Prometheus text at ``/metrics`` and a
health check at ``/healthz``, served by a small threaded HTTP server beside the event loop.

Nothing is counted for the metrics alone: a collector reads, at scrape time, what the
server keeps anyway (its store's accounts, its ``Counts``) into a registry of its own, so
two servers in one process never share or clash over a metric.  ``prometheus_client`` is
imported when an endpoint starts, not with this module (``hurraykv[metrics]``).

``/healthz`` asks the event loop to run a callback and waits for it: 200 when the loop
answers within ``HEALTH_TIMEOUT`` seconds and the server still listens, 503 otherwise
(a loop stuck in a long call, or a server shut down).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ..errors import HurrayError, TransportError, require
from .messages import ErrorCode

if TYPE_CHECKING:
    from .server import KVServer

PREFIX = "hurraykv_server_"
HEALTH_TIMEOUT = 2.0  # seconds the event loop has to answer /healthz


def parse_metrics_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[v6]:PORT`` (a port of 0 picks a free one); the port is required:
    the protocol's default port belongs to the server itself."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536 or (
            host.count(":") and not (host.startswith("[") and host.endswith("]"))):
        raise HurrayError(f"metrics_listen {text!r}: expected HOST:PORT (or [v6]:PORT) "
                          "with a port in 0..65535", field="metrics_listen", value=text,
                          rule="HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


class ServerCollector:
    """The server's metrics, read when scraped (from the HTTP thread: each read is one
    integer or one copied dictionary, so a scrape never waits for the event loop)."""

    def __init__(self, server: KVServer) -> None:
        self.server = server

    def describe(self) -> list[Any]:
        return []  # a private registry: nothing to clash with

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        server = self.server
        s = server.store.stats()
        counts = server.counts

        def gauge(name: str, doc: str, value: float | None) -> Iterable[Any]:
            return [] if value is None else [GaugeMetricFamily(PREFIX + name, doc, value=value)]

        def counter(name: str, doc: str, value: float) -> Any:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        objects = GaugeMetricFamily(PREFIX + "objects", "Stored objects by tier (an object "
                                    "both in memory and persisted counts in each)",
                                    labels=["tier"])
        objects.add_metric(["memory"], s["objects_in_memory"])
        objects.add_metric(["disk"], s["persisted_objects"])
        yield objects
        yield from gauge("memory_bytes", "Bytes of committed objects held in memory",
                         s["memory_bytes"])
        yield from gauge("reserved_bytes", "Bytes reserved against the memory budget by "
                         "pushes and payloads in flight", s["reserved_bytes"])
        yield from gauge("idle_receive_bytes", "Idle receive buffers kept for the next "
                         "pushes (held against the memory budget)", s["idle_receive_bytes"])
        yield from gauge("alias_bytes", "Bytes the aliases hold against the memory budget",
                         s["alias_bytes"])
        yield from gauge("memory_budget_bytes", "--memory-budget (absent: unlimited)",
                         s["memory_budget"])
        yield from gauge("persisted_bytes", "Bytes of .hrry files in the --persist directory",
                         s["persisted_bytes"] if s["persist"] else None)
        yield from gauge("persist_reserved_bytes", "Bytes reserved under the persist budget "
                         "by files being written",
                         s["persist_reserved_bytes"] if s["persist"] else None)
        yield from gauge("persist_budget_bytes", "--persist-budget (absent: unlimited)",
                         s["persist_budget"])
        evictions = CounterMetricFamily(PREFIX + "evictions", "Objects evicted to fit a "
                                        "budget, by tier (memory: --memory-budget, disk: "
                                        "--persist-budget)", labels=["tier"])
        evictions.add_metric(["memory"], s["memory_evictions"])
        evictions.add_metric(["disk"], s["disk_evictions"])
        yield evictions
        yield counter("pushes", "Pushes (PUTs) acknowledged", counts.pushes)
        yield counter("pulls", "Objects sent whole to a client", counts.pulls)
        yield counter("received_bytes", "Bytes received on every connection",
                      counts.bytes_received)
        yield counter("sent_bytes", "Bytes sent on every connection", counts.bytes_sent)
        errors = CounterMetricFamily(PREFIX + "errors", "ERROR messages sent, by protocol "
                                     "error code", labels=["code"])
        seen = dict(counts.errors)  # one copy: the loop may add a code meanwhile
        for code in ErrorCode:  # every code from the start: rate() needs the zero
            errors.add_metric([code.name], seen.pop(code, 0))
        for code, n in sorted(seen.items()):
            errors.add_metric([f"0x{code:02x}"], n)
        yield errors
        yield from gauge("connections", "Open client connections", server.connections)
        yield from gauge("max_connections", "--max-connections",
                         server.config.max_connections)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


class MetricsEndpoint:
    """The HTTP server of one ``KVServer``: started listening, in a daemon thread."""

    def __init__(self, server: KVServer, listen: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        require("prometheus_client", "metrics", "hurraykv serve --metrics-listen")
        from prometheus_client import CollectorRegistry, make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer

        self.server, self.loop = server, loop
        self.registry = CollectorRegistry()
        self.registry.register(ServerCollector(server))
        self._metrics = make_wsgi_app(self.registry)
        host, port = parse_metrics_address(listen)
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]

            class Server(ThreadingWSGIServer):
                address_family = family

            self.httpd: WSGIServer = make_server(host, port, self._app, Server,
                                                 handler_class=_Quiet)
        except OSError as e:
            raise TransportError(f"--metrics-listen {listen}: cannot listen: "
                                 f"{e.strerror or e}", field="metrics_listen", value=listen,
                                 rule="a free local HOST:PORT") from None
        bound_host, bound_port = self.httpd.server_address[:2]
        self.address = (f"[{bound_host}]:{bound_port}" if ":" in str(bound_host)
                        else f"{bound_host}:{bound_port}")
        # a short poll: close() waits for it, and servers stop in tests all the time
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.1,),
                                       daemon=True, name="hurraykv-metrics")
        self.thread.start()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Whether the event loop answers (and how fast) and the server still listens."""
        answered = threading.Event()
        listening: list[bool] = []
        started = time.perf_counter()

        def probe() -> None:
            srv = self.server._server
            listening.append(srv is not None and srv.is_serving())
            answered.set()

        try:
            self.loop.call_soon_threadsafe(probe)
        except RuntimeError:  # the loop is closed
            return False, {"status": "down", "reason": "the event loop is closed"}
        if not answered.wait(HEALTH_TIMEOUT):
            return False, {"status": "unresponsive",
                           "reason": f"the event loop did not answer in {HEALTH_TIMEOUT} s"}
        delay = round(time.perf_counter() - started, 6)
        if not listening[0]:
            return False, {"status": "down", "reason": "the server is not listening",
                           "loop_delay_s": delay}
        return True, {"status": "ok", "loop_delay_s": delay,
                      "connections": self.server.connections}

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]
             ) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics(environ, start_response)
        if path == "/healthz":
            ok, body = self.health()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "application/json")])
            return [json.dumps(body).encode() + b"\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"hurraykv serve: GET /metrics (Prometheus text) or /healthz\n"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
