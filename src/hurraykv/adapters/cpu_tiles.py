"""Where a tiled CPU_ATTN kernel puts each key and value element of a block.

vLLM's CPU_ATTN keeps a (block, head) page as ``2 * block_size * head_size`` contiguous
elements.  The VEC and VEC16 kernels order them as K transposed then V (strided views in
``vllm.py`` read that).  The AMX kernels, which vLLM picks for bfloat16 models on CPUs
with AMX (``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py``), pack K and V
into tile rows whose order is defined only by the C++ extension (``reshape_and_cache``
in ``csrc/cpu/cpu_attn_amx.hpp``; K in pairs of dims per token, V in pairs of tokens per
dim, 16-row tiles).

Rather than restate that order and break when vLLM changes it, we ask the installed
kernel (decision H75): ``cpu_attn_reshape_and_cache`` writes index-coded values into a
one-block, one-head scratch cache, and where each index lands is the permutation.  The
values are positive fp8 numbers (exact in every float type and kept by a conversion to
fp8 at scale 1), so the probe works for ``auto`` and fp8 caches alike; an index is
written as base-64 digits over ``ceil(log64(block_size * head_size))`` probes.  The
result must be a permutation of the K half and of the V half, or the ISA is refused.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np
import torch

from ..errors import UnsupportedError

BASE = 64
VEC = ("vec", "vec16")  # K transposed then V (csrc/cpu/cpu_attn_vec.hpp, cpu_attn_vec16.hpp)
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# (fp8 type, first code): 64 consecutive positive normal codes of each
_CODES = {"fp8_e5m2": (ml_dtypes.float8_e5m2, 0x04), "e4m3": (ml_dtypes.float8_e4m3fn, 0x08)}


def cpu_write_kernel() -> Any:
    """vLLM's ``cpu_attn_reshape_and_cache`` when its extension is loaded, else None."""
    try:
        return torch.ops._C.cpu_attn_reshape_and_cache
    except (AttributeError, RuntimeError):
        return None


def _codes(kv_cache_dtype: str) -> tuple[np.ndarray, int]:
    f8, first = _CODES["fp8_e5m2" if kv_cache_dtype == "fp8_e5m2" else "e4m3"]
    return np.arange(first, first + BASE, dtype=np.uint8).view(f8).astype(np.float32), first


