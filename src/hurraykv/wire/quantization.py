"""The quantization section: ``u32 quantization_length`` then that many bytes.

Every payload opens with ``scheme_tag u8 | scheme_version u8 (= 1) | flags u16``.

=====  ====================  ===  ==========================================================
tag    scheme                len  rest of the payload (offsets from the payload start)
=====  ====================  ===  ==========================================================
0x01   per-tensor affine     16   4 scale f32 (finite, non-zero), 8 zero_point i32, 12 rsv[4]
0x02   per-channel affine    20   4 axis, 8 scale_buf, 12 zp_buf (0xFFFFFFFF iff SYMMETRIC),
                                  16 scale_type u8 (= 0x03 float32), 17 rsv[3]
0x03   per-block affine      24   4 axis, 8 block_size (power of two >= 2), 12 scale_buf,
                                  16 zp_buf (0xFFFFFFFF iff SYMMETRIC), 20 scale_type u8
                                  (0x01 f16, 0x02 bf16, 0x03 f32), 21 rsv[3]
0x04   NF4                   16   4 axis, 8 block_size (power of two), 12 scale_buf
0x05   MXFP                  16   4 axis, 8 block_size (power of two in [16, 2048]), 12 scale_buf
=====  ====================  ===  ==========================================================

Flag bit 0 is SYMMETRIC for 0x02/0x03; every other flag bit is reserved.  Bytes
after a scheme's fixed length (inside quantization_length) are padding and kept
verbatim.  Tags: 0x00/0xFF invalid, 0x60-0xEF reserved (always rejected),
0x06-0x5F unknown and 0xF0-0xFE private (rejected unless reading permissively, and
then carried as raw bytes).

Each scheme is one class in ``quant_schemes`` (tag, name, payload layout, flags,
storage types, scale width, per-slot-ness, codec, context rules), found through the
registry in ``quant_registry``; the tables here are views of that registry.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import QuantizationError
from .cursor import Cursor
from .quant_registry import (
    NO_BUFFER,
    SCALE_TYPE_NAMES,
    SYMMETRIC,
    QuantScheme,
    RawQuantization,
    RegistryView,
    check_param_sizes,
    register,
    scheme_by_name,
    scheme_class,
    scheme_name,
    schemes,
    storage_range,
    unregister,
)
from .quant_schemes import MXFP, NF4, PerBlockAffine, PerChannel, PerTensor

SCALE_TYPES = SCALE_TYPE_NAMES
# Views of the registry (quant_schemes): a registered scheme appears in each of them.
SCHEME_NAMES = RegistryView(lambda c: c.NAME)
VALID_STORAGE = RegistryView(lambda c: c.STORAGE)
VALID_STORAGE_TAGS = RegistryView(lambda c: c.STORAGE_TAGS)

Quantization = QuantScheme


def decode_quantization(cur: Cursor, length: int) -> Quantization:
    """Decode a payload of ``length`` bytes at the cursor (``q.`` fields)."""
    start = cur.pos
    end = start + length
    if length < 4:
        raise QuantizationError.at("quantization_length", start - 4, length,
                                   "a quantization section holds at least its 4-byte header")
    tag = cur.u8("q.scheme_tag")
    version = cur.u8("q.scheme_version")
    flags = cur.u16("q.flags")
    if tag in (0x00, 0xFF) or 0x60 <= tag <= 0xEF:
        raise QuantizationError.at(
            "q.scheme_tag", start, tag,
            "scheme tags 0x00/0xFF are invalid and 0x60-0xEF reserved")
    cls = scheme_class(tag)
    if cls is None:
        kind = "private" if tag >= 0xF0 else "unknown"
        cur.relax(QuantizationError.at(
            "q.scheme_tag", start, tag,
            f"{kind} quantization scheme; rejected unless reading permissively"))
        cur.pos = start
        return RawQuantization(tag, bytes(cur.take(length, "q.payload")))
    if version != 1:
        raise QuantizationError.at("q.scheme_version", start + 1, version,
                                   "scheme_version MUST be 0x01")
    if flags & ~cls.FLAGS:
        raise QuantizationError.at("q.flags", start + 2, flags,
                                   f"reserved {cls.NAME} flag bits MUST be 0")
    if length < cls.LENGTH:
        raise QuantizationError.at("quantization_length", start - 4, length,
                                   f"{cls.NAME} needs {cls.LENGTH} bytes")
    q = cls.decode_body(cur, start, flags)
    pad = bytes(cur.take(end - cur.pos, "q.padding")) if end > cur.pos else b""
    if pad:
        q = replace(q, padding=pad)  # type: ignore[type-var]
    return q


def check_in_context(q: Quantization, desc: object, cur: Cursor, *, paged: bool) -> None:
    """Rules that tie a parsed scheme to its descriptor (type, rank, shape, buffers).

    Buffer sizes of per-block schemes follow the generic formula here; a block-paged
    tensor sizes per-slot parameters from its page structure instead (decision D4), so
    ``paged`` skips that part and the block-paged rules take over.
    """
    q.check_in_context(desc, cur, paged=paged)


__all__ = [
    "MXFP", "NF4", "NO_BUFFER", "SCALE_TYPES", "SCHEME_NAMES", "SYMMETRIC", "VALID_STORAGE",
    "VALID_STORAGE_TAGS", "PerBlockAffine", "PerChannel", "PerTensor", "QuantScheme",
    "Quantization", "RawQuantization", "check_in_context", "check_param_sizes",
    "decode_quantization", "register", "scheme_by_name", "scheme_class", "scheme_name",
    "schemes", "storage_range", "unregister",
]
