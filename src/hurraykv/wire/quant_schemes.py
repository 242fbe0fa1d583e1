"""Quantization schemes: one frozen dataclass per scheme, found through a registry.

Everything about a scheme lives in its class, and nowhere else (issue 21):

* ``TAG``, ``NAME``                  the wire tag and the name printed and accepted
* ``LENGTH``                         fixed payload bytes, the 4-byte header included
* ``FLAGS``                          the flag bits the scheme defines (others reserved)
* ``STORAGE``                        element types the quantized data may be stored as
* ``SCALE_TYPES``                    ``scale_type`` values it allows (``SCALE_TYPE_NAMES``)
* ``GRANULARITY``                    one parameter per ``"tensor"``, ``"channel"``,
                                     page ``"slot"`` (decision D4) or ``"block"``
* ``AFFINE``                         ``x = scale * (q - zero_point)``: hurraykv quantizes
                                     and dequantizes it (``hurraykv.quant``)
* ``BLOCK_PAGED``                    has a composition rule with the block-paged layout
                                     (else relaxed, decision D3)
* ``decode_body`` / ``encode_body``  the payload after the header, with its byte rules
* ``check_in_context``               rules tying it to its descriptor (type, shape, buffers)
* ``check_block_paged``              its block-paged rules
* properties ``per_slot``, ``scale_width``, ``buffers``, ``flags``

The base class and the registry are in ``quant_registry.py``; the tables other modules
used to keep (``SCHEME_NAMES``, ``VALID_STORAGE``, ``quant.SCHEMES``,
``block_paged.SCALE_WIDTH``) are views of the registry.  Adding a scheme is one class
here plus ``@register`` (docs/architecture.md ("Extending hurraykv")).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import QuantizationError
from .cursor import Cursor
from .dtypes import ELEMENT_TYPES
from .quant_registry import (
    INT_STORAGE,
    NO_BUFFER,
    SCALE_TYPE_NAMES,
    SYMMETRIC,
    QuantScheme,
    as_written,
    check_param_sizes,
    decodes_finitely,
    farthest_code,
    is_pow2,
    overflow_rule,
    product,
    register,
    storage_range,
)


@register
@dataclass(frozen=True)
class PerTensor(QuantScheme):
    scale: float
    zero_point: int = 0
    padding: bytes = b""
    TAG: ClassVar[int] = 0x01
    NAME: ClassVar[str] = "per_tensor"
    LENGTH: ClassVar[int] = 16
    STORAGE: ClassVar[tuple[str, ...]] = (*INT_STORAGE, "int16", "uint16", "int32", "uint32")
    SCALE_TYPES: ClassVar[tuple[int, ...]] = (0x03,)
    GRANULARITY: ClassVar[str | None] = "tensor"
    AFFINE: ClassVar[bool] = True
    BLOCK_PAGED: ClassVar[bool] = True
    _BODY: ClassVar[struct.Struct] = struct.Struct("<fi4x")

    def __post_init__(self) -> None:
        # The wire holds a float32: keep the value it round-trips to, so equality holds.
        object.__setattr__(self, "scale", struct.unpack("<f", struct.pack("<f", self.scale))[0])

    @classmethod
    def decode_body(cls, cur: Cursor, start: int, flags: int) -> PerTensor:
        scale = float(cur.scalar("f32", "q.scale"))
        zp = cur.i32("q.zero_point")
        cur.zeros(4, "q._reserved", QuantizationError)
        if not math.isfinite(scale) or scale == 0.0:
            raise QuantizationError.at("q.scale", start + 4, scale,
                                       "scale MUST be finite and non-zero")
        return cls(scale, zp)

    def encode_body(self) -> bytes:
        return self._BODY.pack(self.scale, self.zero_point)

    @classmethod
    def for_buffers(cls, *, axis: int | None, symmetric: bool, scale_type: int,
                    scale: float = 1.0, zero_point: int = 0) -> PerTensor:
        """The section for parameters hurraykv computed (``hurraykv.quant``)."""
        return cls(scale, zero_point)

    def check_in_context(self, desc: Any, cur: Cursor, *, paged: bool) -> None:
        super().check_in_context(desc, cur, paged=paged)
        lo, hi = storage_range(ELEMENT_TYPES[desc.type_tag].name)
        if not lo <= self.zero_point <= hi:
            raise QuantizationError.at("q.zero_point", (cur.at("q.scheme_tag") or 0) + 8,
                                       self.zero_point,
                                       f"zero_point MUST lie in the storage range [{lo}, {hi}]")
        steps = int(farthest_code(lo, hi, self.zero_point))
        if not decodes_finitely(self.scale, steps):
            raise QuantizationError.at("q.scale", (cur.at("q.scheme_tag") or 0) + 4,
                                       as_written(self.scale), overflow_rule(
                                           steps, ELEMENT_TYPES[desc.type_tag].name))


class _Axis(QuantScheme):
    """Schemes along one axis with a scale buffer: the shared context rules."""

    axis: int
    scale_buffer: int
    SCALE_DTYPE: ClassVar[str] = "float32"  # without a scale_type field

    @property
    def buffers(self) -> tuple[int, ...]:
        zp = self.zero_point_buffer
        return (self.scale_buffer,) if zp is None else (self.scale_buffer, zp)

    @property
    def scale_dtype(self) -> str:
        return self.SCALE_DTYPE

    def param_count(self, shape: tuple[int, ...]) -> int:
        size = shape[self.axis]
        return product(shape[: self.axis] + shape[self.axis + 1:]) * -(-size // self.block_size)

    def check_axis_size(self, size: int, base: int, paged: bool) -> None:
        """Rules between ``shape[axis]`` and the scheme's fields."""

    def check_in_context(self, desc: Any, cur: Cursor, *, paged: bool) -> None:
        super().check_in_context(desc, cur, paged=paged)
        shape: tuple[int, ...] = desc.shape
        handles = desc.buffers
        base = cur.at("q.scheme_tag") or 0
        if self.axis >= len(shape):
            raise QuantizationError.at("q.axis", base + 4, self.axis,
                                       f"axis MUST be < rank ({len(shape)})")
        size = shape[self.axis]
        if size == 0xFFFFFFFFFFFFFFFF:
            raise QuantizationError.at(f"shape[{self.axis}]", 20 + 8 * self.axis, size,
                                       "a quantized axis MUST NOT be dynamic")
        idx_fields = (("q.scale_buffer_index", self.scale_buffer),) + (
            (("q.zero_point_buffer_index", self.zero_point_buffer),)
            if self.zero_point_buffer is not None else ())
        for name, i in idx_fields:
            if i == 0 or i >= len(handles):
                raise QuantizationError.at(
                    name, cur.at(name), i,
                    f"a parameter buffer index MUST name a buffer other than the data buffer "
                    f"(1..{len(handles) - 1})")
        self.check_axis_size(size, base, paged)
        if paged and self.per_slot:
            return  # sized by the page slots, in the block-paged rules (D4)
        check_param_sizes(self, handles, self.param_count(shape), self.scale_width, cur)


