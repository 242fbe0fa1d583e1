"""The .hrry file's layout and its rules (file-format.md; decision D9): the header,
index and trailer structures, and the checks every reader runs on them.

Layout::

    header (64) | pad | tensors | KV metadata (8-aligned) | index (8-aligned) | trailer (40)

* header: ``"HRRYFILE" | major 1 | minor 0 | rsv[2] | file_flags u32 (bit0 HAS_KV_METADATA,
  bit1 SORTED_INDEX, bit2 HAS_INDEX_CRC32C) | data_buffer_alignment u32 (power of two in
  [4096, 2 MiB]) | first_descriptor_offset u64 (>= 64, 8-aligned) | tensor_count_hint u64
  (0xFFFF... unknown) | rsv[28]``
* each tensor: descriptor at an 8-aligned offset; every buffer at a multiple of
  data_buffer_alignment (zero padding before, between and after buffers); then zero
  padding to 8.  A composite head (no buffers) gets no alignment padding.
* index: ``u64 count``, entries ``u16 name_len | name | u64 descriptor_offset |
  u32 descriptor_length | u64 data_offset | u64 data_length | u32 flags (0)``, where
  data_length covers the buffers and the padding *between* them.
* trailer: ``index_offset u64 | index_length u64 | kv_offset u64 | kv_length u32 |
  index_crc32c u32 | rsv[4] | "HRRY"``.

Readers locate everything through the trailer and index, never by walking the file, so
files of the reference writer (which pads differently and never sets HAS_KV_METADATA)
read as well.  ``parse_header``, ``parse_tail`` (trailer, KV section, index) and
``check_entries`` hold every offset and length against the file size, the other regions
and the tensor's own descriptor before a byte of tensor data is mapped; the random-access
and the sequential reader (``hrry.py``) share them, so both enforce the same rules.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ContainerError, HurrayError
from ..wire.descriptor import TensorDescriptor, decode_descriptor
from .crc32c import crc32c
from .kvmeta import decode_kv

MAGIC = b"HRRYFILE"
TRAILER_MAGIC = b"HRRY"
HEADER = struct.Struct("<8sBB2sIIQQ28s")
TRAILER = struct.Struct("<QQQII4s4s")
ENTRY = struct.Struct("<QIQQI")
assert HEADER.size == 64 and TRAILER.size == 40 and ENTRY.size == 32
HAS_KV_METADATA, SORTED_INDEX, HAS_INDEX_CRC32C = 1, 2, 4
UNKNOWN_COUNT = 0xFFFFFFFFFFFFFFFF
DEFAULT_ALIGNMENT = 4096
MAX_ALIGNMENT = 2 << 20


def round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def bad(msg: str, field: str, offset: int | None = None, value: Any = None,
         rule: str = "") -> ContainerError:
    return ContainerError(msg, field=field, offset=offset, value=value, rule=rule or None)


def data_span(desc: TensorDescriptor, alignment: int) -> int:
    """Bytes from a tensor's first buffer to the end of its last (padding between)."""
    sizes = [h.byte_size for h in desc.buffers]
    if not sizes:
        return 0
    return sum(round_up(s, alignment) for s in sizes[:-1]) + sizes[-1]


@dataclass(frozen=True)
class IndexEntry:
    name: str
    descriptor_offset: int
    descriptor_length: int
    data_offset: int
    data_length: int



def check_entries(entries: list[IndexEntry], read: Callable[[int, int], bytes], first: int,
                  region_end: int, alignment: int) -> dict[str, TensorDescriptor]:
    """Every index entry against the tensor region and its own descriptor (decoded here):
    8-aligned descriptors inside the region, index descriptor_length = the descriptor's,
    data aligned after it spanning exactly its buffers, no overlaps.  Both readers use it."""
    descs = {e.name: _check_tensor(e, read, first, region_end, alignment) for e in entries}
    prev_end, prev = 0, None
    for e in sorted(entries, key=lambda e: e.descriptor_offset):
        if e.descriptor_offset < prev_end:
            raise bad(f"tensor {e.name!r} at {e.descriptor_offset} overlaps tensor "
                       f"{prev!r}, which ends at {prev_end}", "descriptor_offset",
                       e.descriptor_offset, e.name, "tensor regions do not overlap")
        end = e.descriptor_offset + e.descriptor_length
        if descs[e.name].buffers:
            end = max(end, e.data_offset + e.data_length)
        prev_end, prev = end, e.name
    return descs


