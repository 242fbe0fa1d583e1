"""Tensors <-> NumPy without copies where the bytes allow it.

A CPU tensor becomes a NumPy view of the same memory (bfloat16 and float8 through a
same-width integer view reinterpreted with ml_dtypes); a CUDA tensor is copied to host
once, since NumPy cannot address device memory.  The reverse builds tensors that share
the NumPy arrays' memory.
"""

from __future__ import annotations

import warnings
from typing import Any

import ml_dtypes
import numpy as np
import torch

from ..arrays import torch_to_numpy
from ..errors import HurrayError

# torch dtype -> (same-width integer torch dtype, NumPy dtype of the real values)
_VIEWS = {
    torch.bfloat16: (torch.int16, np.dtype(ml_dtypes.bfloat16)),
    torch.float8_e4m3fn: (torch.uint8, np.dtype(ml_dtypes.float8_e4m3fn)),
    torch.float8_e5m2: (torch.uint8, np.dtype(ml_dtypes.float8_e5m2)),
}
_BACK = {v[1]: (k, v[0]) for k, v in _VIEWS.items()}
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
       "fp8_e5m2": torch.float8_e5m2}


def to_numpy(t: torch.Tensor, *, kv_cache_dtype: str = "auto") -> np.ndarray:
    """A NumPy array of ``t``'s values: a view for CPU tensors, one copy from a device.

    ``kv_cache_dtype`` "fp8"/"fp8_e4m3"/"fp8_e5m2" reinterprets a uint8 cache (as vLLM
    allocates fp8 caches) as that float8 type."""
    if not isinstance(t, torch.Tensor):
        raise HurrayError(f"expected a torch.Tensor, got {type(t).__name__}", field="tensor")
    if kv_cache_dtype in FP8 and t.dtype == torch.uint8:
        t = t.view(FP8[kv_cache_dtype])
    return torch_to_numpy(t)


def from_numpy(a: np.ndarray, *, source_only: bool = False) -> torch.Tensor:
    """A tensor sharing ``a``'s memory.  Read-only arrays (a memory-mapped file) are
    copied once, since torch assumes it may write, unless ``source_only``: the caller
    only reads the tensor (a copy source), so the mapping is used as it is."""
    if not a.flags.writeable and not source_only:
        a = a.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": only read from
        if a.dtype in _BACK:
            real, raw = _BACK[a.dtype]
            ints = np.dtype(np.int16 if raw == torch.int16 else np.uint8)
            return torch.from_numpy(a.view(ints)).view(real)
        return torch.from_numpy(a)


def scalar(x: Any) -> float:
    return float(x.item() if isinstance(x, torch.Tensor) else x)


def place(t: torch.Tensor, device: Any) -> torch.Tensor:
    """``t`` on ``device`` (None: stays on the host, sharing the snapshot's memory)."""
    return t if device is None else t.to(device)


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of a torch dtype (ml_dtypes for bfloat16 and float8)."""
    if dtype in _VIEWS:
        return _VIEWS[dtype][1]
    return torch.empty((), dtype=dtype).numpy().dtype
