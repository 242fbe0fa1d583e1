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

from .decode import (
    DECODE_CODES,
    DECODE_OUTPUTS,
    KERNEL_PLANS,
    Scales,
    decode_rows,
    dequantize,
    gather_dequantized,
    kernel_scales,
)
from .encode import pack_codes, quantize_slots
from .fp8 import FP8_MAX, fp8_e4m3
from .params import (
    CHUNK_ELEMENTS,
    SCALE_TAGS,
    SCHEMES,
    TINY,
    check_decodable,
    params_arrays,
    reset_unused,
    scale_limit,
)

__all__ = ["CHUNK_ELEMENTS", "DECODE_CODES", "DECODE_OUTPUTS", "FP8_MAX", "KERNEL_PLANS",
           "SCALE_TAGS", "SCHEMES", "TINY", "Scales", "check_decodable", "decode_rows",
           "dequantize", "fp8_e4m3", "gather_dequantized", "kernel_scales", "pack_codes",
           "params_arrays", "quantize_slots", "reset_unused", "scale_limit"]
