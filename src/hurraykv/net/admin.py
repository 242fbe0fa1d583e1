"""The private messages a ``hurraykv serve`` connection answers (floor 5): DELETE, HAS,
LINK, LOCATE, LIST, ALIASES, STAT and RETAIN (decisions H35, H62, H93).  Each handler
takes the connection's :class:`~.session.Session`, the stream and the message's decoded
value (``codecs.CODECS``); keys are scoped to the connection's tenant.
``handlers.HANDLERS`` routes the messages here."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ..errors import HurrayError
from ..io.retention import PinRefused
from .aliases import AliasLogError
from .codecs import frame
from .keystore import StoreFull
from .messages import Delete, ErrorCode, MessageType, ProtocolError
from .tenants import client_key

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("hurraykv.server")


def delete(s: Session, stream: int, msg: Delete) -> None:
    key = msg.key
    try:
        found = s.server.store.delete(s.key(key))
    except AliasLogError as e:
        log.warning("delete key=%r: the object is removed, its aliases are not: %s", key, e)
        raise ProtocolError(f"key {key!r} is removed, but the server could not record its "
                            f"aliases as removed ({e.why}); rm it again once that is "
                            "mended", ErrorCode.INTERNAL, field="aliases") from None
    if not found:
        raise ProtocolError(f"no tensor under key {key!r}", ErrorCode.UNKNOWN_TENSOR)
    log.info("delete key=%r", key)
    s.send(frame(MessageType.DELETE_ACK, stream))


def has(s: Session, stream: int, keys: list[str]) -> None:
    store = s.server.store
    flags = [s.key(k) in store for k in keys]
    s.send(frame(MessageType.HAS_REPLY, stream, flags))


def link(s: Session, stream: int, pairs: list[tuple[str, str]]) -> None:
    try:
        s.server.store.link([(s.key(a), s.key(t)) for a, t in pairs])
    except StoreFull as e:
        raise ProtocolError(f"link of {len(pairs)} aliases: {e}", ErrorCode.STORE_FULL,
                            field="aliases", value=e.value) from None
    except AliasLogError as e:
        log.warning("link of %d aliases failed, nothing linked: %s", len(pairs), e)
        raise ProtocolError(f"link of {len(pairs)} aliases: the server could not record "
                            f"them ({e.why}); nothing was linked", ErrorCode.INTERNAL,
                            field="aliases") from None
    s.send(frame(MessageType.LINK_ACK, stream))


def locate(s: Session, stream: int, keys: list[str]) -> None:
    store = s.server.store
    found = [store.locate(s.key(k)) for k in keys]
    names = [client_key(s.tenant, f) or "" if f is not None else "" for f in found]
    s.send(frame(MessageType.LOCATE_REPLY, stream, names))


def listing(s: Session, stream: int, prefix: str) -> None:
    mine = [(client_key(s.tenant, k), n) for k, n in s.server.store.listing()]
    entries = [(k, n) for k, n in mine if k is not None and k.startswith(prefix)]
    s.send(frame(MessageType.LIST_REPLY, stream, entries))


def aliases(s: Session, stream: int, prefix: str) -> None:
    entries = []
    for alias, target in s.server.store.alias_listing():
        mine = client_key(s.tenant, alias)
        if mine is not None and mine.startswith(prefix):
            entries.append((mine, client_key(s.tenant, target) or ""))
    s.send(frame(MessageType.ALIASES_REPLY, stream, entries))


def stat(s: Session, stream: int, _: None) -> None:
    mine = s.tenant if s.server.config.tls_ca else None  # a tenant sees its own
    s.send(frame(MessageType.STAT_REPLY, stream, json.dumps(s.server.stats(mine))))


def retain(s: Session, stream: int, text: str) -> None:
    """``{"keys", "pin", "ttl_s"}``: pin and give a lifetime to this tenant's keys;
    ``{"prefix"}``: what of this tenant's is retained."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ProtocolError(f"retain payload is not JSON: {e}", field="retain") from None
    fields = {"keys", "pin", "ttl_s", "extend"}
    if not isinstance(doc, dict) or not ({"keys"} <= set(doc) <= fields
                                         or set(doc) == {"prefix"}):
        raise ProtocolError(f"retain payload {text[:200]!r} is neither {{keys, pin, ttl_s, "
                            "extend}} nor {prefix}", field="retain", value=text[:200])
    store = s.server.store
    if "prefix" in doc:
        prefix = doc["prefix"]
        if not isinstance(prefix, str):
            raise ProtocolError("retain.prefix is not a string", field="retain.prefix")
        mine = {client_key(s.tenant, k): v for k, v in store.retention_listing().items()}
        reply = {"kept": {k: [v.pinned, v.expiry, v.nbytes] for k, v in mine.items()
                          if k is not None and k.startswith(prefix)}}
        s.send(frame(MessageType.STAT_REPLY, stream, json.dumps(reply)))
        return
    keys, pin, ttl = doc["keys"], doc.get("pin"), doc.get("ttl_s")
    extend = doc.get("extend", False)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ProtocolError("retain.keys is not a list of strings", field="retain.keys")
    for name, value in (("pin", pin), ("extend", extend)):
        if value is not None and not isinstance(value, bool):
            raise ProtocolError(f"retain.{name} is {value!r}, not true, false or null",
                                field=f"retain.{name}", value=value)
    try:
        done = store.retain([s.key(k) for k in keys], pin=pin, ttl_s=ttl,
                            extend=bool(extend))
    except PinRefused as e:
        raise ProtocolError(str(e), ErrorCode.STORE_FULL, field="max_pinned_bytes",
                            value=e.value) from None
    except HurrayError as e:  # ttl_s not a positive number
        raise ProtocolError(str(e), field=f"retain.{e.field}", value=e.value) from None
    log.info("retain %d keys (pin %s, ttl_s %s): %d held", len(keys), pin, ttl, len(done))
    reply = {"retained": [client_key(s.tenant, k) for k in done]}
    s.send(frame(MessageType.STAT_REPLY, stream, json.dumps(reply)))
