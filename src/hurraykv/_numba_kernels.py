"""The numba kernels behind ``kernels.py`` (imported on first use: numba costs ~0.2 s).

Each function is the NumPy arithmetic of ``quant/`` written per slot row; see the
``kernels`` module docstring for the contract.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


@intrinsic
def _f32_from_bits(typingctx, bits):
    """Reinterpret a uint32 as float32 (a bitcast; numba has no scalar view)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen

_jit = numba.njit(cache=True, nogil=True, inline="always")
_kernel = numba.njit(cache=True, nogil=True)

@_jit
def _to_f32(b, kind):
    """float32 of one input element's bits (exact, subnormals included)."""
    if kind == 2:
        return _f32_from_bits(np.uint32(b))
    if kind == 1:
        return _f32_from_bits(np.uint32(b) << np.uint32(16))
    h = np.uint32(b)
    mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
    # exponent and mantissa shifted into float32 place, then scaled by 2**112:
    # exact for normals and subnormals; Inf/NaN keep an all-ones exponent
    if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
        mag |= np.uint32(0x7F800000)
        v = _f32_from_bits(mag)
    else:
        v = _f32_from_bits(mag) * np.float32(5.192296858534828e33)
    if h & np.uint32(0x8000):
        return -v
    return v

@_jit
def _key_limits(kind):
    """(sign bit, magnitude mask, magnitude of +Inf) of an input kind's bits."""
    if kind == 2:
        return np.int64(0x80000000), np.int64(0x7FFFFFFF), np.int64(0x7F800000)
    if kind == 1:
        return np.int64(0x8000), np.int64(0x7FFF), np.int64(0x7F80)
    return np.int64(0x8000), np.int64(0x7FFF), np.int64(0x7C00)

@_jit
def _row_range(x, i, kind):
    """(min, max, finite) of slot row ``i`` as float32.  Sign-magnitude bits map to
    ordered integers (``-magnitude`` for negatives), so the search is integer and
    vectorises; the float32 min and max are the values of the extreme keys."""
    sign, mask, inf = _key_limits(kind)
    lo = np.int64(mask)
    hi = -np.int64(mask)
    for j in range(x.shape[1]):
        b = np.int64(x[i, j])
        m = b & mask
        k = -m if b & sign else m
        lo = min(lo, k)
        hi = max(hi, k)
    finite = lo > -inf and hi < inf
    flo = _to_f32(lo if lo >= 0 else ((-lo) | sign), kind)
    fhi = _to_f32(hi if hi >= 0 else ((-hi) | sign), kind)
    return flo, fhi, finite

@_jit
def _encode_row(x, i, kind, inv, zp, qmin, qmax, symmetric, codes):
    # clipped in every case, as quant/encode.py: a float -> int conversion out of range
    # is undefined and gives different codes on different instruction sets (H74)
    fz = np.float32(0.0) if symmetric else np.float32(zp)
    lo, hi = np.float32(qmin), np.float32(qmax)
    for j in range(x.shape[1]):
        q = np.rint(_to_f32(x[i, j], kind) * inv) + fz
        codes[i, j] = min(max(q, lo), hi)

@_kernel
def block_affine_quantize(x, kind, used, qmin, qmax, symmetric, codes, scales, zps,
                          start, stop):
    """Rows ``[start, stop)``: float32 scales and int32 zero-points per slot and the
    codes, exactly as ``quant.quantize_slots``.  False when a used row is not finite
    or its scale's extreme code overflows float32 (nothing is then promised about the outputs; the
    NumPy path refuses such rows by slot)."""
    for i in range(start, stop):
        if not used[i]:
            scales[i] = np.float32(1.0)
            zps[i] = 0
            for j in range(x.shape[1]):
                codes[i, j] = 0
            continue
        lo, hi, finite = _row_range(x, i, kind)
        if not finite:
            return False
        span = np.float32(qmax if symmetric else qmax - qmin)
        if symmetric:
            scale = max(abs(lo), abs(hi)) / span
        else:
            lo = min(lo, np.float32(0.0))
            hi = max(hi, np.float32(0.0))
            scale = (hi - lo) / span
        # the code farthest from the zero-point: -qmin for a symmetric signed type
        reach = np.float32(max(qmax, -qmin) if symmetric else qmax - qmin)
        if not np.isfinite(scale * reach):  # quant/params.py refuses it
            return False
        tiny = np.float32(1.1754943508222875e-38)  # quant.TINY
        scale = max(scale, tiny) if scale > 0 else np.float32(1.0)
        zp = 0
        if not symmetric:
            zf = np.rint(np.float32(qmin) - lo / scale)
            zp = int(min(max(zf, np.float32(qmin)), np.float32(qmax)))
        scales[i] = scale
        zps[i] = zp
        _encode_row(x, i, kind, np.float32(1.0) / scale, zp, qmin, qmax, symmetric, codes)
    return True

@_kernel
def row_ranges(x, kind, used, lo, hi, start, stop):
    """Per-row float32 min and max (0 for unused rows); False on a non-finite row."""
    for i in range(start, stop):
        if not used[i]:
            lo[i] = 0
            hi[i] = 0
            continue
        a, b, finite = _row_range(x, i, kind)
        if not finite:
            return False
        lo[i] = a
        hi[i] = b
    return True

