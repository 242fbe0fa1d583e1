"""Dequantizing: codes back into float32 by the formula of their scheme (NumPy, over
chunks of rows), the per-block-affine gather straight from the page rows in one
compiled pass, and the compiled decode of int8, int4 and float8 e4m3 codes into float32
or bfloat16 with the scale plan of the scheme's granularity (``KERNEL_PLANS``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import alloc
from .. import kernels as _k
from ..errors import QuantizationError
from ..threads import run_bands
from ..wire.dtypes import ElementType
from ..wire.quantization import (
    Quantization,
)
from .params import SCHEMES, chunk_rows, params_arrays


def dequantize(codes: np.ndarray, slots: np.ndarray, q: Quantization,
               params: tuple[np.ndarray, ...], num_slots: int) -> np.ndarray:
    """float32 values of ``codes`` ``[n, H, D]`` taken from pool slots ``slots``."""
    n, heads, dim = codes.shape
    shape = [1, 1, 1]
    if q is None or not q.AFFINE:
        *first, last = (name.replace("_", "-") for name in SCHEMES)
        raise QuantizationError.at("quantization", None, type(q).__name__,
                                   f"hurraykv dequantizes {', '.join(first)} and {last} "
                                   "block-paged tensors")
    if q.per_slot:
        scales, zps = params_arrays(q, params, num_slots)
        scale = scales[slots][:, None, None]
        zero = None if zps is None else zps[slots][:, None, None]
        per_row = True
    elif q.GRANULARITY == "channel":
        shape[q.axis] = codes.shape[q.axis]
        scales, zps = params_arrays(q, params, shape[q.axis])
        scale, zero, per_row = scales.reshape(shape), zps, False
        zero = None if zps is None else zps.reshape(shape)
    else:  # per tensor: parameters in the section itself
        scale = np.float32(q.scale)
        zero = None if q.zero_point == 0 else np.int32(q.zero_point)
        per_row = False
    out = alloc.empty(codes.shape, np.float32)
    wide = np.int64 if codes.dtype.itemsize >= 4 else np.int32
    step = chunk_rows(heads * dim)
    for a in range(0, n, step):  # chunks of rows keep the temporaries in cache
        b = min(a + step, n)
        o = out[a:b]
        if zero is None:
            o[...] = codes[a:b]
        else:
            z = zero[a:b] if per_row else zero
            o[...] = codes[a:b].astype(wide) - z
        o *= scale[a:b] if per_row else scale
    return out


def gather_dequantized(rows: np.ndarray, et: ElementType, page_size: int, heads: int,
                       dim: int, slots: np.ndarray, scales: np.ndarray,
                       zps: np.ndarray | None, out: np.ndarray | None = None
                       ) -> np.ndarray | None:
    """float32 ``[len(slots), heads, dim]`` of per-block-affine codes read straight from
    the page rows (packed or not) in one compiled pass, or None when the kernels do not
    apply (the caller then gathers and calls ``dequantize``).  Same values as that path.
    ``scales`` (float32) and ``zps`` (int32 or None): per slot, writable, contiguous."""
    if not (rows.flags.c_contiguous and et.bits in (2, 4, 8) and not et.is_float):
        return None
    kern = _k.impl()
    if kern is None:
        return None
    num_slots = rows.shape[0] * page_size
    has_zp = zps is not None
    if not has_zp:
        zps = np.zeros(1, np.int32)
    if not num_slots or len(scales) < num_slots or (has_zp and len(zps) < num_slots):
        return None  # short parameter buffers: the NumPy path reports them
    n, elems = len(slots), heads * dim
    idx = np.ascontiguousarray(slots, np.int64)
    if n and (idx.min() < 0 or idx.max() >= num_slots):
        return None  # the kernels do not bound-check: the NumPy path handles such slots
    if out is None:
        out = alloc.empty((n, heads, dim), np.float32)
    o2 = out.reshape(n, elems)
    if et.sub_byte:
        signed = et.is_signed
        run_bands(lambda a, b: kern.dequantize_gather_packed(
            rows, idx, page_size, elems, et.bits, signed, scales, zps, has_zp, o2, a, b),
            n, o2.nbytes)
    else:
        slot_rows = rows.reshape(num_slots, elems)
        run_bands(lambda a, b: kern.dequantize_gather(slot_rows, idx, scales, zps, has_zp, o2,
                                                    a, b), n, o2.nbytes)
    return out


# How the compiled decode (``decode_rows``) reads the scales of a scheme, by the
# ``GRANULARITY`` the scheme declares: (row scales [n] or None for ones, column scales
# [heads * dim] or None), from its float32 scales, the first slot and the count n.
Scales = tuple[np.ndarray | None, np.ndarray | None]


def _slot_plan(q: Quantization, scales: np.ndarray, first: int, n: int, heads: int,
               dim: int) -> Scales | None:
    return np.ascontiguousarray(scales[first:first + n], np.float32), None


def _channel_plan(q: Quantization, scales: np.ndarray, first: int, n: int, heads: int,
                  dim: int) -> Scales | None:
    if q.axis not in (1, 2):
        return None
    cols = np.tile(scales, heads) if q.axis == 2 else np.repeat(scales, dim)
    return None, np.ascontiguousarray(cols, np.float32)


def _tensor_plan(q: Quantization, scales: np.ndarray, first: int, n: int, heads: int,
                 dim: int) -> Scales | None:
    return np.full(n, scales[0], np.float32), None


KERNEL_PLANS = {"slot": _slot_plan, "channel": _channel_plan, "tensor": _tensor_plan}


def kernel_scales(q: Quantization, params: tuple[np.ndarray, ...], count: int, first: int,
                  n: int, heads: int, dim: int) -> Scales | None:
    """Row and column scales of slots ``first .. first + n - 1`` for the compiled decode,
    or None where it does not apply (zero-points, a scheme without a plan):
    ``KERNEL_PLANS`` by the scheme's ``GRANULARITY``; ``count``: its parameter entries."""
    plan = KERNEL_PLANS.get(q.GRANULARITY) if q.AFFINE else None
    if plan is None:
        return None
    scales, zps = params_arrays(q, params, count)
    if zps is not None and zps.any():
        return None
    return plan(q, scales, first, n, heads, dim)