def _check_tensor(e: IndexEntry, read: Callable[[int, int], bytes], first: int,
                  region_end: int, alignment: int) -> TensorDescriptor:
    what = f"tensor {e.name!r}"
    if (e.descriptor_offset < first or e.descriptor_offset % 8 or e.descriptor_length < 20
            or e.descriptor_offset + e.descriptor_length > region_end):
        raise bad(f"{what}: descriptor at {e.descriptor_offset} (+{e.descriptor_length}) "
                   f"is not 8-aligned inside the tensor region [{first}, {region_end})",
                   "descriptor_offset", e.descriptor_offset, e.name)
    raw = read(e.descriptor_offset, e.descriptor_length)
    try:
        desc = decode_descriptor(raw)
    except HurrayError as err:
        raise type(err)(f"{what} (descriptor at file offset {e.descriptor_offset}): {err}",
                        field=err.field, offset=err.offset, value=err.value,
                        rule=err.rule) from None
    own = int.from_bytes(raw[6:10], "little")  # the decoder checked it is exact
    if own != e.descriptor_length:
        raise bad(f"{what}: the index says descriptor_length {e.descriptor_length}, the "
                   f"descriptor says {own}", "descriptor_length", e.descriptor_offset, own)
    span = data_span(desc, alignment)
    if desc.buffers:
        if (e.data_offset % alignment or e.data_length != span
                or e.data_offset < e.descriptor_offset + e.descriptor_length
                or e.data_offset + e.data_length > region_end):
            raise bad(f"{what}: data at {e.data_offset} (+{e.data_length}) must start "
                       f"{alignment}-aligned after its descriptor, span exactly "
                       f"{span} bytes and end by {region_end}", "data_offset",
                       e.descriptor_offset, e.data_offset)
    elif e.data_length or e.data_offset > region_end:
        raise bad(f"{what} has no buffers but data_length {e.data_length}", "data_length",
                   e.descriptor_offset, e.data_length)
    return desc


def parse_index(index: bytes, base: int, flags: int) -> list[IndexEntry]:
    """Index entries (validated: sizes, UTF-8, unique names, flags, sort order)."""
    (count,) = struct.unpack_from("<Q", index)
    if count > (len(index) - 8) // (2 + 1 + ENTRY.size):
        raise bad(f"index_entry_count at byte {base}: {count} entries cannot fit in "
                   f"{len(index)} bytes", "index_entry_count", base, count)
    pos, entries, names = 8, [], set()
    for k in range(count):
        if pos + 2 > len(index):
            raise bad(f"index entry {k} at byte {base + pos} is truncated", "index",
                       base + pos, k)
        (n,) = struct.unpack_from("<H", index, pos)
        if n == 0 or pos + 2 + n + ENTRY.size > len(index):
            raise bad(f"index entry {k} at byte {base + pos}: name_length {n} is 0 or "
                       "runs past the index", "name_length", base + pos, n)
        try:
            name = index[pos + 2:pos + 2 + n].decode("utf-8")
        except UnicodeDecodeError:
            raise bad(f"index entry {k} at byte {base + pos + 2}: name is not UTF-8",
                       "name", base + pos + 2) from None
        if name in names:
            raise bad(f"index entry {k} at byte {base + pos}: name {name!r} appears twice",
                       "name", base + pos, name, "names are unique")
        names.add(name)
        d_off, d_len, data_off, data_len, eflags = ENTRY.unpack_from(index, pos + 2 + n)
        if eflags:
            raise bad(f"index entry {name!r} at byte {base + pos}: flags 0x{eflags:x}; "
                       "MUST be 0", "flags", base + pos + 2 + n + 28, eflags)
        entries.append(IndexEntry(name, d_off, d_len, data_off, data_len))
        pos += 2 + n + ENTRY.size
    if pos != len(index):
        raise bad(f"the index has {len(index) - pos} bytes after its {count} entries",
                   "index_length", base + pos, len(index))
    if flags & SORTED_INDEX:
        keys = [e.name.encode("utf-8") for e in entries]
        if keys != sorted(keys):
            raise bad("SORTED_INDEX is set but the index is not sorted by name bytes",
                       "file_flags", 12, flags)
    return entries


