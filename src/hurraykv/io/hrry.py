"""The .hrry file container (file-format.md; decision D9), zero-copy through mmap.

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

The writer follows the spec text (padding after a tensor's last buffer, none after a
head, HAS_KV_METADATA when KV exists) and is atomic: a temporary file in the same
directory, fsync, rename, fsync of the directory.  The reader locates everything
through the trailer and index, never by walking the file, so files of the reference
writer (which pads differently and never sets HAS_KV_METADATA) read as well.  Every
offset and length is checked against the file size, the other regions and the tensor's
own descriptor before a byte of tensor data is mapped.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ContainerError, HurrayError
from ..paged import byte_view
from ..threads import run_bands
from ..wire.descriptor import TensorDescriptor, decode_descriptor
from ..wire.layouts import Composite
from .atomic import create_temp, fsync_dir
from .crc32c import crc32c
from .kvmeta import decode_kv, encode_kv
from .sniff import not_expected

STREAM_HINT = (" (read a stream with hk.read_snapshot_stream or SnapshotStreamReader; "
               "`hurraykv inspect` reads both)")

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
_ZEROS = bytes(MAX_ALIGNMENT)

Progress = Callable[[int, int], None]
GATHER = 64 << 10  # pieces below this are written together
RESERVE_FROM = 16 << 20  # files at least this large get their blocks reserved up front


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _bad(msg: str, field: str, offset: int | None = None, value: Any = None,
         rule: str = "") -> ContainerError:
    return ContainerError(msg, field=field, offset=offset, value=value, rule=rule or None)


def data_span(desc: TensorDescriptor, alignment: int) -> int:
    """Bytes from a tensor's first buffer to the end of its last (padding between)."""
    sizes = [h.byte_size for h in desc.buffers]
    if not sizes:
        return 0
    return sum(_align(s, alignment) for s in sizes[:-1]) + sizes[-1]


@dataclass(frozen=True)
class IndexEntry:
    name: str
    descriptor_offset: int
    descriptor_length: int
    data_offset: int
    data_length: int


