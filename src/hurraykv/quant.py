"""Quantizing and dequantizing block-paged pools (floor 1, NumPy only).

Formulas (quantization.md; decision D4 for the block-paged scale layout):

* per-tensor        ``x = scale * float32(q - zero_point)``
* per-channel       ``x[..., c, ...] = scale[c] * float32(q - zp[c])`` along axis 1 (heads)
                    or 2 (head_dim); float32 scales, ``shape[axis]`` of them
* per-block-affine  ``x = scale[slot] * float32(q - zp[slot])`` with
                    ``slot = phys_page * page_size + offset_in_page``: one scale (and int32
                    zero-point) per physical page slot, shared by its heads and dims, so
                    an aliased page dequantizes identically for every sequence.

Arithmetic is float32; float16/bfloat16 scales are widened to float32 first.  Codes
are computed with absmax (symmetric) or min/max widened to include 0 (asymmetric), so
zero-points stay inside the storage range and every element's error is at most
``scale / 2``.  Slots no sequence reads get scale 1.0 and zero-point 0 (every stored
scale must be finite and non-zero).  Work is chunked over slot rows so temporaries stay
in cache; nothing loops per token or element.  Where numba is present the compiled
kernels (``kernels.py``) do the same arithmetic in one pass: per-block-affine and
symmetric per-channel quantization, the dequantizing gather, float8 e4m3 encoding
(``fp8_e4m3``), and codes decoded straight into float32 or bfloat16 (``decode_rows``,
with the scale plan of the scheme's granularity from ``KERNEL_PLANS``).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from . import alloc
from . import kernels as _k
from .errors import QuantizationError
from .threads import run_bands
from .wire.dtypes import BY_NAME, ElementType, pack
from .wire.quant_registry import as_written, decodes_finitely, farthest_code, overflow_rule
from .wire.quantization import (
    SCALE_TYPES,
    Quantization,
    RegistryView,
    scheme_by_name,
    storage_range,
)

# The schemes hurraykv quantizes and dequantizes (the affine ones), name -> tag: a view
# of the scheme registry (wire/quant_schemes.py).
SCHEMES = RegistryView(lambda c: c.TAG, key=lambda c: c.NAME, where=lambda c: c.AFFINE)
SCALE_TAGS = {v: k for k, v in SCALE_TYPES.items()}
TINY = np.finfo(np.float32).tiny
CHUNK_ELEMENTS = 1 << 18  # per chunk of slot rows: float32 temporaries of 1 MiB stay in cache


def _chunk_rows(row_elems: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(row_elems, 1))


def _code_dtype(et: ElementType) -> np.dtype:
    return et.numpy if not et.sub_byte else np.dtype(np.int8 if et.is_signed else np.uint8)


def _as_scale_dtype(scales: np.ndarray, scale_type: int) -> np.ndarray:
    """Round scales *up* to the stored type (so the value range still fits the codes);
    a scale below the type's smallest normal is raised to it (H74; callers have refused
    scales above its maximum).  Returned widened to float32."""
    if scale_type == 3:
        return scales
    dt = BY_NAME[SCALE_TYPES[scale_type]].numpy
    info = ml_dtypes.finfo(dt)
    clipped = np.clip(scales, float(info.smallest_normal), float(info.max))
    low = clipped.astype(dt)
    below = low.astype(np.float32) < clipped
    bits = low.view(np.uint16)  # positive finite 16-bit floats: next value up is bits + 1
    bits[below] += 1
    return low.astype(np.float32)


def scale_limit(scale_type: int) -> float:
    """The largest scale ``scale_type`` stores (finite)."""
    return float(ml_dtypes.finfo(BY_NAME[SCALE_TYPES[scale_type]].numpy).max)


def _check_scales(scale: np.ndarray, stored: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                  scale_type: int, steps: int, first: int, where: str) -> None:
    """Refuse a computed ``scale`` that overflowed float32 or passes what ``scale_type``
    stores, or a ``stored`` (rounded) scale whose farthest code ``steps * stored``
    decodes to Inf (decision H74; the rule loading and decoding apply,
    ``check_decodable``): saturating it would put the codes out of range, and their
    float -> int conversion is what differs between instruction sets."""
    limit = scale_limit(scale_type)
    bad = ~(scale <= limit) | ~decodes_finitely(stored, steps)
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        # + 0.0: -0.0 and 0.0 read the same on both paths (the kernel has no signed zeros)
        lo_i, hi_i = float(lo.reshape(-1)[i]) + 0.0, float(hi.reshape(-1)[i]) + 0.0
        raise QuantizationError.at(
            where, first + i, f"values in [{lo_i:g}, {hi_i:g}]",
            f"the scale this range needs ({float(scale.reshape(-1)[i]):g}) must be at most "
            f"{SCALE_TYPES[scale_type]}'s largest value {limit:g} and decode its {steps} "
            f"steps within float32; use a wider scale_dtype (float32) or bring the values "
            f"into range", where="index")


def check_decodable(scales: np.ndarray, zps: np.ndarray | None, storage: str,
                    field: str = "scales") -> None:
    """Refuse the first scale (float32) whose code farthest from its zero-point (int32,
    None: 0) decodes to Inf, as quantizing refuses it (H74): a file's scales are held
    to the rule hurraykv writes by.  ``field``: "q.scale" for a tensor's one scale."""
    qmin, qmax = storage_range(storage)
    steps = farthest_code(qmin, qmax, 0 if zps is None else zps)
    ok = decodes_finitely(scales, steps)
    if ok.all():
        return
    i = int(np.flatnonzero(~ok.reshape(-1))[0])
    far = int(np.broadcast_to(steps, ok.shape).reshape(-1)[i])
    rule = overflow_rule(far, storage)
    value = as_written(scales.reshape(-1)[i])
    if field == "q.scale":
        raise QuantizationError.at(field, None, value, rule)
    raise QuantizationError.at(f"{field}[{i}]", i, value, rule, where="index")


