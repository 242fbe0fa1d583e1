"""Array inputs: NumPy arrays, anything ``np.asarray`` takes, and PyTorch tensors.

A torch tensor is recognised by its type's module, so ``import hurraykv`` never imports
torch: a caller holding a tensor has already imported it.  CPU tensors become NumPy views
of the same memory (bfloat16 and float8 through a same-width integer view reinterpreted
with ml_dtypes, which NumPy has no native types for); a tensor on a device is copied to the
host once.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .errors import HurrayError

# torch dtype name -> (same-width integer torch dtype name, NumPy dtype of the values)
_VIEWS = {
    "bfloat16": ("int16", np.dtype(ml_dtypes.bfloat16)),
    "float8_e4m3fn": ("uint8", np.dtype(ml_dtypes.float8_e4m3fn)),
    "float8_e5m2": ("uint8", np.dtype(ml_dtypes.float8_e5m2)),
}


def is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def torch_to_numpy(t: Any, name: str = "tensor") -> np.ndarray:
    """A NumPy array of a torch tensor's values: a view for CPU tensors, one host copy
    for a tensor on a device."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype in _VIEWS:
        raw, real = _VIEWS[dtype]
        return t.view(getattr(torch, raw)).numpy().view(real)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as e:
        raise HurrayError(f"{name}: torch dtype {dtype} has no NumPy form: {e}", field=name,
                          value=dtype, rule="float, integer, bfloat16 or float8 tensors") from None


def as_numpy(x: Any, name: str = "array") -> np.ndarray:
    """``x`` as a NumPy array, without a copy where the memory allows."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        return torch_to_numpy(x, name)
    return np.asarray(x)
