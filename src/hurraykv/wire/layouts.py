"""Layout tags and the layout-specific fields that follow ``byte_offset``.

Payloads (metadata.md, block-paged.md; little-endian, packed):

========  ============  ==========================================================
tag       layout        payload
========  ============  ==========================================================
0x01/02   row/col-major none
0x03      strided       strides i64[rank]
0x04      tiled         tile_shape u64[rank], outer u8, inner u8, rsv[2],
                        [outer_strides i64[rank]] [inner_strides i64[rank]]
                        [nested tiled payload when inner == 0x04; depth <= 8]
0x05      Morton        morton_bits u32[rank]
0x06      COO           nnz u64, is_sorted u8, rsv[7]
0x07/08   CSR/CSC       nnz u64, rsv[8]
0x09      CSF           nnz u64, mode_order u32[rank], rsv[8]
0x0A      block-paged   page_size u32, num_pages u64, paged_axis u32, num_seqs u32,
                        kv_role u8, layer_index u32 (0xFFFFFFFF = none),
                        block_table_index_type u8, rsv[6]      (32 bytes, D1)
0x0B      composite     rule u8, combine_op u8, rsv[2], member_count u32
0x40      Hilbert       hilbert_order u32, hilbert_rank u32
0xF0-FE   private       extension_layout_id u64, length u32, bytes[length]
========  ============  ==========================================================

0x00 and 0xFF are invalid; every other unassigned tag is reserved and always
rejected.  A private layout's id is recognised by no one here, so a strict reader
rejects it and a permissive one keeps its bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from ..errors import LayoutError
from .cursor import Cursor

LAYOUT_NAMES = {
    0x01: "row_major", 0x02: "col_major", 0x03: "strided", 0x04: "tiled", 0x05: "morton",
    0x06: "coo", 0x07: "csr", 0x08: "csc", 0x09: "csf", 0x0A: "block_paged",
    0x0B: "composite", 0x40: "hilbert",
}
KV_ROLES = {0: "key", 1: "value", 2: "fused"}
INDEX_TYPES = {0: "uint32", 1: "uint64"}
COMPOSITE_RULES = {1: "partition", 2: "overlay", 3: "group"}
NO_LAYER = 0xFFFFFFFF
MAX_TILED_DEPTH = 8


def layout_name(tag: int) -> str:
    if 0xF0 <= tag <= 0xFE:
        return f"private_0x{tag:02x}"
    return LAYOUT_NAMES.get(tag, f"0x{tag:02x}")


def check_layout_tag(tag: int, offset: int) -> None:
    if tag in LAYOUT_NAMES or 0xF0 <= tag <= 0xFE:
        return
    rule = ("layout tags 0x00 and 0xFF are invalid" if tag in (0, 0xFF)
            else "unassigned layout tags are reserved and always rejected")
    raise LayoutError.at("layout_tag", offset, tag, rule)


def _pack(fmt: str, *values: object) -> bytes:
    try:
        return struct.pack("<" + fmt, *values)
    except struct.error as e:
        raise LayoutError(f"layout field out of range for its wire type: {e}") from None


@dataclass(frozen=True)
class RowMajor:
    TAG: ClassVar[int] = 0x01

    def encode(self, rank: int) -> bytes:
        return b""

    @classmethod
    def decode(cls, cur: Cursor, rank: int, depth: int = 0) -> RowMajor:
        return cls()


@dataclass(frozen=True)
class ColMajor(RowMajor):
    TAG: ClassVar[int] = 0x02


@dataclass(frozen=True)
class Strided:
    strides: tuple[int, ...]
    TAG: ClassVar[int] = 0x03

    def encode(self, rank: int) -> bytes:
        return _pack(f"{rank}q", *self.strides)

    @classmethod
    def decode(cls, cur: Cursor, rank: int, depth: int = 0) -> Strided:
        return cls(cur.array("i64", rank, "layout.strides"))


@dataclass(frozen=True)
class Tiled:
    tile_shape: tuple[int, ...]
    outer_layout: int
    inner_layout: int
    outer_strides: tuple[int, ...] | None = None
    inner_strides: tuple[int, ...] | None = None
    inner_tiled: Tiled | None = None
    TAG: ClassVar[int] = 0x04

    def encode(self, rank: int) -> bytes:
        out = _pack(f"{rank}QBB2x", *self.tile_shape, self.outer_layout, self.inner_layout)
        if self.outer_layout == 0x03:
            out += _pack(f"{rank}q", *(self.outer_strides or ()))
        if self.inner_layout == 0x03:
            out += _pack(f"{rank}q", *(self.inner_strides or ()))
        if self.inner_layout == 0x04:
            if self.inner_tiled is None:
                raise LayoutError("tiled layout with inner_layout 0x04 needs inner_tiled")
            out += self.inner_tiled.encode(rank)
        return out

    @classmethod
    def decode(cls, cur: Cursor, rank: int, depth: int = 0) -> Tiled:
        p = f"layout.tiled[{depth}]"
        if depth >= MAX_TILED_DEPTH:
            raise LayoutError.at(f"{p}", cur.pos, depth,
                                 f"tiled layouts nest at most {MAX_TILED_DEPTH} levels")
        tile = cur.array("u64", rank, f"{p}.tile_shape")
        for i, t in enumerate(tile):
            if t == 0:
                raise LayoutError.at(f"{p}.tile_shape[{i}]", cur.at(f"{p}.tile_shape") + 8 * i,
                                     t, "tile sizes MUST be > 0")
        outer = cur.u8(f"{p}.outer_layout")
        if outer not in (1, 2, 3):
            raise LayoutError.at(f"{p}.outer_layout", cur.at(f"{p}.outer_layout"), outer,
                                 "outer_layout MUST be 0x01, 0x02 or 0x03")
        inner = cur.u8(f"{p}.inner_layout")
        if inner not in (1, 2, 3, 4):
            raise LayoutError.at(f"{p}.inner_layout", cur.at(f"{p}.inner_layout"), inner,
                                 "inner_layout MUST be 0x01-0x04")
        cur.zeros(2, f"{p}._reserved", LayoutError)
        outer_s = cur.array("i64", rank, f"{p}.outer_strides") if outer == 3 else None
        inner_s = cur.array("i64", rank, f"{p}.inner_strides") if inner == 3 else None
        nested = cls.decode(cur, rank, depth + 1) if inner == 4 else None
        return cls(tile, outer, inner, outer_s, inner_s, nested)


@dataclass(frozen=True)
class Morton:
    morton_bits: tuple[int, ...]
    TAG: ClassVar[int] = 0x05

    def encode(self, rank: int) -> bytes:
        return _pack(f"{rank}I", *self.morton_bits)

    @classmethod
    def decode(cls, cur: Cursor, rank: int, depth: int = 0) -> Morton:
        bits = cur.array("u32", rank, "layout.morton_bits")
        for i, b in enumerate(bits):
            if b == 0:
                raise LayoutError.at(f"layout.morton_bits[{i}]",
                                     cur.at("layout.morton_bits") + 4 * i, b,
                                     "morton_bits MUST be > 0")
        return cls(bits)


@dataclass(frozen=True)
class Coo:
    nnz: int
    is_sorted: bool = False
    TAG: ClassVar[int] = 0x06

    def encode(self, rank: int) -> bytes:
        return _pack("QB7x", self.nnz, int(self.is_sorted))

    @classmethod
    def decode(cls, cur: Cursor, rank: int, depth: int = 0) -> Coo:
        nnz = cur.u64("layout.nnz")
        s = cur.u8("layout.is_sorted")
        if s not in (0, 1):
            raise LayoutError.at("layout.is_sorted", cur.at("layout.is_sorted"), s,
                                 "is_sorted MUST be 0x00 or 0x01")
        cur.zeros(7, "layout._reserved", LayoutError)
        return cls(nnz, bool(s))


@dataclass(frozen=True)
class Csr:
    nnz: int
    TAG: ClassVar[int] = 0x07

    def encode(self, rank: int) -> bytes:
        return _pack("Q8x", self.nnz)

    @classmethod
    def decode(cls, cur: Cursor, rank: int, depth: int = 0) -> Csr:
        nnz = cur.u64("layout.nnz")
        cur.zeros(8, "layout._reserved", LayoutError)
        return cls(nnz)


@dataclass(frozen=True)
class Csc(Csr):
    TAG: ClassVar[int] = 0x08


@dataclass(frozen=True)
class Csf:
    nnz: int
    mode_order: tuple[int, ...]
    TAG: ClassVar[int] = 0x09

    def encode(self, rank: int) -> bytes:
        return _pack(f"Q{rank}I8x", self.nnz, *self.mode_order)

    @classmethod
    def decode(cls, cur: Cursor, rank: int, depth: int = 0) -> Csf:
        nnz = cur.u64("layout.nnz")
        order = cur.array("u32", rank, "layout.mode_order")
        if sorted(order) != list(range(rank)):
            raise LayoutError.at("layout.mode_order", cur.at("layout.mode_order"), list(order),
                                 f"mode_order MUST be a permutation of 0..{rank - 1}")
        cur.zeros(8, "layout._reserved", LayoutError)
        return cls(nnz, order)


_BP = struct.Struct("<IQIIBIB6x")
assert _BP.size == 32


@dataclass(frozen=True)
class BlockPaged:
    """The 32-byte block-paged payload (decision D1: tag 0x0A, ``<IQIIBIB6s``)."""

    page_size: int
    num_pages: int
    num_seqs: int
    kv_role: int = 0
    layer_index: int | None = None
    index_type: int = 0
    paged_axis: int = 0
    TAG: ClassVar[int] = 0x0A

    @property
    def kv_role_name(self) -> str:
        return KV_ROLES.get(self.kv_role, f"0x{self.kv_role:02x}")

    @property
    def index_type_name(self) -> str:
        return INDEX_TYPES.get(self.index_type, f"0x{self.index_type:02x}")

    @property
    def index_width(self) -> int:
        return 8 if self.index_type == 1 else 4

    def encode(self, rank: int) -> bytes:
        layer = NO_LAYER if self.layer_index is None else self.layer_index
        if layer == NO_LAYER and self.layer_index is not None:
            raise LayoutError.at("layout.layer_index", None, layer,
                                 "0xFFFFFFFF is the 'not layer-scoped' sentinel; use None")
        try:
            return _BP.pack(self.page_size, self.num_pages, self.paged_axis, self.num_seqs,
                            self.kv_role, layer, self.index_type)
        except struct.error as e:
            raise LayoutError(f"block-paged field out of range for its wire type: {e}") from None

    @classmethod
    def decode(cls, cur: Cursor, rank: int, depth: int = 0) -> BlockPaged:
        # One unpack for the whole payload: this decoder sits on every tensor's hot path.
        base = cur.pos
        raw = cur.take(_BP_RAW.size, "layout")
        page_size, num_pages, paged_axis, num_seqs, role, layer, itype, rsv = _BP_RAW.unpack(raw)
        cur.block(base, _BP_OFFSETS)
        if role not in KV_ROLES:
            raise LayoutError.at("layout.kv_role", base + 20, role,
                                 "kv_role MUST be 0x00 key, 0x01 value or 0x02 fused")
        if itype not in INDEX_TYPES:
            raise LayoutError.at("layout.block_table_index_type", base + 25, itype,
                                 "block_table_index_type MUST be 0x00 uint32 or 0x01 uint64")
        if any(rsv):
            i = next(k for k, b in enumerate(rsv) if b)
            raise LayoutError.at(f"layout._reserved[{i}]", base + 26 + i, rsv[i],
                                 "reserved bytes MUST be 0")
        return cls(page_size, num_pages, num_seqs, role, None if layer == NO_LAYER else layer,
                   itype, paged_axis)


_BP_RAW = struct.Struct("<IQIIBIB6s")
_BP_OFFSETS = tuple((f"layout.{name}", rel) for name, rel in (
    ("page_size", 0), ("num_pages", 4), ("paged_axis", 12), ("num_seqs", 16), ("kv_role", 20),
    ("layer_index", 21), ("block_table_index_type", 25), ("_reserved", 26)))


@dataclass(frozen=True)
class Composite:
    rule: int
    member_count: int
    combine_op: int = 0
    TAG: ClassVar[int] = 0x0B

    def encode(self, rank: int) -> bytes:
        return _pack("BB2xI", self.rule, self.combine_op, self.member_count)

    @classmethod
    def decode(cls, cur: Cursor, rank: int, depth: int = 0) -> Composite:
        rule = cur.u8("layout.composition_rule")
        if rule not in COMPOSITE_RULES and not 0xF0 <= rule <= 0xFE:
            raise LayoutError.at("layout.composition_rule", cur.at("layout.composition_rule"),
                                 rule, "composition_rule MUST be 0x01-0x03 or private 0xF0-0xFE")
        op = cur.u8("layout.combine_op")
        ok = op in (1, 2) if rule == 2 else (op == 0 if rule in (1, 3) else True)
        if not ok:
            want = "0x01 or 0x02 for overlay" if rule == 2 else "0x00 for partition and group"
            raise LayoutError.at("layout.combine_op", cur.at("layout.combine_op"), op,
                                 f"combine_op MUST be {want}")
        cur.zeros(2, "layout._reserved", LayoutError)
        count = cur.u32("layout.member_count")
        if count == 0xFFFFFFFF:
            raise LayoutError.at("layout.member_count", cur.at("layout.member_count"), count,
                                 "member_count 0xFFFFFFFF (open composite) is reserved")
        return cls(rule, count, op)


@dataclass(frozen=True)
class Hilbert:
    order: int
    hilbert_rank: int
    TAG: ClassVar[int] = 0x40

    def encode(self, rank: int) -> bytes:
        return _pack("II", self.order, self.hilbert_rank)

    @classmethod
    def decode(cls, cur: Cursor, rank: int, depth: int = 0) -> Hilbert:
        order = cur.u32("layout.hilbert_order")
        if order == 0:
            raise LayoutError.at("layout.hilbert_order", cur.at("layout.hilbert_order"), order,
                                 "hilbert_order MUST be > 0")
        hr = cur.u32("layout.hilbert_rank")
        if hr != rank or hr < 2:
            raise LayoutError.at("layout.hilbert_rank", cur.at("layout.hilbert_rank"), hr,
                                 f"hilbert_rank MUST equal rank ({rank}) and be >= 2")
        return cls(order, hr)


@dataclass(frozen=True)
class PrivateLayout:
    tag: int
    extension_layout_id: int
    data: bytes = b""

    @property
    def TAG(self) -> int:
        return self.tag

    def encode(self, rank: int) -> bytes:
        return _pack("QI", self.extension_layout_id, len(self.data)) + bytes(self.data)

    @classmethod
    def decode_tagged(cls, tag: int, cur: Cursor) -> PrivateLayout:
        ident = cur.u64("layout.extension_layout_id")
        n = cur.u32("layout.extension_data_length")
        data = bytes(cur.take(n, "layout.extension_data"))
        cur.relax(LayoutError.at(
            "layout.extension_layout_id", cur.at("layout.extension_layout_id"), ident,
            "hurraykv recognises no private layout id; rejected unless reading permissively"))
        return cls(tag, ident, data)


Layout = (RowMajor | ColMajor | Strided | Tiled | Morton | Coo | Csr | Csc | Csf | BlockPaged
          | Composite | Hilbert | PrivateLayout)

_BY_TAG: dict[int, type] = {c.TAG: c for c in (
    RowMajor, ColMajor, Strided, Tiled, Morton, Coo, Csr, Csc, Csf, BlockPaged, Composite,
    Hilbert)}


def decode_layout(tag: int, cur: Cursor, rank: int) -> Layout:
    if 0xF0 <= tag <= 0xFE:
        return PrivateLayout.decode_tagged(tag, cur)
    return _BY_TAG[tag].decode(cur, rank)
