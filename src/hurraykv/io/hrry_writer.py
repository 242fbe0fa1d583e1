"""The .hrry writer: ``HrryWriter`` and ``write_hrry`` (layout: ``hrry_format.py``).

The writer follows the spec text (padding after a tensor's last buffer, none after a
head, HAS_KV_METADATA when KV exists) and is atomic: a temporary file in the same
directory, fsync, rename, fsync of the directory.  It writes in one forward pass, small
pieces gathered, buffers straight from the caller's memory.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ContainerError
from ..paged import byte_view
from ..wire.descriptor import TensorDescriptor
from .atomic import create_temp, fsync_dir
from .crc32c import crc32c
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
    round_up,
)
from .kvmeta import encode_kv

_ZEROS = bytes(MAX_ALIGNMENT)

Progress = Callable[[int, int], None]
GATHER = 64 << 10  # pieces below this are written together
RESERVE_FROM = 16 << 20  # files at least this large get their blocks reserved up front


class HrryWriter:
    """Writes a .hrry file in one forward pass (no seek back) into a temporary file;
    ``finish`` makes it appear atomically at ``path``.  Buffers are written straight from
    the caller's memory; the KV metadata is given up front so the header's flags are final.

    ``into``: an open, empty file descriptor written instead (from its offset 0, not
    atomically, left open: a memory file nobody sees before it is sealed); ``path`` then
    only names it in errors."""

    def __init__(self, path: str | os.PathLike, *, kv: dict[str, Any] | None = None,
                 alignment: int = DEFAULT_ALIGNMENT, tensor_count: int | None = None,
                 progress: Progress | None = None, total_bytes: int = 0,
                 reserve: int = 0, fsync: bool = True, into: int | None = None) -> None:
        if alignment & (alignment - 1) or not DEFAULT_ALIGNMENT <= alignment <= MAX_ALIGNMENT:
            raise bad(f"data_buffer_alignment {alignment} is not a power of two in "
                       "[4096, 2 MiB]", "data_buffer_alignment", value=alignment)
        self.path = Path(path)
        self.alignment = alignment
        self.progress = progress
        self.total_bytes = total_bytes
        self.fsync = fsync
        self._kv = encode_kv(kv) if kv else b""  # encoded first: errors before any write
        self.entries: list[IndexEntry] = []
        self._names: set[str] = set()
        if into is None:
            fd, self._tmp = create_temp(self.path)  # locked until closed
        else:
            fd, self._tmp, self.fsync = os.dup(into), None, False
        self._f = os.fdopen(fd, "wb", buffering=0)
        self._pending = bytearray()
        try:
            # a memory file (into) has no blocks to keep together: reserving would only
            # zero every page before it is written
            self._reserved = (into is None and reserve >= RESERVE_FROM
                              and hasattr(os, "posix_fallocate"))
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
        self._write_out(mv)

    def _flush(self) -> None:
        pending = memoryview(self._pending)
        self._write_out(pending)
        del pending
        self._pending = bytearray()

    def _write_out(self, mv: memoryview) -> None:
        while mv:
            n = self._f.write(mv)
            if not n:  # None (would block) or 0: retrying would spin, never finish
                raise ContainerError(f"the output took {n} of {mv.nbytes} bytes",
                                     field="output", value=n,
                                     rule="a blocking file that accepts every write")
            mv = mv[n:]

    def _pad_to(self, a: int) -> None:
        n = round_up(self.pos, a) - self.pos
        if n:
            self._write(_ZEROS[:n])

    def add(self, name: str, desc: TensorDescriptor, buffers: Sequence[Any]) -> None:
        if not name or len(name.encode("utf-8")) > 0xFFFF or name in self._names:
            raise bad(f"tensor name {name!r} is empty, too long or already used", "name",
                       value=name, rule="names are unique, 1..65535 UTF-8 bytes")
        if len(buffers) != len(desc.buffers):
            raise bad(f"{name}: descriptor declares {len(desc.buffers)} buffers, "
                       f"{len(buffers)} given", "buffers", value=len(buffers))
        views = [byte_view(b) for b in buffers]
        for i, (mv, h) in enumerate(zip(views, desc.buffers, strict=True)):
            if mv.nbytes != h.byte_size:
                raise bad(f"{name}: buffers[{i}] holds {mv.nbytes} bytes, the descriptor "
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
        """KV metadata, index and trailer; then fsync and the atomic rename (``into``:
        neither)."""
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
        if self._tmp is None:
            self._f.close()
            return self.path
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
            if self._tmp is not None and os.path.exists(self._tmp):
                os.unlink(self._tmp)

    def __enter__(self) -> HrryWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()


def write_hrry(path: str | os.PathLike, tensors: Iterable[tuple[str, TensorDescriptor, Any]],
               kv: dict[str, Any] | None = None, *, alignment: int = DEFAULT_ALIGNMENT,
               progress: Progress | None = None, fsync: bool = True,
               into: int | None = None) -> Path:
    """Write named tensors (and KV metadata) to ``path`` atomically; an existing file is
    replaced only once the new one is complete (and, with ``fsync``, on disk).  ``into``:
    written into that open descriptor instead (``HrryWriter``)."""
    tensors = list(tensors)
    total = sum(h.byte_size for _, d, _ in tensors for h in d.buffers)
    overhead = sum(512 + len(n) + alignment * (len(d.buffers) + 1) for n, d, _ in tensors)
    w = HrryWriter(path, kv=kv, alignment=alignment, tensor_count=len(tensors),
                   progress=progress, total_bytes=total, reserve=total + overhead + (1 << 16),
                   fsync=fsync, into=into)
    try:
        for name, desc, bufs in tensors:
            w.add(name, desc, bufs)
        return w.finish()
    except BaseException:
        w.abort()
        raise
