"""The parameters of a quantized pool, scales and zero-points: computed from value
ranges (absmax, or min/max widened to include 0), rounded *up* to the stored scale type,
held to the rule that every code decodes finitely (decision H74), read from their
parameter buffers and reset on unused slots.  The formulas are the package's
(``hurraykv.quant``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import QuantizationError
from ..wire.dtypes import BY_NAME
from ..wire.quant_registry import as_written, decodes_finitely, farthest_code, overflow_rule
from ..wire.quantization import (
    SCALE_TYPES,
    Quantization,
    RegistryView,
    storage_range,
)

# The schemes hurraykv quantizes and dequantizes (the affine ones), name -> tag: a view
# of the scheme registry (wire/quant_schemes.py).
SCHEMES = RegistryView(lambda c: c.TAG, key=lambda c: c.NAME, where=lambda c: c.AFFINE)
SCALE_TAGS = {v: k for k, v in SCALE_TYPES.items()}
TINY = np.finfo(np.float32).tiny
CHUNK_ELEMENTS = 1 << 18  # per chunk of slot rows: float32 temporaries of 1 MiB stay in cache


def chunk_rows(row_elems: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(row_elems, 1))


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


def affine(lo: np.ndarray, hi: np.ndarray, qmin: int, qmax: int, symmetric: bool,
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
