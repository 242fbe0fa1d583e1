"""Descriptor-level rules of the block-paged layout (tag 0x0A, block-paged.md).

Buffers: 0 ``page_pool`` (num_pages*page_size*num_heads*head_dim elements),
1 ``block_table`` and 2 ``seq_ptr`` (uint32 or uint64 per block_table_index_type;
``seq_ptr[num_seqs]`` and ``num_seqs + 1`` entries), then quantization parameter
buffers from index 3, present only with HAS_QUANTIZATION.

This module checks everything that can be known from the descriptor alone (the
rows of the reject checklist in docs/spec/wire-notes.md §9 that need no buffer contents).  The
index invariants that need ``seq_ptr``/``block_table`` contents live with the data,
in ``hurraykv.paged``.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..errors import BufferError, LayoutError, QuantizationError, UnsupportedError
from .cursor import Cursor
from .layouts import BlockPaged
from .quant_registry import SCALE_WIDTHS
from .quantization import RawQuantization, check_in_context, check_param_sizes


class TensorDescriptor(Protocol):
    """What these rules read of a decoded descriptor (``descriptor.TensorDescriptor``,
    which calls them: typed here by its fields so this module imports nothing above)."""

    rank: int
    shape: tuple[int, ...]
    flags: int
    byte_offset: int
    layout: Any
    buffers: tuple[Any, ...]
    quantization: Any
    composite_member: Any
    shard: Any
    element_type: Any
    extension_type: Any
    element_type_name: str

DYNAMIC = 0xFFFFFFFFFFFFFFFF
U32_MAX = 0xFFFFFFFF
SCALE_WIDTH = SCALE_WIDTHS  # bytes per scale_type; use a scheme's ``scale_width``


def pool_nbytes(d: TensorDescriptor, elements: int) -> int | None:
    """Bytes of ``elements`` pool elements, or None when the type cannot be sized."""
    et = d.element_type
    if et is not None:
        return et.nbytes(elements)
    if d.extension_type is not None:
        return d.extension_type.nbytes(elements)
    return None


def check_descriptor(d: TensorDescriptor, cur: Cursor) -> None:
    """Every rule of the block-paged layout the descriptor alone decides (the index
    invariants on buffer contents are ``paged.BlockPagedTensor``'s)."""
    L: BlockPaged = d.layout
    table = cur.at("buffer_count") or 0

    def handle_off(i: int) -> int:
        return table + 1 + 16 * i

    _check_sections(d, cur)
    _check_geometry(d, cur, L)
    _check_pool(d, cur, L, table, handle_off)
    logical_pages = _check_index_buffers(d, cur, L, handle_off)
    total = d.shape[0]
    if total > logical_pages * L.page_size:
        raise LayoutError.at(
            "shape[0]", 20, total,
            f"total_tokens MUST NOT exceed the capacity of the block table's pages "
            f"({logical_pages} pages * page_size {L.page_size} = "
            f"{logical_pages * L.page_size} tokens)")
    if d.quantization is not None:
        _check_quantization(d, cur, L, handle_off)


def _check_sections(d: TensorDescriptor, cur: Cursor) -> None:
    """Rank 3, and none of the sections a block-paged tensor cannot have."""
    if d.rank != 3:
        raise LayoutError.at("rank", 16, d.rank, "a block-paged tensor MUST have rank 3")
    if d.composite_member is not None:
        raise LayoutError.at("flags", 10, d.flags,
                             "HAS_COMPOSITE_MEMBER: a block-paged tensor can only be a group "
                             "member, and group members MUST NOT carry that section")
    if d.shard is not None:
        raise LayoutError.at("flags", 10, d.flags,
                             "HAS_SHARD: a shard descriptor MUST NOT be applied to a "
                             "block-paged tensor")
    if d.byte_offset != 0:
        raise LayoutError.at("byte_offset", cur.at("byte_offset"), d.byte_offset,
                             "byte_offset MUST be 0 for block-paged")


def _check_geometry(d: TensorDescriptor, cur: Cursor, L: BlockPaged) -> None:
    """page_size, paged_axis and the shape's sizes."""
    if L.page_size == 0:
        raise LayoutError.at("layout.page_size", cur.at("layout.page_size"), 0,
                             "page_size MUST be >= 1")
    if L.paged_axis != 0:
        cur.relax(LayoutError.at("layout.paged_axis", cur.at("layout.paged_axis"),
                                 L.paged_axis, "paged_axis MUST be 0 (invariant 6)"))
    for axis, name in ((1, "num_heads"), (2, "head_dim"), (0, "total_tokens")):
        if d.shape[axis] == DYNAMIC:
            raise LayoutError.at(f"shape[{axis}]", 20 + 8 * axis, DYNAMIC,
                                 f"{name} MUST NOT be the dynamic sentinel: the pool and "
                                 "sequences cannot be sized from it")


def _check_pool(d: TensorDescriptor, cur: Cursor, L: BlockPaged, table: int,
                handle_off: Any) -> None:
    """The buffer count and the page pool's size (invariant 4, byte-aligned pages)."""
    nbuf = len(d.buffers)
    if nbuf < 3:
        raise BufferError.at("buffer_count", table, nbuf,
                             "a block-paged tensor MUST have buffers 0-2 (page_pool, "
                             "block_table, seq_ptr)")
    if nbuf > 3 and d.quantization is None:
        raise BufferError.at("buffer_count", table, nbuf,
                             "buffers 3 and up exist only with HAS_QUANTIZATION")
    _, heads, dim = d.shape
    page_elems = L.page_size * heads * dim
    et = d.element_type
    if et is not None and et.sub_byte and not et.whole_bytes(page_elems):
        raise UnsupportedError.at(
            "layout.page_size", cur.at("layout.page_size"), L.page_size,
            f"unsupported: a {et.name} page of {page_elems} elements does not end on a byte "
            "boundary; hurraykv needs byte-aligned pages (decision D11)")
    want = pool_nbytes(d, L.num_pages * page_elems)
    if want is not None and d.buffers[0].byte_size != want:
        raise BufferError.at(
            "buffers[0].byte_size", handle_off(0), d.buffers[0].byte_size,
            f"page_pool MUST hold num_pages*page_size*num_heads*head_dim = "
            f"{L.num_pages}*{L.page_size}*{heads}*{dim} {d.element_type_name} elements "
            f"= {want} bytes (invariant 4)")


def _check_index_buffers(d: TensorDescriptor, cur: Cursor, L: BlockPaged,
                         handle_off: Any) -> int:
    """block_table and seq_ptr sizes and their index type; returns the block table's
    entry count (the logical pages)."""
    w = L.index_width
    bt, sp = d.buffers[1].byte_size, d.buffers[2].byte_size
    for i, size, name in ((1, bt, "block_table"), (2, sp, "seq_ptr")):
        if size % w:
            raise BufferError.at(f"buffers[{i}].byte_size", handle_off(i), size,
                                 f"{name} holds {L.index_type_name} entries, so its size MUST "
                                 f"be a multiple of {w}")
    if sp != (L.num_seqs + 1) * w:
        cur.relax(BufferError.at(
            "buffers[2].byte_size", handle_off(2), sp,
            f"seq_ptr MUST hold num_seqs + 1 = {L.num_seqs + 1} {L.index_type_name} entries "
            f"= {(L.num_seqs + 1) * w} bytes"))
    if L.num_seqs == 0 and bt != 0:
        cur.relax(BufferError.at("buffers[1].byte_size", handle_off(1), bt,
                                 "an empty batch (num_seqs 0) has an empty block_table "
                                 "(invariant 1)"))
    logical_pages = bt // w
    field = "layout.block_table_index_type"
    if L.index_type == 0 and L.num_pages > U32_MAX:
        raise LayoutError.at(field, cur.at(field), 0,
                             f"num_pages {L.num_pages} exceeds what uint32 page IDs address; "
                             "larger pools MUST use uint64 (0x01)")
    if L.index_type == 0 and logical_pages > U32_MAX:
        raise LayoutError.at(field, cur.at(field), 0,
                             f"the block table has {logical_pages} entries, more than "
                             "uint32 seq_ptr offsets address; it MUST use uint64 (0x01)")
    return logical_pages


def _check_quantization(d: TensorDescriptor, cur: Cursor, L: BlockPaged, handle_off) -> None:
    q = d.quantization
    at = cur.at
    if isinstance(q, RawQuantization):
        return  # unknown scheme, already relaxed by the decoder
    if not q.BLOCK_PAGED:
        cur.relax(QuantizationError.at(
            "q.scheme_tag", at("q.scheme_tag"), q.TAG,
            f"{q.NAME} has no composition rule with block-paged; rejected in "
            "strict mode (decision D3)"))
        return
    params = q.buffers
    for i in params:
        if i < 3:
            field = ("q.scale_buffer_index" if i == q.scale_buffer  # type: ignore[attr-defined]
                     else "q.zero_point_buffer_index")
            raise QuantizationError.at(
                field, at(field), i,
                "block-paged quantization parameters MUST live at buffer index >= 3 "
                "(0-2 are page_pool, block_table, seq_ptr)")
    q.check_block_paged(L.page_size, cur)
    check_in_context(q, d, cur, paged=True)
    expected = sorted(set(params))
    present = list(range(3, len(d.buffers)))
    if expected != present:
        raise BufferError.at(
            "buffer_count", at("buffer_count"), len(d.buffers),
            f"buffers 3 and up MUST be exactly the parameter buffers the "
            f"{q.NAME} section names ({expected or 'none'})")
    if q.per_slot:
        slots = L.num_pages * L.page_size
        check_param_sizes(q, d.buffers, slots, q.scale_width, cur)

__all__ = ["check_descriptor", "pool_nbytes"]
