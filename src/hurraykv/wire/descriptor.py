"""The Hurray tensor descriptor: ``decode_descriptor(bytes)`` and ``TensorDescriptor.encode()``.

Wire order (metadata.md; every integer little-endian, nothing padded)::

    0  magic "HRRY" | 4 version_major u8 (1) | 5 version_minor u8 (0)
    6  descriptor_length u32 (whole descriptor, header included, >= 20)
    10 flags u32: bit0 HAS_QUANTIZATION, bit1 HAS_SHARD, bit2 HAS_EXTENSION_TYPE
       (iff type_tag is 0xF0-0xFE), bit3 HAS_STATISTICS, bit4 HAS_COMPOSITE_MEMBER;
       bits 5-31 reserved
    14 type_tag u8 | 15 layout_tag u8 | 16 rank u32 (<= 64)
    20 shape u64[rank] (0xFFFF_FFFF_FFFF_FFFF = dynamic) | byte_offset u64
       layout payload (see layouts.py)
       buffer_count u8 | buffer handles, 16 bytes each (see buffers.py)
       [u32 quantization_length | payload]   if bit0
       [shard, 16*rank bytes]                if bit1
       [statistics, 72 bytes]                if bit3  (before the extension type!)
       [extension type, 20 bytes]            if bit2
       [composite member, 16 bytes]          if bit4

The decoder never reads past ``descriptor_length`` or the input.  With
``version_minor == 0`` the fields must fill ``descriptor_length`` exactly; a newer
minor may append bytes, which are kept verbatim (``trailing``) and not interpreted.

``strict=False`` (permissive) lets through exactly what the spec lets a permissive
reader skip - unknown type tags, unknown or private quantization schemes, private
layout ids, and the block-paged index invariants (1)-(3), (6) - and records each
skipped rule in ``relaxed``.  A descriptor with relaxed rules refuses data access.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field, replace

from ..errors import DescriptorError, ElementTypeError, HurrayBufferError, HurrayError, LayoutError
from . import block_paged as _bp
from .buffers import HANDLE, BufferHandle, check_colocation, check_handle
from .cursor import Cursor
from .dtypes import ELEMENT_TYPES, ElementType, check_type_tag, tag_class
from .layouts import BlockPaged, Composite, Layout, RowMajor, check_layout_tag, decode_layout
from .quant_registry import on_registry_change
from .quantization import Quantization, check_in_context, decode_quantization
from .sections import CompositeMember, ExtensionType, Shard, Statistics

MAGIC = b"HRRY"
HEADER = struct.Struct("<4sBBIIBBI")
assert HEADER.size == 20
MAX_RANK = 64
SUPPORTED_MAJOR = 1
DYNAMIC = 0xFFFFFFFFFFFFFFFF

HAS_QUANTIZATION = 1 << 0
HAS_SHARD = 1 << 1
HAS_EXTENSION_TYPE = 1 << 2
HAS_STATISTICS = 1 << 3
HAS_COMPOSITE_MEMBER = 1 << 4
KNOWN_FLAGS = 0x1F


@dataclass(frozen=True)
class TensorDescriptor:
    type_tag: int
    shape: tuple[int, ...]
    layout: Layout
    buffers: tuple[BufferHandle, ...] = ()
    byte_offset: int = 0
    quantization: Quantization | None = None
    shard: Shard | None = None
    statistics: Statistics | None = None
    extension_type: ExtensionType | None = None
    composite_member: CompositeMember | None = None
    version_major: int = 1
    version_minor: int = 0
    trailing: bytes = b""
    #: Rules a permissive decode skipped; non-empty means: do not touch the data.
    relaxed: tuple[str, ...] = field(default=(), compare=False)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def layout_tag(self) -> int:
        return self.layout.TAG

    @property
    def flags(self) -> int:
        return ((HAS_QUANTIZATION if self.quantization is not None else 0)
                | (HAS_SHARD if self.shard is not None else 0)
                | (HAS_EXTENSION_TYPE if self.extension_type is not None else 0)
                | (HAS_STATISTICS if self.statistics is not None else 0)
                | (HAS_COMPOSITE_MEMBER if self.composite_member is not None else 0))

    @property
    def element_type(self) -> ElementType | None:
        return ELEMENT_TYPES.get(self.type_tag)

    @property
    def element_type_name(self) -> str:
        et = self.element_type
        if et is not None:
            return et.name
        return f"extension_0x{self.type_tag:02x}" if tag_class(self.type_tag) == "extension" \
            else f"unknown_0x{self.type_tag:02x}"

    @property
    def is_block_paged(self) -> bool:
        return isinstance(self.layout, BlockPaged)

    def encode(self) -> bytes:
        """The descriptor's bytes; ``decode_descriptor(d.encode()) == d``."""
        rank = self.rank
        try:
            parts = [struct.pack(f"<{rank}QQ", *self.shape, self.byte_offset),
                     self.layout.encode(rank),
                     struct.pack("<B", len(self.buffers))]
            parts += [h.encode() for h in self.buffers]
            if self.quantization is not None:
                q = self.quantization.encode()
                parts += [struct.pack("<I", len(q)), q]
            if self.shard is not None:
                parts.append(self.shard.encode(rank))
            if self.statistics is not None:
                parts.append(self.statistics.encode())
            if self.extension_type is not None:
                parts.append(self.extension_type.encode())
            if self.composite_member is not None:
                parts.append(self.composite_member.encode())
            parts.append(self.trailing)
            body = b"".join(parts)
            head = HEADER.pack(MAGIC, self.version_major, self.version_minor,
                               HEADER.size + len(body), self.flags, self.type_tag,
                               self.layout_tag, rank)
        except struct.error as e:
            raise DescriptorError(f"descriptor field out of range for its wire type: {e}") \
                from None
        return head + body

    def validate(self) -> TensorDescriptor:
        """Check every strict rule, with byte offsets as a decoder reports them."""
        return decode_descriptor(self.encode())

    def permissively_decoded_check(self) -> None:
        if self.relaxed:
            from ..errors import PermissiveAccessError

            raise PermissiveAccessError(
                "this descriptor was decoded permissively and relaxed "
                f"{len(self.relaxed)} rule(s), so its data must not be touched: "
                + "; ".join(self.relaxed),
                rule="a permissive reader MUST NOT dereference data buffers")


