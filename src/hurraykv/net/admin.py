"""The private messages a ``hurraykv serve`` connection answers (floor 4): DELETE, HAS,
LINK, LOCATE, LIST, ALIASES and STAT (decisions H35, H62).  Each handler takes the
connection, the stream and the message's decoded value (``codecs.CODECS``); keys are
scoped to the connection's tenant.  ``handlers.HANDLERS`` routes the messages here."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from .aliases import AliasLogError
from .codecs import frame
from .keystore import StoreFull
from .messages import Delete, ErrorCode, MessageType, ProtocolError
from .tenants import client_key

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("hurraykv.server")


def delete(c: Connection, stream: int, msg: Delete) -> None:
    key = msg.key
    try:
        found = c.server.store.delete(c._key(key))
    except AliasLogError as e:
        log.warning("delete key=%r: the object is removed, its aliases are not: %s", key, e)
        raise ProtocolError(f"key {key!r} is removed, but the server could not record its "
                            f"aliases as removed ({e.why}); rm it again once that is "
                            "mended", ErrorCode.INTERNAL, field="aliases") from None
    if not found:
        raise ProtocolError(f"no tensor under key {key!r}", ErrorCode.UNKNOWN_TENSOR)
    log.info("delete key=%r", key)
    c._write(frame(MessageType.DELETE_ACK, stream))


def has(c: Connection, stream: int, keys: list[str]) -> None:
    store = c.server.store
    flags = [c._key(k) in store for k in keys]
    c._write(frame(MessageType.HAS_REPLY, stream, flags))


def link(c: Connection, stream: int, pairs: list[tuple[str, str]]) -> None:
    try:
        c.server.store.link([(c._key(a), c._key(t)) for a, t in pairs])
    except StoreFull as e:
        raise ProtocolError(f"link of {len(pairs)} aliases: {e}", ErrorCode.STORE_FULL,
                            field="aliases", value=e.value) from None
    except AliasLogError as e:
        log.warning("link of %d aliases failed, nothing linked: %s", len(pairs), e)
        raise ProtocolError(f"link of {len(pairs)} aliases: the server could not record "
                            f"them ({e.why}); nothing was linked", ErrorCode.INTERNAL,
                            field="aliases") from None
    c._write(frame(MessageType.LINK_ACK, stream))


def locate(c: Connection, stream: int, keys: list[str]) -> None:
    store = c.server.store
    found = [store.locate(c._key(k)) for k in keys]
    names = [client_key(c.tenant, f) or "" if f is not None else "" for f in found]
    c._write(frame(MessageType.LOCATE_REPLY, stream, names))


def listing(c: Connection, stream: int, prefix: str) -> None:
    mine = [(client_key(c.tenant, k), n) for k, n in c.server.store.listing()]
    entries = [(k, n) for k, n in mine if k is not None and k.startswith(prefix)]
    c._write(frame(MessageType.LIST_REPLY, stream, entries))


def aliases(c: Connection, stream: int, prefix: str) -> None:
    entries = []
    for alias, target in c.server.store.alias_listing():
        mine = client_key(c.tenant, alias)
        if mine is not None and mine.startswith(prefix):
            entries.append((mine, client_key(c.tenant, target) or ""))
    c._write(frame(MessageType.ALIASES_REPLY, stream, entries))


def stat(c: Connection, stream: int, _: None) -> None:
    mine = c.tenant if c.cfg.tls_ca else None  # a tenant sees its own
    c._write(frame(MessageType.STAT_REPLY, stream, json.dumps(c.server.stats(mine))))

