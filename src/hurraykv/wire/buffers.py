"""Buffer handles: the 16-byte entries of a descriptor's buffer table.

``byte_size u64 | alignment u32 | device_tag u8 | sync_mode u8 | memory_class u8 |
reserved u8`` (buffer-protocol.md, ADR-020; decision D2 - the older metadata table
that shows bytes 13-15 as reserved is stale and yields the same bytes when both
fields are 0).

Rules a reader enforces: alignment is a power of two, at least 64 for a non-empty
buffer (an empty buffer may declare any power of two, 1 included); device tags
0x09-0xEF are reserved and 0xFF invalid; sync modes above 2 are rejected and a CPU
buffer must be PRODUCER_SYNCED; memory classes 0x04-0xEF and 0xFF are rejected, a
private class needs a private device, and the (device, memory class) pair must be
one the buffer protocol lists.  All buffers of one descriptor share device_tag and
memory_class.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ..errors import HurrayBufferError

HANDLE = struct.Struct("<QIBBBB")
assert HANDLE.size == 16

DEVICE_TAGS = {
    0x00: "cpu", 0x01: "cuda", 0x02: "rocm", 0x03: "metal", 0x04: "vulkan",
    0x05: "webgpu", 0x06: "hexagon", 0x07: "level_zero", 0x08: "opencl",
}
SYNC_MODES = {0x00: "producer_synced", 0x01: "event", 0x02: "consumer_stream"}
MEMORY_CLASSES = {0x00: "standard", 0x01: "host_pinned", 0x02: "unified", 0x03: "peer"}

_ALL = frozenset({0, 1, 2, 3})
_NO_PEER = frozenset({0, 1, 2})
# Memory classes each public device may use (buffer-protocol.md § memory_class).
VALID_CLASSES = {
    0x00: _NO_PEER, 0x01: _ALL, 0x02: _ALL, 0x03: _NO_PEER, 0x04: _ALL,
    0x05: frozenset({0}), 0x06: _NO_PEER, 0x07: _ALL, 0x08: _NO_PEER,
}


def _private(v: int) -> bool:
    return 0xF0 <= v <= 0xFE


def device_name(tag: int) -> str:
    return DEVICE_TAGS.get(tag, f"private_0x{tag:02x}" if _private(tag) else f"0x{tag:02x}")


def memory_class_name(v: int) -> str:
    return MEMORY_CLASSES.get(v, f"private_0x{v:02x}" if _private(v) else f"0x{v:02x}")


class BufferHandle(NamedTuple):
    """One buffer-table entry.  A NamedTuple: decoding builds one per buffer, cheaply."""

    byte_size: int
    alignment: int = 64
    device_tag: int = 0
    sync_mode: int = 0
    memory_class: int = 0
    reserved: int = 0

    def encode(self) -> bytes:
        return HANDLE.pack(
            self.byte_size, self.alignment, self.device_tag, self.sync_mode,
            self.memory_class, self.reserved,
        )

    def to_json(self) -> dict[str, object]:
        return {
            "byte_size": self.byte_size,
            "alignment": self.alignment,
            "device_tag": self.device_tag,
            "sync_mode": self.sync_mode,
            "memory_class": self.memory_class,
        }


def handle(byte_size: int, alignment: int = 64, device_tag: int = 0, sync_mode: int = 0,
           memory_class: int = 0) -> BufferHandle:
    """The handle a writer declares for ``byte_size`` bytes: an empty buffer declares
    alignment 1, as the reference's ``BufferHandle::empty()`` does (any power of two is
    valid there), so both write the same bytes."""
    return BufferHandle(byte_size, alignment if byte_size else 1, device_tag, sync_mode,
                        memory_class)


def check_handle(h: BufferHandle, index: int, base: int) -> None:
    """Reject a handle that breaks a byte-level rule; ``base`` is its byte offset."""
    name = f"buffers[{index}]"
    a = h.alignment
    if a == 0 or a & (a - 1):
        raise HurrayBufferError.at(f"{name}.alignment", base + 8, a,
                                   "alignment MUST be a power of two")
    if h.byte_size > 0 and a < 64:
        raise HurrayBufferError.at(
            f"{name}.alignment", base + 8, a, "a non-empty buffer MUST be aligned to >= 64 bytes"
        )
    dev = h.device_tag
    if dev == 0xFF:
        raise HurrayBufferError.at(f"{name}.device_tag", base + 12, dev,
                                   "device tag 0xFF is invalid")
    if dev not in DEVICE_TAGS and not _private(dev):
        raise HurrayBufferError.at(
            f"{name}.device_tag", base + 12, dev, "device tags 0x09-0xEF are reserved"
        )
    if h.sync_mode not in SYNC_MODES:
        raise HurrayBufferError.at(
            f"{name}.sync_mode", base + 13, h.sync_mode, "sync_mode MUST be 0x00, 0x01 or 0x02"
        )
    if dev == 0x00 and h.sync_mode != 0:
        raise HurrayBufferError.at(
            f"{name}.sync_mode", base + 13, h.sync_mode,
            "a CPU buffer MUST be PRODUCER_SYNCED (0x00)",
        )
    mc = h.memory_class
    if mc not in MEMORY_CLASSES and not _private(mc):
        raise HurrayBufferError.at(
            f"{name}.memory_class", base + 14, mc, "memory classes 0x04-0xEF and 0xFF are reserved"
        )
    ok = (mc == 0 or _private(mc)) if _private(dev) else mc in VALID_CLASSES[dev]
    if not ok:
        raise HurrayBufferError.at(
            f"{name}.memory_class", base + 14, mc,
            f"memory class {memory_class_name(mc)} is not valid on device {device_name(dev)}",
        )
    if h.reserved:
        raise HurrayBufferError.at(f"{name}.reserved", base + 15, h.reserved,
                                   "reserved byte MUST be 0")


def check_colocation(handles: tuple[BufferHandle, ...], table_offset: int) -> None:
    """All buffers of one descriptor MUST share device_tag and memory_class."""
    if not handles:
        return
    first = handles[0]
    for i, h in enumerate(handles[1:], start=1):
        base = table_offset + 1 + 16 * i
        if h.device_tag != first.device_tag:
            raise HurrayBufferError.at(
                f"buffers[{i}].device_tag", base + 12, h.device_tag,
                f"all buffers MUST share buffer 0's device_tag 0x{first.device_tag:02x}",
            )
        if h.memory_class != first.memory_class:
            raise HurrayBufferError.at(
                f"buffers[{i}].memory_class", base + 14, h.memory_class,
                f"all buffers MUST share buffer 0's memory_class 0x{first.memory_class:02x}",
            )