# --------------------------------------------------------------------------- writing
class HrryWriter:
    """Writes a .hrry file in one forward pass (no seek back) into a temporary file;
    ``finish`` makes it appear atomically at ``path``.  Buffers are written straight from
    the caller's memory; the KV metadata is given up front so the header's flags are final."""

    def __init__(self, path: str | os.PathLike, *, kv: dict[str, Any] | None = None,
                 alignment: int = DEFAULT_ALIGNMENT, tensor_count: int | None = None,
                 progress: Progress | None = None, total_bytes: int = 0,
                 reserve: int = 0, fsync: bool = True) -> None:
        if alignment & (alignment - 1) or not DEFAULT_ALIGNMENT <= alignment <= MAX_ALIGNMENT:
            raise _bad(f"data_buffer_alignment {alignment} is not a power of two in "
                       "[4096, 2 MiB]", "data_buffer_alignment", value=alignment)
        self.path = Path(path)
        self.alignment = alignment
        self.progress = progress
        self.total_bytes = total_bytes
        self.fsync = fsync
        self._kv = encode_kv(kv) if kv else b""  # encoded first: errors before any write
        self.entries: list[IndexEntry] = []
        self._names: set[str] = set()
        fd, self._tmp = create_temp(self.path)  # locked until closed
        self._f = os.fdopen(fd, "wb", buffering=0)
        self._pending = bytearray()
        try:
            self._reserved = reserve >= RESERVE_FROM and hasattr(os, "posix_fallocate")
            if self._reserved:
                # Reserve the blocks up front: the file system allocates once rather than on
                # every write (finish() trims what was not used).
                with contextlib.suppress(OSError):
                    os.posix_fallocate(fd, 0, reserve)
            self.pos = 0
            count = UNKNOWN_COUNT if tensor_count is None else tensor_count
            self.flags = SORTED_INDEX | HAS_INDEX_CRC32C | (HAS_KV_METADATA if self._kv else 0)
            self._write(HEADER.pack(MAGIC, 1, 0, b"\0\0", self.flags, alignment, HEADER.size,
                                    count, bytes(28)))
        except BaseException:
            self.abort()
            raise

    def _write(self, data: bytes | memoryview) -> None:
        """Small pieces (headers, descriptors, padding) gather in one buffer; large buffers
        go straight from the caller's memory, after what gathered before them."""
        mv = memoryview(data).cast("B")
        self.pos += mv.nbytes
        if mv.nbytes < GATHER:
            self._pending += mv
            if len(self._pending) < GATHER:
                return
            mv = memoryview(b"")
        self._flush()
        while mv:
            n = self._f.write(mv)
            mv = mv[n:]

    def _flush(self) -> None:
        pending = memoryview(self._pending)
        while pending:
            n = self._f.write(pending)
            pending = pending[n:]
        del pending
        self._pending = bytearray()

    def _pad_to(self, a: int) -> None:
        n = _align(self.pos, a) - self.pos
        if n:
            self._write(_ZEROS[:n])

    def add(self, name: str, desc: TensorDescriptor, buffers: Sequence[Any]) -> None:
        if not name or len(name.encode("utf-8")) > 0xFFFF or name in self._names:
            raise _bad(f"tensor name {name!r} is empty, too long or already used", "name",
                       value=name, rule="names are unique, 1..65535 UTF-8 bytes")
        if len(buffers) != len(desc.buffers):
            raise _bad(f"{name}: descriptor declares {len(desc.buffers)} buffers, "
                       f"{len(buffers)} given", "buffers", value=len(buffers))
        views = [byte_view(b) for b in buffers]
        for i, (mv, h) in enumerate(zip(views, desc.buffers, strict=True)):
            if mv.nbytes != h.byte_size:
                raise _bad(f"{name}: buffers[{i}] holds {mv.nbytes} bytes, the descriptor "
                           f"declares {h.byte_size}", f"buffers[{i}]", value=mv.nbytes)
        self._names.add(name)
        self._pad_to(8)
        desc_off = self.pos
        raw = desc.encode()
        self._write(raw)
        data_off = self.pos
        if views:
            self._pad_to(self.alignment)
            data_off = self.pos
            for mv in views:
                self._pad_to(self.alignment)
                self._write(mv)
                if self.progress is not None:
                    self.progress(self.pos, self.total_bytes)
            data_end = self.pos
            self._pad_to(self.alignment)
        else:
            data_end = data_off
        self.entries.append(IndexEntry(name, desc_off, len(raw), data_off, data_end - data_off))

    def finish(self) -> Path:
        """KV metadata, index and trailer; then fsync and the atomic rename."""
        kv_off = kv_len = 0
        if self._kv:
            self._pad_to(8)
            kv_off, kv_len = self.pos, len(self._kv)
            self._write(self._kv)
        self._pad_to(8)
        index_off = self.pos
        entries = sorted(self.entries, key=lambda e: e.name.encode("utf-8"))
        parts = [struct.pack("<Q", len(entries))]
        for e in entries:
            raw = e.name.encode("utf-8")
            parts += [struct.pack("<H", len(raw)), raw,
                      ENTRY.pack(e.descriptor_offset, e.descriptor_length, e.data_offset,
                                 e.data_length, 0)]
        index = b"".join(parts)
        self._write(index)
        self._write(TRAILER.pack(index_off, len(index), kv_off, kv_len, crc32c(index),
                                 bytes(4), TRAILER_MAGIC))
        self._flush()
        if self._reserved:
            os.ftruncate(self._f.fileno(), self.pos)  # drop what fallocate reserved past the end
        if self.fsync:
            os.fsync(self._f.fileno())
        os.replace(self._tmp, self.path)  # renamed while still locked, then closed
        self._f.close()
        if self.fsync:
            fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        try:
            self._f.close()
        finally:
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)

    def __enter__(self) -> HrryWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()


