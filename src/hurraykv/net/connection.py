"""One client connection of ``hurraykv serve``: framing, handshake, dispatch.

Each connection is an ``asyncio.BufferedProtocol`` state machine: headers and control
payloads land in small buffers that grow only as bytes arrive, and TENSOR_DATA bytes land
straight in the destination buffer of the tensor being received (no intermediate copy).
Every other message goes through the two tables (``codecs.CODECS``, then
``handlers.HANDLERS``), whose handlers see the connection as a ``session.Session``
(``send``, ``key``, ``tenant``, ``spawn``, ``abort``, ``fail``, ``closing``, ``drain``);
PUTs are ``puts.py``, pulls ``pulls.py``.  The connection sees its server as a
``session.ServerState``: it never imports ``server.py``, which imports it.

Rules kept here (decisions H32-H42 and H52-H55 in docs/spec-decisions.md):

* CLIENT_HELLO first, answered by SERVER_HELLO; anything else first, or a first message
  over 64 KiB, closes the connection.  Under mutual TLS a certificate that names nobody
  is answered with ERROR UNAUTHORIZED and the connection closes.  A connection past
  ``--max-connections``, or past its tenant's ``--max-connections-per-tenant`` (a
  quarter of it by default), is answered with ERROR SERVER_BUSY naming the limit and
  closes: one tenant's idle connections never take every slot.
* A group PUT is all or nothing: ``TENSOR_PUT(head)`` + ``TENSOR_DATA_END``, then one
  ``TENSOR_PUT`` + ``TENSOR_DATA``* + ``TENSOR_DATA_END`` per member; one ACK or ERROR
  after the Nth member.  Each member's bytes are reserved against the memory budget before
  its data is accepted; a group the budget cannot hold is read to its end and discarded,
  and the ERROR names the bytes it needs.  Nothing is visible before the commit, and the
  previous value of the key stays whole on any failure.
* A stream answered with ERROR is closed: whatever else of its PUT arrives is discarded,
  never taken for a new PUT.
* Every PUT is answered: a failure inside the commit is an ERROR (INTERNAL for the
  unexpected), never a silent task death.
* A pull whose persisted file turns out damaged is answered with ERROR INTERNAL naming
  the key (``pulls.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from ..errors import HurrayError
from .codecs import decode, frame
from .handlers import HANDLERS, refusal, timed_as
from .keystore import StoreFull
from .messages import (
    HEADER,
    ErrorCode,
    ErrorMessage,
    Hello,
    MessageType,
    ProtocolError,
    code_of,
    decode_header,
)
from .output import Output
from .tenants import UnreadableIdentity, scoped_key, tenant_identity

if TYPE_CHECKING:
    from .puts import Put
    from .session import ServerState

log = logging.getLogger("hurraykv.server")
SCRATCH = 1 << 20
PUMP_BYTES = 64 << 20  # read at most this much per event before letting others run
PRE_HELLO_MAX = 64 << 10  # the largest message accepted before the handshake
FIRST_CHUNK = 64 << 10  # control payloads start this big and grow as bytes arrive
CLOSED_STREAMS = 4096  # closed stream ids remembered per connection


class Connection(asyncio.BufferedProtocol):
    """One client connection; a ``session.Session`` to its message handlers."""

    def __init__(self, server: ServerState) -> None:
        self.server = server
        self.cfg = server.config
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.tenant = ""  # tenant id (hex) under mutual TLS
        self.refusal: str | None = None  # why the handshake will be refused
        self.hello: Hello | None = None
        self.busy = False  # over --max-connections
        self.over_share = False  # over its tenant's --max-connections-per-tenant
        self.closed = False
        self.puts: dict[int, Put] = {}
        self.dead: OrderedDict[int, None] = OrderedDict()  # streams closed by an ERROR
        self.tasks: set[asyncio.Task] = set()
        self.operations_in_flight = 0  # extensions.MAX_IN_FLIGHT bounds it
        self._header = bytearray(HEADER.size)
        self._offset = bytearray(8)
        self._payload = bytearray()
        self._need = 0
        self._held = 0  # bytes of payload buffers reserved against the memory budget
        self._target: memoryview = memoryview(self._header)
        self._got = 0
        self._state = "header"
        self._msg: tuple[int, int, int] = (0, 0, 0)
        self._discard = 0
        self._last = self.loop.time()
        self._watchdog: asyncio.TimerHandle | None = None
        self.out = Output(self.loop, server.counts)  # the way out: writes, flow control

    # -- transport callbacks ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.out.attach(transport)  # type: ignore[arg-type]
        self.server.connections += 1
        self.server.open_connections.add(self)
        if self.cfg.tls_ca:
            ssl_object = transport.get_extra_info("ssl_object")
            try:
                identity = tenant_identity(
                    ssl_object.getpeercert(binary_form=True) if ssl_object else None,
                    transport.get_extra_info("peercert"))
            except UnreadableIdentity as e:
                self.refusal = f"the client certificate names no tenant exactly: {e}"
                log.warning("refusing a client: %s", self.refusal)
            else:
                if identity is None:
                    self.refusal = ("the client certificate has neither a subject nor a "
                                    "subjectAltName: it names no tenant")
                    log.warning("refusing a client: %s", self.refusal)
                else:
                    self.tenant, readable = identity
                    self.server.tenant_connections[self.tenant] += 1
                    log.info("tenant %s (%s) connected", self.tenant, readable)
                    self.over_share = (self.server.tenant_connections[self.tenant]
                                       > self.cfg.tenant_share())
        # A connection past its tenant's share is refused at its hello and takes no slot
        # of --max-connections meanwhile: idle connections that never say hello cannot
        # crowd out another tenant (and are closed after --read-timeout, _check_timeouts).
        self.server.over_share += self.over_share
        admitted = self.server.connections - self.server.over_share
        self.busy = not self.over_share and admitted > self.cfg.max_connections
        self._watchdog = self.loop.call_later(1.0, self._check_timeouts)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections -= 1
        self.server.open_connections.discard(self)
        if self.tenant:
            self.server.tenant_connections[self.tenant] -= 1
        self.server.over_share -= self.over_share
        for put in self.puts.values():  # unfinished PUTs leave nothing behind
            self.server.store.release(put.reserved, self.tenant)
        self.puts.clear()
        self._payload = bytearray()
        self._unhold_all()
        self.out.detach()
        for task in self.tasks:
            task.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def pause_writing(self) -> None:
        self.out.writable.clear()

    def resume_writing(self) -> None:
        self.out.writable.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self._consume(nbytes)
        budget = PUMP_BYTES
        while self.out.raw is not None and not self.closed and budget > 0:
            try:
                n = self.out.raw.recv_into(self._target[self._got:])
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
        self.server.counts.bytes_received += nbytes
        self._got += nbytes
        if self._got < len(self._target):
            return
        try:
            self._advance()
        except ProtocolError as e:  # a framing problem outside any stream: drop the line
            self.fail(self._msg[1] or 1, e.code, str(e))
            self.close()

    def eof_received(self) -> bool:
        return False

    def _check_timeouts(self) -> None:
        if self.closed:
            return
        idle = self.loop.time() - self._last
        # a connection that has not said hello yet is mid-way through its first message
        mid = self.hello is None or self._state != "header" or self._got > 0 or self.puts
        if idle > (self.cfg.read_timeout if mid else self.cfg.idle_timeout):
            log.info("closing connection: %s for %.1f s", "stalled" if mid else "idle", idle)
            if mid and self._msg[1]:
                self.fail(self._msg[1], ErrorCode.TIMEOUT, "read timeout")
            self.close()
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
            self._on_header()
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
            done = len(self._payload)
            if done < self._need:  # grow only as bytes arrive: a claim allocates nothing
                size = min(self._need, 2 * done)
                if not self._hold(size, self._need - done):
                    return
                grown = bytearray(size)
                grown[:done] = self._payload
                self._payload = grown
                self._unhold(done)  # the smaller buffer goes
                self._expect("payload", memoryview(grown)[done:])
                return
            payload = memoryview(self._payload)
            self._payload = bytearray()
            mtype, stream, _ = self._msg
            self._expect("header", memoryview(self._header))
            try:
                self._dispatch(mtype, stream, payload)
            except ProtocolError as e:
                self._stream_error(stream, e, 0)
            except HurrayError as e:
                self._stream_error(stream, ProtocolError(str(e), code_of(e)), 0)
            finally:
                del payload
                self._unhold_all()
        elif state == "discard":
            self._discard -= self._got
            if self._discard > 0:
                self._expect("discard", self.server.scratch[:min(self._discard, SCRATCH)])
            else:
                self._expect("header", memoryview(self._header))

    def _on_header(self) -> None:
        limit = self.cfg.max_message_size if self.hello is not None else PRE_HELLO_MAX
        try:
            self._msg = decode_header(self._header, limit)
        except ProtocolError as e:
            mtype, stream, length = HEADER.unpack(self._header)
            if e.code == ErrorCode.MESSAGE_TOO_LARGE and stream and self.hello is not None:
                self.fail(stream, e.code, str(e))
                self.abort(stream)
                self._msg = (mtype, stream, length)
                self._start_discard(length)
                return
            raise
        mtype, stream, length = self._msg
        if stream in self.dead and mtype in (MessageType.TENSOR_PUT, MessageType.TENSOR_DATA,
                                             MessageType.TENSOR_DATA_END):
            self._start_discard(length)  # the rest of a PUT already answered with ERROR
            return
        put = self.puts.get(stream)
        if mtype == MessageType.TENSOR_DATA and put is not None and put.open:
            if put.assembler is None:  # a refused group: read to its end, keep nothing
                self._start_discard(length)
                return
            if length < 8:
                self._stream_error(stream, ProtocolError("tensor_data shorter than its "
                                                         "u64 byte_offset"), length)
                return
            self._expect("data_offset", memoryview(self._offset))
            return
        self._need = length
        self._payload = bytearray(min(length, FIRST_CHUNK))  # the connection's own bytes
        self._expect("payload", memoryview(self._payload))

    def _hold(self, nbytes: int, rest: int) -> bool:
        """Reserve a payload buffer of ``nbytes`` against the memory budget before any byte
        lands in it (the first FIRST_CHUNK bytes of a payload are the connection's own,
        like its header: at most --max-connections x 64 KiB in all).  The reservation
        never evicts an object that would be lost, a message being refusable after it; if
        the budget cannot hold the buffer the message is refused with ERROR STORE_FULL on
        its stream and its ``rest`` bytes are read and discarded."""
        if nbytes <= FIRST_CHUNK:
            return True
        try:
            self.server.store.reserve(nbytes, lossy=False, owner=self.tenant)
        except StoreFull as e:
            _, stream, length = self._msg
            self._payload = bytearray()
            self._unhold_all()
            text = f"a {length}-byte message payload does not fit the memory budget: {e}"
            log.info("stream %d: %s", stream, text)
            self.fail(stream, ErrorCode.STORE_FULL, text)
            self.abort(stream)
            self._start_discard(rest)
            return False
        self._held += nbytes
        return True

    def _unhold(self, nbytes: int) -> None:
        """Release what ``_hold(nbytes)`` reserved."""
        if nbytes > FIRST_CHUNK:
            self._held -= nbytes
            self.server.store.release(nbytes, self.tenant)

    def _unhold_all(self) -> None:
        if self._held:
            self.server.store.release(self._held, self.tenant)
            self._held = 0

    def _start_discard(self, n: int) -> None:
        self._discard = n
        if n == 0:
            self._expect("header", memoryview(self._header))
        else:
            self._expect("discard", self.server.scratch[:min(n, SCRATCH)])

    def _stream_error(self, stream: int, e: ProtocolError, discard: int) -> None:
        log.info("stream %d: %s", stream, e)
        self.fail(stream, e.code, str(e))
        self.abort(stream)
        self._start_discard(discard)

    def abort(self, stream: int) -> None:
        """Close ``stream``: an unfinished PUT on it is dropped and what follows of it
        is discarded, not taken for a new PUT."""
        put = self.puts.pop(stream, None)
        if put is not None:
            self.server.store.release(put.reserved, self.tenant)
        self.dead[stream] = None
        if len(self.dead) > CLOSED_STREAMS:
            self.dead.popitem(last=False)

    # -- output (output.py) ----------------------------------------------------------
    def closing(self) -> bool:
        """The transport is closed or closing: whatever is written now is dropped (and
        asyncio would warn about each such write)."""
        return self.closed or self.out.closing()

    def send(self, *parts: bytes | memoryview) -> None:
        if not self.closed:
            self.out.send(*parts)

    async def drain(self) -> None:
        await self.out.drain()

    async def send_data(self, parts: list[Any]) -> None:
        if not self.closed:
            await self.out.send_data(parts)

    def can_pass_fds(self) -> bool:
        return self.out.can_pass_fds()

    async def send_with_fds(self, message: bytes, fds: list[int]) -> None:
        await self.out.send_with_fds(message, fds)

    def fail(self, stream: int, code: int, text: str) -> None:
        """Answer ``stream`` with ERROR ``code``, counted by code."""
        self.server.counts.errors[int(code)] += 1
        self.send(frame(MessageType.ERROR, stream, ErrorMessage(int(code), text)))

    def close(self) -> None:
        """Close the connection (its PUTs in flight leave nothing)."""
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` on the loop; cancelled when the connection closes."""
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- messages --------------------------------------------------------------------
    def key(self, key: str) -> str:
        """The store's key for a client's key (tenant-scoped; ProtocolError if no client
        may send it)."""
        try:
            return scoped_key(self.tenant, key)
        except HurrayError as e:
            raise ProtocolError(str(e), field="key", value=e.value) from None

    def _dispatch(self, mtype: int, stream: int, payload: memoryview) -> None:
        if self.hello is None:
            if mtype != MessageType.CLIENT_HELLO:
                self.fail(stream, ErrorCode.INVALID_MESSAGE,
                          "CLIENT_HELLO must be the first message")
                self.close()
                return
            self._on_hello(stream, payload)
            return
        self.dead.pop(stream, None)  # a new exchange on this stream id (after the PUT)
        why = refusal(mtype)
        if why is not None:
            raise ProtocolError(why)
        started = time.perf_counter()
        value = decode(mtype, payload)
        HANDLERS[mtype](self, stream, value)
        timed = timed_as(mtype, value)  # answered by now (pushes and pulls are timed apart)
        if timed is not None:
            self.server.counts.latencies.observe(timed, time.perf_counter() - started)

    def _on_hello(self, stream: int, payload: memoryview) -> None:
        try:
            hello = decode(MessageType.CLIENT_HELLO, payload)
        except ProtocolError as e:
            self.fail(stream, e.code, str(e))
            self.close()
            return
        refusal = None
        if self.refusal is not None:
            refusal = (ErrorCode.UNAUTHORIZED, self.refusal)
        elif hello.protocol_version < 1:
            refusal = (ErrorCode.PROTOCOL_VERSION_MISMATCH,
                       f"protocol_version {hello.protocol_version}; this server speaks 1")
        elif self.busy:
            refusal = (ErrorCode.SERVER_BUSY, f"more than {self.cfg.max_connections} "
                       "connections")
        elif self.over_share:
            share = self.cfg.tenant_share()
            refusal = (ErrorCode.SERVER_BUSY, f"tenant {self.tenant} already holds {share} "
                       f"connections: at most {share} per tenant "
                       "(--max-connections-per-tenant)")
        if refusal is not None:
            self.fail(stream, *refusal)
            self.close()
            return
        self.hello = hello
        reply = Hello(1, self.cfg.max_message_size, 0)
        self.send(frame(MessageType.SERVER_HELLO, stream, reply))
