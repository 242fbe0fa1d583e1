"""Message type -> handler: what a ``hurraykv serve`` connection does with each message a
client sends after the handshake (floor 5).

``Connection._dispatch`` decodes a payload with its codec (``codecs.CODECS``) and calls
``HANDLERS[type](session, stream, value)``, the session being the connection as its
handlers see it (``session.Session``: send, key, tenant, spawn, abort, fail); a handler
answers on ``stream`` or raises :class:`ProtocolError`, which closes that stream with
ERROR (its ``code``).  Types in ``REFUSED`` are refused before their payload is read; any
other type without a handler does not travel client to server.  CLIENT_HELLO (the
handshake) and TENSOR_DATA of an open PUT (written straight into its buffers) never get
here: ``connection.py`` frames them.  A private operation added since RETAIN is no entry
here but a name in ``extensions.OPERATIONS`` (the EXTENSION envelope, H95).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import admin, extensions, pulls, puts
from .codecs import frame
from .messages import ErrorMessage, MessageType
from .private import Extension

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("hurraykv.server")
T = MessageType


def ping(s: Session, stream: int, payload: bytes) -> None:
    s.send(frame(T.PONG, stream, payload))


def error(s: Session, stream: int, err: ErrorMessage) -> None:
    log.info("stream %d: client error %d: %s", stream, err.code, err.message)
    s.abort(stream)


def private(s: Session, stream: int, value: str | Extension) -> None:
    """0xFE: the EXTENSION envelope (H95), or RETAIN's text (H93)."""
    if isinstance(value, Extension):
        extensions.on_extension(s, stream, value)
    else:
        admin.retain(s, stream, value)


HANDLERS: dict[int, Callable[[Session, int, Any], None]] = {
    T.TENSOR_REQUEST: pulls.on_request,
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
    T.RETAIN: private,  # and T.EXTENSION, the same number
}

# the requests answered at once, by what the latency histograms call them (a push is
# timed from its first TENSOR_PUT to its ACK, a pull until its last frame is written;
# every private operation of the envelope is "extension", until its reply is sent or,
# for one that answers later, until it has started)
TIMED: dict[int, str] = {T.DELETE: "delete", T.HAS: "has", T.LINK: "link",
                         T.LOCATE: "locate", T.LIST: "list", T.ALIASES: "aliases",
                         T.STAT: "stat", T.RETAIN: "retain", T.PING: "ping"}
REQUESTS = ("push", "pull", *TIMED.values(), "extension")


def timed_as(mtype: int, value: Any) -> str | None:
    """What the latency histograms call a request answered by its handler's return, or
    None (pushes and pulls are timed apart)."""
    if isinstance(value, Extension):
        return "extension"
    return TIMED.get(mtype)


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
    try:
        return f"{MessageType(mtype).name} does not travel client to server"
    except ValueError:
        return f"unknown message_type 0x{mtype:x}"
