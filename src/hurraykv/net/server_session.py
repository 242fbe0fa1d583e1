"""One client connection's session on the server (``ServerSession``): what its message
handlers see of it (a ``session.Session``) and the state that lives as long as it does.

* who it is: its tenant under mutual TLS, read from the client certificate, and its
  admission (``admit``): a connection past ``--max-connections``, or past its tenant's
  ``--max-connections-per-tenant`` (a quarter of it by default), is answered at its
  CLIENT_HELLO with ERROR SERVER_BUSY naming the limit and closes; under mutual TLS a
  certificate that names nobody is answered with ERROR UNAUTHORIZED (``greet``);
* its streams: the PUTs arriving on them (``puts.py``) and those closed by an ERROR
  (``abort``), whose rest is discarded, never taken for a new PUT;
* the memory its payload buffers hold against the memory budget (``hold``);
* the work it spawned, cancelled when it closes.

Its bytes go out through ``output.Output``; what comes in is framed by the connection
(``connection.py``), which owns the session and hands its messages to the handlers.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from ..errors import HurrayError
from .codecs import decode, frame
from .messages import ErrorCode, ErrorMessage, Hello, MessageType, ProtocolError
from .output import Output
from .tenants import UnreadableIdentity, scoped_key, tenant_identity

if TYPE_CHECKING:
    from .puts import Put
    from .session import ServerState

log = logging.getLogger("hurraykv.server")
FIRST_CHUNK = 64 << 10  # control payloads start this big and grow as bytes arrive
CLOSED_STREAMS = 4096  # closed stream ids remembered per connection


class ServerSession:
    """One client connection's session; a ``session.Session`` to its message handlers."""

    def __init__(self, server: ServerState, loop: asyncio.AbstractEventLoop,
                 out: Output) -> None:
        self.server = server
        self.cfg = server.config
        self.loop = loop
        self.out = out  # the way out: writes, flow control
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
        self.held = 0  # bytes of payload buffers reserved against the memory budget

    # -- admission -------------------------------------------------------------------
    def admit(self, transport: asyncio.BaseTransport) -> None:
        """Counted among the server's connections, its tenant read from the client
        certificate under mutual TLS, and whether it is past a limit (refused at its
        hello, ``greet``)."""
        self.server.connections += 1
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
        # crowd out another tenant (and are closed after --read-timeout by the connection).
        self.server.over_share += self.over_share
        admitted = self.server.connections - self.server.over_share
        self.busy = not self.over_share and admitted > self.cfg.max_connections

    def greet(self, stream: int, payload: memoryview) -> None:
        """The client's CLIENT_HELLO: answered by SERVER_HELLO, or by the ERROR that
        refuses it (then the connection closes)."""
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

    def leave(self) -> None:
        """The connection is lost: no longer counted, its unfinished PUTs and payload
        buffers leave nothing behind, its tasks are cancelled."""
        self.closed = True
        self.server.connections -= 1
        if self.tenant:
            self.server.tenant_connections[self.tenant] -= 1
        self.server.over_share -= self.over_share
        for put in self.puts.values():
            self.server.store.release(put.reserved, self.tenant)
        self.puts.clear()
        self.unhold_all()
        for task in self.tasks:
            task.cancel()

    # -- streams and budget ----------------------------------------------------------
    def key(self, key: str) -> str:
        """The store's key for a client's key (tenant-scoped; ProtocolError if no client
        may send it)."""
        try:
            return scoped_key(self.tenant, key)
        except HurrayError as e:
            raise ProtocolError(str(e), field="key", value=e.value) from None

    def abort(self, stream: int) -> None:
        """Close ``stream``: an unfinished PUT on it is dropped and what follows of it
        is discarded, not taken for a new PUT."""
        put = self.puts.pop(stream, None)
        if put is not None:
            self.server.store.release(put.reserved, self.tenant)
        self.dead[stream] = None
        if len(self.dead) > CLOSED_STREAMS:
            self.dead.popitem(last=False)

    def hold(self, nbytes: int) -> None:
        """Reserve a payload buffer of ``nbytes`` against the memory budget before any byte
        lands in it (the first FIRST_CHUNK bytes of a payload are the connection's own,
        like its header: at most --max-connections x 64 KiB in all).  The reservation
        never evicts an object that would be lost, a message being refusable after it;
        ``StoreFull`` when the budget cannot hold the buffer."""
        if nbytes <= FIRST_CHUNK:
            return
        self.server.store.reserve(nbytes, lossy=False, owner=self.tenant)
        self.held += nbytes

    def unhold(self, nbytes: int) -> None:
        """Release what ``hold(nbytes)`` reserved."""
        if nbytes > FIRST_CHUNK:
            self.held -= nbytes
            self.server.store.release(nbytes, self.tenant)

    def unhold_all(self) -> None:
        if self.held:
            self.server.store.release(self.held, self.tenant)
            self.held = 0

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
        if self.out.transport is not None and not self.closed:
            self.out.transport.close()
        self.closed = True

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` on the loop; cancelled when the connection closes."""
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


__all__ = ["CLOSED_STREAMS", "FIRST_CHUNK", "ServerSession"]