def _view(data: bytes | bytearray | memoryview) -> memoryview:
    try:
        mv = memoryview(data)
    except TypeError:
        raise DescriptorError(
            f"descriptor data must be bytes-like, got {type(data).__name__}") from None
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def peek_length(prefix: bytes | memoryview) -> int:
    """``descriptor_length`` from the first 10 bytes, after checking the magic."""
    mv = _view(prefix)
    if len(mv) < 10:
        raise DescriptorError.at("descriptor_length", 6, f"{len(mv)} bytes",
                                 "10 bytes are needed to find the descriptor length")
    if bytes(mv[:4]) != MAGIC:
        raise DescriptorError.at("magic", 0, bytes(mv[:4]), "magic MUST be b'HRRY'")
    return int.from_bytes(mv[6:10], "little")


CACHED_BYTES = 4096  # descriptors up to this size are remembered once decoded


def decode_descriptor(data: bytes | bytearray | memoryview, *, strict: bool = True
                      ) -> TensorDescriptor:
    """Decode one descriptor from the start of ``data`` (extra bytes after it are ignored).

    Descriptors are immutable values, and a store or a file holds many identical ones (every
    layer, every chunk of one geometry), so the outcome of each distinct byte string up to
    4 KiB is kept (LRU) and the rules run once per distinct descriptor."""
    mv = _view(data)
    if len(mv) >= 10 and bytes(mv[:4]) == MAGIC:
        length = int.from_bytes(mv[6:10], "little")
        if 20 <= length <= min(CACHED_BYTES, len(mv)):
            return _decode_cached(bytes(mv[:length]), strict)
    return _decode(mv, strict)


@functools.lru_cache(maxsize=2048)
def _decode_cached(raw: bytes, strict: bool) -> TensorDescriptor:
    return _decode(memoryview(raw), strict)


on_registry_change(_decode_cached.cache_clear)  # a (un)registered scheme changes verdicts