def parse_header(raw: bytes, size: int | None) -> tuple[int, int, int, int]:
    """``(file_flags, data_buffer_alignment, first_descriptor_offset, tensor_count_hint)``
    of a 64-byte header, every rule checked (``size``: the file's, when known)."""
    (magic, major, _minor, rsv, flags, align, first, hint, rsv2) = HEADER.unpack(raw)
    if magic != MAGIC:
        raise bad(f"magic at byte 0: found {magic!r}; a .hrry file starts with HRRYFILE",
                   "magic", 0, magic)
    if major != 1:
        raise bad(f"container_version_major at byte 8: found {major}; this reader "
                   "supports 1", "container_version_major", 8, major)
    if any(rsv) or any(rsv2):
        raise bad("header reserved bytes MUST be 0", "header._reserved",
                   10 if any(rsv) else 36)
    if flags & ~7:
        raise bad(f"file_flags at byte 12: found 0x{flags:x}; bits 3-31 are reserved",
                   "file_flags", 12, flags)
    if align & (align - 1) or not DEFAULT_ALIGNMENT <= align <= MAX_ALIGNMENT:
        raise bad(f"data_buffer_alignment at byte 16: found {align}; a power of two in "
                   "[4096, 2097152]", "data_buffer_alignment", 16, align)
    if first < 64 or first % 8 or (size is not None and first > size - TRAILER.size):
        raise bad(f"first_descriptor_offset at byte 20: found {first}; >= 64, 8-aligned "
                   "and inside the file", "first_descriptor_offset", 20, first)
    return flags, align, first, hint


def kv_text_spans(data: memoryview | bytes) -> dict[str, tuple[int, int]]:
    """``(file offset, byte length)`` of the text of each string value in the KV section
    of a file whose bytes ``data`` passed ``parse_tail``: found through the trailer and
    each entry's key."""
    t_off = len(data) - TRAILER.size
    _, _, kv_off, kv_len, *_ = TRAILER.unpack(bytes(data[t_off:]))
    spans: dict[str, tuple[int, int]] = {}
    if kv_len:
        decode_kv(bytes(data[kv_off:kv_off + kv_len]), kv_off, spans)
    return spans


def parse_tail(read: Callable[[int, int], bytes], size: int, first: int, flags: int
               ) -> tuple[int, dict[str, Any], list[IndexEntry]]:
    """Trailer, KV section and index of a file of ``size`` bytes whose bytes ``read(offset,
    n)`` returns: ``(end of the tensor region, KV metadata, index entries)``.  Random-access
    and sequential reading share it, so both enforce the same rules."""
    t_off = size - TRAILER.size
    (index_off, index_len, kv_off, kv_len, crc, rsv3,
     tmagic) = TRAILER.unpack(read(t_off, TRAILER.size))
    if tmagic != TRAILER_MAGIC:
        raise bad(f"trailer_magic at byte {t_off + 36}: found {tmagic!r}; expected b'HRRY' "
                   "(truncated or not a .hrry file)", "trailer_magic", t_off + 36, tmagic)
    if any(rsv3):
        raise bad("trailer reserved bytes MUST be 0", "trailer._reserved", t_off + 32)
    if index_off + index_len > t_off or index_off < first or index_off % 8 or index_len < 8:
        raise bad(f"index_offset {index_off} + index_length {index_len} at byte {t_off}: the "
                   f"index lies 8-aligned between the tensors (from {first}) and the "
                   f"trailer ({t_off})", "index_offset", t_off, index_off)
    region_end = index_off
    kv: dict[str, Any] = {}
    if kv_off or kv_len:
        if (kv_off % 8 or kv_off < first or kv_off + kv_len > index_off
                or not kv_off or not kv_len):
            raise bad(f"kv_offset {kv_off} / kv_length {kv_len} at byte {t_off + 16}: the "
                       f"KV section lies 8-aligned before the index ({index_off})",
                       "kv_offset", t_off + 16, kv_off)
        region_end = kv_off
    elif flags & HAS_KV_METADATA:
        raise bad("HAS_KV_METADATA is set but the trailer locates no KV section",
                   "file_flags", 12, flags)
    index = read(index_off, index_len)
    if flags & HAS_INDEX_CRC32C:
        if crc32c(index) != crc:
            raise bad(f"index_crc32c at byte {t_off + 28}: stored 0x{crc:08x}, the index "
                       f"hashes to 0x{crc32c(index):08x}", "index_crc32c", t_off + 28, crc,
                       "the index MUST match its CRC-32C")
    elif crc:
        raise bad(f"index_crc32c at byte {t_off + 28} is 0x{crc:08x} without "
                   "HAS_INDEX_CRC32C; it MUST be 0", "index_crc32c", t_off + 28, crc)
    if kv_len:
        kv = decode_kv(read(kv_off, kv_len), kv_off)
    return region_end, kv, parse_index(index, index_off, flags)