def write_hrry(path: str | os.PathLike, tensors: Iterable[tuple[str, TensorDescriptor, Any]],
               kv: dict[str, Any] | None = None, *, alignment: int = DEFAULT_ALIGNMENT,
               progress: Progress | None = None, fsync: bool = True) -> Path:
    """Write named tensors (and KV metadata) to ``path`` atomically; an existing file is
    replaced only once the new one is complete (and, with ``fsync``, on disk)."""
    tensors = list(tensors)
    total = sum(h.byte_size for _, d, _ in tensors for h in d.buffers)
    overhead = sum(512 + len(n) + alignment * (len(d.buffers) + 1) for n, d, _ in tensors)
    w = HrryWriter(path, kv=kv, alignment=alignment, tensor_count=len(tensors),
                   progress=progress, total_bytes=total, reserve=total + overhead + (1 << 16),
                   fsync=fsync)
    try:
        for name, desc, bufs in tensors:
            w.add(name, desc, bufs)
        return w.finish()
    except BaseException:
        w.abort()
        raise


# --------------------------------------------------------------------------- reading
def read_bands(fd: int, view: memoryview, at: int = 0) -> int:
    """Fill ``view`` from byte ``at`` of file ``fd`` with ``preadv``, one band per core
    (page-cache reads take no file lock, so bands copy at once); the bytes read, fewer
    than ``len(view)`` when the file is shorter or shrinks meanwhile."""
    got: list[int] = []

    def band(a: int, b: int) -> None:
        pos = a
        while pos < b:
            n = os.preadv(fd, [view[pos:b]], at + pos)
            if n <= 0:
                break
            pos += n
        got.append(pos - a)

    run_bands(band, len(view), len(view))
    return sum(got)


