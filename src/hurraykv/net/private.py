"""The private messages' lists (floor 5): HAS, LINK, LOCATE and their replies, LIST_REPLY,
ALIASES_REPLY; and 0xFE's payloads, RETAIN's text or the EXTENSION envelope of a private
operation by name (H95; see the table in ``messages.py``)."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from .messages import decode_text, encode_text, payload_reader, protocol_error

MAX_KEYS = 65536  # keys one HAS may ask about


def encode_keys(keys: list[str], per: int = 1) -> bytes:
    return struct.pack("<I", len(keys) // per) + b"".join(encode_text(k) for k in keys)


def decode_keys(payload: bytes | memoryview, what: str = "has", per: int = 1) -> list[str]:
    """``u32 count`` then ``count * per`` strings (HAS, LOCATE and LOCATE_REPLY: one per
    key; LINK: alias and target)."""
    r = payload_reader(payload, what)
    n = r.count("count", 4 * per, MAX_KEYS)
    keys = [r.text("key") for _ in range(n * per)]
    r.end()
    return keys


def encode_pairs(pairs: list[tuple[str, str]]) -> bytes:
    """LINK's payload: ``u32 count`` then per alias its name and its target."""
    return encode_keys([text for pair in pairs for text in pair], per=2)


def decode_pairs(payload: bytes | memoryview, what: str = "link") -> list[tuple[str, str]]:
    flat = decode_keys(payload, what, per=2)
    return list(zip(flat[::2], flat[1::2], strict=True))


def encode_flags(flags: list[bool]) -> bytes:
    return struct.pack("<I", len(flags)) + bytes(int(bool(f)) for f in flags)


def decode_flags(payload: bytes | memoryview, expected: int | None = None) -> list[bool]:
    """HAS_REPLY; ``expected`` is the number of keys asked about, where known."""
    r = payload_reader(payload, "has_reply")
    n = r.count("count", 1)
    if expected is not None and n != expected:
        raise protocol_error(f"has_reply.count {n}: {expected} keys were asked about",
                             field_="count", offset=0, value=n)
    out = bytes(r.take(n, "flags"))
    r.end()
    bad = next((i for i, b in enumerate(out) if b > 1), None)
    if bad is not None:
        raise r.fail(f"flags[{bad}]", 4 + bad, out[bad], "has_reply flags are 0 or 1")
    return [b == 1 for b in out]


def encode_listing(entries: list[tuple[str, int]]) -> bytes:
    return struct.pack("<I", len(entries)) + b"".join(
        encode_text(k) + struct.pack("<Q", n) for k, n in entries)


def _decode_pairs(payload: bytes | memoryview, message: str, least: int, pair) -> list:
    """``u32 count`` then ``count`` entries of at least ``least`` bytes, each read by
    ``pair(reader)``; a count the payload cannot hold is refused before any is read."""
    r = payload_reader(payload, message)
    n = r.count("count", least)
    out = [pair(r) for _ in range(n)]
    r.end()
    return out


def decode_listing(payload: bytes | memoryview) -> list[tuple[str, int]]:
    return _decode_pairs(payload, "list_reply", 12, lambda r: (r.text("key"), r.u64("bytes")))


def encode_alias_listing(entries: list[tuple[str, str]]) -> bytes:
    return encode_pairs(entries)


def decode_alias_listing(payload: bytes | memoryview) -> list[tuple[str, str]]:
    return _decode_pairs(payload, "aliases_reply", 8,
                         lambda r: (r.text("alias"), r.text("target")))


# --------------------------------------------------------------------------- EXTENSION
EXTENSION_MARK = 0xFFFFFFFF  # the first u32 of an envelope: no RETAIN text is that long
OPERATION_RULE = ("an operation name is 1 to 128 ASCII letters, digits, '.', '_' or '-' "
                  "(vendor.name by convention)")
_OPERATION = re.compile(r"[A-Za-z0-9._-]{1,128}")


def valid_operation(name: str) -> bool:
    """Whether ``name`` may name a private operation (``OPERATION_RULE``)."""
    return isinstance(name, str) and _OPERATION.fullmatch(name) is not None


@dataclass(frozen=True)
class Extension:
    """The EXTENSION envelope (0xFE, H95): a private operation's name and its payload,
    a request's or, from a server, the reply's (which names the same operation)."""

    operation: str
    payload: bytes = b""

    def encode(self) -> bytes:
        raw = self.operation.encode("utf-8")
        return struct.pack("<II", EXTENSION_MARK, len(raw)) + raw + bytes(self.payload)


def is_extension(payload: bytes | memoryview) -> bool:
    """Whether a 0xFE payload is the envelope (else it is RETAIN's text)."""
    return len(payload) >= 4 and bytes(payload[:4]) == EXTENSION_MARK.to_bytes(4, "little")


def decode_extension(payload: bytes | memoryview) -> Extension:
    r = payload_reader(payload, "extension")
    mark = r.u32("mark")
    if mark != EXTENSION_MARK:
        raise r.fail("mark", 0, mark, f"an EXTENSION envelope starts with 0x{EXTENSION_MARK:x}")
    at = r.pos + 4
    name = r.text("operation")
    if not valid_operation(name):
        raise r.fail("operation", at, name[:200], OPERATION_RULE)
    return Extension(name, bytes(r.take(r.left, "payload")))


def encode_private(value: str | Extension) -> bytes:
    """0xFE's payload: the envelope for an :class:`Extension`, RETAIN's text for a str."""
    return value.encode() if isinstance(value, Extension) else encode_text(value)


def decode_private(payload: bytes | memoryview) -> str | Extension:
    """0xFE's value: an :class:`Extension` when the payload starts with
    ``EXTENSION_MARK``, else RETAIN's JSON text (H93, H95)."""
    if is_extension(payload):
        return decode_extension(payload)
    return decode_text(payload, "retain")