@_kernel
def encode_rows(x, kind, used, scales, zps, qmin, qmax, symmetric, codes, start, stop):
    """Codes of rows ``[start, stop)`` under given per-row scales and zero-points."""
    for i in range(start, stop):
        if not used[i]:
            for j in range(x.shape[1]):
                codes[i, j] = 0
            continue
        _encode_row(x, i, kind, np.float32(1.0) / scales[i], zps[i], qmin, qmax,
                    symmetric, codes)

@_kernel
def dequantize_gather(rows, slots, scales, zps, has_zp, out, start, stop):
    """``out[i] = float32(rows[slots[i]] - zp[slot]) * scale[slot]`` for
    ``i`` in ``[start, stop)`` (per-slot parameters, unpacked codes)."""
    for i in range(start, stop):
        s = slots[i]
        sc = scales[s]
        if has_zp:
            z = np.int32(zps[s])  # int32 arithmetic, wrapping as NumPy's does
            for j in range(rows.shape[1]):
                out[i, j] = np.float32(np.int32(np.int32(rows[s, j]) - z)) * sc
        else:
            for j in range(rows.shape[1]):
                out[i, j] = np.float32(rows[s, j]) * sc

@_jit
def _code(byte, t, bits, signed):
    """Code ``t`` of a packed byte (low bits first), sign-extended for signed types."""
    c = np.int32((byte >> (t * bits)) & ((1 << bits) - 1))
    if signed:
        half = 1 << (bits - 1)
        c = (c ^ half) - half
    return c


