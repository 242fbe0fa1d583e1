"""What the user named on the command line, read once and sorted into what it holds.

A regular file is read lazily (mapped); standard input (``-``) and any other
non-seekable source is read once into memory, so sniffing its kind never consumes bytes
the reader then misses (decision H58).  A group whose members include block-paged tensors
is a KV snapshot and held to the snapshot rules; anything else is a set of tensors, each
held to its own rules."""

from __future__ import annotations

import io
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ContainerError
from ..io.hrry import HrryFile
from ..io.snapshots import snapshot_from_file
from ..io.sniff import looks_like
from ..io.stream import TensorStreamReader
from ..paged import BlockPagedTensor
from ..snapshot import GROUP, KVCacheSnapshot
from ..wire.descriptor import TensorDescriptor, decode_descriptor
from ..wire.layouts import BlockPaged, Composite


class CannotRead(Exception):
    """A named input or output that cannot be opened: exit code 2."""


class Input:
    def __init__(self, path: str) -> None:
        self.name = "<stdin>" if path == "-" else path
        self.path: str | None = None
        self.data: memoryview | None = None
        try:
            if path == "-":
                self.data = read_all(sys.stdin.buffer)
            else:
                with open(path, "rb") as f:
                    if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        self.path = path
                    else:
                        self.data = read_all(f)
        except OSError as e:
            raise CannotRead(f"cannot read {self.name}: {e.strerror}") from None

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else os.path.getsize(self.path)

    def head(self, n: int) -> bytes:
        if self.data is not None:
            return bytes(self.data[:n])
        with open(self.path, "rb") as f:
            return f.read(n)

    def read(self) -> bytes | memoryview:
        return self.data if self.data is not None else Path(self.path).read_bytes()

    def hrry(self) -> HrryFile:
        if self.data is not None:
            return HrryFile.from_bytes(self.data, self.name)
        return HrryFile.open(self.path)

    def stream(self) -> BinaryIO:
        return io.BytesIO(self.data) if self.data is not None else open(self.path, "rb")

    @property
    def kind(self) -> str:
        head = self.head(16)
        what = looks_like(head, self.size)
        if what == "a .hrry file":
            return "hrry"
        if what is not None and what.startswith("a Hurray stream"):
            length = int.from_bytes(head[6:10], "little")
            # bytes after the first descriptor: buffers or more tensors, so a stream
            return "stream" if 20 <= length < self.size else "descriptor"
        if what is not None:
            raise ContainerError(f"{self.name}: this is {what}, not a Hurray descriptor, "
                                 "stream or .hrry file", field="magic", value=head[:8])
        return "descriptor"  # let the decoder say what is wrong with it


def read_all(f: BinaryIO) -> memoryview:
    """Everything ``f`` yields, in one growing buffer (memory follows the bytes that come)."""
    buf = bytearray(1 << 16)
    got = 0
    while True:
        if got == len(buf):
            bigger = bytearray(2 * len(buf))
            bigger[:got] = buf
            buf = bigger
        n = f.readinto(memoryview(buf)[got:])
        if not n:
            return memoryview(buf)[:got]
        got += n


@dataclass
class Contents:
    """What an input holds: one descriptor, a KV snapshot, or standalone tensors."""

    kind: str  # "descriptor", "hrry" or "stream"
    desc: TensorDescriptor | None = None
    snapshot: KVCacheSnapshot | None = None
    tensors: list[tuple[str | None, TensorDescriptor, Any]] = field(default_factory=list)
    file: HrryFile | None = None


def torn_head(desc: TensorDescriptor) -> str:
    """Why a lone descriptor is a cut stream: a composite head whose members never came."""
    layout = desc.layout
    if isinstance(layout, Composite) and layout.member_count:
        return (f"a composite head announcing {layout.member_count} members, and none "
                "follow: as a stream this is truncated")
    return ""


def _is_group(desc: TensorDescriptor) -> bool:
    return isinstance(desc.layout, Composite) and desc.layout.rule == GROUP


def _has_block_paged(descs: list[TensorDescriptor]) -> bool:
    return any(isinstance(d.layout, BlockPaged) for d in descs)


def load_contents(inp: Input, permissive: bool = False) -> Contents:
    kind = inp.kind
    if kind == "descriptor":
        return Contents(kind, desc=decode_descriptor(inp.read(), strict=not permissive))
    if kind == "hrry":
        f = inp.hrry()
        heads = [n for n in f.names if isinstance(f.descriptor(n).layout, Composite)]
        if any(_is_group(f.descriptor(h)) and _has_block_paged(
                [f.descriptor(m) for m in f.members(h)]) for h in heads):
            return Contents(kind, snapshot=snapshot_from_file(f), file=f)
        return Contents(kind, tensors=[(n, f.descriptor(n), f.buffers(n)) for n in f.names
                                       if n not in heads], file=f)
    with inp.stream() as fh:
        items = list(TensorStreamReader(fh))
    if (len(items) == 1 and _is_group(items[0].desc)
            and _has_block_paged([m.desc for m in items[0].members])):
        return Contents(kind, snapshot=KVCacheSnapshot.from_members(
            [(None, m.desc, m.buffers) for m in items[0].members]))
    flat: list[tuple[str | None, TensorDescriptor, Any]] = []

    def walk(item: Any) -> None:
        if not isinstance(item.desc.layout, Composite):
            flat.append((None, item.desc, item.buffers))
        for m in item.members:
            walk(m)

    for item in items:
        walk(item)
    return Contents(kind, tensors=flat)


def check_tensors(contents: Contents) -> list[BlockPagedTensor | None]:
    """Each standalone block-paged tensor built (index invariants; lengths per D6)."""
    return [BlockPagedTensor.from_descriptor(d, b) if isinstance(d.layout, BlockPaged)
            else None for _, d, b in contents.tensors]