def _affine(lo: np.ndarray, hi: np.ndarray, qmin: int, qmax: int, symmetric: bool,
            scale_type: int = 3, first: int = 0, where: str = "page_pool slot"
            ) -> tuple[np.ndarray, np.ndarray]:
    """Scales (rounded to the stored scale type) and zero-points from value ranges;
    ``first`` and ``where`` name the first range in a refusal."""
    span = qmax if symmetric else qmax - qmin
    with np.errstate(over="ignore"):  # an overflowing range is refused just below
        if symmetric:
            computed = np.maximum(np.abs(lo), np.abs(hi)) / np.float32(span)
        else:
            lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
            computed = (hi - lo) / np.float32(span)
    # a stored file may hold any code (int8's -128 beside a symmetric scale): what a
    # reader's check refuses is refused here, so nothing written is refused on load
    steps = int(farthest_code(qmin, qmax, 0 if symmetric else qmin))
    # at least float32's smallest normal, so 1 / scale is finite and the codes in range
    scale = np.where(computed > 0, np.maximum(computed, TINY),
                     np.float32(1.0)).astype(np.float32)
    scale = _as_scale_dtype(scale, scale_type)
    _check_scales(computed, scale, lo, hi, scale_type, steps, first, where)
    if symmetric:
        return scale, np.zeros(scale.shape, np.int32)
    return scale, np.clip(np.rint(qmin - lo / scale), qmin, qmax).astype(np.int32)


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
    step = _chunk_rows(x.shape[1] * x.shape[2])
    for a in range(0 if not done else n, n, step):
        b = min(a + step, n)
        xc = x[a:b].reshape(b - a, -1).astype(np.float32)
        u = used[a:b]
        if not u.all():
            xc[~u] = 0
        lo, hi = xc.min(axis=1), xc.max(axis=1)
        _check_finite(lo, hi, a)
        s, z = _affine(lo, hi, qmin, qmax, symmetric, scale_type, a)
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
    step = _chunk_rows(x.shape[1] * x.shape[2])
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
    s, z = _affine(lo, hi, qmin, qmax, symmetric, where="quantization channel"
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
    s, z = _affine(lo, hi, qmin, qmax, symmetric, scale_type)
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
    s, _ = _affine(lo, hi, qmin, qmax, True, where="quantization channel")
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


def params_arrays(q: Quantization, params: tuple[np.ndarray, ...], count: int
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 scales and int32 zero-points (None when symmetric) from the parameter
    buffers, handling a shared ``[scales | zero_points]`` buffer."""
    if q.GRANULARITY == "tensor":  # parameters in the section itself
        return np.array([q.scale], np.float32), np.array([q.zero_point], np.int32)
    stype = BY_NAME[q.scale_dtype]
    sbuf = params[q.scale_buffer - 3]
    scales = sbuf[: count * stype.itemsize].view(stype.numpy).astype(np.float32)
    if q.zero_point_buffer is None:
        return scales, None
    zbuf = params[q.zero_point_buffer - 3]
    if q.zero_point_buffer == q.scale_buffer:
        zbuf = zbuf[count * stype.itemsize:]
    return scales, zbuf[: count * 4].view("<i4")


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
    step = _chunk_rows(heads * dim)
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


FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def fp8_e4m3(pages: np.ndarray, what: str = "page_pool") -> tuple[np.ndarray, float]:
    """float8 e4m3 codes of ``pages`` (a float array) and their scale ``absmax / 448``
    (1.0 for an all-zero array, or one whose peak is below float32's range for a scale):
    ``clip(pages / scale, -448, 448)`` rounded to nearest even, in one compiled pass from
    the input's bits where the kernels apply, else NumPy's conversion (the same bits).
    A non-finite value is refused, naming ``what``."""
    peak = _peak(pages)
    if not np.isfinite(peak):  # named where it is (a rare path: the copy is affordable)
        values = np.asarray(pages, np.float32)
        where = np.unravel_index(int(np.flatnonzero(~np.isfinite(values))[0]), values.shape)
        index = ", ".join(str(int(i)) for i in where)
        raise QuantizationError.at(f"{what}[{index}]", None, float(values[where]),
                                   "fp8 stores finite values")
    scale = np.float32(peak / FP8_MAX) if peak > 0 else np.float32(1.0)
    if not scale > 0:
        scale = np.float32(1.0)
    compiled = _slot_bits(pages)
    if compiled is None:
        values = np.asarray(pages, np.float32)
        codes = np.clip(values / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        return codes, float(scale)
    kern, kind, rows = compiled
    out = alloc.empty(rows.shape, np.uint8)
    run_bands(lambda a, b: kern.fp8_e4m3_encode(rows, kind, scale, out, a, b),
              rows.shape[0], pages.nbytes)
    return out.view(ml_dtypes.float8_e4m3fn).reshape(pages.shape), float(scale)


def _slot_bits(pages: np.ndarray) -> tuple[Any, int, np.ndarray] | None:
    """``(kernels, input kind, rows of the unsigned bits the kernels read)``, or None
    where the compiled path does not apply (no numba, another dtype, a view)."""
    kind = _k.input_kind(pages.dtype)
    kern = _k.impl() if kind is not None and pages.flags.c_contiguous else None
    if kern is None or not pages.size:
        return None
    return kern, kind, _k.as_bits(pages.reshape(pages.shape[0] * pages.shape[1], -1), kind)


def _peak(pages: np.ndarray) -> float:
    """The largest magnitude in ``pages`` (inf or nan when one is not finite)."""
    compiled = _slot_bits(pages)
    if compiled is None:
        return float(np.abs(np.asarray(pages, np.float32)).max()) if pages.size else 0.0
    kern, kind, rows = compiled
    n = rows.shape[0]
    used = np.ones(n, np.bool_)
    lo, hi = np.empty(n, np.float32), np.empty(n, np.float32)
    ok: list[bool] = []
    run_bands(lambda a, b: ok.append(kern.row_ranges(rows, kind, used, lo, hi, a, b)), n,
              pages.nbytes)
    if not all(ok):
        return float("nan")
    return float(max(-lo.min(), hi.max()))


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


def reset_unused(q: Quantization, params: tuple[np.ndarray, ...], unused: np.ndarray
                 ) -> tuple[np.ndarray, ...]:
    """Per-slot parameters with scale 1.0 and zero-point 0 on ``unused`` slots (copies)."""
    n = len(unused)
    stype = BY_NAME[q.scale_dtype].numpy
    out = [p.copy() for p in params]
    sbuf = out[q.scale_buffer - 3]
    sbuf[: n * stype.itemsize].view(stype)[unused] = 1.0
    if q.zero_point_buffer is not None:
        zbuf = out[q.zero_point_buffer - 3]
        if q.zero_point_buffer == q.scale_buffer:
            zbuf = zbuf[n * stype.itemsize:]
        zbuf[: n * 4].view("<i4")[unused] = 0
    return tuple(out)
