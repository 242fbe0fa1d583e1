"""The private messages a ``hurraykv serve`` connection answers (floor 4): DELETE, HAS,
LINK, LOCATE, LIST, ALIASES and STAT (decisions H35, H62).  Each handler takes the connection, the
stream and the payload; keys are scoped to the connection's tenant."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .keystore import StoreFull
from .messages import (
    ErrorCode,
    MessageType,
    ProtocolError,
    decode_delete,
    decode_empty,
    decode_text,
    encode_text,
    message,
)
from .private import (
    decode_keys,
    encode_alias_listing,
    encode_flags,
    encode_keys,
    encode_listing,
)
from .tenants import client_key

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("hurraykv.server")


def delete(c: Connection, stream: int, payload: memoryview) -> None:
    key = decode_delete(payload).key
    if not c.server.store.delete(c._key(key)):
        raise ProtocolError(f"no tensor under key {key!r}", ErrorCode.UNKNOWN_TENSOR)
    log.info("delete key=%r", key)
    c._write(message(MessageType.DELETE_ACK, stream))


def has(c: Connection, stream: int, payload: memoryview) -> None:
    store = c.server.store
    flags = [c._key(k) in store for k in decode_keys(payload)]
    c._write(message(MessageType.HAS_REPLY, stream, encode_flags(flags)))


def link(c: Connection, stream: int, payload: memoryview) -> None:
    pairs = decode_keys(payload, "link", per=2)
    try:
        c.server.store.link([(c._key(a), c._key(t))
                             for a, t in zip(pairs[::2], pairs[1::2], strict=True)])
    except StoreFull as e:
        raise ProtocolError(f"link of {len(pairs) // 2} aliases: {e}", ErrorCode.STORE_FULL,
                            field="aliases", value=e.value) from None
    c._write(message(MessageType.LINK_ACK, stream))


def locate(c: Connection, stream: int, payload: memoryview) -> None:
    store = c.server.store
    found = [store.locate(c._key(k)) for k in decode_keys(payload, "locate")]
    names = [client_key(c.tenant, f) or "" if f is not None else "" for f in found]
    c._write(message(MessageType.LOCATE_REPLY, stream, encode_keys(names)))


def listing(c: Connection, stream: int, payload: memoryview) -> None:
    prefix = decode_text(payload, "list")
    mine = [(client_key(c.tenant, k), n) for k, n in c.server.store.listing()]
    entries = [(k, n) for k, n in mine if k is not None and k.startswith(prefix)]
    c._write(message(MessageType.LIST_REPLY, stream, encode_listing(entries)))


def aliases(c: Connection, stream: int, payload: memoryview) -> None:
    prefix = decode_text(payload, "aliases")
    entries = []
    for alias, target in c.server.store.alias_listing():
        mine = client_key(c.tenant, alias)
        if mine is not None and mine.startswith(prefix):
            entries.append((mine, client_key(c.tenant, target) or ""))
    c._write(message(MessageType.ALIASES_REPLY, stream, encode_alias_listing(entries)))


def stat(c: Connection, stream: int, payload: memoryview) -> None:
    decode_empty(payload, "stat")
    mine = c.tenant if c.cfg.tls_ca else None  # a tenant sees its own
    c._write(message(MessageType.STAT_REPLY, stream,
                     encode_text(json.dumps(c.server.stats(mine)))))


HANDLERS: dict[int, Callable[[Connection, int, memoryview], None]] = {
    MessageType.DELETE: delete, MessageType.HAS: has, MessageType.LINK: link,
    MessageType.LOCATE: locate, MessageType.LIST: listing, MessageType.ALIASES: aliases,
    MessageType.STAT: stat}