class _Affine(_Axis):
    """Per-channel and per-block affine: optional zero-points (None: SYMMETRIC) and a
    ``scale_type`` field."""

    scale_type: int
    FLAGS: ClassVar[int] = SYMMETRIC
    STORAGE: ClassVar[tuple[str, ...]] = INT_STORAGE
    AFFINE: ClassVar[bool] = True
    BLOCK_PAGED: ClassVar[bool] = True
    SCALE_TYPE_RULE: ClassVar[str]
    _TAIL: ClassVar[struct.Struct] = struct.Struct("<IIB3x")

    @property
    def symmetric(self) -> bool:
        return self.zero_point_buffer is None

    @property
    def flags(self) -> int:
        return SYMMETRIC if self.symmetric else 0

    @property
    def scale_dtype(self) -> str:
        return SCALE_TYPE_NAMES[self.scale_type]

    @property
    def _zp_field(self) -> int:
        return NO_BUFFER if self.zero_point_buffer is None else self.zero_point_buffer

    def _tail(self) -> bytes:
        return self._TAIL.pack(self.scale_buffer, self._zp_field, self.scale_type)

    @classmethod
    def _read_tail(cls, cur: Cursor) -> tuple[int, int, int]:
        sbuf = cur.u32("q.scale_buffer_index")
        zbuf = cur.u32("q.zero_point_buffer_index")
        stype = cur.u8("q.scale_type")
        cur.zeros(3, "q._reserved", QuantizationError)
        return sbuf, zbuf, stype

    @classmethod
    def _check_tail(cls, cur: Cursor, flags: int, sbuf: int, zbuf: int, stype: int
                    ) -> int | None:
        """The zero-point buffer (None when SYMMETRIC) once the buffer fields are valid."""
        sym = bool(flags & SYMMETRIC)
        if sbuf == NO_BUFFER:
            raise QuantizationError.at("q.scale_buffer_index", cur.at("q.scale_buffer_index"),
                                       sbuf, "a scale buffer index is required")
        if sym != (zbuf == NO_BUFFER):
            raise QuantizationError.at(
                "q.zero_point_buffer_index", cur.at("q.zero_point_buffer_index"), zbuf,
                "zero_point_buffer_index MUST be 0xFFFFFFFF if and only if SYMMETRIC is set "
                f"(SYMMETRIC is {'set' if sym else 'clear'})")
        if stype not in cls.SCALE_TYPES:
            raise QuantizationError.at("q.scale_type", cur.at("q.scale_type"), stype,
                                       cls.SCALE_TYPE_RULE)
        return None if sym else zbuf


