"""The one bounded little-endian reader: descriptors, protocol payloads, KV metadata,
store manifests and prefix-index values are all read through a :class:`Cursor`.

The cursor never reads past its limit and checks the size of an array against what is
left *before* reading it, so a count or length that claims more than the input holds
cannot make a decoder allocate.  Every failure is a :class:`HurrayError` subclass chosen
by the caller (``error=``) whose message names the field, its offset, the value found and
the rule; ``struct.error``, ``IndexError`` and ``UnicodeDecodeError`` never escape.  The
offsets it records feed error messages of rules checked later, across fields.

Defaults read a descriptor (errors are :class:`DescriptorError`, positions are descriptor
bytes).  Other readers name what they read (``noun``), the prefix of their field names
(``prefix``), how a position is shown (``where``, e.g. ``"payload byte"``) and the file
offset of their first byte (``base``)::

    cur = Cursor(payload, error=ProtocolError, noun="tensor_request payload",
                 prefix="tensor_request.", where="payload byte")
    key = cur.text("key")
    cur.end()
"""

from __future__ import annotations

import struct

from ..errors import DescriptorError, HurrayError

_FMT = {"u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q", "i32": "<i", "i64": "<q",
        "f32": "<f", "f64": "<d"}
_STRUCTS = {k: struct.Struct(v) for k, v in _FMT.items()}


class Cursor:
    def __init__(self, data: bytes | bytearray | memoryview, pos: int = 0,
                 limit: int | None = None, *, strict: bool = True,
                 error: type[HurrayError] = DescriptorError, noun: str = "descriptor",
                 prefix: str = "", where: str = "byte", base: int = 0,
                 bound: str | None = None) -> None:
        self.data = data if isinstance(data, memoryview) and data.format == "B" \
            else memoryview(data).cast("B")
        self.pos = pos
        self.limit = len(self.data) if limit is None else limit
        self.strict = strict
        self.error = error
        self.noun, self.prefix, self.where, self.base = noun, prefix, where, base
        self.bound = bound or (f"descriptor_length ({self.limit})" if noun == "descriptor"
                               else f"its {self.limit} bytes")
        self.offsets: dict[str, int] = {}
        self.relaxed: list[str] = []
        # (base, ((field, relative offset), ...)) of fixed structs read in one unpack;
        # resolved only when asked, which is mostly on the error path.
        self._blocks: list[tuple[int, tuple[tuple[str, int], ...]]] = []

    # -- errors --------------------------------------------------------------------
    def fail(self, field: str, offset: int | None, value: object, rule: str) -> HurrayError:
        """The caller's error for ``field`` at ``offset`` (relative to this reader)."""
        return self.error.at(self.prefix + field,
                             None if offset is None else self.base + offset, value, rule,
                             where=self.where)

    @property
    def left(self) -> int:
        return max(self.limit - self.pos, 0)

    # -- reads ---------------------------------------------------------------------
    def take(self, n: int, field: str) -> memoryview:
        if n > self.limit - self.pos:
            raise self.fail(field, self.pos, f"{self.left} bytes left",
                            f"{n} bytes are needed inside {self.bound}; the {self.noun} "
                            "is truncated")
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

    def utf8(self, raw: memoryview | bytes, field: str, at: int) -> str:
        """``raw`` (read at ``at``) as UTF-8, or the caller's error."""
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(field, at + e.start, bytes(raw[e.start:e.start + 4]),
                            "text MUST be valid UTF-8") from None

    def text(self, field: str, length: str = "u32") -> str:
        """A length-prefixed UTF-8 string (``length`` is the prefix's kind)."""
        n = int(self.scalar(length, f"{field}_length"))
        at = self.pos
        return self.utf8(self.take(n, field), field, at)

    def count(self, field: str, least: int, most: int | None = None) -> int:
        """A u32 count of entries of at least ``least`` bytes each (at most ``most``),
        refused before any entry is read when what is left cannot hold them."""
        at = self.pos
        n = self.u32(field)
        if (most is not None and n > most) or n * least > self.left:
            cap = "" if most is None else f"at most {most} entries, "
            raise self.fail(field, at, n, f"{cap}each at least {least} bytes of the "
                            f"{self.left} left")
        return n

    def zeros(self, n: int, field: str, error: type[HurrayError]) -> None:
        raw = bytes(self.take(n, field))
        if any(raw):
            i = next(k for k, b in enumerate(raw) if b)
            raise error.at(f"{field}[{i}]", self.offsets[field] + i, raw[i],
                           "reserved bytes MUST be 0")

    def end(self) -> None:
        """Every byte up to the limit was read."""
        if self.pos != self.limit:
            raise self.fail("trailing", self.pos, f"{self.left} unexpected bytes",
                            f"the {self.noun} ends after its fields")

    # -- permissive mode and recorded offsets -------------------------------------
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
