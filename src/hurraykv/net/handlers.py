"""Message type -> handler: what a ``hurraykv serve`` connection does with each message a
client sends after the handshake (floor 4).

``Connection._dispatch`` decodes a payload with its codec (``codecs.CODECS``) and calls
``HANDLERS[type](connection, stream, value)``; a handler answers on ``stream`` or raises
:class:`ProtocolError`, which closes that stream with ERROR (its ``code``).  Types in
``REFUSED`` are refused before their payload is read; any other type without a handler
does not travel client to server.  CLIENT_HELLO (the handshake) and TENSOR_DATA of an open
PUT (written straight into its buffers) never get here: ``connection.py`` frames them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import admin, puts
from .codecs import frame
from .messages import ErrorCode, ErrorMessage, MessageType, ProtocolError, Request
from .stored import UnreadableObject

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("hurraykv.server")
T = MessageType


def request(c: Connection, stream: int, req: Request) -> None:
    try:
        obj = c.server.store.get(c._key(req.key))
    except UnreadableObject as e:
        c._fail_pull(stream, req.key, e)
        return
    if obj is None:
        raise ProtocolError(f"no tensor under key {req.key!r}", ErrorCode.UNKNOWN_TENSOR)
    if req.preferred_device not in (0,) and 0 not in c.hello.devices:  # type: ignore[union-attr]
        raise ProtocolError(f"device 0x{req.preferred_device:02x} is unavailable and "
                            "the client does not take CPU", ErrorCode.DEVICE_UNAVAILABLE)
    c._spawn(c._send_object(stream, req.key, obj))


def ping(c: Connection, stream: int, payload: bytes) -> None:
    c._write(frame(T.PONG, stream, payload))


def error(c: Connection, stream: int, err: ErrorMessage) -> None:
    log.info("stream %d: client error %d: %s", stream, err.code, err.message)
    c._abort_stream(stream)


HANDLERS: dict[int, Callable[[Connection, int, Any], None]] = {
    T.TENSOR_REQUEST: request,
    T.TENSOR_PUT: puts.on_put,
    T.TENSOR_DATA_END: puts.on_data_end,
    T.PING: ping,
    T.ERROR: error,
    T.DELETE: admin.delete,
    T.HAS: admin.has,
    T.LINK: admin.link,
    T.LOCATE: admin.locate,
    T.LIST: admin.listing,
    T.ALIASES: admin.aliases,
    T.STAT: admin.stat,
    T.RETAIN: admin.retain,
}

# the requests answered at once, by what the latency histograms call them (a push is
# timed from its first TENSOR_PUT to its ACK, a pull until its last frame is written)
TIMED: dict[int, str] = {T.DELETE: "delete", T.HAS: "has", T.LINK: "link",
                         T.LOCATE: "locate", T.LIST: "list", T.ALIASES: "aliases",
                         T.STAT: "stat", T.RETAIN: "retain", T.PING: "ping"}
REQUESTS = ("push", "pull", *TIMED.values())

REFUSED: dict[int, str] = {
    T.TENSOR_DATA: "tensor_data without a TENSOR_PUT open on this stream",
    T.CLIENT_HELLO: "CLIENT_HELLO may be sent once per connection",
    T.RDMA_REGISTER: "the RDMA data plane is not offered (capability bit 2 clear)",
    T.RDMA_READY: "the RDMA data plane is not offered (capability bit 2 clear)",
}


def refusal(mtype: int) -> str | None:
    """Why a client's ``mtype`` message is refused unread, or None when it is handled."""
    if mtype in HANDLERS:
        return None
    if mtype in REFUSED:
        return REFUSED[mtype]
    if mtype in MessageType._value2member_map_:
        return f"{MessageType(mtype).name} does not travel client to server"
    return f"unknown message_type 0x{mtype:x}"
