"""vLLM paged KV caches <-> KVCacheSnapshot.

Layouts, per layer, checked against vLLM's source:

* ``"flash_attn"``: one tensor ``(2, num_blocks, block_size, num_kv_heads, head_size)``
  (``vllm/attention/backends/flash_attn.py``, ``FlashAttentionBackend.get_kv_cache_shape``);
  ``[0]`` is the key cache, ``[1]`` the value cache, each already the interchange layout:
  no copy.
* ``"flashinfer"``: ``(num_blocks, 2, block_size, num_kv_heads, head_size)``
  (``vllm/attention/backends/flashinfer.py``, ``FlashInferBackend.get_kv_cache_shape``);
  key and value interleave per block, so each role is copied once.
* ``"cpu"``: the heads-first (HND) cache ``(2, num_blocks, num_kv_heads, block_size,
  head_size)`` (vLLM's ``HND`` KV-cache layout, ``vllm/v1/attention/backends/utils.py``
  ``get_kv_cache_layout``); transposed once.
* ``"paged_attention_v1"``: a ``(key_cache, value_cache)`` pair with key
  ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` (``x = 16 // element
  size``) and value ``[num_blocks, num_kv_heads, head_size, block_size]``
  (``vllm/attention/ops/paged_attn.py``, ``PagedAttention.split_kv_cache`` and the
  kernels' docstrings); transposed to the interchange layout and back, as the spec
  requires of producers.

Caches on a GPU stay there until the snapshot is read or written (their descriptors record
the device; what is written is a host copy, described as CPU memory);
``to_vllm(..., device="cuda")`` puts caches back on a device.  Block tables
are vLLM's padded ``[num_seqs, max_blocks]`` int32 tensor plus per-sequence
lengths.  fp8 caches (``kv_cache_dtype`` "fp8"/"fp8_e4m3"/"fp8_e5m2"; vLLM may hold them as
uint8) keep their per-layer ``k_scale``/``v_scale`` in the snapshot's ``kv_scales``
(decision D5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import HurrayError
from ..snapshot import KVCacheSnapshot
from ._common import as_array, build, checked_int32, csr_to_padded, float_pools, padded_to_csr
from ._torch import FP8, from_numpy, place, scalar

LAYOUTS = ("flash_attn", "flashinfer", "cpu", "paged_attention_v1")


def _as_fp8(t: Any, kv_cache_dtype: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise HurrayError(f"expected a torch.Tensor, got {type(t).__name__}", field="kv_caches")
    return t.view(FP8[kv_cache_dtype]) if kv_cache_dtype in FP8 and t.dtype == torch.uint8 \
        else t


def _pools(cache: Any, layout: str, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's key and value pools as ``[num_blocks, block_size, H, D]`` tensors on the
    cache's own device (views where the layout allows)."""
    if layout == "paged_attention_v1":
        key, value = (_as_fp8(c, kv_cache_dtype) for c in cache)
        nb, heads, dx, bs, x = key.shape
        k = key.permute(0, 3, 1, 2, 4).reshape(nb, bs, heads, dx * x)
        v = value.permute(0, 3, 1, 2)
        return k, v
    a = _as_fp8(cache, kv_cache_dtype)
    if a.dim() != 5:
        raise HurrayError(f"a vLLM {layout} cache is 5-D, got shape {list(a.shape)}",
                          field="kv_caches", value=list(a.shape), rule=f"{layout} layout")
    if layout == "flash_attn":
        return a[0], a[1]
    if layout == "flashinfer":
        return a[:, 0], a[:, 1]
    return a[0].permute(0, 2, 1, 3), a[1].permute(0, 2, 1, 3)  # cpu: HND -> NHD


def from_vllm(kv_caches: Sequence[Any], block_table: Any, seq_lens: Any,
              layout: str = "flash_attn", k_scales: Sequence[Any] | None = None,
              v_scales: Sequence[Any] | None = None, kv_cache_dtype: str = "auto",
              lazy: bool | None = None) -> KVCacheSnapshot:
    """A snapshot of vLLM's per-layer caches (views where the layout allows).  Caches on
    a GPU stay there (descriptors record the device) until the snapshot is read or
    written; ``lazy=True`` does the same for CPU caches."""
    if layout not in LAYOUTS:
        raise HurrayError(f"layout {layout!r} is not one of {LAYOUTS}", field="layout",
                          value=layout)
    pools = [_pools(c, layout, kv_cache_dtype) for c in kv_caches]
    if not pools:
        raise HurrayError("kv_caches is empty", field="kv_caches")
    block_size = pools[0][0].shape[1]
    lens = as_array(seq_lens).astype(np.int64)
    flat, seq_ptr = padded_to_csr(as_array(block_table), lens, block_size)
    scales = None
    if k_scales is not None or v_scales is not None:
        ks = k_scales if k_scales is not None else [1.0] * len(pools)
        vs = v_scales if v_scales is not None else [1.0] * len(pools)
        scales = [(scalar(k), scalar(v)) for k, v in zip(ks, vs, strict=True)]
    return build(pools, flat, seq_ptr, lens, scales, lazy=lazy)


def to_vllm(snapshot: KVCacheSnapshot, layout: str = "flash_attn", device: Any = None
            ) -> tuple[list[Any], torch.Tensor, torch.Tensor]:
    """``(kv_caches, block_table, seq_lens)`` in vLLM's forms (one copy per cache: vLLM
    keeps key and value in one tensor, or in a kernel-specific order)."""
    if layout not in LAYOUTS:
        raise HurrayError(f"layout {layout!r} is not one of {LAYOUTS}", field="layout",
                          value=layout)
    caches: list[Any] = []
    for k, v in float_pools(snapshot, "vLLM"):
        if layout == "flash_attn":
            caches.append(place(from_numpy(np.stack([k, v])), device))
        elif layout == "flashinfer":
            caches.append(place(from_numpy(np.stack([k, v], axis=1)), device))
        elif layout == "cpu":
            caches.append(place(from_numpy(np.stack([k.transpose(0, 2, 1, 3),
                                                     v.transpose(0, 2, 1, 3)])), device))
        else:
            nb, bs, heads, dim = k.shape
            x = 16 // k.dtype.itemsize
            if dim % x:
                raise HurrayError(f"head_size {dim} is not a multiple of x = {x}",
                                  field="head_dim", value=dim,
                                  rule="paged_attention_v1 splits head_size by 16 bytes")
            key = np.ascontiguousarray(k.reshape(nb, bs, heads, dim // x, x)
                                       .transpose(0, 2, 3, 1, 4))
            value = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
            caches.append((place(from_numpy(key), device), place(from_numpy(value), device)))
    first = snapshot.tensor(0, "key")
    table = place(torch.from_numpy(csr_to_padded(first)), device)
    lens = place(torch.from_numpy(checked_int32(snapshot.seq_lens, "seq_lens")), device)
    return caches, table, lens
