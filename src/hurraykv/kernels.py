"""Compiled kernels for the quantization data paths (floor 1, optional ``numba``).

Per-block-affine quantization and the dequantizing gather are one pass per page slot
here: each slot row is read once, its absmax (or min and max) found in the integer
domain of the input's bits, its scale and zero-point computed, and its codes written
while the row is still in L1.  NumPy's float16 -> float32 conversion is not vectorised
in the NumPy builds we pin, and its formulation costs four passes over memory; these
kernels are the same arithmetic in one.  Symmetric per-channel quantization takes two
(column ranges, then codes), and the connector's stored formats have their own
(``integrations/vllm/store_format.py``: float -> e4m3, and codes times scales written
straight as the cache's bfloat16 or float32 bits).

**Results are bit-identical to the NumPy code in ``quant/``** (tested on both): the
same float32 operations in the same order, with ``rint`` rounding half to even.  Input
rows holding Inf or NaN make a kernel report failure, and the caller takes the NumPy
path for the whole call, which refuses them naming the slot (decision H72).

Installed with ``pip install 'hurraykv[fast]'``; without numba, or with
``HURRAYKV_KERNELS=numpy``, ``ENABLED`` is False and ``quant/`` uses NumPy alone.
Kernels release the GIL, so ``threads.run_bands`` spreads them over the cores.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import ml_dtypes
import numpy as np

ENABLED = (os.environ.get("HURRAYKV_KERNELS", "").lower() != "numpy"
           and importlib.util.find_spec("numba") is not None)

# Input kinds: how a slot row's unsigned bits become float32.
FLOAT16, BFLOAT16, FLOAT32 = 0, 1, 2
KINDS = {np.dtype(np.float16): FLOAT16, np.dtype(ml_dtypes.bfloat16): BFLOAT16,
         np.dtype(np.float32): FLOAT32}
_BITS_VIEW = {FLOAT16: np.uint16, BFLOAT16: np.uint16, FLOAT32: np.uint32}


def input_kind(dtype: np.dtype) -> int | None:
    """The kernel input kind of a float pool dtype, or None (convert to float32 first)."""
    return KINDS.get(np.dtype(dtype))


def as_bits(rows: np.ndarray, kind: int) -> np.ndarray:
    """``rows`` reinterpreted as the unsigned integers the kernels read."""
    return rows.view(_BITS_VIEW[kind])


_SIGN = {FLOAT16: 0x8000, BFLOAT16: 0x8000, FLOAT32: 0x80000000}
_DTYPES = {FLOAT16: np.float16, BFLOAT16: ml_dtypes.bfloat16, FLOAT32: np.float32}


def key_limits(kind: int) -> int:
    """The largest magnitude key of an input kind (its bits less the sign bit): what
    ``column_keys`` starts its minima from."""
    return _SIGN[kind] - 1


def key_floats(keys: np.ndarray, kind: int) -> np.ndarray:
    """float32 of ordered keys (the kernels' sign-magnitude bits as integers, negative
    for negative values) of an input kind."""
    bits = np.where(keys >= 0, keys, (-keys) | _SIGN[kind]).astype(_BITS_VIEW[kind])
    return bits.view(_DTYPES[kind]).astype(np.float32)


def impl() -> ModuleType | None:
    """The compiled kernels, or None without them.  numba is imported, and the kernels
    compiled or loaded from its cache, on the first call; a numba that fails to import
    (say, built for another NumPy) turns the kernels off rather than failing the call."""
    global ENABLED
    if not ENABLED:
        return None
    try:
        from . import _numba_kernels
    except ImportError:
        ENABLED = False
        return None
    _scan_safe_llvmlite()
    return _numba_kernels


class _ForwardingLib:
    """llvmlite's library handle, behind an object with an ordinary ``__dict__``."""

    def __init__(self, lib: object) -> None:
        self.__dict__["_wrapped"] = lib

    def __getattr__(self, name: str) -> object:
        return getattr(self._wrapped, name)


def _scan_safe_llvmlite() -> None:
    """vLLM scans every module's attributes when a worker starts
    (``vllm/triton_utils/dispatcher.py``, ``_patch_references``: ``vars(value).get(...)``
    for each value with a ``__dict__``).  llvmlite's ``ffi.lib`` answers any attribute,
    ``__dict__`` included, with a function wrapper, so once numba is imported every later
    engine in the process fails to start (``AttributeError: '_lib_fn_wrapper' object has
    no attribute 'get'``).  ``ffi.lib`` is put behind a forwarding object whose
    ``__dict__`` is a dict; llvmlite and numba reach the library through that module
    attribute, so they see no difference."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    if not isinstance(ffi.lib, _ForwardingLib) and not isinstance(
            getattr(ffi.lib, "__dict__", None), dict):
        ffi.lib = _ForwardingLib(ffi.lib)


_warm = False


def warm() -> None:
    """Compile (or load from numba's cache) every dequantizing-read kernel variant a
    tensor can meet: int8 and uint8 codes, packed pages, each in writable and read-only
    memory.  For callers that must not compile later (compilation allocates ~10 MB)."""
    global _warm
    kern = impl()
    if kern is None or _warm:
        return
    _warm = True
    slots, scales, zps = np.zeros(1, np.int64), np.ones(2, np.float32), np.zeros(2, np.int32)
    out = np.empty((1, 8), np.float32)
    for readonly in (False, True):
        for dt in (np.int8, np.uint8):
            rows = np.zeros((2, 8), dt)
            rows.flags.writeable = not readonly
            kern.dequantize_gather(rows, slots, scales, zps, True, out, 0, 1)
        pages = np.zeros((2, 4), np.uint8)
        pages.flags.writeable = not readonly
        kern.dequantize_gather_packed(pages, slots, 1, 8, 4, True, scales, zps, True, out, 0, 1)
