"""One client connection of ``hurraykv serve``, its transport: framing and dispatch.

Each connection is an ``asyncio.BufferedProtocol`` state machine: headers and control
payloads land in small buffers that grow only as bytes arrive, and TENSOR_DATA bytes land
straight in the destination buffer of the tensor being received (no intermediate copy).
Every other message goes through the two tables (``codecs.CODECS``, then
``handlers.HANDLERS``), whose handlers see the connection's session
(``server_session.ServerSession``, a ``session.Session``: its tenant, streams, budget,
``send``, ``key``, ``spawn``, ``abort``, ``fail``, ``closing``, ``drain``); its bytes go
out through ``output.Output``; PUTs are ``puts.py``, pulls ``pulls.py``.  The connection
sees its server as a ``session.ServerState``: it never imports ``server.py``, which
imports it.

Rules kept here (decisions H32-H42 and H52-H55 in docs/spec-decisions.md):

* CLIENT_HELLO first, answered by SERVER_HELLO (or refused: ``ServerSession.greet``);
  anything else first, or a first message over 64 KiB, closes the connection.  One
  tenant's idle connections never take every slot (``ServerSession.admit``).
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
from typing import TYPE_CHECKING

from ..errors import HurrayError
from .codecs import decode
from .handlers import HANDLERS, refusal, timed_as
from .keystore import StoreFull
from .messages import (
    HEADER,
    ErrorCode,
    MessageType,
    ProtocolError,
    code_of,
    decode_header,
)
from .output import Output
from .server_session import FIRST_CHUNK, ServerSession

if TYPE_CHECKING:
    from .session import ServerState

log = logging.getLogger("hurraykv.server")
SCRATCH = 1 << 20
PUMP_BYTES = 64 << 20  # read at most this much per event before letting others run
PRE_HELLO_MAX = 64 << 10  # the largest message accepted before the handshake


class Connection(asyncio.BufferedProtocol):
    """One client connection's transport: bytes in, framed and dispatched to the message
    handlers with its session (``self.session``)."""

    def __init__(self, server: ServerState) -> None:
        self.server = server
        self.cfg = server.config
        self.loop = asyncio.get_running_loop()
        self.out = Output(self.loop, server.counts)  # the way out: writes, flow control
        self.session = ServerSession(server, self.loop, self.out)
        self._header = bytearray(HEADER.size)
        self._offset = bytearray(8)
        self._payload = bytearray()
        self._need = 0
        self._target: memoryview = memoryview(self._header)
        self._got = 0
        self._state = "header"
        self._msg: tuple[int, int, int] = (0, 0, 0)
        self._discard = 0
        self._last = self.loop.time()
        self._watchdog: asyncio.TimerHandle | None = None

    # -- transport callbacks ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.out.attach(transport)  # type: ignore[arg-type]
        self.server.open_connections.add(self)
        self.session.admit(transport)
        self._watchdog = self.loop.call_later(1.0, self._check_timeouts)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.open_connections.discard(self)
        self.session.leave()  # unfinished PUTs and payload buffers leave nothing behind
        self._payload = bytearray()
        self.out.detach()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def close(self) -> None:
        """Close the connection (its PUTs in flight leave nothing)."""
        self.session.close()

    def pause_writing(self) -> None:
        self.out.writable.clear()

    def resume_writing(self) -> None:
        self.out.writable.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self._consume(nbytes)
        budget = PUMP_BYTES
        while self.out.raw is not None and not self.session.closed and budget > 0:
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
            self.session.fail(self._msg[1] or 1, e.code, str(e))
            self.close()

    def eof_received(self) -> bool:
        return False

    def _check_timeouts(self) -> None:
        session = self.session
        if session.closed:
            return
        idle = self.loop.time() - self._last
        # a connection that has not said hello yet is mid-way through its first message
        mid = session.hello is None or self._state != "header" or self._got > 0 or session.puts
        if idle > (self.cfg.read_timeout if mid else self.cfg.idle_timeout):
            log.info("closing connection: %s for %.1f s", "stalled" if mid else "idle", idle)
            if mid and self._msg[1]:
                session.fail(self._msg[1], ErrorCode.TIMEOUT, "read timeout")
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
            put = self.session.puts[stream]
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
                self.session.unhold(done)  # the smaller buffer goes
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
                self.session.unhold_all()
        elif state == "discard":
            self._discard -= self._got
            if self._discard > 0:
                self._expect("discard", self.server.scratch[:min(self._discard, SCRATCH)])
            else:
                self._expect("header", memoryview(self._header))

    def _on_header(self) -> None:
        session = self.session
        limit = self.cfg.max_message_size if session.hello is not None else PRE_HELLO_MAX
        try:
            self._msg = decode_header(self._header, limit)
        except ProtocolError as e:
            mtype, stream, length = HEADER.unpack(self._header)
            if e.code == ErrorCode.MESSAGE_TOO_LARGE and stream and session.hello is not None:
                session.fail(stream, e.code, str(e))
                session.abort(stream)
                self._msg = (mtype, stream, length)
                self._start_discard(length)
                return
            raise
        mtype, stream, length = self._msg
        if stream in session.dead and mtype in (MessageType.TENSOR_PUT, MessageType.TENSOR_DATA,
                                             MessageType.TENSOR_DATA_END):
            self._start_discard(length)  # the rest of a PUT already answered with ERROR
            return
        put = session.puts.get(stream)
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
        """The session holds a payload buffer of ``nbytes`` (``ServerSession.hold``); if
        the budget cannot hold it the message is refused with ERROR STORE_FULL on its
        stream and its ``rest`` bytes are read and discarded."""
        try:
            self.session.hold(nbytes)
        except StoreFull as e:
            _, stream, length = self._msg
            self._payload = bytearray()
            self.session.unhold_all()
            text = f"a {length}-byte message payload does not fit the memory budget: {e}"
            log.info("stream %d: %s", stream, text)
            self.session.fail(stream, ErrorCode.STORE_FULL, text)
            self.session.abort(stream)
            self._start_discard(rest)
            return False
        return True

    def _start_discard(self, n: int) -> None:
        self._discard = n
        if n == 0:
            self._expect("header", memoryview(self._header))
        else:
            self._expect("discard", self.server.scratch[:min(n, SCRATCH)])

    def _stream_error(self, stream: int, e: ProtocolError, discard: int) -> None:
        log.info("stream %d: %s", stream, e)
        self.session.fail(stream, e.code, str(e))
        self.session.abort(stream)
        self._start_discard(discard)

    # -- messages --------------------------------------------------------------------
    def _dispatch(self, mtype: int, stream: int, payload: memoryview) -> None:
        session = self.session
        if session.hello is None:
            if mtype != MessageType.CLIENT_HELLO:
                session.fail(stream, ErrorCode.INVALID_MESSAGE,
                             "CLIENT_HELLO must be the first message")
                self.close()
                return
            session.greet(stream, payload)
            return
        session.dead.pop(stream, None)  # a new exchange on this stream id (after the PUT)
        why = refusal(mtype)
        if why is not None:
            raise ProtocolError(why)
        started = time.perf_counter()
        value = decode(mtype, payload)
        HANDLERS[mtype](session, stream, value)
        timed = timed_as(mtype, value)  # answered by now (pushes and pulls are timed apart)
        if timed is not None:
            self.server.counts.latencies.observe(timed, time.perf_counter() - started)
