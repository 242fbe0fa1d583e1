"""Message type -> codec: the one table of what each message's payload holds (floor 5).

Every message type this implementation speaks has one :class:`Codec` here: ``encode``
turns the message's value into payload bytes and ``decode`` turns payload bytes back
into that value, raising :class:`~hurraykv.net.messages.ProtocolError` for anything
malformed (``tests/net/test_messages.py`` pins every entry byte by byte).  The server's
handlers (``handlers.py``) receive what ``decode`` returns; the client sends what
``encode`` makes.  The values:

==================  ================================================================
message             value
==================  ================================================================
CLIENT_HELLO,       :class:`Hello`
SERVER_HELLO
TENSOR_REQUEST      :class:`Request`
TENSOR_DESCRIPTOR   :class:`DescriptorMessage`
TENSOR_DATA         ``(byte_offset_in_buffer, data)``
TENSOR_PUT          :class:`Put`
ERROR               :class:`ErrorMessage`
PING, PONG          ``bytes`` (opaque)
DELETE              :class:`Delete`
HAS, LOCATE,        ``list[str]`` (keys; LOCATE_REPLY: "" where none is stored)
LOCATE_REPLY
HAS_REPLY           ``list[bool]``
LINK                ``list[(alias, target)]``
LIST, ALIASES       ``str`` (the key or alias prefix)
RETAIN, EXTENSION   ``str`` (RETAIN's JSON object) or :class:`Extension` (the private
                    envelope, H95: an operation's name and payload, either direction)
LIST_REPLY          ``list[(key, bytes)]``
ALIASES_REPLY       ``list[(alias, target)]``
STAT_REPLY          ``str`` (a JSON object)
the rest            ``None`` (an empty payload)
==================  ================================================================
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .messages import (
    Delete,
    DescriptorMessage,
    ErrorMessage,
    Hello,
    MessageType,
    Put,
    Request,
    decode_data,
    decode_delete,
    decode_descriptor_message,
    decode_empty,
    decode_error,
    decode_hello,
    decode_put,
    decode_request,
    decode_text,
    encode_text,
    message,
)
from .private import (
    decode_alias_listing,
    decode_flags,
    decode_keys,
    decode_listing,
    decode_pairs,
    decode_private,
    encode_alias_listing,
    encode_flags,
    encode_keys,
    encode_listing,
    encode_pairs,
    encode_private,
)

T = MessageType


@dataclass(frozen=True)
class Codec:
    """How one message type's payload is written and read."""

    name: str  # as errors name it: "tensor_request", "has_reply", ...
    encode: Callable[[Any], bytes]
    decode: Callable[[memoryview], Any]


def _empty(name: str) -> Codec:
    def decode(payload: memoryview) -> None:
        decode_empty(payload, name)

    return Codec(name, lambda _=None: b"", decode)


def _text(name: str) -> Codec:
    return Codec(name, encode_text, lambda p: decode_text(p, name))


def _keys(name: str) -> Codec:
    return Codec(name, encode_keys, lambda p: decode_keys(p, name))


def _encode_data(value: tuple[int, bytes | memoryview]) -> bytes:
    offset, data = value
    return struct.pack("<Q", offset) + bytes(data)


CODECS: dict[int, Codec] = {
    T.CLIENT_HELLO: Codec("client_hello", Hello.encode,
                          lambda p: decode_hello(p, "client_hello")),
    T.SERVER_HELLO: Codec("server_hello", Hello.encode,
                          lambda p: decode_hello(p, "server_hello")),
    T.TENSOR_REQUEST: Codec("tensor_request", Request.encode, decode_request),
    T.TENSOR_DESCRIPTOR: Codec("tensor_descriptor", DescriptorMessage.encode,
                               decode_descriptor_message),
    T.TENSOR_DATA: Codec("tensor_data", _encode_data, decode_data),
    T.TENSOR_DATA_END: _empty("tensor_data_end"),
    T.TENSOR_PUT: Codec("tensor_put", Put.encode, decode_put),
    T.TENSOR_PUT_ACK: _empty("tensor_put_ack"),
    T.ERROR: Codec("error", ErrorMessage.encode, decode_error),
    T.PING: Codec("ping", bytes, bytes),
    T.PONG: Codec("pong", bytes, bytes),
    T.DELETE: Codec("delete", Delete.encode, decode_delete),
    T.DELETE_ACK: _empty("delete_ack"),
    T.LIST: _text("list"),
    T.LIST_REPLY: Codec("list_reply", encode_listing, decode_listing),
    T.STAT: _empty("stat"),
    T.STAT_REPLY: _text("stat_reply"),
    T.HAS: _keys("has"),
    T.HAS_REPLY: Codec("has_reply", encode_flags, decode_flags),
    T.LINK: Codec("link", encode_pairs, decode_pairs),
    T.LINK_ACK: _empty("link_ack"),
    T.LOCATE: _keys("locate"),
    T.LOCATE_REPLY: _keys("locate_reply"),
    T.ALIASES: _text("aliases"),
    T.RETAIN: Codec("retain", encode_private, decode_private),  # and EXTENSION: H95
    T.ALIASES_REPLY: Codec("aliases_reply", encode_alias_listing, decode_alias_listing),
}


def encode(mtype: int, value: Any = None) -> bytes:
    """The payload of a ``mtype`` message carrying ``value``."""
    return CODECS[mtype].encode(value)


def decode(mtype: int, payload: bytes | memoryview) -> Any:
    """The value of a ``mtype`` message's payload (ProtocolError if malformed)."""
    return CODECS[mtype].decode(memoryview(payload).cast("B"))


def frame(mtype: int, stream: int, value: Any = None) -> bytes:
    """A whole message: header and payload."""
    return message(mtype, stream, encode(mtype, value))
