"""Quantizing: slot rows of float values into codes and their parameters, by the
scheme's granularity (per-block-affine, per-channel, per-tensor), compiled in one pass
where the kernels apply (``kernels.py``), else in NumPy over chunks of slot rows; and
sub-byte codes packed.  The formulas are the package's (``hurraykv.quant``)."""

from __future__ import annotations

import numpy as np

from .. import alloc
from .. import kernels as _k
from ..errors import QuantizationError
from ..threads import run_bands
from ..wire.dtypes import BY_NAME, ElementType, pack
from ..wire.quantization import (
    SCALE_TYPES,
    Quantization,
    scheme_by_name,
    storage_range,
)
from .params import SCHEMES, affine, chunk_rows


def _code_dtype(et: ElementType) -> np.dtype:
    return et.numpy if not et.sub_byte else np.dtype(np.int8 if et.is_signed else np.uint8)


def quantize_slots(x: np.ndarray, used: np.ndarray, scheme: str, et: ElementType,
                   symmetric: bool, axis: int | None, scale_type: int
                   ) -> tuple[np.ndarray, Quantization, tuple[np.ndarray, ...]]:
    """Quantize slot rows ``x`` ``[slots, H, D]`` (float); ``used`` marks slots holding tokens.

    Returns the codes ``[slots, H, D]`` (unpacked), the quantization section with
    parameter buffers at 3 (scales) and 4 (zero-points, asymmetric only), and the
    parameter buffers as byte arrays.
    """
    cls = _scheme_for(scheme, et, symmetric, axis, scale_type)
    codes = alloc.empty(x.shape, _code_dtype(et))
    if cls.GRANULARITY == "slot":
        scales, zps = _slot_params(x, used, et, symmetric, scale_type, codes)
        q = cls.for_buffers(axis=0, symmetric=symmetric, scale_type=scale_type)
        return codes, q, _param_buffers(scales, zps, symmetric, scale_type)
    if cls.GRANULARITY == "channel" and symmetric and scale_type == 3:
        qmin, qmax = storage_range(et.name)
        fast = _channel_kernel(x, used, axis, qmin, qmax, codes)
        if fast is not None:
            q = cls.for_buffers(axis=axis, symmetric=True, scale_type=scale_type)
            return codes, q, (fast.view(np.uint8),)
    s, z = _range_params(x, used, et, symmetric, cls.GRANULARITY, axis, codes)
    if cls.GRANULARITY == "tensor":
        return codes, cls.for_buffers(axis=None, symmetric=symmetric, scale_type=scale_type,
                                      scale=float(s.reshape(-1)[0]),
                                      zero_point=int(z.reshape(-1)[0])), ()
    q = cls.for_buffers(axis=axis, symmetric=symmetric, scale_type=scale_type)
    return codes, q, _param_buffers(s.reshape(-1), z.reshape(-1), symmetric, scale_type)


def _scheme_for(scheme: str, et: ElementType, symmetric: bool, axis: int | None,
                scale_type: int) -> type[Quantization]:
    """The affine scheme class ``scheme`` names, once its arguments are valid for it."""
    cls = scheme_by_name(scheme)
    if cls is None or not cls.AFFINE:
        *first, last = SCHEMES
        raise QuantizationError.at("scheme", None, scheme,
                                   f"scheme is {', '.join(first)} or {last}")
    if et.name not in cls.STORAGE:
        raise QuantizationError.at("dtype", None, et.name,
                                   f"{scheme} storage is one of {', '.join(cls.STORAGE)}")
    if symmetric and not et.is_signed:
        raise QuantizationError.at("symmetric", None, True,
                                   f"symmetric quantization keeps zero-point 0 and needs a "
                                   f"signed storage type, not {et.name}; use symmetric=False")
    granularity = cls.GRANULARITY
    if granularity == "channel" and axis not in (1, 2):
        raise QuantizationError.at("axis", None, axis,
                                   f"{scheme} quantizes axis 1 (heads) or 2 (head_dim); the "
                                   "paged axis 0 is quantized with per_block_affine")
    if granularity != "channel" and axis not in (None, 0 if granularity == "slot" else None):
        raise QuantizationError.at("axis", None, axis, f"{scheme} takes no axis")
    if scale_type not in cls.SCALE_TYPES:
        raise QuantizationError.at("scale_dtype", None, SCALE_TYPES[scale_type],
                                   f"{scheme} scales are "
                                   f"{' or '.join(SCALE_TYPES[t] for t in cls.SCALE_TYPES)}")
    return cls


