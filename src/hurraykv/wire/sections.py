"""Optional descriptor sections after the quantization section, in wire order.

* shard (flag bit 1): ``parent_shape u64[rank] | shard_offset u64[rank]``; every
  ``offset + shape`` stays inside ``parent``.
* statistics (flag bit 3, 72 bytes): ``computed_mask u32 (bits 0-5) | rsv u32 |
  nnz u64 | sparsity, min, max, abs_max, mean, stddev f64 | nm_n, nm_m, has_nan,
  has_inf u8 | rsv[4]``.  Advisory only.
* extension type (flag bit 2, 20 bytes): ``bit_width u32 | packing u8 | is_float |
  is_signed | sign_bits | exp_bits | mant_bits | rsv[2] | exponent_bias u32 |
  has_nan | has_inf | rsv[2]``.
* composite member (flag bit 4, 16 bytes): ``role u8 (0 correction, 1 base) | rsv[15]``.

Statistics come *before* the extension type on the wire although their flag bit
is higher (metadata.md; the reference encoder and decoder agree).
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass

from ..errors import DescriptorError, ElementTypeError
from .cursor import Cursor

_STATS = struct.Struct("<IIQddddddBBBB4x")
_EXT = struct.Struct("<IBBBBBB2xIBB2x")
assert _STATS.size == 72 and _EXT.size == 20
DYNAMIC = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True)
class Shard:
    parent_shape: tuple[int, ...]
    shard_offset: tuple[int, ...]

    def encode(self, rank: int) -> bytes:
        return struct.pack(f"<{rank}Q{rank}Q", *self.parent_shape, *self.shard_offset)

    @classmethod
    def decode(cls, cur: Cursor, shape: tuple[int, ...]) -> Shard:
        rank = len(shape)
        parent = cur.array("u64", rank, "shard.parent_shape")
        off = cur.array("u64", rank, "shard.shard_offset")
        for i in range(rank):
            if DYNAMIC in (shape[i], parent[i]):
                continue
            if off[i] + shape[i] > parent[i]:
                raise DescriptorError.at(
                    f"shard.shard_offset[{i}]", cur.at("shard.shard_offset") + 8 * i, off[i],
                    f"shard_offset + shape ({off[i]} + {shape[i]}) MUST NOT exceed "
                    f"parent_shape ({parent[i]})")
        return cls(parent, off)


@dataclass(frozen=True, eq=False)
class Statistics:
    computed_mask: int = 0
    nnz: int = 0
    sparsity: float = 0.0
    min: float = 0.0
    max: float = 0.0
    abs_max: float = 0.0
    mean: float = 0.0
    stddev: float = 0.0
    nm_n: int = 0
    nm_m: int = 0
    has_nan: int = 0
    has_inf: int = 0

    def encode(self) -> bytes:
        f = astuple(self)
        return _STATS.pack(f[0], 0, *f[1:])

    def __eq__(self, other: object) -> bool:  # bytes, so NaN statistics compare equal
        return isinstance(other, Statistics) and self.encode() == other.encode()

    def __hash__(self) -> int:
        return hash(self.encode())

    @classmethod
    def decode(cls, cur: Cursor) -> Statistics:
        start = cur.pos
        raw = cur.take(_STATS.size, "statistics")
        mask, rsv, *rest = _STATS.unpack(raw)
        if mask & ~0x3F:
            raise DescriptorError.at("statistics.computed_mask", start, mask,
                                     "computed_mask bits 6-31 are reserved and MUST be 0")
        if rsv:
            raise DescriptorError.at("statistics._reserved", start + 4, rsv,
                                     "reserved bytes MUST be 0")
        if any(raw[68:72]):
            raise DescriptorError.at("statistics._reserved2", start + 68, bytes(raw[68:72]).hex(),
                                     "reserved bytes MUST be 0")
        return cls(mask, *rest)


@dataclass(frozen=True)
class ExtensionType:
    bit_width: int
    packing: int = 1
    is_float: int = 0
    is_signed: int = 0
    sign_bits: int = 0
    exp_bits: int = 0
    mant_bits: int = 0
    exponent_bias: int = 0
    has_nan: int = 0
    has_inf: int = 0

    def encode(self) -> bytes:
        return _EXT.pack(*astuple(self))

    def nbytes(self, count: int) -> int:
        if self.bit_width < 8:
            return -(-count // self.packing)
        return -(-count * self.bit_width // 8)

    @classmethod
    def decode(cls, cur: Cursor) -> ExtensionType:
        start = cur.pos
        raw = cur.take(_EXT.size, "extension_type")
        if any(raw[10:12]) or any(raw[18:20]):
            raise ElementTypeError.at("extension_type._reserved", start + 10, bytes(raw).hex(),
                                      "reserved bytes MUST be 0")
        ext = cls(*_EXT.unpack(raw))
        w, p = ext.bit_width, ext.packing
        if w == 0:
            raise ElementTypeError.at("extension_type.bit_width", start, w,
                                      "bit_width MUST be > 0")
        if w >= 8 and p != 1:
            raise ElementTypeError.at("extension_type.packing", start + 4, p,
                                      "packing MUST be 1 when bit_width >= 8")
        if w < 8 and (w not in (1, 2, 4) or p != 8 // w):
            raise ElementTypeError.at(
                "extension_type.packing", start + 4, p,
                f"a {w}-bit type needs bit_width in (1, 2, 4) and packing 8/bit_width")
        return ext


@dataclass(frozen=True)
class CompositeMember:
    role: int  # 0 correction, 1 base

    def encode(self) -> bytes:
        return struct.pack("<B15x", self.role)

    @classmethod
    def decode(cls, cur: Cursor) -> CompositeMember:
        role = cur.u8("composite_member.role")
        if role not in (0, 1):
            raise DescriptorError.at("composite_member.role", cur.at("composite_member.role"),
                                     role, "role MUST be 0x00 correction or 0x01 base")
        cur.zeros(15, "composite_member._reserved", DescriptorError)
        return cls(role)