class HrryFile:
    """A parsed, validated .hrry file; tensor buffers are zero-copy views of an mmap."""

    _held: dict[str, list] | None = None  # buffers already read (the sequential reader)

    def __init__(self, data: Any, size: int, read: Callable[[int, int], bytes],
                 source: str) -> None:
        self.source = source
        self.size = size
        self._read = read
        self._data = data  # mmap or bytes-like, created only after validation
        self._parse()

    @classmethod
    def open(cls, path: str | os.PathLike) -> HrryFile:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            fd = f.fileno()

            def pread(off: int, n: int) -> bytes:
                return os.pread(fd, n, off)

            self = cls.__new__(cls)
            self.source, self.size, self._read, self._data = str(path), size, pread, None
            self._parse()
            self._data = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else b""
        self._read = lambda off, n: bytes(self._view[off:off + n])
        return self

    @classmethod
    def over(cls, fd: int, data: memoryview, source: str) -> HrryFile:
        """File ``fd`` parsed with small reads of its header, index and descriptors only;
        its tensors' buffers are views of ``data`` (the file's size), which the caller
        fills before using them (a reader that reads the bulk its own way)."""
        self = cls.__new__(cls)
        self.source, self.size, self._data = source, len(data), None
        self._read = lambda off, n: os.pread(fd, n, off)
        self._parse()
        self._data = data
        self._read = lambda off, n: bytes(self._view[off:off + n])
        return self

    @classmethod
    def read(cls, path: str | os.PathLike) -> HrryFile:
        """Read the whole file into memory (one buffer, filled with readinto) and parse it;
        tensors are views of that buffer.  For a full load where mmap page faults cost."""
        import numpy as np

        with open(path, "rb", buffering=0) as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            view = memoryview(np.empty(size, np.uint8))
            got = read_bands(fd, view)
        if got != size:  # the file shrank while being read
            raise _bad(f"{path}: read {got} of {size} bytes (the file changed while "
                       "being read)", "file_size", value=got)
        return cls.from_bytes(view, str(path))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, source: str = "<bytes>"
                   ) -> HrryFile:
        mv = memoryview(data).cast("B")
        return cls(mv, len(mv), lambda off, n: bytes(mv[off:off + n]), source)

    @property
    def _view(self) -> memoryview:
        return memoryview(self._data)

    # -- parsing ------------------------------------------------------------------
    def _parse(self) -> None:
        size = self.size
        head = self._read(0, min(size, 64))
        other = not_expected(head, size, "a .hrry file", "a Hurray stream",
                             STREAM_HINT)
        if other is not None:
            raise _bad(f"{self.source}: {other}", "magic", 0, head[:8])
        if size < HEADER.size + TRAILER.size:
            raise _bad(f"{self.source}: {size} bytes cannot hold a 64-byte header and a 40-byte "
                       "trailer", "file_size", value=size)
        flags, align, first, hint = parse_header(head, size)
        region_end, kv, entries = parse_tail(self._read, size, first, flags)
        if hint not in (UNKNOWN_COUNT, len(entries)):  # the sequential reader relies on it
            raise _bad(f"tensor_count_hint at byte 28 is {hint}, the index has "
                       f"{len(entries)} entries", "tensor_count_hint", 28, hint,
                       "tensor_count_hint is 0xFFFFFFFFFFFFFFFF (unknown) or the tensor count")
        self._set(flags, align, first, hint, kv, entries,
                  check_entries(entries, self._read, first, region_end, align))

    def _set(self, flags: int, align: int, first: int, hint: int, kv: dict[str, Any],
             entries: list[IndexEntry], descs: dict[str, TensorDescriptor]) -> None:
        self.flags, self.alignment, self.first_descriptor_offset = flags, align, first
        self.tensor_count_hint = hint
        self.kv = kv
        self._by_name = {e.name: e for e in entries}
        self._descs = descs
        self.entries = sorted(entries, key=lambda e: e.descriptor_offset)

    # -- access -------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Tensor names in file (descriptor-offset) order."""
        return [e.name for e in self.entries]

    def entry(self, name: str) -> IndexEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise _bad(f"{self.source} has no tensor named {name!r}", "name",
                       value=name) from None

    def descriptor(self, name: str) -> TensorDescriptor:
        self.entry(name)
        return self._descs[name]

    def buffers(self, name: str) -> list[memoryview]:
        """Zero-copy views of the tensor's buffers in the mapped file."""
        e, desc = self.entry(name), self.descriptor(name)
        if self._held is not None:
            return list(self._held[name])
        out, off = [], e.data_offset
        view = self._view
        for h in desc.buffers:
            out.append(view[off:off + h.byte_size])
            off = _align(off + h.byte_size, self.alignment)
        return out

    def members(self, name: str) -> list[str]:
        """Names of a composite head's members (pre-order, by descriptor offset)."""
        names = self.names
        start = names.index(self.entry(name).name)
        out, pos = [], start + 1

        def take(depth: int, count: int) -> None:
            nonlocal pos
            if depth > 8:
                raise _bad(f"composite {name!r} nests deeper than 8", "depth", value=depth)
            for _ in range(count):
                if pos >= len(names):
                    raise _bad(f"torn composite {name!r}: the file ends before its "
                               f"{count} members", "member_count", value=count)
                member = names[pos]
                pos += 1
                if depth == 1:
                    out.append(member)
                layout = self._descs[member].layout
                if isinstance(layout, Composite):
                    take(depth + 1, layout.member_count)

        layout = self._descs[name].layout
        if not isinstance(layout, Composite):
            raise _bad(f"{name!r} is not a composite head", "layout_tag", value=name)
        take(1, layout.member_count)
        return out