@register
@dataclass(frozen=True)
class PerChannel(_Affine):
    axis: int
    scale_buffer: int
    zero_point_buffer: int | None = None
    scale_type: int = 0x03
    padding: bytes = b""
    TAG: ClassVar[int] = 0x02
    NAME: ClassVar[str] = "per_channel"
    LENGTH: ClassVar[int] = 20
    STORAGE: ClassVar[tuple[str, ...]] = PerTensor.STORAGE
    SCALE_TYPES: ClassVar[tuple[int, ...]] = (0x03,)
    SCALE_TYPE_RULE: ClassVar[str] = "per-channel scale_type MUST be 0x03 float32"
    GRANULARITY: ClassVar[str | None] = "channel"

    @classmethod
    def decode_body(cls, cur: Cursor, start: int, flags: int) -> PerChannel:
        axis = cur.u32("q.axis")
        sbuf, zbuf, stype = cls._read_tail(cur)
        return cls(axis, sbuf, cls._check_tail(cur, flags, sbuf, zbuf, stype), stype)

    def encode_body(self) -> bytes:
        return struct.pack("<I", self.axis) + self._tail()

    @classmethod
    def for_buffers(cls, *, axis: int | None, symmetric: bool, scale_type: int,
                    scale: float = 1.0, zero_point: int = 0) -> PerChannel:
        return cls(axis or 0, 3, None if symmetric else 4, scale_type)

    def param_count(self, shape: tuple[int, ...]) -> int:
        return shape[self.axis]

    def check_block_paged(self, page_size: int, cur: Cursor) -> None:
        if self.axis == 0:
            raise QuantizationError.at("q.axis", cur.at("q.axis"), 0,
                                       "per-channel MUST NOT quantize the paged axis 0; use "
                                       "per-block-affine with block_size == page_size")


