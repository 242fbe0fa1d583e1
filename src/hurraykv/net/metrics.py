"""``hurraykv serve --metrics-listen HOST:PORT``: Prometheus text at ``/metrics`` and a
health check at ``/healthz``, served by a small threaded HTTP server beside the event loop.

Nothing is counted for the metrics alone: a collector reads, at scrape time, what the
server keeps anyway (its store's accounts, its ``Counts`` with the request latencies)
into a registry of its own, so two servers in one process never share or clash over a
metric; the registry also holds ``prometheus_client``'s process collector (``process_*``)
and ``hurraykv_build_info`` says the version.  ``prometheus_client`` is
imported when an endpoint starts, not with this module (``hurraykv[metrics]``).

``/healthz`` asks the event loop to run a callback and waits for it: 200 when the loop
answers within ``HEALTH_TIMEOUT`` seconds and the server still listens, 503 otherwise
(a loop stuck in a long call, or a server shut down).

The endpoint shares the process's file descriptors with the protocol port, and must never
starve it (idle HTTP connections once took every descriptor, and pushes timed out): a
connection has ``READ_TIMEOUT`` seconds in all to send its request, at most
``MAX_CONNECTIONS`` are open at once, and one is refused when fewer than ``FD_RESERVE``
descriptors would remain below RLIMIT_NOFILE, which leaves those to the protocol port.
At the cap a new connection takes the place of the oldest one that has not sent a whole
request yet (that one is closed): a client holding idle connections cannot keep a health
probe, which sends its request at once, from being answered.  Only when every connection
is past its request is a new one closed unserved.  Refusals and timeouts are counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import json
import logging
import resource
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ..errors import HurrayError, TransportError, require
from .counts import LATENCY_BUCKETS
from .messages import PROTOCOL_VERSION, ErrorCode

if TYPE_CHECKING:
    from .config import ServerConfig
    from .counts import Counts
    from .keystore import KeyStore

log = logging.getLogger("hurraykv.server")
PREFIX = "hurraykv_server_"
HEALTH_TIMEOUT = 2.0  # seconds the event loop has to answer /healthz
READ_TIMEOUT = 5.0  # seconds a connection has to send its whole request; and per reply
MAX_CONNECTIONS = 16  # metrics connections served at once (a scraper or two, probes)
FD_RESERVE = 64  # descriptors below RLIMIT_NOFILE that only the protocol port may take
ACCEPT_PAUSE = 0.1  # after an accept() failed for want of descriptors
REFUSAL_LOG_INTERVAL = 60.0  # seconds between two log lines about refused connections


def parse_metrics_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[v6]:PORT`` (a port of 0 picks a free one); the port is required:
    the protocol's default port belongs to the server itself."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536 or (
            host.count(":") and not (host.startswith("[") and host.endswith("]"))):
        raise HurrayError(f"metrics_listen {text!r}: expected HOST:PORT (or [v6]:PORT) "
                          "with a port in 0..65535", field="metrics_listen", value=text,
                          rule="HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


class Monitored(Protocol):
    """What the endpoint reads of the server it serves (``KVServer``), so that this
    module never imports the server."""

    config: ServerConfig
    store: KeyStore
    counts: Counts  # its latencies hold the requests timed, by name
    connections: int
    metrics: MetricsEndpoint | None  # this endpoint, while it runs

    def serving(self) -> bool:
        """Whether the server still listens."""
        ...


class ServerCollector:
    """The server's metrics, read when scraped (from the HTTP thread: each read is one
    integer or one copied dictionary, so a scrape never waits for the event loop)."""

    def __init__(self, server: Monitored) -> None:
        self.server = server

    def describe(self) -> list[Any]:
        return []  # a private registry: nothing to clash with

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        from .. import __version__

        server = self.server
        yield InfoMetricFamily("hurraykv_build", "The hurraykv version serving, and the "
                               "interchange protocol it speaks",
                               value={"version": __version__,
                                      "protocol": str(PROTOCOL_VERSION)})
        latency = HistogramMetricFamily(PREFIX + "request_duration_seconds", "Seconds from "
                                        "a request's arrival to its answer, by request: a "
                                        "push from its first TENSOR_PUT to its ACK, a pull "
                                        "to its last frame written, the others to their "
                                        "reply (requests answered with ERROR: errors_total)",
                                        labels=["request"])
        latencies = server.counts.latencies
        for request in latencies.requests:  # every request from the start, at 0
            counts, total = latencies.read(request)
            running, cumulative = 0, []
            for bound, n in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
                running += n
                cumulative.append((_bound(bound), running))
            latency.add_metric([request], cumulative, total)
        yield latency
        read = Reading(server.store.stats(), server.counts, server, server.metrics)
        for m in METRICS:
            value = m.value(read)
            if value is None:
                continue  # absent: unlimited, or a part not running
            family = (GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily)(
                PREFIX + m.name, m.doc, **({"labels": [m.label]} if m.label else
                                           {"value": value}))
            if m.label:
                for label, n in value.items():
                    family.add_metric([label], n)
            yield family


@dataclass(frozen=True)
class Reading:
    """What one scrape reads of the server: its store's accounts (``KeyStore.stats``),
    its counts, the server and its metrics endpoint."""

    s: dict[str, Any]
    counts: Counts
    server: Monitored
    endpoint: MetricsEndpoint | None


@dataclass(frozen=True)
class Metric:
    """One row of the table: ``hurraykv_server_NAME`` of ``kind`` (``gauge`` or
    ``counter``), its help text, and its value read from a scrape's ``Reading``: a
    number, None (the metric absent), or with ``label`` a dict of label value -> number."""

    name: str
    kind: str
    doc: str
    value: Callable[[Reading], Any]
    label: str | None = None


def _errors(r: Reading) -> dict[str, int]:
    seen = dict(r.counts.errors)  # one copy: the loop may add a code meanwhile
    out = {code.name: seen.pop(code, 0) for code in ErrorCode}  # rate() needs the zeros
    out.update((f"0x{code:02x}", n) for code, n in sorted(seen.items()))
    return out


def _refused(r: Reading) -> dict[str, int] | None:
    if r.endpoint is None:
        return None
    seen = dict(r.endpoint.refused)
    return {reason: seen.get(reason, 0) for reason in ("cap", "idle", "descriptors")}


def _persisted(key: str) -> Callable[[Reading], Any]:
    return lambda r: r.s[key] if r.s["persist"] else None


METRICS = (
    Metric("objects", "gauge", "Stored objects by tier (an object both in memory and "
           "persisted counts in each)", lambda r: {"memory": r.s["objects_in_memory"],
                                                   "disk": r.s["persisted_objects"]},
           "tier"),
    Metric("memory_bytes", "gauge", "Bytes of committed objects held in memory",
           lambda r: r.s["memory_bytes"]),
    Metric("reserved_bytes", "gauge", "Bytes reserved against the memory budget by pushes "
           "and payloads in flight", lambda r: r.s["reserved_bytes"]),
    Metric("idle_receive_bytes", "gauge", "Idle receive buffers kept for the next pushes "
           "(held against the memory budget)", lambda r: r.s["idle_receive_bytes"]),
    Metric("alias_bytes", "gauge", "Bytes the aliases hold against the memory budget",
           lambda r: r.s["alias_bytes"]),
    Metric("memory_budget_bytes", "gauge", "--memory-budget (absent: unlimited)",
           lambda r: r.s["memory_budget"]),
    Metric("persisted_bytes", "gauge", "Bytes of .hrry files in the --persist directory",
           _persisted("persisted_bytes")),
    Metric("persist_reserved_bytes", "gauge", "Bytes reserved under the persist budget by "
           "files being written", _persisted("persist_reserved_bytes")),
    Metric("persist_budget_bytes", "gauge", "--persist-budget (absent: unlimited)",
           lambda r: r.s["persist_budget"]),
    Metric("evictions", "counter", "Objects evicted to fit a budget, by tier (memory: "
           "--memory-budget, disk: --persist-budget)",
           lambda r: {"memory": r.s["memory_evictions"], "disk": r.s["disk_evictions"]},
           "tier"),
    Metric("pushes", "counter", "Pushes (PUTs) acknowledged", lambda r: r.counts.pushes),
    Metric("pulls", "counter", "Objects sent whole to a client", lambda r: r.counts.pulls),
    Metric("received_bytes", "counter", "Bytes received on every connection",
           lambda r: r.counts.bytes_received),
    Metric("sent_bytes", "counter", "Bytes sent on every connection",
           lambda r: r.counts.bytes_sent),
    Metric("errors", "counter", "ERROR messages sent, by protocol error code", _errors,
           "code"),
    Metric("connections", "gauge", "Open client connections", lambda r: r.server.connections),
    Metric("max_connections", "gauge", "--max-connections",
           lambda r: r.server.config.max_connections),
    Metric("metrics_connections", "gauge", "Open connections to --metrics-listen (this "
           "scrape's included)", lambda r: None if r.endpoint is None else r.endpoint.open),
    Metric("metrics_refused", "counter", "Connections to --metrics-listen closed unserved, "
           f"by reason (cap: {MAX_CONNECTIONS} open and past their request; idle: the "
           "oldest without a request, for a newer one; descriptors: fewer than the "
           "protocol port's reserve left)", _refused, "reason"),
    Metric("metrics_timeouts", "counter", "Connections to --metrics-listen closed for not "
           f"sending a request within {READ_TIMEOUT} s (or not taking the reply)",
           lambda r: None if r.endpoint is None else r.endpoint.timeouts),
)


def _bound(seconds: float) -> str:
    """A bucket's ``le`` as Prometheus writes it: ``0.005``, ``1.0``, ``+Inf``."""
    return "+Inf" if seconds == float("inf") else repr(float(seconds))


