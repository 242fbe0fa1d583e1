"""The data plane of one tensor (floor 5; D10): where each byte of a tensor's data region
comes from when sending (``DataPlan``) and where each received TENSOR_DATA frame goes
(``DataAssembler``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..wire.descriptor import TensorDescriptor
from .memory import populate
from .messages import ErrorCode, protocol_error, total_data_bytes

POOL_MIN = 1 << 20  # smaller tensors come from the allocator


@dataclass
class DataPlan:
    """Where each byte of a tensor's data region (D10) comes from: byte views in order."""

    views: list[memoryview] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(v.nbytes for v in self.views)

    def frames(self, max_chunk: int):
        """``(offset, parts)`` per TENSOR_DATA frame, in ascending offset order: ``parts``
        are consecutive views (a frame may span buffers and segments) totalling at most
        ``max_chunk`` bytes, so small segments still travel in large frames."""
        offset, parts, size = 0, [], 0
        for v in self.views:
            pos = 0
            while pos < v.nbytes:
                take = min(v.nbytes - pos, max_chunk - size)
                parts.append(v[pos:pos + take])
                size += take
                pos += take
                if size == max_chunk:
                    yield offset, parts
                    offset, parts, size = offset + size, [], 0
        if parts:
            yield offset, parts


class DataAssembler:
    """Receives TENSOR_DATA frames of one tensor into one buffer: ascending offsets, no
    gaps, no overlaps, summing to total_data_bytes; then cut into the tensor's buffers.

    With a ``pool`` the buffer comes from recycled or fresh anonymous mappings, fresh
    pages being populated one frame ahead of the socket; without one the allocator's
    memory is used.  With ``into`` (writable byte views, one per buffer, of the sizes the
    descriptor gives) frames land in memory the caller already holds."""

    def __init__(self, desc: TensorDescriptor, *, pool: Any = None,
                 into: list[memoryview] | None = None) -> None:
        import numpy as np

        self.desc = desc
        self.total = total_data_bytes(desc)
        self._map: Any = None
        self._into = into
        self._ends: list[int] = []
        try:
            if into is not None:
                pos = 0
                for v in into:
                    pos += v.nbytes
                    self._ends.append(pos)
                self.data = None
            elif pool is not None and self.total >= POOL_MIN:
                self.data, mm, recycled = pool.take(self.total)
                self._map = None if recycled else mm
            else:
                self.data = np.empty(self.total, np.uint8)
        except (MemoryError, OSError, ValueError) as e:
            raise protocol_error(f"cannot hold a tensor of {self.total} bytes: {e}",
                                 ErrorCode.STORE_FULL, "total_data_bytes",
                                 value=self.total) from None
        self.received = 0

    def _check(self, offset: int, length: int) -> None:
        if offset != self.received:
            raise protocol_error(f"tensor_data at byte_offset {offset}: expected "
                                 f"{self.received} (frames ascend with no gaps or overlaps)",
                                 field_="byte_offset_in_buffer", value=offset)
        if offset + length > self.total:
            raise protocol_error(f"tensor_data at byte_offset {offset} + {length} bytes runs past "
                                 f"total_data_bytes {self.total}", field_="byte_offset_in_buffer",
                                 value=offset + length)
        self.received += length

    def target(self, offset: int, length: int) -> memoryview:
        """Where a frame of ``length`` bytes at ``offset`` goes (checked)."""
        self._check(offset, length)
        if self._map is not None and length and not populate(self._map, offset, length):
            self._map = None  # an older kernel: pages fault in as they are written
        return memoryview(self.data)[offset:offset + length]

    def targets(self, offset: int, length: int) -> list[memoryview]:
        """As ``target``, as one view per destination buffer the frame touches."""
        if self._into is None:
            return [self.target(offset, length)]
        self._check(offset, length)
        out, start, end = [], 0, offset + length
        for view, stop in zip(self._into, self._ends, strict=True):
            a, b = max(offset, start), min(end, stop)
            if a < b:
                out.append(view[a - start:b - start])
            start = stop
        return out

    def region(self, n: int) -> memoryview:
        """The first ``n`` bytes of where the data region lands (at most the first
        buffer's): contiguous memory, received in order."""
        if self._into is not None:
            return self._into[0][:n]
        return memoryview(self.data)[:n]

    def finish(self) -> list:
        if self.received != self.total:
            raise protocol_error(f"tensor_data_end after {self.received} of {self.total} bytes",
                                 field_="total_data_bytes", value=self.received)
        if self._into is not None:
            import numpy as np

            return [np.frombuffer(v, np.uint8) for v in self._into]
        out, pos = [], 0
        for h in self.desc.buffers:
            out.append(self.data[pos:pos + h.byte_size])
            pos += h.byte_size
        return out
