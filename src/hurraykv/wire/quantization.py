"""The quantization section: ``u32 quantization_length`` then that many bytes.

Every payload opens with ``scheme_tag u8 | scheme_version u8 (= 1) | flags u16``.

=====  ====================  ===  ==========================================================
tag    scheme                len  rest of the payload (offsets from the payload start)
=====  ====================  ===  ==========================================================
0x01   per-tensor affine     16   4 scale f32 (finite, non-zero), 8 zero_point i32, 12 rsv[4]
0x02   per-channel affine    20   4 axis, 8 scale_buf, 12 zp_buf (0xFFFFFFFF iff SYMMETRIC),
                                  16 scale_type u8 (= 0x03 float32), 17 rsv[3]
0x03   per-block affine      24   4 axis, 8 block_size (power of two >= 2), 12 scale_buf,
                                  16 zp_buf (0xFFFFFFFF iff SYMMETRIC), 20 scale_type u8
                                  (0x01 f16, 0x02 bf16, 0x03 f32), 21 rsv[3]
0x04   NF4                   16   4 axis, 8 block_size (power of two), 12 scale_buf
0x05   MXFP                  16   4 axis, 8 block_size (power of two in [16, 2048]), 12 scale_buf
=====  ====================  ===  ==========================================================

Flag bit 0 is SYMMETRIC for 0x02/0x03; every other flag bit is reserved.  Bytes
after a scheme's fixed length (inside quantization_length) are padding and kept
verbatim.  Tags: 0x00/0xFF invalid, 0x60-0xEF reserved (always rejected),
0x06-0x5F unknown and 0xF0-0xFE private (rejected unless reading permissively, and
then carried as raw bytes).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import ClassVar

from ..errors import QuantizationError
from .cursor import Cursor
from .dtypes import BY_NAME

NO_BUFFER = 0xFFFFFFFF
SYMMETRIC = 0x0001
SCHEME_NAMES = {0x01: "per_tensor", 0x02: "per_channel", 0x03: "per_block_affine",
                0x04: "nf4", 0x05: "mxfp"}
SCALE_TYPES = {0x01: "float16", 0x02: "bfloat16", 0x03: "float32"}

_INT_STORAGE = ("int8", "uint8", "int4", "uint4", "int2", "uint2")
VALID_STORAGE = {
    0x01: (*_INT_STORAGE, "int16", "uint16", "int32", "uint32"),
    0x02: (*_INT_STORAGE, "int16", "uint16", "int32", "uint32"),
    0x03: _INT_STORAGE,
    0x04: ("uint4",),
    0x05: ("float8_e4m3", "float8_e5m2", "float4_e2m1", "float6_e2m3", "float6_e3m2", "int8",
           "int4"),
}
VALID_STORAGE_TAGS = {k: frozenset(BY_NAME[n].tag for n in v) for k, v in VALID_STORAGE.items()}


def storage_range(type_name: str) -> tuple[int, int]:
    et = BY_NAME[type_name]
    if et.is_signed:
        return -(1 << (et.bits - 1)), (1 << (et.bits - 1)) - 1
    return 0, (1 << et.bits) - 1


@dataclass(frozen=True)
class PerTensor:
    scale: float
    zero_point: int = 0
    padding: bytes = b""
    TAG: ClassVar[int] = 0x01

    def __post_init__(self) -> None:
        # The wire holds a float32: keep the value it round-trips to, so equality holds.
        object.__setattr__(self, "scale", struct.unpack("<f", struct.pack("<f", self.scale))[0])

    def encode(self) -> bytes:
        return struct.pack("<BBHfi4x", self.TAG, 1, 0, self.scale, self.zero_point) + self.padding

    @property
    def buffers(self) -> tuple[int, ...]:
        return ()


class _Affine:
    """What per-channel and per-block affine share: optional zero-points (None: SYMMETRIC)."""

    scale_buffer: int
    zero_point_buffer: int | None

    @property
    def symmetric(self) -> bool:
        return self.zero_point_buffer is None

    @property
    def buffers(self) -> tuple[int, ...]:
        zp = self.zero_point_buffer
        return (self.scale_buffer,) if zp is None else (self.scale_buffer, zp)

    def _head(self, tag: int) -> tuple[int, int, int]:
        return tag, 1, SYMMETRIC if self.symmetric else 0

    @property
    def _zp_field(self) -> int:
        return NO_BUFFER if self.zero_point_buffer is None else self.zero_point_buffer


@dataclass(frozen=True)
class PerChannel(_Affine):
    axis: int
    scale_buffer: int
    zero_point_buffer: int | None = None
    scale_type: int = 0x03
    padding: bytes = b""
    TAG: ClassVar[int] = 0x02

    def encode(self) -> bytes:
        return struct.pack("<BBHIIIB3x", *self._head(self.TAG), self.axis, self.scale_buffer,
                           self._zp_field, self.scale_type) + self.padding


@dataclass(frozen=True)
class PerBlockAffine(_Affine):
    axis: int
    block_size: int
    scale_buffer: int
    zero_point_buffer: int | None = None
    scale_type: int = 0x03
    padding: bytes = b""
    TAG: ClassVar[int] = 0x03

    def encode(self) -> bytes:
        return struct.pack("<BBHIIIIB3x", *self._head(self.TAG), self.axis, self.block_size,
                           self.scale_buffer, self._zp_field, self.scale_type) + self.padding


@dataclass(frozen=True)
class NF4:
    axis: int
    block_size: int
    scale_buffer: int
    padding: bytes = b""
    TAG: ClassVar[int] = 0x04

    @property
    def buffers(self) -> tuple[int, ...]:
        return (self.scale_buffer,)

    def encode(self) -> bytes:
        return struct.pack("<BBHIII", self.TAG, 1, 0, self.axis, self.block_size,
                           self.scale_buffer) + self.padding


@dataclass(frozen=True)
class MXFP(NF4):
    TAG: ClassVar[int] = 0x05


@dataclass(frozen=True)
class RawQuantization:
    """An unknown or private scheme, carried verbatim by a permissive reader."""

    scheme_tag: int
    payload: bytes  # the whole section, header included

    @property
    def TAG(self) -> int:
        return self.scheme_tag

    @property
    def buffers(self) -> tuple[int, ...]:
        return ()

    def encode(self) -> bytes:
        return self.payload


Quantization = PerTensor | PerChannel | PerBlockAffine | NF4 | MXFP | RawQuantization


def scheme_name(tag: int) -> str:
    return SCHEME_NAMES.get(tag, f"private_0x{tag:02x}" if 0xF0 <= tag <= 0xFE else f"0x{tag:02x}")


def _is_pow2(v: int) -> bool:
    return v > 0 and not v & (v - 1)


def decode_quantization(cur: Cursor, length: int) -> Quantization:
    """Decode a payload of ``length`` bytes at the cursor (``q.`` fields)."""
    start = cur.pos
    end = start + length
    if length < 4:
        raise QuantizationError.at("quantization_length", start - 4, length,
                                   "a quantization section holds at least its 4-byte header")
    tag = cur.u8("q.scheme_tag")
    version = cur.u8("q.scheme_version")
    flags = cur.u16("q.flags")
    if tag in (0x00, 0xFF) or 0x60 <= tag <= 0xEF:
        raise QuantizationError.at(
            "q.scheme_tag", start, tag,
            "scheme tags 0x00/0xFF are invalid and 0x60-0xEF reserved")
    if tag not in SCHEME_NAMES:
        kind = "private" if tag >= 0xF0 else "unknown"
        cur.relax(QuantizationError.at(
            "q.scheme_tag", start, tag,
            f"{kind} quantization scheme; rejected unless reading permissively"))
        cur.pos = start
        return RawQuantization(tag, bytes(cur.take(length, "q.payload")))
    if version != 1:
        raise QuantizationError.at("q.scheme_version", start + 1, version,
                                   "scheme_version MUST be 0x01")
    allowed = SYMMETRIC if tag in (0x02, 0x03) else 0
    if flags & ~allowed:
        raise QuantizationError.at("q.flags", start + 2, flags,
                                   f"reserved {scheme_name(tag)} flag bits MUST be 0")
    need = {0x01: 16, 0x02: 20, 0x03: 24, 0x04: 16, 0x05: 16}[tag]
    if length < need:
        raise QuantizationError.at("quantization_length", start - 4, length,
                                   f"{scheme_name(tag)} needs {need} bytes")
    sym = bool(flags & SYMMETRIC)
    q: Quantization
    if tag == 0x01:
        scale = float(cur.scalar("f32", "q.scale"))
        zp = cur.i32("q.zero_point")
        cur.zeros(4, "q._reserved", QuantizationError)
        if not math.isfinite(scale) or scale == 0.0:
            raise QuantizationError.at("q.scale", start + 4, scale,
                                       "scale MUST be finite and non-zero")
        q = PerTensor(scale, zp)
    elif tag in (0x02, 0x03):
        axis = cur.u32("q.axis")
        block = cur.u32("q.block_size") if tag == 0x03 else 0
        sbuf = cur.u32("q.scale_buffer_index")
        zbuf = cur.u32("q.zero_point_buffer_index")
        stype = cur.u8("q.scale_type")
        cur.zeros(3, "q._reserved", QuantizationError)
        if tag == 0x03 and not (_is_pow2(block) and block >= 2):
            raise QuantizationError.at("q.block_size", cur.at("q.block_size"), block,
                                       "block_size MUST be a power of two >= 2")
        if sbuf == NO_BUFFER:
            raise QuantizationError.at("q.scale_buffer_index", cur.at("q.scale_buffer_index"),
                                       sbuf, "a scale buffer index is required")
        if sym != (zbuf == NO_BUFFER):
            raise QuantizationError.at(
                "q.zero_point_buffer_index", cur.at("q.zero_point_buffer_index"), zbuf,
                "zero_point_buffer_index MUST be 0xFFFFFFFF if and only if SYMMETRIC is set "
                f"(SYMMETRIC is {'set' if sym else 'clear'})")
        valid_types = (0x03,) if tag == 0x02 else tuple(SCALE_TYPES)
        if stype not in valid_types:
            raise QuantizationError.at(
                "q.scale_type", cur.at("q.scale_type"), stype,
                "per-channel scale_type MUST be 0x03 float32" if tag == 0x02
                else "per-block scale_type MUST be 0x01 f16, 0x02 bf16 or 0x03 f32")
        zp_buf = None if sym else zbuf
        q = (PerChannel(axis, sbuf, zp_buf, stype) if tag == 0x02
             else PerBlockAffine(axis, block, sbuf, zp_buf, stype))
    else:
        axis = cur.u32("q.axis")
        block = cur.u32("q.block_size")
        sbuf = cur.u32("q.scale_buffer_index")
        ok = _is_pow2(block) and (tag == 0x04 or 16 <= block <= 2048)
        if not ok:
            raise QuantizationError.at(
                "q.block_size", cur.at("q.block_size"), block,
                "NF4 block_size MUST be a power of two" if tag == 0x04
                else "MXFP block_size MUST be a power of two in [16, 2048]")
        q = (NF4 if tag == 0x04 else MXFP)(axis, block, sbuf)
    pad = bytes(cur.take(end - cur.pos, "q.padding")) if end > cur.pos else b""
    if pad:
        q = type(q)(**{**q.__dict__, "padding": pad})
    return q


def _prod(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def check_in_context(q: Quantization, desc: object, cur: Cursor, *, paged: bool) -> None:
    """Rules that tie a parsed scheme to its descriptor (type, rank, shape, buffers).

    Buffer sizes of per-block schemes follow the generic formula here; a block-paged
    tensor sizes them from its page structure instead (decision D4), so ``paged``
    skips that part and the block-paged rules take over.
    """
    if isinstance(q, RawQuantization):
        return
    type_tag: int = desc.type_tag  # type: ignore[attr-defined]
    shape: tuple[int, ...] = desc.shape  # type: ignore[attr-defined]
    handles = desc.buffers  # type: ignore[attr-defined]
    base = cur.at("q.scheme_tag") or 0
    if type_tag not in VALID_STORAGE_TAGS[q.TAG]:
        raise QuantizationError.at(
            "type_tag", 14, type_tag,
            f"{scheme_name(q.TAG)} storage MUST be one of {', '.join(VALID_STORAGE[q.TAG])}")
    if isinstance(q, PerTensor):
        from .dtypes import ELEMENT_TYPES

        lo, hi = storage_range(ELEMENT_TYPES[type_tag].name)
        if not lo <= q.zero_point <= hi:
            raise QuantizationError.at("q.zero_point", base + 8, q.zero_point,
                                       f"zero_point MUST lie in the storage range [{lo}, {hi}]")
        return
    if q.axis >= len(shape):
        raise QuantizationError.at("q.axis", base + 4, q.axis,
                                   f"axis MUST be < rank ({len(shape)})")
    size = shape[q.axis]
    if size == 0xFFFFFFFFFFFFFFFF:
        raise QuantizationError.at(f"shape[{q.axis}]", 20 + 8 * q.axis, size,
                                   "a quantized axis MUST NOT be dynamic")
    idx_fields = (("q.scale_buffer_index", q.scale_buffer),) + (
        (("q.zero_point_buffer_index", q.zero_point_buffer),)
        if isinstance(q, PerChannel | PerBlockAffine) and not q.symmetric else ())
    for name, i in idx_fields:
        if i == 0 or i >= len(handles):
            raise QuantizationError.at(
                name, cur.at(name), i,
                f"a parameter buffer index MUST name a buffer other than the data buffer "
                f"(1..{len(handles) - 1})")
    if isinstance(q, PerBlockAffine) and size > 0 and q.block_size > size and not paged:
        raise QuantizationError.at("q.block_size", base + 8, q.block_size,
                                   f"block_size MUST NOT exceed shape[axis] ({size})")
    if isinstance(q, MXFP) and (size == 0 or size % q.block_size):
        raise QuantizationError.at(f"shape[{q.axis}]", 20 + 8 * q.axis, size,
                                   f"MXFP needs shape[axis] a positive multiple of "
                                   f"block_size ({q.block_size})")
    if paged and not isinstance(q, PerChannel):
        return
    if isinstance(q, PerChannel):
        count = size
    else:
        outer = _prod(shape[: q.axis] + shape[q.axis + 1:])
        count = outer * -(-size // q.block_size)
    scale_width = {PerChannel: 4, NF4: 4, MXFP: 1}.get(type(q)) or {1: 2, 2: 2, 3: 4}[
        q.scale_type]  # type: ignore[union-attr]
    check_param_sizes(q, handles, count, scale_width, cur)


def check_param_sizes(q: Quantization, handles: tuple, count: int, scale_width: int,
                      cur: Cursor) -> None:
    """Scale (and zero-point) buffers hold exactly ``count`` entries; a shared entry
    holds ``[scales | zero_points]``."""
    zp = getattr(q, "zero_point_buffer", None)
    want = {q.scale_buffer: count * scale_width}  # type: ignore[union-attr]
    if zp is not None:
        want[zp] = want.get(zp, 0) + count * 4
    for i, nbytes in want.items():
        got = handles[i].byte_size
        if got != nbytes:
            what = "scales and zero-points" if zp == q.scale_buffer else (  # type: ignore
                "zero-points" if i == zp else "scales")
            raise QuantizationError.at(
                f"buffers[{i}].byte_size", (cur.at("buffer_count") or 0) + 1 + 16 * i, got,
                f"{scheme_name(q.TAG)} {what} take exactly {nbytes} bytes "
                f"({count} entries)")