def _param_buffers(scales: np.ndarray, zps: np.ndarray, symmetric: bool, scale_type: int
                   ) -> tuple[np.ndarray, ...]:
    """Scales in their stored type, then zero-points (int32, asymmetric only), as bytes."""
    stype = BY_NAME[SCALE_TYPES[scale_type]].numpy
    params = [scales.astype(stype).view(np.uint8)]
    if not symmetric:
        params.append(zps.astype("<i4").view(np.uint8))
    return tuple(params)


def _slot_params(x: np.ndarray, used: np.ndarray, et: ElementType, symmetric: bool,
                 scale_type: int, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-block-affine: a scale and zero-point per slot (1.0 and 0 for unused slots),
    the codes written into ``codes``; compiled in one pass where it applies."""
    qmin, qmax = storage_range(et.name)
    n = x.shape[0]
    scales = np.ones(n, np.float32)
    zps = np.zeros(n, np.int32)
    done = _block_affine_kernel(x, used, qmin, qmax, symmetric, scale_type, codes, scales,
                                zps)
    step = chunk_rows(x.shape[1] * x.shape[2])
    for a in range(0 if not done else n, n, step):
        b = min(a + step, n)
        xc = x[a:b].reshape(b - a, -1).astype(np.float32)
        u = used[a:b]
        if not u.all():
            xc[~u] = 0
        lo, hi = xc.min(axis=1), xc.max(axis=1)
        _check_finite(lo, hi, a)
        s, z = affine(lo, hi, qmin, qmax, symmetric, scale_type, a)
        s[~u], z[~u] = 1.0, 0
        scales[a:b], zps[a:b] = s, z
        _encode(xc, s[:, None], z[:, None], qmin, qmax, codes[a:b].reshape(b - a, -1),
                symmetric)
    return scales, zps


def _range_params(x: np.ndarray, used: np.ndarray, et: ElementType, symmetric: bool,
                  granularity: str | None, axis: int | None, codes: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Per-tensor and per-channel: scales and zero-points from the ranges over the used
    slots only (unused are undefined), then the codes written into ``codes``."""
    qmin, qmax = storage_range(et.name)
    n = x.shape[0]
    step = chunk_rows(x.shape[1] * x.shape[2])
    red = (0, 1, 2) if granularity == "tensor" else tuple(i for i in (0, 1, 2) if i != axis)
    lo = np.full([1 if i in red else x.shape[i] for i in range(3)], np.inf, np.float32)
    hi = np.full(lo.shape, -np.inf, np.float32)
    for a in range(0, n, step):
        xc = x[a:a + step].reshape(min(step, n - a), -1).astype(np.float32)
        xc[~used[a:a + step]] = 0
        _check_finite(xc.min(axis=1), xc.max(axis=1), a)
        xc = xc.reshape(-1, *x.shape[1:])[used[a:a + step]]
        if xc.size:
            lo = np.minimum(lo, xc.min(axis=red, keepdims=True))
            hi = np.maximum(hi, xc.max(axis=red, keepdims=True))
    lo, hi = np.where(np.isfinite(lo), lo, 0), np.where(np.isfinite(hi), hi, 0)
    s, z = affine(lo, hi, qmin, qmax, symmetric, where="quantization channel"
                   if granularity == "channel" else "quantization range")
    for a in range(0, n, step):
        b = min(a + step, n)
        xc = x[a:b].astype(np.float32)
        if not used[a:b].all():
            xc[~used[a:b]] = 0
        _encode(xc, s, z, qmin, qmax, codes[a:b], symmetric)
    return s, z


def _check_finite(lo: np.ndarray, hi: np.ndarray, first_slot: int) -> None:
    """Refuse Inf and NaN (their codes would be undefined): ``lo``/``hi`` are per-slot
    minima and maxima, which every non-finite value reaches."""
    bad = ~(np.isfinite(lo) & np.isfinite(hi))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        value = lo[i] if not np.isfinite(lo[i]) else hi[i]
        raise QuantizationError.at("page_pool slot", first_slot + i, float(value),
                                   "quantization takes finite values (a slot is "
                                   "page * page_size + offset_in_page)", where="index")


def _block_affine_kernel(x: np.ndarray, used: np.ndarray, qmin: int, qmax: int,
                         symmetric: bool, scale_type: int, codes: np.ndarray,
                         scales: np.ndarray, zps: np.ndarray) -> bool:
    """The compiled one-pass path (kernels.py); False when it does not apply or met a
    non-finite row, leaving the NumPy path to do the whole work."""
    kind = _k.input_kind(x.dtype)
    kern = _k.impl() if kind is not None else None
    if kern is None or not x.flags.c_contiguous or x.shape[0] == 0:
        return False
    n = x.shape[0]
    bits = _k.as_bits(x.reshape(n, -1), kind)
    c2 = codes.reshape(n, -1)
    u = np.ascontiguousarray(used, np.bool_)
    ok: list[bool] = []
    if scale_type == 3:  # float32 scales: range, scale and codes in one pass per slot
        run_bands(lambda a, b: ok.append(kern.block_affine_quantize(
            bits, kind, u, qmin, qmax, symmetric, c2, scales, zps, a, b)), n, x.nbytes)
        return all(ok)
    # 16-bit scales are rounded up to their type between the range and the encoding
    lo, hi = np.empty(n, np.float32), np.empty(n, np.float32)
    run_bands(lambda a, b: ok.append(kern.row_ranges(bits, kind, u, lo, hi, a, b)), n,
              x.nbytes)
    if not all(ok):
        return False
    s, z = affine(lo, hi, qmin, qmax, symmetric, scale_type)
    s[~u], z[~u] = 1.0, 0
    scales[...], zps[...] = s, z
    run_bands(lambda a, b: kern.encode_rows(bits, kind, u, scales, zps, qmin, qmax, symmetric,
                                          c2, a, b), n, x.nbytes)
    return True


def _channel_kernel(x: np.ndarray, used: np.ndarray, axis: int, qmin: int, qmax: int,
                    codes: np.ndarray) -> np.ndarray | None:
    """Symmetric per-channel quantization with float32 scales in two compiled passes
    (column ranges, then codes), the NumPy path's arithmetic: the float32 scales, or
    None when it does not apply or met a non-finite value (the NumPy path then does the
    whole work and refuses it by slot)."""
    kind = _k.input_kind(x.dtype)
    kern = _k.impl() if kind is not None else None
    if kern is None or not x.flags.c_contiguous or x.shape[0] == 0:
        return None
    n, heads, dim = x.shape
    bits = _k.as_bits(x.reshape(n, -1), kind)
    u = np.ascontiguousarray(used, np.bool_)
    mask = _k.key_limits(kind)
    bands: list[tuple[np.ndarray, np.ndarray, bool]] = []

    def ranges(a: int, b: int) -> None:
        lo = np.full(heads * dim, mask, np.int64)
        hi = np.full(heads * dim, -mask, np.int64)
        bands.append((lo, hi, kern.column_keys(bits, kind, u, lo, hi, a, b)))

    run_bands(ranges, n, x.nbytes)
    if not all(ok for _, _, ok in bands):
        return None
    keys = np.stack([np.min([lo for lo, _, _ in bands], axis=0),
                     np.max([hi for _, hi, _ in bands], axis=0)])
    values = _k.key_floats(keys, kind).reshape(2, heads, dim)
    red = 0 if axis == 2 else 1  # over the other of (heads, head_dim)
    lo, hi = values[0].min(axis=red), values[1].max(axis=red)
    if not u.any():
        lo, hi = np.zeros_like(lo), np.zeros_like(hi)
    s, _ = affine(lo, hi, qmin, qmax, True, where="quantization channel")
    inv = (np.float32(1.0) / s).astype(np.float32)
    cols = np.ascontiguousarray(np.tile(inv, heads) if axis == 2 else np.repeat(inv, dim))
    c2 = codes.reshape(n, -1)
    run_bands(lambda a, b: kern.encode_columns(bits, kind, u, cols, qmin, qmax, c2, a, b),
              n, x.nbytes)
    return s.astype(np.float32)


def _encode(x: np.ndarray, scale: np.ndarray, zp: np.ndarray, qmin: int, qmax: int,
            out: np.ndarray, symmetric: bool) -> None:
    """``out = clip(rint(x / scale) + zp)``, in place on the float32 chunk ``x``.  Codes
    are clipped in every case, symmetric too, so the float -> int conversion only ever
    sees values in range (its result outside the range differs between CPUs: H74)."""
    x *= np.float32(1.0) / scale  # one multiply per element; the bound holds to 1 ulp
    np.rint(x, out=x)
    if not symmetric:
        x += zp
    np.clip(x, qmin, qmax, out=x)
    out[...] = x


def pack_codes(codes: np.ndarray, et: ElementType) -> np.ndarray:
    """Sub-byte codes (in range, as ``quantize_slots`` makes them) packed to uint8, low
    bits first, as ``wire.dtypes.pack`` packs them."""
    kern = _k.impl() if et.bits in (2, 4) and codes.size % (8 // et.bits) == 0 else None
    if kern is None:
        return np.frombuffer(pack(codes, et), np.uint8).copy()
    flat = codes.reshape(-1)
    out = np.empty(et.nbytes(flat.size), np.uint8)
    run_bands(lambda a, b: kern.pack_bits(flat, et.bits, out, a, b), len(out), flat.nbytes)
    return out
