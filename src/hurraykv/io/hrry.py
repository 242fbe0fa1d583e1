"""The .hrry file container (file-format.md; decision D9): ``HrryFile``, the reader,
zero-copy through mmap, and the sequential reader for non-seekable sources.

The layout and the rules both readers enforce are in ``hrry_format.py``, the atomic
writer in ``hrry_writer.py``; this module re-exports both, so ``hurraykv.io.hrry``
remains the one import for the container.  Every offset and length is checked before a
byte of tensor data is mapped.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from ..errors import StreamError
from ..threads import run_bands
from ..wire.descriptor import TensorDescriptor
from ..wire.layouts import Composite
from .hrry_format import (
    DEFAULT_ALIGNMENT,
    ENTRY,
    HAS_INDEX_CRC32C,
    HAS_KV_METADATA,
    HEADER,
    MAGIC,
    MAX_ALIGNMENT,
    SORTED_INDEX,
    TRAILER,
    TRAILER_MAGIC,
    UNKNOWN_COUNT,
    IndexEntry,
    bad,
    check_entries,
    data_span,
    parse_header,
    parse_index,
    parse_tail,
    round_up,
)
from .hrry_writer import GATHER, RESERVE_FROM, HrryWriter, Progress, write_hrry
from .sniff import not_expected

STREAM_HINT = (" (read a stream with hk.read_snapshot_stream or SnapshotStreamReader; "
               "`hurraykv inspect` reads both)")


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
    def index(cls, fd: int, source: str) -> HrryFile:
        """File ``fd`` parsed with small reads of its header, index and descriptors, and
        never mapped: for a reader that reads the tensors' bytes itself, where ``spans``
        says (a mapped file cut underneath kills a reader that touches it with SIGBUS; a
        short read is an error it can report).  ``buffers`` is not available."""
        self = cls.__new__(cls)
        self.source, self.size, self._data = source, os.fstat(fd).st_size, None
        self._read = lambda off, n: os.pread(fd, n, off)
        self._parse()
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
            raise bad(f"{path}: read {got} of {size} bytes (the file changed while "
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
            raise bad(f"{self.source}: {other}", "magic", 0, head[:8])
        if size < HEADER.size + TRAILER.size:
            raise bad(f"{self.source}: {size} bytes cannot hold a 64-byte header and a 40-byte "
                       "trailer", "file_size", value=size)
        flags, align, first, hint = parse_header(head, size)
        region_end, kv, entries = parse_tail(self._read, size, first, flags)
        if hint not in (UNKNOWN_COUNT, len(entries)):  # the sequential reader relies on it
            raise bad(f"tensor_count_hint at byte 28 is {hint}, the index has "
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
            raise bad(f"{self.source} has no tensor named {name!r}", "name",
                       value=name) from None

    def descriptor(self, name: str) -> TensorDescriptor:
        self.entry(name)
        return self._descs[name]

    def buffers(self, name: str) -> list[memoryview]:
        """Zero-copy views of the tensor's buffers in the mapped file."""
        if self._held is not None:
            self.entry(name)
            return list(self._held[name])
        view = self._view
        return [view[off:off + n] for off, n in self.spans(name)]

    def spans(self, name: str) -> list[tuple[int, int]]:
        """``(file offset, byte size)`` of each of the tensor's buffers."""
        e, desc = self.entry(name), self.descriptor(name)
        out, off = [], e.data_offset
        for h in desc.buffers:
            out.append((off, h.byte_size))
            off = round_up(off + h.byte_size, self.alignment)
        return out

    def members(self, name: str) -> list[str]:
        """Names of a composite head's members (pre-order, by descriptor offset)."""
        names = self.names
        start = names.index(self.entry(name).name)
        out, pos = [], start + 1

        def take(depth: int, count: int) -> None:
            nonlocal pos
            if depth > 8:
                raise bad(f"composite {name!r} nests deeper than 8", "depth", value=depth)
            for _ in range(count):
                if pos >= len(names):
                    raise bad(f"torn composite {name!r}: the file ends before its "
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
            raise bad(f"{name!r} is not a composite head", "layout_tag", value=name)
        take(1, layout.member_count)
        return out


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
        try:
            item = reader.read_tensor(align)
        except StreamError as e:  # a tensor overrunning the file is the file's damage,
            # named as the random-access reader names it
            raise bad(f"tensor {k} of the tensor region: {e}", e.field or "tensor", e.offset,
                      e.value, e.rule or "") from None
        if item is None:
            raise bad(f"tensor_count_hint at byte 28 is {hint}; the file ends after {k} "
                       "tensors", "tensor_count_hint",
                       28, hint, "the tensor region holds tensor_count_hint tensors")
        seen[item.offset] = item
        yield None, item.desc, item.buffers
    reader.pad_to(8)
    boundary = reader.offset
    tail = f.read()
    size = boundary + len(tail)
    if len(tail) < TRAILER.size:
        raise bad(f"the file ends at byte {size}, {len(tail)} bytes after the tensors: too "
                   "short for the trailer", "trailer", size)

    def read(off: int, n: int) -> bytes:
        if off >= boundary:
            return tail[off - boundary:off - boundary + n]
        if off in seen:  # the tensors are streamed past; their descriptors are kept
            return seen[off].raw[:n]
        raise bad(f"byte {off} lies in the tensor region (before {boundary}) where no "
                   "descriptor was read", "descriptor_offset", off,
                   rule="the index locates the tensors the region holds")

    region_end, kv, entries = parse_tail(read, size, first, flags)
    if boundary != region_end:
        raise bad(f"after {hint} tensors the reader is at byte {boundary}, not at the end of "
                   f"the tensor region ({region_end})", "tensor_count_hint", 28, hint,
                   "the running offset lands on the section after the tensors")
    descs = check_entries(entries, read, first, region_end, align)
    located = sorted(e.descriptor_offset for e in entries)
    if located != sorted(seen):
        raise bad(f"the index locates descriptors at {located}, the tensor region held them "
                   f"at {sorted(seen)}", "descriptor_offset", region_end)
    for e in entries:
        item = seen[e.descriptor_offset]
        if descs[e.name].buffers and e.data_offset != item.data_offset:
            raise bad(f"tensor {e.name!r}: the index says its data starts at {e.data_offset}, "
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


__all__ = ["DEFAULT_ALIGNMENT", "ENTRY", "GATHER", "HAS_INDEX_CRC32C", "HAS_KV_METADATA",
           "HEADER", "MAGIC", "MAX_ALIGNMENT", "RESERVE_FROM", "SORTED_INDEX", "TRAILER",
           "TRAILER_MAGIC", "UNKNOWN_COUNT", "HrryFile", "HrryWriter", "IndexEntry",
           "Progress", "check_entries", "data_span", "iter_hrry_sequential", "parse_header",
           "parse_index", "parse_tail", "read_bands", "read_hrry_sequential", "write_hrry"]
