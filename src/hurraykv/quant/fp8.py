"""float8 e4m3 encoding of a float pool: codes and their one scale ``absmax / 448``,
compiled from the input's bits where the kernels apply, else NumPy's conversion (the
same bits)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .. import alloc
from .. import kernels as _k
from ..errors import QuantizationError
from ..threads import run_bands

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