DECODE_CODES = ("int8", "int4", "float8_e4m3")  # the element types decode_rows reads
DECODE_OUTPUTS = {np.dtype(np.float32): False, np.dtype(ml_dtypes.bfloat16): True}  # to_bf16
_NO_SCALES = np.ones(1, np.float32)  # what the kernels get for scales they skip


def decode_rows(codes: np.ndarray, et: ElementType, rows: np.ndarray | None,
                cols: np.ndarray | None, out: np.ndarray) -> bool:
    """``out[i, j] = value(codes[i, j]) * rows[i] * cols[j]`` in one compiled pass:
    ``codes`` ``[n, bytes]`` of int8, packed int4 or float8 e4m3 elements, ``out``
    ``[n, elements]`` float32 or bfloat16 (rounded to nearest even, as torch converts).
    False where the kernels do not apply (no numba, another type), nothing written."""
    kern = _k.impl()
    to_bf16 = DECODE_OUTPUTS.get(out.dtype)
    if kern is None or to_bf16 is None or et.name not in DECODE_CODES \
            or not codes.flags.c_contiguous:
        return False
    n = codes.shape[0]
    rows = np.ones(n, np.float32) if rows is None else rows
    per_column = cols is not None
    cols = cols if per_column else _NO_SCALES
    o2 = out.view(np.uint16) if to_bf16 else out
    if et.name == "int4":
        run_bands(lambda a, b: kern.dequantize_packed_rows(codes, rows, cols, per_column, o2,
                                                           to_bf16, a, b), n, out.nbytes)
    else:
        fp8 = et.name == "float8_e4m3"
        c = codes.view(np.uint8) if fp8 else codes.view(np.int8)
        run_bands(lambda a, b: kern.dequantize_rows(c, fp8, rows, cols, per_column, o2,
                                                    to_bf16, a, b), n, out.nbytes)
    return True
