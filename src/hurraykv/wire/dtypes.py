"""Hurray element types: the single table of type tags, and sub-byte packing.

Tag ranges (element-types.md): 0x01-0x3F Tier 1, 0x40-0x7F Tier 2, 0x80-0xEF
reserved, 0xF0-0xFE extension types (described by the descriptor's extension
type section), 0x00 and 0xFF invalid, 0x47 reserved.  An unassigned tag inside
the Tier 1/2 ranges is *unknown*: a strict reader rejects it, a permissive one
may carry it but never touches the data.

Buffer size of N elements of W bits: ``N*W/8`` for W >= 8, ``ceil(N*W/8)`` for
1, 2 and 4 bits, ``ceil(N/4)*3`` for 6 bits.  Packing is LSB first: element i
of a 4-bit array sits in the low nibble of byte i/2 when i is even; element 4k+j
of a 2-bit array in bits [2j+1:2j]; bool element i in bit i%8.  Unused high bits
of the last byte are zero.  Bit patterns are never canonicalised.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..errors import ElementTypeError


@dataclass(frozen=True)
class ElementType:
    tag: int
    name: str
    bits: int
    is_float: bool
    is_signed: bool
    #: NumPy dtype of one *unpacked* element (little-endian); None where NumPy has none.
    numpy: np.dtype | None

    @property
    def sub_byte(self) -> bool:
        return self.bits < 8

    @property
    def packing(self) -> int:
        """Elements per byte for 1/2/4-bit types; 1 for whole-byte types (6-bit: see nbytes)."""
        return 8 // self.bits if self.bits in (1, 2, 4) else 1

    @property
    def itemsize(self) -> int:
        """Bytes per element of a whole-byte type."""
        if self.bits % 8:
            raise ElementTypeError(
                f"element type {self.name} has {self.bits} bits and no whole-byte item size",
                field="type_tag", value=self.tag, rule="sub-byte types are sized with nbytes()",
            )
        return self.bits // 8

    def nbytes(self, count: int) -> int:
        """Buffer size in bytes of ``count`` elements (Python ints: never overflows)."""
        if self.bits >= 8:
            return count * self.bits // 8
        if self.bits == 6:
            return -(-count // 4) * 3
        return -(-count * self.bits // 8)

    def whole_bytes(self, count: int) -> bool:
        """True when ``count`` elements end exactly on a byte (group) boundary."""
        if self.bits >= 8:
            return True
        if self.bits == 6:
            return count % 4 == 0
        return (count * self.bits) % 8 == 0


def _le(dt: object) -> np.dtype:
    d = np.dtype(dt)
    return d.newbyteorder("<") if d.itemsize > 1 and d.kind in "fiuc" else d


# One row per assigned tag; the only source of names, widths and NumPy types.
_ROWS: tuple[tuple[int, str, int, bool, bool, object], ...] = (
    (0x01, "float16", 16, True, True, np.float16),
    (0x02, "bfloat16", 16, True, True, ml_dtypes.bfloat16),
    (0x03, "float32", 32, True, True, np.float32),
    (0x04, "float64", 64, True, True, np.float64),
    (0x10, "int8", 8, False, True, np.int8),
    (0x11, "uint8", 8, False, False, np.uint8),
    (0x12, "int16", 16, False, True, np.int16),
    (0x13, "uint16", 16, False, False, np.uint16),
    (0x14, "int32", 32, False, True, np.int32),
    (0x15, "uint32", 32, False, False, np.uint32),
    (0x16, "int64", 64, False, True, np.int64),
    (0x17, "uint64", 64, False, False, np.uint64),
    (0x20, "bool", 1, False, False, np.bool_),
    (0x40, "float8_e4m3", 8, True, True, ml_dtypes.float8_e4m3fn),
    (0x41, "float8_e5m2", 8, True, True, ml_dtypes.float8_e5m2),
    (0x42, "float8_e8m0", 8, True, False, ml_dtypes.float8_e8m0fnu),
    (0x43, "float4_e2m1", 4, True, True, ml_dtypes.float4_e2m1fn),
    (0x44, "float6_e2m3", 6, True, True, ml_dtypes.float6_e2m3fn),
    (0x45, "float6_e3m2", 6, True, True, ml_dtypes.float6_e3m2fn),
    (0x46, "float128", 128, True, True, None),
    (0x48, "int4", 4, False, True, np.int8),
    (0x49, "uint4", 4, False, False, np.uint8),
    (0x4A, "int2", 2, False, True, np.int8),
    (0x4B, "uint2", 2, False, False, np.uint8),
    (0x50, "complex64", 64, True, True, np.complex64),
    (0x51, "complex128", 128, True, True, np.complex128),
)

ELEMENT_TYPES: dict[int, ElementType] = {
    tag: ElementType(tag, name, bits, is_f, is_s, None if dt is None else _le(dt))
    for tag, name, bits, is_f, is_s, dt in _ROWS
}
BY_NAME: dict[str, ElementType] = {t.name: t for t in ELEMENT_TYPES.values()}


def tag_class(tag: int) -> str:
    """One of 'known', 'extension', 'unknown', 'reserved', 'invalid'."""
    if tag in ELEMENT_TYPES:
        return "known"
    if tag in (0x00, 0xFF):
        return "invalid"
    if 0xF0 <= tag <= 0xFE:
        return "extension"
    if tag == 0x47 or 0x80 <= tag <= 0xEF:
        return "reserved"
    return "unknown"


_TAG_RULES = {
    "invalid": "type tags 0x00 and 0xFF are invalid",
    "reserved": "type tags 0x47 and 0x80-0xEF are reserved and always rejected",
    "unknown": "an unassigned type tag is rejected unless reading permissively",
}


def check_type_tag(tag: int, offset: int | None, *, strict: bool = True) -> None:
    """Raise for a tag a reader must reject; permissive mode lets *unknown* tags pass."""
    cls = tag_class(tag)
    if cls in ("known", "extension") or (cls == "unknown" and not strict):
        return
    raise ElementTypeError.at("type_tag", offset, tag, _TAG_RULES[cls])


def element_type(key: int | str | np.dtype | type) -> ElementType:
    """Look an element type up by tag, spec name or NumPy dtype."""
    if isinstance(key, ElementType):
        return key
    if isinstance(key, int | np.integer):
        tag = int(key)
        if tag in ELEMENT_TYPES:
            return ELEMENT_TYPES[tag]
        raise ElementTypeError.at(
            "type_tag", None, tag, f"not an element type this library can hold ({tag_class(tag)})"
        )
    if isinstance(key, str) and key in BY_NAME:
        return BY_NAME[key]
    try:
        dt = np.dtype(key)
    except TypeError:
        dt = None
    if dt is not None:
        for et in ELEMENT_TYPES.values():
            if et.numpy is not None and not et.sub_byte and et.numpy == dt.newbyteorder("<"):
                return et
    raise ElementTypeError(
        f"element type {key!r} is not a Hurray element type; known names: "
        + ", ".join(sorted(BY_NAME)),
        field="element_type", value=key, rule="must name a Hurray element type",
    )


def _codes(values: np.ndarray, et: ElementType) -> np.ndarray:
    """Validate and convert unpacked values to unsigned bit codes of ``et.bits`` bits."""
    arr = np.asarray(values)
    if et.name == "bool":
        return arr.astype(np.bool_, copy=False).astype(np.uint8)
    if et.is_float:
        # float4/float6: take the raw code of each ml_dtypes element.
        return arr.astype(et.numpy, copy=False).view(np.uint8) & ((1 << et.bits) - 1)
    lo, hi = (-(1 << (et.bits - 1)), (1 << (et.bits - 1)) - 1) if et.is_signed else (
        0, (1 << et.bits) - 1)
    wide = arr.astype(np.int64, copy=False)
    if wide.size and (wide.min() < lo or wide.max() > hi):
        bad = int(np.flatnonzero((wide < lo) | (wide > hi))[0])
        raise ElementTypeError.at(
            f"{et.name} value", bad, int(wide.reshape(-1)[bad]),
            f"{et.name} holds values in [{lo}, {hi}]", where="index",
        )
    return (wide & ((1 << et.bits) - 1)).astype(np.uint8)


def pack(values: np.ndarray, et: ElementType | str) -> bytes:
    """Pack unpacked sub-byte values (any shape, row-major order) into Hurray bytes."""
    et = element_type(et)
    if not et.sub_byte:
        return np.ascontiguousarray(values, dtype=et.numpy).tobytes()
    c = _codes(values, et).reshape(-1)
    n = c.size
    if et.bits == 6:
        g = np.zeros(-(-n // 4) * 4, np.uint8)
        g[:n] = c
        g = g.reshape(-1, 4)
        out = np.empty((g.shape[0], 3), np.uint8)
        out[:, 0] = g[:, 0] | (g[:, 1] << 6)
        out[:, 1] = (g[:, 1] >> 2) | (g[:, 2] << 4)
        out[:, 2] = (g[:, 2] >> 4) | (g[:, 3] << 2)
        return out.tobytes()
    per = et.packing
    g = np.zeros(-(-n // per) * per, np.uint8)
    g[:n] = c
    g = g.reshape(-1, per)
    shifts = (np.arange(per, dtype=np.uint8) * et.bits).astype(np.uint8)
    return np.bitwise_or.reduce(g << shifts, axis=1).astype(np.uint8).tobytes()


def unpack(data: bytes | memoryview | np.ndarray, et: ElementType | str, count: int) -> np.ndarray:
    """Unpack ``count`` elements from Hurray bytes into a flat array of ``et.numpy``."""
    et = element_type(et)
    raw = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.view(
        np.uint8).reshape(-1)
    need = et.nbytes(count)
    if raw.size < need:
        raise ElementTypeError(
            f"{et.name} data: {count} elements need {need} bytes, found {raw.size}",
            field="data", value=raw.size, rule=f"{count} {et.name} elements take {need} bytes",
        )
    raw = raw[:need]
    if not et.sub_byte:
        return raw.view(et.numpy)
    if et.bits == 6:
        b = raw.reshape(-1, 3)
        c = np.empty((b.shape[0], 4), np.uint8)
        c[:, 0] = b[:, 0] & 0x3F
        c[:, 1] = (b[:, 0] >> 6) | ((b[:, 1] & 0x0F) << 2)
        c[:, 2] = (b[:, 1] >> 4) | ((b[:, 2] & 0x03) << 4)
        c[:, 3] = b[:, 2] >> 2
        codes = c.reshape(-1)[:count]
    else:
        shifts = (np.arange(et.packing, dtype=np.uint8) * et.bits).astype(np.uint8)
        codes = ((raw[:, None] >> shifts) & ((1 << et.bits) - 1)).reshape(-1)[:count]
    if et.name == "bool":
        return codes.astype(np.bool_)
    if et.is_float:
        return codes.view(et.numpy)
    if et.is_signed:
        half = np.uint8(1 << (et.bits - 1))
        return ((codes ^ half).astype(np.int8) - np.int8(half)).astype(np.int8)
    return codes
