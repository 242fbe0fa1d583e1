"""The Hurray streaming format (decision D8) and KV snapshots over it (D7).

A stream is tensors back to back, nothing else: each tensor's descriptor bytes, then
each of its buffers' raw bytes in buffer-table order - no framing, padding or
checksums, byte-compatible with the reference ``hurray-io`` stream.  A composite head
has no buffers; its ``member_count`` members follow it (pre-order, depth <= 8).

A snapshot stream is one group head followed by ``seq_lens``, ``kv_scales`` (fp8
caches), then key and value per layer (``hurraykv.snapshot``).  A plain stream of
block-paged tensors without a group is also read (lengths per D6).

Reading never trusts a size it has not seen: a descriptor longer than
``max_descriptor_bytes`` (16 MiB) or a buffer larger than ``max_buffer_bytes`` is
refused before anything is allocated, and a buffer whose claimed size exceeds what a
regular file still holds is refused up front; on pipes and sockets memory grows only
as bytes actually arrive.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from ..errors import HurrayError, SnapshotError, StreamError
from ..info import check_metadata, info_member
from ..paged import BlockPagedTensor, byte_view
from ..snapshot import (
    KVCacheSnapshot,
    SnapshotAssembler,
    group_head,
    kv_scales_member,
    member_name,
    seq_lens_member,
)
from ..wire.descriptor import TensorDescriptor, decode_descriptor, peek_length
from ..wire.layouts import Composite
from .sniff import not_expected

FILE_HINT = " (open a .hrry file with hk.load_snapshot or HrryFile.open)"

MAX_DESCRIPTOR_BYTES = 16 << 20
MAX_DEPTH = 8
GROW_CHUNK = 64 << 10  # first allocation for a claimed size not yet seen; doubles as bytes arrive


# --------------------------------------------------------------------------- writing
def write_tensor(f: BinaryIO, desc: TensorDescriptor, buffers: Sequence[Any]) -> int:
    """Write one tensor: descriptor, then each buffer as is (no copy).  Returns bytes."""
    if len(buffers) != len(desc.buffers):
        raise StreamError(f"descriptor declares {len(desc.buffers)} buffers, "
                          f"{len(buffers)} given", field="buffers", value=len(buffers))
    views = [byte_view(b) for b in buffers]
    for i, (mv, h) in enumerate(zip(views, desc.buffers, strict=True)):
        if mv.nbytes != h.byte_size:
            raise StreamError(f"buffers[{i}] holds {mv.nbytes} bytes, the descriptor declares "
                              f"{h.byte_size}", field=f"buffers[{i}]", value=mv.nbytes)
    head = desc.encode()
    f.write(head)
    for mv in views:
        f.write(mv)
    return len(head) + sum(mv.nbytes for mv in views)


def write_snapshot_stream(snapshot: KVCacheSnapshot, f: BinaryIO) -> int:
    """Write a whole snapshot as one group; returns the number of bytes written."""
    n = write_tensor(f, snapshot.head(), [])
    for _, desc, bufs in snapshot.members():
        n += write_tensor(f, desc, bufs)
    f.flush()
    return n


class SnapshotStreamWriter:
    """Write a snapshot layer by layer, as each layer's KV becomes available.

    The head, ``seq_lens`` and ``kv_scales`` go out at once; ``write_layer(i, key,
    value)`` sends a layer (in any order, each once) and flushes, so a reader can start
    on it; ``close()`` refuses to leave a torn group behind silently."""

    def __init__(self, f: BinaryIO, seq_lens: Any, num_layers: int, *,
                 kv_scales: Any = None, fused: bool = False, model: str | None = None,
                 metadata: dict[str, Any] | None = None) -> None:
        self.f = f
        self.seq_lens = np.asarray(seq_lens, dtype=np.int64)
        self.num_layers = int(num_layers)
        self.kv_scales = None if kv_scales is None else np.asarray(kv_scales, np.float32)
        self.roles = ("fused",) if fused else ("key", "value")
        if self.num_layers < 1:
            raise SnapshotError("a snapshot holds at least one layer", field="num_layers",
                                value=num_layers)
        if self.kv_scales is not None and self.kv_scales.shape != (self.num_layers, 2):
            raise SnapshotError(f"kv_scales has shape {list(self.kv_scales.shape)}, expected "
                                f"[{self.num_layers}, 2]", field="kv_scales")
        self._written: set[int] = set()
        self._seq_ptr: np.ndarray | None = None
        metadata = check_metadata(metadata)
        info = model is not None or bool(metadata)
        count = 1 + (self.kv_scales is not None) + info + self.num_layers * len(self.roles)
        self.bytes_written = write_tensor(f, group_head(count), [])
        self.bytes_written += write_tensor(f, *seq_lens_member(self.seq_lens))
        if self.kv_scales is not None:
            self.bytes_written += write_tensor(f, *kv_scales_member(self.kv_scales))
        if info:
            self.bytes_written += write_tensor(f, *info_member(model, metadata))
        f.flush()

    def write_layer(self, i: int, *tensors: BlockPagedTensor) -> None:
        if not 0 <= i < self.num_layers or i in self._written:
            raise SnapshotError(f"layer {i} is outside 0..{self.num_layers - 1} or was "
                                "already written", field="layer_index", value=i)
        if len(tensors) != len(self.roles):
            raise SnapshotError(f"layer {i} takes {'/'.join(self.roles)}, {len(tensors)} "
                                "tensors given", field="tensors", value=len(tensors))
        for role, t in zip(self.roles, tensors, strict=True):
            self._check(i, role, t)
        for t in tensors:
            self.bytes_written += write_tensor(self.f, t.descriptor(), t.buffers())
        self.f.flush()
        self._written.add(i)

    def _check(self, i: int, role: str, t: BlockPagedTensor) -> None:
        name = member_name(i, role)
        if t.layer_index != i or t.kv_role != role:
            raise SnapshotError(f"{name}: got the {t.kv_role} tensor of layer {t.layer_index}",
                                field="layer_index", value=(t.layer_index, t.kv_role))
        if t.total_tokens != int(self.seq_lens.sum()) or t.num_seqs != len(self.seq_lens):
            raise SnapshotError(f"{name} holds {t.num_seqs} sequences / {t.total_tokens} "
                                f"tokens; seq_lens says {len(self.seq_lens)} / "
                                f"{int(self.seq_lens.sum())}", field="seq_lens")
        if self._seq_ptr is None:
            self._seq_ptr = t.seq_ptr.astype(np.int64)
        elif not np.array_equal(self._seq_ptr, t.seq_ptr):
            raise SnapshotError(f"{name} has a different seq_ptr than the layers before it",
                                field="seq_ptr")
        if t.seq_lens is not None and not np.array_equal(t.seq_lens, self.seq_lens):
            raise SnapshotError(f"{name} has seq_lens {t.seq_lens.tolist()}", field="seq_lens")

    def close(self) -> None:
        missing = sorted(set(range(self.num_layers)) - self._written)
        if missing:
            raise StreamError(f"layers {missing} were never written: the group is torn and a "
                              "reader will reject it", field="layers", value=missing)

    def __enter__(self) -> SnapshotStreamWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()


# --------------------------------------------------------------------------- reading
@dataclass
class Item:
    """One tensor read from a stream; a composite head carries its members."""

    desc: TensorDescriptor
    buffers: list[np.ndarray]
    offset: int
    members: list[Item] = field(default_factory=list)
    raw: bytes = b""  # the descriptor's bytes as read
    data_offset: int = 0  # where its first buffer starts (after any alignment padding)


class TensorStreamReader:
    """Reads tensors one at a time from a binary file object (file, pipe, socket)."""

    def __init__(self, f: BinaryIO, *, max_descriptor_bytes: int = MAX_DESCRIPTOR_BYTES,
                 max_buffer_bytes: int | None = None, max_depth: int = MAX_DEPTH) -> None:
        self.f = f
        self.max_descriptor_bytes = max_descriptor_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self.max_depth = max_depth
        self.offset = 0
        self._regular = _is_regular(f)

    def _remaining(self) -> int | None:
        """Bytes left in a regular file or other seekable source (None for pipes)."""
        try:
            if self._regular:
                return os.fstat(self.f.fileno()).st_size - self.f.tell()
            if self.f.seekable():
                here = self.f.tell()
                end = self.f.seek(0, os.SEEK_END)
                self.f.seek(here)
                return end - here
        except (AttributeError, OSError, ValueError):
            pass
        return None

    def _fill(self, mv: memoryview, what: str) -> int:
        got = 0
        readinto = getattr(self.f, "readinto", None)
        while got < len(mv):
            if readinto is not None:
                k = readinto(mv[got:])
            else:
                chunk = self.f.read(len(mv) - got)
                k = len(chunk)
                mv[got:got + k] = chunk
            if not k:
                break
            got += k
        self.offset += got
        return got

    def read_exact(self, n: int, what: str) -> np.ndarray:
        remaining = self._remaining()
        if remaining is not None and n > remaining:
            raise StreamError(f"{what} at stream offset {self.offset} claims {n} bytes but only "
                              f"{remaining} remain", field=what, offset=self.offset, value=n,
                              rule="a buffer holds exactly byte_size bytes")
        cap = n if remaining is not None or n <= GROW_CHUNK else GROW_CHUNK
        buf = np.empty(cap, np.uint8)
        got = self._fill(memoryview(buf), what)
        while got == cap and cap < n:  # memory grows only as bytes arrive
            bigger = np.empty(min(n, cap * 2), np.uint8)
            bigger[:cap] = buf
            buf, cap = bigger, len(bigger)
            got += self._fill(memoryview(buf)[got:], what)
        if got < n:
            raise StreamError(f"the stream ended at offset {self.offset}, inside {what} "
                              f"({got} of {n} bytes)", field=what, offset=self.offset, value=got,
                              rule="a buffer holds exactly byte_size bytes")
        return buf

    def pad_to(self, align: int) -> None:
        """Skip the padding up to the next multiple of ``align`` (file containers)."""
        if self.offset % align:
            self.read_exact(align - self.offset % align, "padding")

    def read_tensor(self, align: int = 1) -> Item | None:
        """The next tensor (descriptor and buffers), or None at a clean end of stream.
        ``align`` > 1 reads a .hrry tensor region: each buffer, and the end of the last,
        sit on that alignment."""
        start = self.offset
        first = np.empty(10, np.uint8)
        got = self._fill(memoryview(first)[:1], "descriptor")
        if got == 0:
            return None
        got += self._fill(memoryview(first)[1:], "descriptor")
        if got < 10:
            raise StreamError(f"the stream ended inside a descriptor header at offset {start}",
                              field="descriptor", offset=start, value=got)
        if (start == 0 and align == 1 and first[:4].tobytes() != b"HRRY") or \
                first[:8].tobytes() == b"HRRYFILE":
            other = not_expected(first.tobytes(), None, "a Hurray stream", "a .hrry",
                                 FILE_HINT)
            if other is not None:
                raise StreamError(f"at stream offset {start}: {other}", field="magic",
                                  offset=start, value=first[:8].tobytes())
        length = peek_length(first.tobytes())
        if length < 20:
            decode_descriptor(first.tobytes() + bytes(10))  # the decoder's own rejection
        if length > self.max_descriptor_bytes:
            raise StreamError(f"descriptor_length at stream offset {start + 6}: found {length}; "
                              f"this reader takes descriptors up to {self.max_descriptor_bytes} "
                              "bytes", field="descriptor_length", offset=start + 6,
                              value=length, rule="max_descriptor_bytes")
        raw = first.tobytes() + self.read_exact(length - 10, "descriptor").tobytes()
        desc = decode_descriptor(raw)
        buffers = []
        data_offset = self.offset
        for i, h in enumerate(desc.buffers):
            if self.max_buffer_bytes is not None and h.byte_size > self.max_buffer_bytes:
                raise StreamError(f"buffers[{i}] of the tensor at stream offset {start}: "
                                  f"byte_size {h.byte_size} exceeds max_buffer_bytes "
                                  f"{self.max_buffer_bytes}", field=f"buffers[{i}]",
                                  offset=start, value=h.byte_size, rule="max_buffer_bytes")
            self.pad_to(align)
            if i == 0:
                data_offset = self.offset
            buffers.append(self.read_exact(h.byte_size, f"buffers[{i}]"))
        if desc.buffers:
            self.pad_to(align)
        return Item(desc, buffers, start, raw=raw, data_offset=data_offset)

    def read_item(self, depth: int = 0) -> Item | None:
        """The next tensor; a composite head comes with its members (torn groups raise)."""
        item = self.read_tensor()
        if item is None or not isinstance(item.desc.layout, Composite):
            return item
        if depth + 1 > self.max_depth:
            raise StreamError(f"composite at offset {item.offset} nests deeper than "
                              f"{self.max_depth}", field="depth", offset=item.offset,
                              value=depth + 1, rule="composite nesting depth <= 8")
        count = item.desc.layout.member_count
        for k in range(count):
            member = self.read_item(depth + 1)
            if member is None:
                raise StreamError(f"torn composite: the stream ended after {k} of {count} "
                                  f"members of the head at offset {item.offset}",
                                  field="member_count", offset=item.offset, value=k,
                                  rule="a group closes at its Nth member")
            item.members.append(member)
        return item

    def __iter__(self) -> Iterator[Item]:
        while (item := self.read_item()) is not None:
            yield item


class SnapshotStreamReader:
    """Reads a snapshot stream, yielding each layer as soon as all its roles arrived."""

    def __init__(self, f: BinaryIO, *, max_descriptor_bytes: int = MAX_DESCRIPTOR_BYTES,
                 max_buffer_bytes: int | None = None) -> None:
        self.tensors = TensorStreamReader(f, max_descriptor_bytes=max_descriptor_bytes,
                                          max_buffer_bytes=max_buffer_bytes)
        self.snapshot: KVCacheSnapshot | None = None

    def layers(self) -> Iterator[tuple[int, tuple[BlockPagedTensor, ...]]]:
        """``(layer_index, (key, value))`` or ``(layer_index, (fused,))`` as layers complete;
        after the last, ``self.snapshot`` holds the validated snapshot."""
        first = self.tensors.read_tensor()
        if first is None:
            raise StreamError("the stream is empty: no snapshot", field="stream", offset=0)
        if isinstance(first.desc.layout, Composite):
            layout = first.desc.layout
            if layout.rule != 0x03:
                raise SnapshotError(f"a snapshot is a group composite (rule 0x03), found rule "
                                    f"0x{layout.rule:02x}", field="composition_rule",
                                    value=layout.rule)
            count = layout.member_count

            def members() -> Iterator[Item]:
                for k in range(count):
                    item = self.tensors.read_item(depth=1)
                    if item is None:
                        raise StreamError(
                            f"torn group: the stream ended after {k} of {count} members",
                            field="member_count", offset=first.offset, value=k,
                            rule="a group closes at its Nth member")
                    yield item
        else:
            def members() -> Iterator[Item]:
                yield first
                yield from self.tensors
        assembler = SnapshotAssembler()
        for item in members():
            layer = assembler.add(item.desc, item.buffers, f"at stream offset {item.offset}")
            if layer is not None:
                yield layer
        self.snapshot = assembler.finish()

    def read(self) -> KVCacheSnapshot:
        for _ in self.layers():
            pass
        assert self.snapshot is not None
        return self.snapshot


def read_snapshot_stream(f: BinaryIO, **limits: Any) -> KVCacheSnapshot:
    """Read one snapshot (a group, or a plain stream of block-paged tensors to EOF)."""
    return SnapshotStreamReader(f, **limits).read()


def _is_regular(f: Any) -> bool:
    try:
        return stat.S_ISREG(os.fstat(f.fileno()).st_mode) and f.seekable()
    except (AttributeError, OSError, ValueError, HurrayError):
        return False
