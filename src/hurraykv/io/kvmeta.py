"""The .hrry KV metadata section: ``u32 count``, then ``u16 key_len | key | u8 tag | value``.

======  ========  ==================================================================
tag     type      payload
======  ========  ==================================================================
0x01    string    u32 length + UTF-8
0x02    int64     8 bytes
0x03    uint64    8 bytes
0x04    float64   8 bytes
0x05    bool      1 byte, 0 or 1 only
0x06    bytes     u32 length + bytes
0x07    array     u8 element tag (0x01-0x06), u32 count, payloads back to back
======  ========  ==================================================================

Keys are unique, non-empty UTF-8.  Tags 0x08-0xEF and 0xFF are rejected; private tags
0xF0-0xFE are rejected too (nothing here agrees on them out of band).  Python values
map to tags by type: ``str``, ``bool``, ``int`` (int64, or uint64 when only that fits),
``float``, ``bytes``; NumPy integer/float scalars and arrays keep their signedness
(``np.uint64`` -> 0x03); lists and arrays become 0x07.  Numeric arrays decode to NumPy
arrays, the others to lists.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ..errors import ContainerError
from ..wire.cursor import Cursor

STRING, INT64, UINT64, FLOAT64, BOOL, BYTES, ARRAY = range(1, 8)
_NUMERIC = {INT64: "<i8", UINT64: "<u8", FLOAT64: "<f8"}
_NAMES = {STRING: "string", INT64: "int64", UINT64: "uint64", FLOAT64: "float64", BOOL: "bool",
          BYTES: "bytes", ARRAY: "array"}


def _tag_of(value: Any) -> int:
    if isinstance(value, bool | np.bool_):
        return BOOL
    if isinstance(value, str):
        return STRING
    if isinstance(value, bytes | bytearray | memoryview):
        return BYTES
    if isinstance(value, np.unsignedinteger):
        return UINT64
    if isinstance(value, int | np.integer):
        return INT64 if -(1 << 63) <= int(value) < (1 << 63) else UINT64
    if isinstance(value, float | np.floating):
        return FLOAT64
    if isinstance(value, list | tuple | np.ndarray):
        return ARRAY
    raise ContainerError(f"KV value of type {type(value).__name__} has no KV tag",
                         field="kv", value=type(value).__name__,
                         rule="KV values are str, int, float, bool, bytes or arrays of them")


def _payload(tag: int, value: Any) -> bytes:
    if tag == STRING:
        raw = value.encode("utf-8")
        return struct.pack("<I", len(raw)) + raw
    if tag == BYTES:
        return struct.pack("<I", len(value)) + bytes(value)
    if tag == BOOL:
        return b"\x01" if value else b"\x00"
    if tag in _NUMERIC:
        try:
            return np.array(value, dtype=_NUMERIC[tag]).tobytes()
        except OverflowError:
            raise ContainerError(f"KV value {value} does not fit {_NAMES[tag]}", field="kv",
                                 value=value) from None
    raise AssertionError(tag)


def _array(values: Any) -> tuple[int, bytes]:
    if isinstance(values, np.ndarray):
        kind = values.dtype.kind
        tag = {"u": UINT64, "i": INT64, "f": FLOAT64, "b": BOOL}.get(kind)
        if tag is None:
            raise ContainerError(f"KV array of dtype {values.dtype} has no KV tag", field="kv")
        if tag == BOOL:
            return tag, values.astype(np.uint8).tobytes()
        return tag, np.ascontiguousarray(values.reshape(-1), dtype=_NUMERIC[tag]).tobytes()
    values = list(values)
    if not values:
        raise ContainerError("an empty Python list has no element type; pass a NumPy array",
                             field="kv", value=[])
    tags = {_tag_of(v) for v in values}
    if len(tags) > 1 or ARRAY in tags:
        raise ContainerError("KV arrays hold one scalar type", field="kv",
                             value=sorted(_NAMES[t] for t in tags))
    tag = tags.pop()
    return tag, b"".join(_payload(tag, v) for v in values)


def encode_kv(kv: dict[str, Any]) -> bytes:
    parts = [struct.pack("<I", len(kv))]
    for key, value in kv.items():
        raw = key.encode("utf-8")
        if not 1 <= len(raw) <= 0xFFFF:
            raise ContainerError(f"KV key {key!r} is {len(raw)} bytes; keys are 1..65535",
                                 field="kv", value=key)
        tag = _tag_of(value)
        if tag == ARRAY:
            elem, body = _array(value)
            count = len(value) if not isinstance(value, np.ndarray) else value.size
            payload = struct.pack("<BI", elem, count) + body
        else:
            payload = _payload(tag, value)
        parts += [struct.pack("<H", len(raw)), raw, bytes([tag]), payload]
    return b"".join(parts)


def _reader(data: memoryview | bytes, base: int) -> Cursor:
    return Cursor(data, error=ContainerError, noun="KV section", prefix="kv.",
                  where="file offset", base=base, bound="kv_length")


def _value(r: Cursor, tag: int, key: str) -> Any:
    if tag in (STRING, BYTES):
        n = r.u32(f"{key}.length")
        at = r.pos
        raw = r.take(n, key)
        return r.utf8(raw, key, at) if tag == STRING else bytes(raw)
    if tag == BOOL:
        b = r.u8(key)
        if b > 1:
            raise ContainerError(f"KV bool {key!r} at file offset {r.base + r.pos - 1}: found "
                                 f"{b}; a bool is 0 or 1", field=f"kv.{key}",
                                 offset=r.base + r.pos - 1, value=b, rule="bool is 0x00 or 0x01")
        return bool(b)
    return np.frombuffer(r.take(8, key), _NUMERIC[tag])[0].item()


def decode_kv(data: memoryview | bytes, base: int = 0,
              spans: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """Decode a KV section; ``base`` is its file offset, for messages.  ``spans``, when
    given, gets the ``(file offset, byte length)`` of each string value's UTF-8 text: an
    entry is found by its key, never by searching for its text."""
    r = _reader(data, base)
    count = r.u32("kv_count")
    if count > (len(r.data) - 4) // 4:  # each entry takes >= 4 bytes: bound before looping
        raise ContainerError(f"kv_count {count} at file offset {base} cannot fit in "
                             f"{len(r.data)} bytes", field="kv.kv_count", offset=base,
                             value=count, rule="entries stay inside kv_length")
    out: dict[str, Any] = {}
    for _ in range(count):
        at = base + r.pos
        n = r.u16("key_length")
        if n == 0:
            raise ContainerError(f"KV key_length at file offset {at} is 0; keys are >= 1 byte",
                                 field="kv.key_length", offset=at, value=0)
        key = r.utf8(r.take(n, "key"), "key", r.pos - n)
        if key in out:
            raise ContainerError(f"KV key {key!r} at file offset {at} appears twice",
                                 field="kv.key", offset=at, value=key, rule="keys are unique")
        tag = r.u8(f"{key}.value_tag")
        if tag not in _NAMES:
            raise ContainerError(f"KV value_tag of {key!r} at file offset {base + r.pos - 1}: "
                                 f"found 0x{tag:02x}; tags 0x01-0x07 only (0x08-0xEF reserved, "
                                 "0xF0-0xFE private, 0xFF invalid)", field=f"kv.{key}.value_tag",
                                 offset=base + r.pos - 1, value=tag)
        if tag != ARRAY:
            start = r.pos
            out[key] = _value(r, tag, key)
            if spans is not None and tag == STRING:
                spans[key] = (base + start + 4, r.pos - start - 4)  # after the u32 length
            continue
        elem = r.u8(f"{key}.element_tag")
        n_el = r.u32(f"{key}.count")
        if elem not in _NAMES or elem == ARRAY:
            raise ContainerError(f"KV array {key!r}: element tag 0x{elem:02x}; arrays hold tags "
                                 "0x01-0x06", field=f"kv.{key}.element_tag", value=elem,
                                 offset=base + r.pos - 5)
        if elem in _NUMERIC:
            out[key] = np.frombuffer(r.take(8 * n_el, key), _NUMERIC[elem]).copy()
        else:
            if n_el > r.left:  # every element takes >= 1 byte
                raise ContainerError(f"KV array {key!r} claims {n_el} elements in "
                                     f"{r.left} bytes", field=f"kv.{key}.count",
                                     value=n_el, offset=base + r.pos - 4)
            out[key] = [_value(r, elem, key) for _ in range(n_el)]
    if r.pos != len(r.data):
        raise ContainerError(f"KV section has {len(r.data) - r.pos} bytes after its "
                             f"{count} entries", field="kv_length", offset=base + r.pos,
                             value=len(r.data), rule="kv_length covers the entries exactly")
    return out