def check_entries(entries: list[IndexEntry], read: Callable[[int, int], bytes], first: int,
                  region_end: int, alignment: int) -> dict[str, TensorDescriptor]:
    """Every index entry against the tensor region and its own descriptor (decoded here):
    8-aligned descriptors inside the region, index descriptor_length = the descriptor's,
    data aligned after it spanning exactly its buffers, no overlaps.  Both readers use it."""
    descs = {e.name: _check_tensor(e, read, first, region_end, alignment) for e in entries}
    prev_end, prev = 0, None
    for e in sorted(entries, key=lambda e: e.descriptor_offset):
        if e.descriptor_offset < prev_end:
            raise _bad(f"tensor {e.name!r} at {e.descriptor_offset} overlaps tensor "
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
        raise _bad(f"{what}: descriptor at {e.descriptor_offset} (+{e.descriptor_length}) "
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
        raise _bad(f"{what}: the index says descriptor_length {e.descriptor_length}, the "
                   f"descriptor says {own}", "descriptor_length", e.descriptor_offset, own)
    span = data_span(desc, alignment)
    if desc.buffers:
        if (e.data_offset % alignment or e.data_length != span
                or e.data_offset < e.descriptor_offset + e.descriptor_length
                or e.data_offset + e.data_length > region_end):
            raise _bad(f"{what}: data at {e.data_offset} (+{e.data_length}) must start "
                       f"{alignment}-aligned after its descriptor, span exactly "
                       f"{span} bytes and end by {region_end}", "data_offset",
                       e.descriptor_offset, e.data_offset)
    elif e.data_length or e.data_offset > region_end:
        raise _bad(f"{what} has no buffers but data_length {e.data_length}", "data_length",
                   e.descriptor_offset, e.data_length)
    return desc


def parse_index(index: bytes, base: int, flags: int) -> list[IndexEntry]:
    """Index entries (validated: sizes, UTF-8, unique names, flags, sort order)."""
    (count,) = struct.unpack_from("<Q", index)
    if count > (len(index) - 8) // (2 + 1 + ENTRY.size):
        raise _bad(f"index_entry_count at byte {base}: {count} entries cannot fit in "
                   f"{len(index)} bytes", "index_entry_count", base, count)
    pos, entries, names = 8, [], set()
    for k in range(count):
        if pos + 2 > len(index):
            raise _bad(f"index entry {k} at byte {base + pos} is truncated", "index",
                       base + pos, k)
        (n,) = struct.unpack_from("<H", index, pos)
        if n == 0 or pos + 2 + n + ENTRY.size > len(index):
            raise _bad(f"index entry {k} at byte {base + pos}: name_length {n} is 0 or "
                       "runs past the index", "name_length", base + pos, n)
        try:
            name = index[pos + 2:pos + 2 + n].decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(f"index entry {k} at byte {base + pos + 2}: name is not UTF-8",
                       "name", base + pos + 2) from None
        if name in names:
            raise _bad(f"index entry {k} at byte {base + pos}: name {name!r} appears twice",
                       "name", base + pos, name, "names are unique")
        names.add(name)
        d_off, d_len, data_off, data_len, eflags = ENTRY.unpack_from(index, pos + 2 + n)
        if eflags:
            raise _bad(f"index entry {name!r} at byte {base + pos}: flags 0x{eflags:x}; "
                       "MUST be 0", "flags", base + pos + 2 + n + 28, eflags)
        entries.append(IndexEntry(name, d_off, d_len, data_off, data_len))
        pos += 2 + n + ENTRY.size
    if pos != len(index):
        raise _bad(f"the index has {len(index) - pos} bytes after its {count} entries",
                   "index_length", base + pos, len(index))
    if flags & SORTED_INDEX:
        keys = [e.name.encode("utf-8") for e in entries]
        if keys != sorted(keys):
            raise _bad("SORTED_INDEX is set but the index is not sorted by name bytes",
                       "file_flags", 12, flags)
    return entries


def parse_header(raw: bytes, size: int | None) -> tuple[int, int, int, int]:
    """``(file_flags, data_buffer_alignment, first_descriptor_offset, tensor_count_hint)``
    of a 64-byte header, every rule checked (``size``: the file's, when known)."""
    (magic, major, _minor, rsv, flags, align, first, hint, rsv2) = HEADER.unpack(raw)
    if magic != MAGIC:
        raise _bad(f"magic at byte 0: found {magic!r}; a .hrry file starts with HRRYFILE",
                   "magic", 0, magic)
    if major != 1:
        raise _bad(f"container_version_major at byte 8: found {major}; this reader "
                   "supports 1", "container_version_major", 8, major)
    if any(rsv) or any(rsv2):
        raise _bad("header reserved bytes MUST be 0", "header._reserved",
                   10 if any(rsv) else 36)
    if flags & ~7:
        raise _bad(f"file_flags at byte 12: found 0x{flags:x}; bits 3-31 are reserved",
                   "file_flags", 12, flags)
    if align & (align - 1) or not DEFAULT_ALIGNMENT <= align <= MAX_ALIGNMENT:
        raise _bad(f"data_buffer_alignment at byte 16: found {align}; a power of two in "
                   "[4096, 2097152]", "data_buffer_alignment", 16, align)
    if first < 64 or first % 8 or (size is not None and first > size - TRAILER.size):
        raise _bad(f"first_descriptor_offset at byte 20: found {first}; >= 64, 8-aligned "
                   "and inside the file", "first_descriptor_offset", 20, first)
    return flags, align, first, hint


def parse_tail(read: Callable[[int, int], bytes], size: int, first: int, flags: int
               ) -> tuple[int, dict[str, Any], list[IndexEntry]]:
    """Trailer, KV section and index of a file of ``size`` bytes whose bytes ``read(offset,
    n)`` returns: ``(end of the tensor region, KV metadata, index entries)``.  Random-access
    and sequential reading share it, so both enforce the same rules."""
    t_off = size - TRAILER.size
    (index_off, index_len, kv_off, kv_len, crc, rsv3,
     tmagic) = TRAILER.unpack(read(t_off, TRAILER.size))
    if tmagic != TRAILER_MAGIC:
        raise _bad(f"trailer_magic at byte {t_off + 36}: found {tmagic!r}; expected b'HRRY' "
                   "(truncated or not a .hrry file)", "trailer_magic", t_off + 36, tmagic)
    if any(rsv3):
        raise _bad("trailer reserved bytes MUST be 0", "trailer._reserved", t_off + 32)
    if index_off + index_len > t_off or index_off < first or index_off % 8 or index_len < 8:
        raise _bad(f"index_offset {index_off} + index_length {index_len} at byte {t_off}: the "
                   f"index lies 8-aligned between the tensors (from {first}) and the "
                   f"trailer ({t_off})", "index_offset", t_off, index_off)
    region_end = index_off
    kv: dict[str, Any] = {}
    if kv_off or kv_len:
        if (kv_off % 8 or kv_off < first or kv_off + kv_len > index_off
                or not kv_off or not kv_len):
            raise _bad(f"kv_offset {kv_off} / kv_length {kv_len} at byte {t_off + 16}: the "
                       f"KV section lies 8-aligned before the index ({index_off})",
                       "kv_offset", t_off + 16, kv_off)
        region_end = kv_off
    elif flags & HAS_KV_METADATA:
        raise _bad("HAS_KV_METADATA is set but the trailer locates no KV section",
                   "file_flags", 12, flags)
    index = read(index_off, index_len)
    if flags & HAS_INDEX_CRC32C:
        if crc32c(index) != crc:
            raise _bad(f"index_crc32c at byte {t_off + 28}: stored 0x{crc:08x}, the index "
                       f"hashes to 0x{crc32c(index):08x}", "index_crc32c", t_off + 28, crc,
                       "the index MUST match its CRC-32C")
    elif crc:
        raise _bad(f"index_crc32c at byte {t_off + 28} is 0x{crc:08x} without "
                   "HAS_INDEX_CRC32C; it MUST be 0", "index_crc32c", t_off + 28, crc)
    if kv_len:
        kv = decode_kv(read(kv_off, kv_len), kv_off)
    return region_end, kv, parse_index(index, index_off, flags)


# --------------------------------------------------------------------------- sequential
def iter_hrry_sequential(f: BinaryIO, result: list[HrryFile] | None = None
                         ) -> Iterator[tuple[str | None, TensorDescriptor, list]]:
    """Read a .hrry file from a non-seekable source, in order (file-format.md § Sequential
    Reader).  With a tensor_count_hint, tensors are yielded as they arrive (names come from
    the index at the end, so they are None here); without one, the file is buffered and
    read through its trailer.  Either way the whole file is then held to the random-access
    reader's rules (header, trailer, KV section, index, every entry against the tensor the
    region really held) before the iterator ends; the validated file, whose buffers are
    the bytes read, is appended to ``result``."""
    from .stream import TensorStreamReader

    reader = TensorStreamReader(f)
    header = reader.read_exact(64, "header").tobytes()
    flags, align, first, hint = parse_header(header, None)
    if hint == UNKNOWN_COUNT:
        parsed = HrryFile.from_bytes(header + f.read())
        for name in parsed.names:
            yield name, parsed.descriptor(name), parsed.buffers(name)
        if result is not None:
            result.append(parsed)
        return
    reader.read_exact(first - 64, "padding")
    seen = {}  # descriptor offset -> the tensor read there
    for k in range(hint):
        reader.pad_to(8)
        item = reader.read_tensor(align)
        if item is None:
            raise _bad(f"tensor_count_hint at byte 28 is {hint}; the file ends after {k} "
                       "tensors", "tensor_count_hint",
                       28, hint, "the tensor region holds tensor_count_hint tensors")
        seen[item.offset] = item
        yield None, item.desc, item.buffers
    reader.pad_to(8)
    boundary = reader.offset
    tail = f.read()
    size = boundary + len(tail)
    if len(tail) < TRAILER.size:
        raise _bad(f"the file ends at byte {size}, {len(tail)} bytes after the tensors: too "
                   "short for the trailer", "trailer", size)

    def read(off: int, n: int) -> bytes:
        if off >= boundary:
            return tail[off - boundary:off - boundary + n]
        if off in seen:  # the tensors are streamed past; their descriptors are kept
            return seen[off].raw[:n]
        raise _bad(f"byte {off} lies in the tensor region (before {boundary}) where no "
                   "descriptor was read", "descriptor_offset", off,
                   rule="the index locates the tensors the region holds")

    region_end, kv, entries = parse_tail(read, size, first, flags)
    if boundary != region_end:
        raise _bad(f"after {hint} tensors the reader is at byte {boundary}, not at the end of "
                   f"the tensor region ({region_end})", "tensor_count_hint", 28, hint,
                   "the running offset lands on the section after the tensors")
    descs = check_entries(entries, read, first, region_end, align)
    located = sorted(e.descriptor_offset for e in entries)
    if located != sorted(seen):
        raise _bad(f"the index locates descriptors at {located}, the tensor region held them "
                   f"at {sorted(seen)}", "descriptor_offset", region_end)
    for e in entries:
        item = seen[e.descriptor_offset]
        if descs[e.name].buffers and e.data_offset != item.data_offset:
            raise _bad(f"tensor {e.name!r}: the index says its data starts at {e.data_offset}, "
                       f"the tensor region has it at {item.data_offset}", "data_offset",
                       e.descriptor_offset, e.data_offset)
    if result is not None:
        held = HrryFile.__new__(HrryFile)
        held.source, held.size, held._read, held._data = "<sequential>", size, read, b""
        held._set(flags, align, first, hint, kv, entries, descs)
        held._held = {e.name: seen[e.descriptor_offset].buffers for e in entries}
        result.append(held)


def read_hrry_sequential(f: BinaryIO) -> HrryFile:
    """The whole file from a non-seekable source, validated as ``HrryFile.open`` would."""
    out: list[HrryFile] = []
    for _ in iter_hrry_sequential(f, out):
        pass
    return out[0]


__all__ = ["HrryFile", "HrryWriter", "IndexEntry", "iter_hrry_sequential", "read_hrry_sequential",
           "write_hrry"]
