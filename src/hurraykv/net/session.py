"""What a message handler may use of the connection that received its message, and what a
connection uses of its server: two ``typing.Protocol`` classes, below both sides.

``handlers.HANDLERS`` (and ``admin.py``, ``puts.py``, ``pulls.py``, ``extensions.py``)
take a :class:`Session`; a connection's ``server_session.ServerSession`` is one.  A
connection takes a :class:`ServerState`; ``server.KVServer`` is one.  So handlers never
import the connection, nor the connection the server: the imports of ``net/`` run one
way (``server`` -> ``connection`` -> ``handlers`` -> ``admin``/``puts``/``pulls``/
``extensions`` -> ``session``), and this module imports nothing of theirs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .config import ServerConfig
    from .counts import Counts
    from .keystore import KeyStore
    from .memory import ReceivePool
    from .messages import Hello


class ServerState(Protocol):
    """What a connection and its handlers read and bump of their server (``KVServer``)."""

    config: ServerConfig
    store: KeyStore
    pool: ReceivePool  # received tensors' memory, recycled
    counts: Counts
    scratch: memoryview  # where discarded bytes land
    connections: int  # open client connections
    over_share: int  # of them, past their tenant's share (refused at CLIENT_HELLO)
    open_connections: set[Any]
    tenant_connections: Counter[str]
    hands_over: bool  # on a Unix socket without TLS: objects sealed as stored (handover)

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """What ``hurraykv stat`` shows (a tenant's own part for ``tenant``)."""
        ...


class Session(Protocol):
    """One client connection as its message handlers see it.

    A handler is ``handler(session, stream, value)``: it answers on ``stream`` with
    :meth:`send` (a ``codecs.frame``), or raises ``ProtocolError`` to have the stream
    closed with ERROR; work that outlives the call goes to :meth:`spawn` and answers with
    :meth:`fail` when it fails."""

    server: ServerState
    tenant: str  # the tenant id (hex) under mutual TLS, "" without tenants
    hello: Hello | None  # the client's CLIENT_HELLO
    puts: dict[int, Any]  # PUTs arriving (``puts.Put``), by stream
    operations_in_flight: int  # private operations awaiting their answer (extensions)

    def key(self, key: str) -> str:
        """The store's key for a key the client sent (tenant-scoped); ``ProtocolError``
        for a key no client may send."""
        ...

    def send(self, *parts: bytes | memoryview) -> None:
        """Write bytes (whole messages) to the client, counted; dropped when
        :meth:`closing`."""
        ...

    def fail(self, stream: int, code: int, text: str) -> None:
        """Answer ``stream`` with ERROR ``code`` (counted by code)."""
        ...

    def abort(self, stream: int) -> None:
        """Close ``stream``: a PUT open on it is dropped, what follows of it discarded."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` on the event loop, cancelled if the connection closes first."""
        ...

    def closing(self) -> bool:
        """Whether the connection is closed or closing (what is sent now is dropped)."""
        ...

    async def send_data(self, parts: list[Any]) -> None:
        """Write whole messages (a pull's data frames: headers and byte views, sent from
        their own memory where the transport allows), then wait as :meth:`drain` does."""
        ...

    async def drain(self) -> None:
        """Return once the transport takes more bytes (flow control of a long send)."""
        ...

    def can_pass_fds(self) -> bool:
        """Whether descriptors can go to the client: a Unix socket without TLS."""
        ...

    async def send_with_fds(self, message: bytes, fds: list[int]) -> None:
        """Write one whole message with ``fds`` passed alongside its first byte
        (``SCM_RIGHTS``), in order with what was sent before it; only where
        :meth:`can_pass_fds`.  The descriptors stay the caller's."""
        ...
