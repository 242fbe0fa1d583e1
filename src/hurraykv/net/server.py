"""``hurraykv serve``: an asyncio KV cache server speaking the Hurray interchange protocol.

Each connection is an ``asyncio.BufferedProtocol`` state machine: headers and small
payloads land in small buffers, and TENSOR_DATA bytes land straight in the destination
buffer of the tensor being received (no intermediate copy).  Pulls write descriptors and
data frames from the stored buffers (mmap views for persisted objects) under transport
flow control.

Rules the server keeps (decisions in docs/spec-decisions.md):

* CLIENT_HELLO first, answered by SERVER_HELLO; anything else first closes the connection.
* A snapshot is pushed as one group: ``TENSOR_PUT(head)`` + ``TENSOR_DATA_END``, then one
  ``TENSOR_PUT`` + ``TENSOR_DATA``* + ``TENSOR_DATA_END`` per member, all under the same key
  and stream; one ``TENSOR_PUT_ACK`` (or ERROR) follows the Nth member.  Nothing is visible
  under the key before that; a stream that errs or a connection that drops leaves nothing.
* A malformed or oversized message gets ERROR and closes that stream only; oversized
  payloads are read and discarded so the connection stays in step.
* With mutual TLS the client certificate's subject scopes every key: tenants never see
  or overwrite each other's objects.
* Unused page slots are zeroed before data leaves the process (``zero_unused``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import HurrayError
from ..wire.layouts import Composite
from .keystore import KeyStore, StoredObject, object_from_items
from .memory import ReceivePool
from .messages import (
    HEADER,
    DataAssembler,
    DataPlan,
    DescriptorMessage,
    ErrorCode,
    ErrorMessage,
    Hello,
    MessageType,
    ProtocolError,
    decode_delete,
    decode_empty,
    decode_error,
    decode_header,
    decode_hello,
    decode_put,
    decode_request,
    encode_data_header,
    message,
)

log = logging.getLogger("hurraykv.server")
SCRATCH = 1 << 20
PUMP_BYTES = 64 << 20  # read at most this much per event before letting others run


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:0"  # HOST:PORT, or a Unix socket path
    memory_budget: int | None = None
    persist: str | None = None
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


def parse_address(address: str) -> tuple[str, int] | str:
    """``HOST:PORT`` (``[v6]:PORT`` too) or a Unix socket path."""
    if "/" in address or address.endswith(".sock"):
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise HurrayError(f"address {address!r} is neither HOST:PORT nor a socket path",
                          field="address", value=address, rule="HOST:PORT or a path")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass
class _Put:
    key: str
    items: list
    expected: int  # tensors this PUT carries: 1, or a group head and its members
    assembler: DataAssembler | None = None
    nbytes: int = 0
    started: float = 0.0


class Connection(asyncio.BufferedProtocol):
    def __init__(self, server: KVServer) -> None:
        self.server = server
        self.cfg = server.config
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.tenant = ""
        self.hello: Hello | None = None
        self.busy = False
        self.closed = False
        self.puts: dict[int, _Put] = {}
        self.tasks: set[asyncio.Task] = set()
        self._header = bytearray(HEADER.size)
        self._offset = bytearray(8)
        self._target: memoryview = memoryview(self._header)
        self._got = 0
        self._state = "header"
        self._msg: tuple[int, int, int] = (0, 0, 0)
        self._discard = 0
        self._last = self.loop.time()
        self._writable = asyncio.Event()
        self._writable.set()
        self._watchdog: asyncio.TimerHandle | None = None
        self._raw: socket.socket | None = None

    # -- transport callbacks ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections += 1
        self.busy = self.server.connections > self.cfg.max_connections
        cert = transport.get_extra_info("peercert")
        if cert:
            self.tenant = ",".join(f"{k}={v}" for rdn in cert.get("subject", ())
                                   for k, v in rdn)
        elif transport.get_extra_info("sslcontext") is None:
            # A duplicate of the plain socket lets buffer_updated keep reading while bytes
            # are waiting, instead of one event-loop round per kernel-buffer's worth.
            sock = transport.get_extra_info("socket")
            if sock is not None:
                self._raw = socket.socket(sock.family, sock.type, sock.proto,
                                          fileno=os.dup(sock.fileno()))
                self._raw.setblocking(False)
        self._watchdog = self.loop.call_later(1.0, self._check_timeouts)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections -= 1
        self.puts.clear()  # unfinished PUTs leave nothing behind
        if self._raw is not None:
            self._raw.close()
            self._raw = None
        for task in self.tasks:
            task.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self._consume(nbytes)
        budget = PUMP_BYTES
        while self._raw is not None and not self.closed and budget > 0:
            try:
                n = self._raw.recv_into(self._target[self._got:])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # the transport sees the same error and closes
            if n == 0:
                return  # end of stream: the transport reports it
            budget -= n
            self._consume(n)

    def _consume(self, nbytes: int) -> None:
        self._last = self.loop.time()
        self._got += nbytes
        if self._got < len(self._target):
            return
        try:
            self._advance()
        except ProtocolError as e:  # a framing problem outside any stream: drop the line
            self._send_error(self._msg[1] or 1, e.code, str(e))
            self._close()

    def eof_received(self) -> bool:
        return False

    def _check_timeouts(self) -> None:
        if self.closed:
            return
        idle = self.loop.time() - self._last
        mid = self._state != "header" or self._got > 0 or self.puts
        if idle > (self.cfg.read_timeout if mid else self.cfg.idle_timeout):
            log.info("closing connection: %s for %.1f s", "stalled" if mid else "idle", idle)
            if mid and self._msg[1]:
                self._send_error(self._msg[1], ErrorCode.TIMEOUT, "read timeout")
            self._close()
            return
        self._watchdog = self.loop.call_later(1.0, self._check_timeouts)

    # -- framing -----------------------------------------------------------------------
    def _expect(self, state: str, target: memoryview) -> None:
        self._state, self._target, self._got = state, target, 0
        if len(target) == 0:
            self._advance()

    def _advance(self) -> None:
        state = self._state
        if state == "header":
            try:
                self._msg = decode_header(self._header, self.cfg.max_message_size)
            except ProtocolError as e:
                mtype, stream, length = HEADER.unpack(self._header)
                if e.code == ErrorCode.MESSAGE_TOO_LARGE and stream:
                    self._send_error(stream, e.code, str(e))
                    self._abort_stream(stream)
                    self._msg = (mtype, stream, length)
                    self._start_discard(length)
                    return
                raise
            mtype, stream, length = self._msg
            put = self.puts.get(stream)
            if mtype == MessageType.TENSOR_DATA and put is not None and put.assembler:
                if length < 8:
                    self._stream_error(stream, ProtocolError("tensor_data shorter than its "
                                                             "u64 byte_offset"), length)
                    return
                self._expect("data_offset", memoryview(self._offset))
                return
            self._expect("payload", memoryview(bytearray(length)))
        elif state == "data_offset":
            mtype, stream, length = self._msg
            put = self.puts[stream]
            offset = int.from_bytes(self._offset, "little")
            try:
                target = put.assembler.target(offset, length - 8)  # type: ignore[union-attr]
            except ProtocolError as e:
                self._stream_error(stream, e, length - 8)
                return
            self._expect("data", target)
        elif state == "data":
            self._expect("header", memoryview(self._header))
        elif state == "payload":
            payload = self._target
            mtype, stream, _ = self._msg
            self._expect("header", memoryview(self._header))
            try:
                self._dispatch(mtype, stream, payload)
            except ProtocolError as e:
                self._stream_error(stream, e, 0)
            except HurrayError as e:
                self._stream_error(stream, ProtocolError(str(e)), 0)
        elif state == "discard":
            self._discard -= self._got
            if self._discard > 0:
                self._expect("discard", self.server.scratch[:min(self._discard, SCRATCH)])
            else:
                self._expect("header", memoryview(self._header))

    def _start_discard(self, n: int) -> None:
        self._discard = n
        if n == 0:
            self._expect("header", memoryview(self._header))
        else:
            self._expect("discard", self.server.scratch[:min(n, SCRATCH)])

    def _stream_error(self, stream: int, e: ProtocolError, discard: int) -> None:
        log.info("stream %d: %s", stream, e)
        self._send_error(stream, e.code, str(e))
        self._abort_stream(stream)
        self._start_discard(discard)

    def _abort_stream(self, stream: int) -> None:
        self.puts.pop(stream, None)

    # -- output ----------------------------------------------------------------------
    def _write(self, *parts: Any) -> None:
        if not self.closed and self.transport is not None:
            for p in parts:
                self.transport.write(p)

    def _send_error(self, stream: int, code: int, text: str) -> None:
        self._write(message(MessageType.ERROR, stream, ErrorMessage(int(code), text).encode()))

    def _close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- messages --------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return f"{self.tenant}\x00{key}" if self.tenant else key

    def _dispatch(self, mtype: int, stream: int, payload: memoryview) -> None:
        if self.hello is None:
            if mtype != MessageType.CLIENT_HELLO:
                self._send_error(stream, ErrorCode.INVALID_MESSAGE,
                                 "CLIENT_HELLO must be the first message")
                self._close()
                return
            self._on_hello(stream, payload)
            return
        if mtype == MessageType.TENSOR_REQUEST:
            req = decode_request(payload)
            obj = self.server.store.get(self._key(req.key))
            if obj is None:
                raise ProtocolError(f"no tensor under key {req.key!r}", ErrorCode.UNKNOWN_TENSOR)
            if req.preferred_device not in (0,) and 0 not in self.hello.devices:
                raise ProtocolError(f"device 0x{req.preferred_device:02x} is unavailable and "
                                    "the client does not take CPU", ErrorCode.DEVICE_UNAVAILABLE)
            self._spawn(self._send_object(stream, req.key, obj))
        elif mtype == MessageType.TENSOR_PUT:
            self._on_put(stream, payload)
        elif mtype == MessageType.TENSOR_DATA:
            raise ProtocolError("tensor_data without a TENSOR_PUT open on this stream")
        elif mtype == MessageType.TENSOR_DATA_END:
            decode_empty(payload, "tensor_data_end")
            self._on_data_end(stream)
        elif mtype == MessageType.PING:
            self._write(message(MessageType.PONG, stream, bytes(payload)))
        elif mtype == MessageType.DELETE:
            key = decode_delete(payload).key
            if not self.server.store.delete(self._key(key)):
                raise ProtocolError(f"no tensor under key {key!r}", ErrorCode.UNKNOWN_TENSOR)
            log.info("delete key=%r", key)
            self._write(message(MessageType.DELETE_ACK, stream))
        elif mtype == MessageType.ERROR:
            err = decode_error(payload)
            log.info("stream %d: client error %d: %s", stream, err.code, err.message)
            self._abort_stream(stream)
        elif mtype == MessageType.CLIENT_HELLO:
            raise ProtocolError("CLIENT_HELLO may be sent once per connection")
        elif mtype in (MessageType.RDMA_REGISTER, MessageType.RDMA_READY):
            raise ProtocolError("the RDMA data plane is not offered (capability bit 2 clear)")
        elif mtype in MessageType._value2member_map_:
            raise ProtocolError(f"{MessageType(mtype).name} does not travel client to server")
        else:
            raise ProtocolError(f"unknown message_type 0x{mtype:x}")

    def _on_hello(self, stream: int, payload: memoryview) -> None:
        try:
            hello = decode_hello(payload, "client_hello")
        except ProtocolError as e:
            self._send_error(stream, e.code, str(e))
            self._close()
            return
        if hello.protocol_version < 1:
            self._send_error(stream, ErrorCode.PROTOCOL_VERSION_MISMATCH,
                             f"protocol_version {hello.protocol_version}; this server speaks 1")
            self._close()
            return
        if self.busy:
            self._send_error(stream, ErrorCode.SERVER_BUSY,
                             f"more than {self.cfg.max_connections} connections")
            self._close()
            return
        self.hello = hello
        reply = Hello(1, self.cfg.max_message_size, 0)
        self._write(message(MessageType.SERVER_HELLO, stream, reply.encode()))

    def _on_put(self, stream: int, payload: memoryview) -> None:
        put_msg = decode_put(payload)
        desc = put_msg.descriptor
        put = self.puts.get(stream)
        if put is None:
            expected = 1 + (desc.layout.member_count if isinstance(desc.layout, Composite)
                            else 0)
            put = _Put(put_msg.key, [], expected, started=time.perf_counter())
            self.puts[stream] = put
        elif put.assembler is not None:
            raise ProtocolError("TENSOR_PUT while the previous tensor's data is still open")
        elif put_msg.key != put.key:
            raise ProtocolError(f"member pushed under key {put_msg.key!r} inside the group of "
                                f"{put.key!r}")
        elif isinstance(desc.layout, Composite):
            raise ProtocolError("nested composites are not stored by this server")
        put.nbytes += put_msg.total_data_bytes
        if not self.server.store.fits(put.nbytes):
            raise ProtocolError(f"{put.nbytes} bytes exceed the server's memory budget "
                                f"{self.server.store.memory_budget}", ErrorCode.STORE_FULL)
        put.assembler = DataAssembler(desc, pool=self.server.pool)

    def _on_data_end(self, stream: int) -> None:
        put = self.puts.get(stream)
        if put is None or put.assembler is None:
            raise ProtocolError("tensor_data_end without an open TENSOR_PUT")
        buffers = put.assembler.finish()
        put.items.append((put.assembler.desc, buffers))
        put.assembler = None
        if len(put.items) == put.expected:  # the group closes at its Nth member
            del self.puts[stream]
            self._spawn(self._commit(stream, put))

    async def _commit(self, stream: int, put: _Put) -> None:
        store = self.server.store
        try:
            obj, snap = object_from_items(put.items, self.cfg.zero_unused)
            path = await self.loop.run_in_executor(None, store.persist_object,
                                                   self._key(put.key), obj, snap)
        except HurrayError as e:
            self._send_error(stream, getattr(e, "code", ErrorCode.INVALID_MESSAGE),
                             f"rejected: {e}")
            return
        store.commit(self._key(put.key), obj, path)
        seconds = time.perf_counter() - put.started
        log.info("put key=%r bytes=%d seconds=%.3f GB/s=%.2f", put.key, obj.nbytes, seconds,
                 obj.nbytes / max(seconds, 1e-9) / 1e9)
        self._write(message(MessageType.TENSOR_PUT_ACK, stream))

    async def _send_object(self, stream: int, key: str, obj: StoredObject) -> None:
        started = time.perf_counter()
        max_frame = min(self.cfg.frame_bytes, (self.hello.max_message_size if self.hello
                                                else self.cfg.max_message_size) - 8)
        for desc, buffers in obj.items:
            total = sum(h.byte_size for h in desc.buffers)
            self._write(message(MessageType.TENSOR_DESCRIPTOR, stream,
                                DescriptorMessage(desc, total).encode()))
            for offset, parts in DataPlan([memoryview(b).cast("B") for b in buffers]).frames(
                    max_frame):
                if self.closed:
                    return
                size = sum(p.nbytes for p in parts)
                self._write(encode_data_header(stream, offset, size), *parts)
                if not self._writable.is_set():
                    await self._writable.wait()
            self._write(message(MessageType.TENSOR_DATA_END, stream))
        seconds = time.perf_counter() - started
        log.info("get key=%r bytes=%d seconds=%.3f GB/s=%.2f", key, obj.nbytes, seconds,
                 obj.nbytes / max(seconds, 1e-9) / 1e9)


class KVServer:
    """The server; ``await start()`` then ``serve_forever()``, or ``run_in_thread()``."""

    def __init__(self, config: ServerConfig | None = None, **kw: Any) -> None:
        self.config = config or ServerConfig(**kw)
        backing = None
        if self.config.store:
            from ..store import PageStore

            backing = PageStore.from_url(self.config.store)
        self.store = KeyStore(self.config.memory_budget, self.config.persist,
                              self.config.zero_unused, backing)
        self.connections = 0
        self.scratch = memoryview(bytearray(SCRATCH))
        self.pool = ReceivePool(self.config.recycle_bytes)
        self._server: asyncio.AbstractServer | None = None
        self.address: str = ""

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
        return self.address

    async def serve_forever(self) -> None:
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

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

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()