@lru_cache(maxsize=32)
def positions(isa: str, dtype: torch.dtype, kv_cache_dtype: str, block_size: int,
              head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key, value)``: int64 tensors ``[block_size * head_size]`` giving, for element
    ``t * head_size + d`` of a page's K (and V), its offset within the (block, head)
    region of ``2 * block_size * head_size`` elements, as the installed kernel lays it."""
    kernel = cpu_write_kernel()
    refuse = f"CPU_ATTN with the {isa!r} kernels ({kv_cache_dtype}, {dtype})"
    if kernel is None:
        raise UnsupportedError.at("isa", None, isa, f"{refuse} tiles K and V; reading them "
                                  "needs vLLM's CPU extension loaded to probe its layout "
                                  "(not supported)")
    n = block_size * head_size
    codes, first = _codes(kv_cache_dtype)
    fp8 = kv_cache_dtype != "auto"
    index = np.arange(n).reshape(block_size, 1, head_size)
    found = np.zeros(2 * n, np.int64)
    slots = torch.arange(block_size)
    digits, scale = 1, BASE
    while scale < n:
        digits, scale = digits + 1, scale * BASE
    for k in range(digits):
        values = torch.from_numpy(codes[(index // BASE ** k) % BASE]).to(dtype)
        cache = torch.zeros(1, 1, block_size, 2 * head_size,
                            dtype=torch.uint8 if fp8 else dtype)
        halves = cache.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        try:
            kernel(values, values, *halves, slots, isa, 1.0, 1.0, kv_cache_dtype)
        except RuntimeError as exc:
            raise UnsupportedError.at("isa", None, isa, f"{refuse}: vLLM's kernel refused a "
                                      f"probe ({str(exc).splitlines()[0]}) (not supported)"
                                      ) from None
        stored = cache.reshape(-1)
        if fp8:
            digit = stored.numpy().astype(np.int64) - first
        else:
            digit = np.searchsorted(codes, stored.float().numpy())
        if (digit < 0).any() or (digit >= BASE).any():
            raise UnsupportedError.at("isa", None, isa, f"{refuse}: the kernel changed the "
                                      "probe's values (not a permutation; not supported)")
        found += digit * BASE ** k
    out = []
    for half in (found[:n], found[n:]):
        if not np.array_equal(np.sort(half), np.arange(n)):
            raise UnsupportedError.at("isa", None, isa, f"{refuse} does not keep K and V "
                                      "as a permutation of each half of the page (not "
                                      "supported)")
        where = np.empty(n, np.int64)
        where[half] = np.arange(n)
        out.append(torch.from_numpy(where + (n if out else 0)))
    return out[0], out[1]


class TiledPages:
    """Reads and writes pages of a CPU_ATTN cache in a probed tile order: ``[n,
    block_size, heads, dim]`` tensors out and in, one gather of whole (block, head)
    regions plus one index per element."""

    def __init__(self, t: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """``t``: the cache as held; ``key``, ``value``: ``positions`` of its kernel."""
        blocks, heads, size, content = (int(x) for x in t.shape)
        s0, s1, _, _ = t.stride()
        self.hs, self.size, self.heads, self.dtype = content // 2, size, heads, t.dtype
        # an integer view of the same width: indexing works for every element type
        self.bits = _SAME_WIDTH[t.element_size()]
        self.flat = torch.as_strided(t.view(self.bits), (blocks, heads, size * content),
                                     (s0, s1, 1), t.storage_offset())
        self.key, self.value = key, value

    def _page(self, raw: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        n = raw.shape[0]
        return raw[..., where].reshape(n, self.heads, self.size, self.hs).permute(0, 2, 1, 3)

    def read(self, ids: torch.Tensor) -> list[torch.Tensor]:
        raw = self.flat.index_select(0, ids)
        return [self._page(raw, w).contiguous().view(self.dtype)
                for w in (self.key, self.value)]

    def write(self, ids: torch.Tensor, pages: list[torch.Tensor]) -> None:
        raw = torch.empty((len(ids), *self.flat.shape[1:]), dtype=self.flat.dtype)
        for where, page in zip((self.key, self.value), pages, strict=True):
            bits = page.to(self.dtype).view(self.bits)
            raw[..., where] = bits.permute(0, 2, 1, 3).reshape(len(ids), self.heads, -1)
        self.flat[ids] = raw


def strided(key: torch.Tensor, value: torch.Tensor, block_size: int, head_size: int
            ) -> bool:
    """True when probed positions are the VEC layout: K[t, d] at ``d * block_size + t``,
    V[t, d] at ``n + t * head_size + d`` (strided views read it without an index)."""
    t, d = np.divmod(np.arange(block_size * head_size), head_size)
    return (np.array_equal(key.numpy(), d * block_size + t)
            and np.array_equal(value.numpy(), block_size * head_size + t * head_size + d))


def tiles_for(t: torch.Tensor, isa: Any, kv_cache_dtype: str) -> TiledPages | None:
    """The tile reader for a CPU_ATTN cache whose kernel ``isa`` does not keep the VEC
    layout, None where strided views read it (no ISA known, or no kernel to ask about
    VEC: its documented layout)."""
    if isa is None or (isa in VEC and cpu_write_kernel() is None):
        return None  # no kernel to ask: VEC's documented layout
    dtype = t.dtype if kv_cache_dtype == "auto" else torch.bfloat16
    size, hs = int(t.shape[2]), int(t.shape[3]) // 2
    if kv_cache_dtype == "auto" and dtype not in (torch.bfloat16, torch.float16,
                                                 torch.float32):
        return None
    key, value = positions(isa, dtype, kv_cache_dtype, size, hs)
    if strided(key, value, size, hs):
        return None
    return TiledPages(t, key, value)