@register
@dataclass(frozen=True)
class PerBlockAffine(_Affine):
    axis: int
    block_size: int
    scale_buffer: int
    zero_point_buffer: int | None = None
    scale_type: int = 0x03
    padding: bytes = b""
    TAG: ClassVar[int] = 0x03
    NAME: ClassVar[str] = "per_block_affine"
    LENGTH: ClassVar[int] = 24
    SCALE_TYPES: ClassVar[tuple[int, ...]] = (0x01, 0x02, 0x03)
    SCALE_TYPE_RULE: ClassVar[str] = \
        "per-block scale_type MUST be 0x01 f16, 0x02 bf16 or 0x03 f32"
    GRANULARITY: ClassVar[str | None] = "slot"

    @classmethod
    def decode_body(cls, cur: Cursor, start: int, flags: int) -> PerBlockAffine:
        axis = cur.u32("q.axis")
        block = cur.u32("q.block_size")
        sbuf, zbuf, stype = cls._read_tail(cur)
        if not (is_pow2(block) and block >= 2):
            raise QuantizationError.at("q.block_size", cur.at("q.block_size"), block,
                                       "block_size MUST be a power of two >= 2")
        return cls(axis, block, sbuf, cls._check_tail(cur, flags, sbuf, zbuf, stype), stype)

    def encode_body(self) -> bytes:
        return struct.pack("<II", self.axis, self.block_size) + self._tail()

    @classmethod
    def for_buffers(cls, *, axis: int | None, symmetric: bool, scale_type: int,
                    scale: float = 1.0, zero_point: int = 0) -> PerBlockAffine:
        """block_size is the page size, set by the pool (``BlockPagedTensor.quantize``)."""
        return cls(0, 0, 3, None if symmetric else 4, scale_type)

    def check_axis_size(self, size: int, base: int, paged: bool) -> None:
        if size > 0 and self.block_size > size and not paged:
            raise QuantizationError.at("q.block_size", base + 8, self.block_size,
                                       f"block_size MUST NOT exceed shape[axis] ({size})")

    def check_block_paged(self, page_size: int, cur: Cursor) -> None:
        if self.axis != 0:
            raise QuantizationError.at("q.axis", cur.at("q.axis"), self.axis,
                                       "per-block-affine on block-paged MUST use axis 0")
        if self.block_size != page_size:
            raise QuantizationError.at("q.block_size", cur.at("q.block_size"), self.block_size,
                                       f"per-block-affine on block-paged MUST have block_size "
                                       f"== page_size ({page_size})")


@register
@dataclass(frozen=True)
class NF4(_Axis):
    axis: int
    block_size: int
    scale_buffer: int
    padding: bytes = b""
    TAG: ClassVar[int] = 0x04
    NAME: ClassVar[str] = "nf4"
    LENGTH: ClassVar[int] = 16
    STORAGE: ClassVar[tuple[str, ...]] = ("uint4",)
    GRANULARITY: ClassVar[str | None] = "block"
    BLOCK_RULE: ClassVar[str] = "NF4 block_size MUST be a power of two"
    _BODY: ClassVar[struct.Struct] = struct.Struct("<III")

    @classmethod
    def block_ok(cls, block: int) -> bool:
        return is_pow2(block)

    @classmethod
    def decode_body(cls, cur: Cursor, start: int, flags: int) -> NF4:
        axis = cur.u32("q.axis")
        block = cur.u32("q.block_size")
        sbuf = cur.u32("q.scale_buffer_index")
        if not cls.block_ok(block):
            raise QuantizationError.at("q.block_size", cur.at("q.block_size"), block,
                                       cls.BLOCK_RULE)
        return cls(axis, block, sbuf)

    def encode_body(self) -> bytes:
        return self._BODY.pack(self.axis, self.block_size, self.scale_buffer)


@register
@dataclass(frozen=True)
class MXFP(NF4):
    TAG: ClassVar[int] = 0x05
    NAME: ClassVar[str] = "mxfp"
    STORAGE: ClassVar[tuple[str, ...]] = ("float8_e4m3", "float8_e5m2", "float4_e2m1",
                                          "float6_e2m3", "float6_e3m2", "int8", "int4")
    SCALE_DTYPE: ClassVar[str] = "float8_e8m0"
    BLOCK_RULE: ClassVar[str] = "MXFP block_size MUST be a power of two in [16, 2048]"

    @classmethod
    def block_ok(cls, block: int) -> bool:
        return is_pow2(block) and 16 <= block <= 2048

    def check_axis_size(self, size: int, base: int, paged: bool) -> None:
        if size == 0 or size % self.block_size:
            raise QuantizationError.at(f"shape[{self.axis}]", 20 + 8 * self.axis, size,
                                       f"MXFP needs shape[axis] a positive multiple of "
                                       f"block_size ({self.block_size})")


__all__ = ["MXFP", "NF4", "PerBlockAffine", "PerChannel", "PerTensor"]
