"""A bounded little-endian reader that remembers where every field was.

The cursor never reads past its limit (``min(descriptor_length, len(data))``) and
checks the size of an array against what is left *before* reading it, so a
descriptor that claims a huge rank or count cannot make the decoder allocate
more than the input holds.  The offsets it records feed error messages of rules
checked later, across fields.
"""

from __future__ import annotations

import struct

from ..errors import DescriptorError, HurrayError

_FMT = {"u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q", "i32": "<i", "i64": "<q",
        "f32": "<f", "f64": "<d"}
_STRUCTS = {k: struct.Struct(v) for k, v in _FMT.items()}


class Cursor:
    def __init__(self, data: memoryview, pos: int, limit: int, *, strict: bool = True) -> None:
        self.data = data
        self.pos = pos
        self.limit = limit
        self.strict = strict
        self.offsets: dict[str, int] = {}
        self.relaxed: list[str] = []
        # (base, ((field, relative offset), ...)) of fixed structs read in one unpack;
        # resolved only when asked, which is mostly on the error path.
        self._blocks: list[tuple[int, tuple[tuple[str, int], ...]]] = []

    def take(self, n: int, field: str) -> memoryview:
        if n > self.limit - self.pos:
            raise DescriptorError.at(
                field, self.pos, f"{max(self.limit - self.pos, 0)} bytes left",
                f"{n} bytes are needed inside descriptor_length ({self.limit}); "
                "the descriptor is truncated",
            )
        self.offsets[field] = self.pos
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, kind: str, field: str) -> int | float:
        s = _STRUCTS[kind]
        return s.unpack(self.take(s.size, field))[0]

    def u8(self, field: str) -> int:
        return int(self.scalar("u8", field))

    def u16(self, field: str) -> int:
        return int(self.scalar("u16", field))

    def u32(self, field: str) -> int:
        return int(self.scalar("u32", field))

    def u64(self, field: str) -> int:
        return int(self.scalar("u64", field))

    def i32(self, field: str) -> int:
        return int(self.scalar("i32", field))

    def array(self, kind: str, count: int, field: str) -> tuple[int, ...]:
        s = _STRUCTS[kind]
        raw = self.take(count * s.size, field)  # size checked before any allocation
        return struct.unpack(f"<{count}{s.format[1:]}", raw)

    def zeros(self, n: int, field: str, error: type[HurrayError]) -> None:
        raw = bytes(self.take(n, field))
        if any(raw):
            i = next(k for k, b in enumerate(raw) if b)
            raise error.at(f"{field}[{i}]", self.offsets[field] + i, raw[i],
                           "reserved bytes MUST be 0")

    def relax(self, err: HurrayError) -> None:
        """Raise in strict mode; in permissive mode remember the rule that was skipped."""
        if self.strict:
            raise err
        self.relaxed.append(str(err))

    def block(self, base: int, fields: tuple[tuple[str, int], ...]) -> None:
        """Record the offsets of a fixed struct read in one piece at ``base``."""
        self._blocks.append((base, fields))

    def at(self, field: str) -> int | None:
        off = self.offsets.get(field)
        if off is None:
            for base, fields in self._blocks:
                for name, rel in fields:
                    if name == field:
                        return base + rel
        return off