class _Deadline(io.RawIOBase):
    """A socket's incoming bytes under one deadline for all of them: a timeout per read
    alone would let a client that sends a byte now and then hold its connection (and a
    thread) for ever."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.sock, self.deadline = sock, time.monotonic() + seconds

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(b)


class _Handler(WSGIRequestHandler):
    """One request per connection, read under ``READ_TIMEOUT`` in all."""

    server: _EndpointServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own file would keep its descriptor open
        self.rfile = io.BufferedReader(_Deadline(self.connection, READ_TIMEOUT))

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:  # the request line and headers are in: this connection is being served
            self.server.endpoint._requested(self.connection)
        self.connection.settimeout(READ_TIMEOUT)  # the reply's own limit, not what is left
        return ok

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:
            self.server.endpoint._timed_out()
        except OSError:
            pass  # the client went away: nothing to answer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


class _EndpointServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, admitted by ``MetricsEndpoint._admit`` first."""

    daemon_threads = True  # a stuck client never holds up the process's exit
    request_queue_size = 128  # a burst of connections waits for accept() (no descriptor)
    endpoint: MetricsEndpoint

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                # the connection waits in the backlog and the listening socket stays
                # readable: without a pause this thread would spin a core until a
                # descriptor frees
                time.sleep(ACCEPT_PAUSE)
            raise

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.endpoint._admit(request)

    def service_actions(self) -> None:
        self.endpoint._report()

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread: nobody else leaves for it
            self.endpoint._leave(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.endpoint._leave(request)


class MetricsEndpoint:
    """The HTTP server of one ``KVServer``: started listening, in a daemon thread."""

    def __init__(self, server: Monitored, listen: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        require("prometheus_client", "metrics", "hurraykv serve --metrics-listen")
        from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app

        self.server, self.loop = server, loop
        self.open = 0  # connections admitted and not yet closed
        # of those, the ones that have not sent a whole request, oldest first
        self._waiting: OrderedDict[socket.socket, None] = OrderedDict()
        self.refused: Counter[str] = Counter()  # by reason: "cap", "idle", "descriptors"
        self.timeouts = 0
        self._lock = threading.Lock()  # open, timeouts: counted by the handler threads
        self._logged = -REFUSAL_LOG_INTERVAL  # the first refusal is logged at once
        self._unlogged: Counter[str] = Counter()
        self.registry = CollectorRegistry()
        self.registry.register(ServerCollector(server))
        # process_* (CPU seconds, resident memory, open descriptors, start time): read
        # from /proc where there is one (Linux), absent elsewhere
        ProcessCollector(registry=self.registry)
        self._metrics = make_wsgi_app(self.registry)
        host, port = parse_metrics_address(listen)
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]

            class Server(_EndpointServer):
                address_family = family
                endpoint = self

            self.httpd: WSGIServer = make_server(host, port, self._app, Server,
                                                 handler_class=_Handler)
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

    def _admit(self, sock: socket.socket) -> bool:
        """Whether to serve a connection just accepted (else it is closed at once)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # The kernel hands out the lowest free descriptor, so every one below this
        # connection's is taken: past the ceiling, the rest belong to the protocol port.
        if soft != resource.RLIM_INFINITY and sock.fileno() >= soft - FD_RESERVE:
            self._refuse("descriptors")
            return False
        victim = None
        with self._lock:
            if self.open >= MAX_CONNECTIONS:
                victim = next(iter(self._waiting), None)  # the oldest without a request
                if victim is None:
                    admitted = False
                else:
                    del self._waiting[victim]
                    admitted = True
            else:
                admitted = True
            if admitted:
                self.open += 1
                self._waiting[sock] = None
        if victim is not None:
            # its thread's read ends at once, and that thread leaves (counted then)
            with contextlib.suppress(OSError):
                victim.shutdown(socket.SHUT_RDWR)
            self._refuse("idle")
        if not admitted:
            self._refuse("cap")
        return admitted

    def _requested(self, sock: socket.socket) -> None:
        """``sock`` sent its whole request: no newer connection takes its place now."""
        with self._lock:
            self._waiting.pop(sock, None)

    def _leave(self, sock: socket.socket) -> None:
        with self._lock:
            self._waiting.pop(sock, None)
            self.open -= 1

    def _timed_out(self) -> None:
        with self._lock:  # handler threads count at once
            self.timeouts += 1

    def _refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        self._unlogged[reason] += 1

    def _report(self) -> None:
        """Log the refusals not yet logged, at most once per ``REFUSAL_LOG_INTERVAL``: a
        flood of connections is a line a minute with counts, not a line each (called
        between accepts, on the thread that counts them)."""
        now = time.monotonic()
        if not self._unlogged or now - self._logged < REFUSAL_LOG_INTERVAL:
            return
        cap, idle = self._unlogged["cap"], self._unlogged["idle"]
        fds = self._unlogged["descriptors"]
        log.warning("metrics endpoint: closed %d connection(s) unserved (%d over the cap "
                    "of %d open at once, %d idle without a request for a newer one, %d "
                    "with fewer than %d descriptors left below RLIMIT_NOFILE, kept for the "
                    "protocol port); reported at most once a minute", cap + idle + fds, cap,
                    MAX_CONNECTIONS, idle, fds, FD_RESERVE)
        self._logged = now
        self._unlogged.clear()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Whether the event loop answers (and how fast) and the server still listens."""
        answered = threading.Event()
        listening: list[bool] = []
        started = time.perf_counter()

        def probe() -> None:
            listening.append(self.server.serving())
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