def _decode(mv: memoryview, strict: bool) -> TensorDescriptor:
    if len(mv) < HEADER.size:
        if len(mv) >= 4 and bytes(mv[:4]) != MAGIC:
            raise DescriptorError.at("magic", 0, bytes(mv[:4]), "magic MUST be b'HRRY'")
        raise DescriptorError.at("header", 0, f"{len(mv)} bytes",
                                 "a descriptor starts with a 20-byte fixed header")
    magic, major, minor, length, flags, type_tag, layout_tag, rank = HEADER.unpack(mv[:20])
    if magic != MAGIC:
        raise DescriptorError.at("magic", 0, magic, "magic MUST be b'HRRY'")
    if major != SUPPORTED_MAJOR:
        raise DescriptorError.at("version_major", 4, major,
                                 f"this reader supports major version {SUPPORTED_MAJOR} only")
    if length < HEADER.size:
        raise DescriptorError.at("descriptor_length", 6, length,
                                 "descriptor_length MUST be >= 20")
    if length > len(mv):
        raise DescriptorError.at("descriptor_length", 6, length,
                                 f"only {len(mv)} bytes are available; the descriptor is "
                                 "truncated")
    if flags & ~KNOWN_FLAGS:
        raise DescriptorError.at("flags", 10, flags, "flag bits 5-31 are reserved and MUST be 0")
    cur = Cursor(mv, HEADER.size, length, strict=strict)
    if strict:
        check_type_tag(type_tag, 14)
    else:
        _permissive_type(type_tag, cur)
    if bool(flags & HAS_EXTENSION_TYPE) != (tag_class(type_tag) == "extension"):
        raise DescriptorError.at("flags", 10, flags,
                                 "HAS_EXTENSION_TYPE MUST be set if and only if type_tag is "
                                 f"0xF0-0xFE (type_tag is 0x{type_tag:02x})")
    check_layout_tag(layout_tag, 15)
    if rank > MAX_RANK:
        raise DescriptorError.at("rank", 16, rank, f"rank MUST be <= {MAX_RANK}")
    shape = cur.array("u64", rank, "shape")
    byte_offset = cur.u64("byte_offset")
    layout = decode_layout(layout_tag, cur, rank)
    count = cur.u8("buffer_count")
    table = cur.pos
    raw = cur.take(16 * count, "buffers")
    handles = tuple(map(BufferHandle._make, HANDLE.iter_unpack(raw)))
    for i, h in enumerate(handles):
        check_handle(h, i, table + 16 * i)
    quant = shard = stats = ext = member = None
    if flags & HAS_QUANTIZATION:
        qlen = cur.u32("quantization_length")
        quant = decode_quantization(cur, qlen)
    if flags & HAS_SHARD:
        shard = Shard.decode(cur, shape)
    if flags & HAS_STATISTICS:
        stats = Statistics.decode(cur)
    if flags & HAS_EXTENSION_TYPE:
        ext = ExtensionType.decode(cur)
    if flags & HAS_COMPOSITE_MEMBER:
        member = CompositeMember.decode(cur)
    trailing = b""
    if cur.pos != length:
        if minor == 0:
            raise DescriptorError.at(
                "descriptor_length", 6, length,
                f"the fields end at byte {cur.pos}; with version_minor 0 they MUST fill "
                "descriptor_length exactly")
        trailing = bytes(cur.take(length - cur.pos, "trailing"))
    desc = TensorDescriptor(type_tag, shape, layout, handles, byte_offset, quant, shard, stats,
                            ext, member, major, minor, trailing)
    _check(desc, cur)
    return replace(desc, relaxed=tuple(cur.relaxed)) if cur.relaxed else desc


def _permissive_type(tag: int, cur: Cursor) -> None:
    try:
        check_type_tag(tag, 14, strict=True)
    except ElementTypeError as e:
        check_type_tag(tag, 14, strict=False)  # reserved/invalid still raise
        cur.relax(e)


def _check(d: TensorDescriptor, cur: Cursor) -> None:
    """Rules that span fields, after every byte has been read."""
    table = cur.at("buffer_count") or 0
    check_colocation(d.buffers, table)
    layout = d.layout
    if d.rank == 0 and not isinstance(layout, RowMajor):
        raise LayoutError.at("layout_tag", 15, d.layout_tag,
                             "a scalar (rank 0) tensor MUST be row-major")
    if isinstance(layout, Composite):
        if d.buffers:
            raise HurrayBufferError.at("buffer_count", table, len(d.buffers),
                                 "a composite head MUST have buffer_count 0")
        if d.byte_offset:
            raise LayoutError.at("byte_offset", cur.at("byte_offset"), d.byte_offset,
                                 "a composite head MUST have byte_offset 0")
        if d.quantization is not None or d.composite_member is not None:
            raise DescriptorError.at("flags", 10, d.flags,
                                     "a composite head carries no quantization and no "
                                     "composite member section")
        return
    if not d.buffers:
        raise HurrayBufferError.at("buffer_count", table, 0,
                             "a tensor that is not a composite head needs >= 1 buffer")
    if isinstance(layout, BlockPaged):
        _bp.check_descriptor(d, cur)
        return
    if d.byte_offset > d.buffers[0].byte_size:
        raise LayoutError.at("byte_offset", cur.at("byte_offset"), d.byte_offset,
                             f"byte_offset MUST be <= buffer 0's byte_size "
                             f"({d.buffers[0].byte_size})")
    if d.quantization is not None:
        check_in_context(d.quantization, d, cur, paged=False)


__all__ = ["DYNAMIC", "HurrayError", "TensorDescriptor", "decode_descriptor", "peek_length"]