@_jit
def _packed_slot(pages, page, first, row_elems, bits, signed, sc, z, out, i):
    """One slot row from packed bytes; ``bits`` is a literal at every call site, so the
    loops unroll and vectorise."""
    per = 8 // bits
    if first % per == 0 and row_elems % per == 0:  # the slot starts and ends on bytes
        base = first // per
        for k in range(row_elems // per):
            byte = pages[page, base + k]
            for t in range(per):
                out[i, k * per + t] = np.float32(np.int32(_code(byte, t, bits, signed) - z)) * sc
    else:
        for j in range(row_elems):
            e = first + j
            c = _code(pages[page, e // per], e % per, bits, signed)
            out[i, j] = np.float32(np.int32(c - z)) * sc


@_kernel
def dequantize_gather_packed(pages, slots, page_size, row_elems, bits, signed, scales,
                             zps, has_zp, out, start, stop):
    """As ``dequantize_gather`` over packed 2- or 4-bit pages (D11: each page's
    elements in row-major order, low bits first)."""
    for i in range(start, stop):
        s = slots[i]
        sc = scales[s]
        z = np.int32(zps[s]) if has_zp else np.int32(0)
        page, first = s // page_size, (s % page_size) * row_elems
        if bits == 4:
            _packed_slot(pages, page, first, row_elems, 4, signed, sc, z, out, i)
        else:
            _packed_slot(pages, page, first, row_elems, 2, signed, sc, z, out, i)


@_jit
def _pack_range(codes, bits, out, start, stop):
    per = 8 // bits
    mask = (1 << bits) - 1
    for k in range(start, stop):
        acc = 0
        for t in range(per):
            acc |= (np.int32(codes[k * per + t]) & mask) << (t * bits)
        out[k] = acc


@_kernel
def pack_bits(codes, bits, out, start, stop):
    """Pack bytes ``[start, stop)`` of ``out`` from ``codes`` (values in range, a whole
    number of bytes of them), ``8 // bits`` codes per byte, low bits first."""
    if bits == 4:
        _pack_range(codes, 4, out, start, stop)
    else:
        _pack_range(codes, 2, out, start, stop)


@intrinsic
def _bits_of_f32(typingctx, value):
    """Reinterpret a float32 as uint32 (a bitcast)."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return sig, codegen


@_jit
def _bf16(v):
    """bfloat16 bits of a finite float32, rounded to nearest even (as torch converts)."""
    u = _bits_of_f32(v)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                     >> np.uint32(16))


@_jit
def _e4m3(b):
    """float32 of float8 e4m3fn bits, exactly: normals by moving exponent and mantissa
    into float32 place (bias 7 -> 127), subnormals as ``mantissa * 2**-9`` (no float32
    subnormal is formed, so a flush-to-zero mode cannot change them); 0x7F and 0xFF are
    NaN, as in NumPy's conversion.  Selects, not branches: the loop vectorises."""
    u = np.uint32(b)
    e = (u >> np.uint32(3)) & np.uint32(15)
    m = u & np.uint32(7)
    normal = ((e + np.uint32(120)) << np.uint32(23)) | (m << np.uint32(20))
    small = _bits_of_f32(np.float32(np.int32(m)) * np.float32(0.001953125))
    bits = small if e == np.uint32(0) else normal
    bits = np.uint32(0x7FC00000) if (u & np.uint32(0x7F)) == np.uint32(0x7F) else bits
    return _f32_from_bits(bits | ((u & np.uint32(0x80)) << np.uint32(24)))


@_jit
def _scaled(v, rs, col_scales, per_column, j):
    return v * rs * col_scales[j] if per_column else v * rs


@_kernel
def dequantize_rows(codes, fp8, row_scales, col_scales, per_column, out, to_bf16, start,
                    stop):
    """``out[i, j] = value(codes[i, j]) * row_scales[i] * col_scales[j]`` for rows
    ``[start, stop)``: ``value`` is the int8 code itself, or the float8 e4m3 value of the
    byte (``fp8``); ``out`` float32, or bfloat16 bits (``to_bf16``).  Without
    ``per_column`` the column scales are 1 and not read.  A scale of 1 is exact, so
    per-slot and per-channel scales give the bits of ``code * scale``.  The flags are
    the same for every element: the branches leave the inner loops."""
    n = codes.shape[1]
    for i in range(start, stop):
        rs = row_scales[i]
        if fp8 and to_bf16:
            for j in range(n):
                out[i, j] = _bf16(_scaled(_e4m3(codes[i, j]), rs, col_scales, per_column, j))
        elif fp8:
            for j in range(n):
                out[i, j] = _scaled(_e4m3(codes[i, j]), rs, col_scales, per_column, j)
        elif to_bf16:
            for j in range(n):
                out[i, j] = _bf16(_scaled(np.float32(np.int8(codes[i, j])), rs, col_scales,
                                          per_column, j))
        else:
            for j in range(n):
                out[i, j] = _scaled(np.float32(np.int8(codes[i, j])), rs, col_scales,
                                    per_column, j)


@_kernel
def dequantize_packed_rows(packed, row_scales, col_scales, per_column, out, to_bf16, start,
                           stop):
    """As ``dequantize_rows`` for signed 4-bit codes, two a byte, low nibble first."""
    n = packed.shape[1]
    for i in range(start, stop):
        rs = row_scales[i]
        for k in range(n):
            b = np.int32(packed[i, k])
            lo = _scaled(np.float32(((b & 15) ^ 8) - 8), rs, col_scales, per_column, 2 * k)
            hi = _scaled(np.float32((((b >> 4) & 15) ^ 8) - 8), rs, col_scales, per_column,
                         2 * k + 1)
            if to_bf16:
                out[i, 2 * k] = _bf16(lo)
                out[i, 2 * k + 1] = _bf16(hi)
            else:
                out[i, 2 * k] = lo
                out[i, 2 * k + 1] = hi


@_kernel
def fp8_e4m3_encode(x, kind, scale, out, start, stop):
    """``out[i, j]``: the float8 e4m3fn bits of ``clip(x[i, j] / scale, -448, 448)``,
    rounded to nearest even, subnormals included: what NumPy's ``clip`` then
    ``astype(float8_e4m3fn)`` gives (finite input; the caller checks)."""
    top = np.float32(448.0)
    for i in range(start, stop):
        for j in range(x.shape[1]):
            v = min(max(_to_f32(x[i, j], kind) / scale, -top), top)
            u = _bits_of_f32(v)
            sign = np.uint8((u >> np.uint32(24)) & np.uint32(0x80))
            a = _f32_from_bits(u & np.uint32(0x7FFFFFFF))
            if a < np.float32(0.015625):  # below 2**-6: subnormal steps of 2**-9
                code = np.uint8(np.rint(a * np.float32(512.0)))
            else:
                r = u & np.uint32(0x7FFFFFFF)
                r = r + np.uint32(0x7FFFF) + ((r >> np.uint32(20)) & np.uint32(1))
                code = np.uint8((r >> np.uint32(20)) - np.uint32(120 << 3))
            out[i, j] = code | sign


@_kernel
def column_keys(x, kind, used, lo, hi, start, stop):
    """Per column, the smallest and largest ordered key (``_row_range``'s: sign-magnitude
    bits as integers) of the used rows ``[start, stop)``, folded into ``lo`` and ``hi``
    (this band's own arrays); False when a used value is not finite."""
    sign, mask, inf = _key_limits(kind)
    for i in range(start, stop):
        if not used[i]:
            continue
        for j in range(x.shape[1]):
            b = np.int64(x[i, j])
            m = b & mask
            k = -m if b & sign else m
            lo[j] = min(lo[j], k)
            hi[j] = max(hi[j], k)
    finite = True
    for j in range(x.shape[1]):
        finite = finite and lo[j] > -inf and hi[j] < inf
    return finite


@_kernel
def encode_columns(x, kind, used, inv, qmin, qmax, codes, start, stop):
    """Symmetric codes ``clip(rint(x * inv[column]))`` of rows ``[start, stop)``; an unused
    row is encoded from zeros, as the NumPy path does."""
    lo, hi = np.float32(qmin), np.float32(qmax)
    for i in range(start, stop):
        if used[i]:
            for j in range(x.shape[1]):
                codes[i, j] = min(max(np.rint(_to_f32(x[i, j], kind) * inv[j]), lo), hi)
        else:
            for j in range(x.shape[1]):
                codes[i, j] = min(max(np.rint(np.float32(0.0) * inv[j]), lo), hi)
