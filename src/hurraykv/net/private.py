"""The private messages' lists (floor 4): HAS, LINK, LOCATE and their replies, LIST_REPLY,
ALIASES_REPLY (see the table in ``messages.py``)."""

from __future__ import annotations

import struct

from .messages import _bad, _Reader, encode_text

MAX_KEYS = 65536  # keys one HAS may ask about


def encode_keys(keys: list[str], per: int = 1) -> bytes:
    return struct.pack("<I", len(keys) // per) + b"".join(encode_text(k) for k in keys)


def decode_keys(payload: bytes | memoryview, what: str = "has", per: int = 1) -> list[str]:
    """``u32 count`` then ``count * per`` strings (HAS, LOCATE and LOCATE_REPLY: one per
    key; LINK: alias and target)."""
    r = _Reader(payload, what)
    n = r.unpack("I", "count")
    if n > MAX_KEYS or n * per * 4 > r.left:
        raise _bad(f"{what}.count {n}: at most {MAX_KEYS} entries of {per} string(s), each "
                   f"at least 4 bytes of the {r.left} left", field_="count", value=n)
    keys = [r.text("key") for _ in range(n * per)]
    r.end()
    return keys


def encode_flags(flags: list[bool]) -> bytes:
    return struct.pack("<I", len(flags)) + bytes(int(bool(f)) for f in flags)


def decode_flags(payload: bytes | memoryview, expected: int) -> list[bool]:
    r = _Reader(payload, "has_reply")
    n = r.unpack("I", "count")
    if n != expected:
        raise _bad(f"has_reply.count {n}: {expected} keys were asked about", field_="count",
                   value=n)
    out = bytes(r.take(n, "flags"))
    r.end()
    if any(b > 1 for b in out):
        raise _bad("has_reply flags are 0 or 1", field_="flags")
    return [b == 1 for b in out]


def encode_listing(entries: list[tuple[str, int]]) -> bytes:
    return struct.pack("<I", len(entries)) + b"".join(
        encode_text(k) + struct.pack("<Q", n) for k, n in entries)


def _decode_pairs(payload: bytes | memoryview, message: str, least: int, pair) -> list:
    """``u32 count`` then ``count`` entries of at least ``least`` bytes, each read by
    ``pair(reader)``; a count the payload cannot hold is refused before any is read."""
    r = _Reader(payload, message)
    n = r.unpack("I", "count")
    if n * least > r.left:
        raise _bad(f"{message}.count {n} cannot fit in {r.left} bytes", field_="count",
                   value=n)
    out = [pair(r) for _ in range(n)]
    r.end()
    return out


def decode_listing(payload: bytes | memoryview) -> list[tuple[str, int]]:
    return _decode_pairs(payload, "list_reply", 12,
                         lambda r: (r.text("key"), r.unpack("Q", "bytes")))


def encode_alias_listing(entries: list[tuple[str, str]]) -> bytes:
    return encode_keys([text for pair in entries for text in pair], per=2)


def decode_alias_listing(payload: bytes | memoryview) -> list[tuple[str, str]]:
    return _decode_pairs(payload, "aliases_reply", 8,
                         lambda r: (r.text("alias"), r.text("target")))
