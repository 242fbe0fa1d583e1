"""FlashInfer paged KV caches <-> KVCacheSnapshot.

Checked against flashinfer-python 0.7.4:

* The page table (``decode.py``, ``BatchDecodeWithPagedKVCacheWrapper.plan``;
  ``prefill.py`` likewise): int32 ``kv_indptr`` ``[batch + 1]`` (= ``seq_ptr``),
  ``kv_indices`` (= ``block_table``) and ``kv_last_page_len`` ``[batch]``, the tokens in
  each sequence's last page.  The docstring example asks ``1 <= kv_last_page_len <=
  page_size``; a sequence with no pages has no last page, and hurraykv writes 0 for it
  (the kernels never read it: the sequence has no pages) and accepts 0 only there.
* A layer's cache (``utils.py``, ``_unpack_paged_kv_cache`` / ``_expand_5d`` /
  ``_expand_4d``): one tensor ``(num_pages, 2, page_size, num_heads, head_dim)`` (NHD) or
  ``(num_pages, 2, num_heads, page_size, head_dim)`` (HND), or a ``(k_cache, v_cache)``
  pair of 4-D tensors; with ``page_size`` 1 the page axis may be left out: a 4-D single
  tensor ``(num_pages, 2, num_heads, head_dim)`` or a pair of 3-D tensors.
* fp8 caches (float8_e4m3fn / float8_e5m2, or uint8 with ``kv_cache_dtype``) take a
  per-layer ``k_scale``/``v_scale`` at run time (``BatchDecodeWithPagedKVCacheWrapper.run``);
  they travel as the snapshot's ``kv_scales`` (D5) and come back from ``to_flashinfer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import HurrayError, LayoutError, UnsupportedError
from ..snapshot import KVCacheSnapshot
from ._common import as_array, as_cache_dtype, build, checked_int32, float_pools, scales_of
from ._torch import FP8, from_numpy, place


class FlashInferCache(NamedTuple):
    paged_kv_caches: list[Any]  # per layer: a tensor, or a (k_cache, v_cache) tuple
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    k_scales: list[float] | None
    v_scales: list[float] | None


def _pools(cache: Any, kv_layout: str, kv_cache_dtype: str, where: str
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's key and value pages as ``[num_pages, page_size, H, D]`` views."""
    if kv_layout not in ("NHD", "HND"):
        raise LayoutError.at("kv_layout", None, kv_layout, "kv_layout is NHD or HND")
    if isinstance(cache, tuple | list):
        k, v = (as_cache_dtype(x, kv_cache_dtype, where) for x in cache)
        if k.dim() == 3 and v.dim() == 3:  # page_size 1: (num_pages, H, D) each
            return k.unsqueeze(1), v.unsqueeze(1)
        if k.dim() != 4 or v.dim() != 4:
            raise LayoutError.at(f"{where}.shape", None, [list(k.shape), list(v.shape)],
                                 "a (k_cache, v_cache) pair of 4-D tensors (3-D with "
                                 "page_size 1)")
    else:
        t = as_cache_dtype(cache, kv_cache_dtype, where)
        if t.dim() == 4 and t.shape[1] == 2:  # page_size 1: (num_pages, 2, H, D)
            return t[:, 0].unsqueeze(1), t[:, 1].unsqueeze(1)
        if t.dim() != 5 or t.shape[1] != 2:
            raise LayoutError.at(f"{where}.shape", None, list(t.shape),
                                 f"a FlashInfer paged cache is (num_pages, 2, ...) 5-D "
                                 f"({kv_layout}), or 4-D with page_size 1")
        k, v = t[:, 0], t[:, 1]
    if kv_layout == "HND":
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    return k, v


def from_flashinfer(paged_kv_caches: Sequence[Any], kv_indptr: Any, kv_indices: Any,
                    kv_last_page_len: Any, kv_layout: str = "NHD", *,
                    kv_cache_dtype: str = "auto", k_scales: Any = None, v_scales: Any = None,
                    lazy: bool | None = None) -> KVCacheSnapshot:
    pools = [_pools(c, kv_layout, kv_cache_dtype, f"paged_kv_caches[{i}]")
             for i, c in enumerate(paged_kv_caches)]
    if not pools:
        raise HurrayError("paged_kv_caches is empty", field="paged_kv_caches")
    page_size = pools[0][0].shape[1]
    indptr = as_array(kv_indptr).astype(np.int64)
    indices = as_array(kv_indices).astype(np.int64)[: int(indptr[-1]) if len(indptr) else 0]
    last = as_array(kv_last_page_len).astype(np.int64)
    pages = np.diff(indptr)
    if len(last) != len(pages):
        raise LayoutError.at("kv_last_page_len", None, len(last),
                             f"one entry per sequence ({len(pages)})")
    bad = ((pages > 0) & ((last < 1) | (last > page_size))) | ((pages == 0) & (last != 0))
    if bad.any():
        s = int(np.flatnonzero(bad)[0])
        raise LayoutError.at(f"kv_last_page_len[{s}]", s, int(last[s]),
                             f"a last page holds 1..{page_size} tokens (0 for a sequence "
                             "with no pages)", where="index")
    lens = np.where(pages > 0, (pages - 1) * page_size + last, 0)
    scales = scales_of(k_scales, v_scales, len(pools),
                       _dtype_name(pools[0][0], kv_cache_dtype))
    return build(pools, indices, indptr, lens, scales, lazy=lazy)


def _dtype_name(pool: torch.Tensor, kv_cache_dtype: str) -> str:
    """``kv_cache_dtype`` as given, or the fp8 name of a float8 tensor passed as is."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return {v: k for k, v in FP8.items() if k != "fp8"}.get(pool.dtype, "auto")


def to_flashinfer(snapshot: KVCacheSnapshot, kv_layout: str = "NHD", device: Any = None,
                  *, paired: bool | None = None) -> FlashInferCache:
    """The caches, the int32 page table and, for fp8 snapshots, the per-layer
    ``k_scale``/``v_scale`` lists.  A layer's cache is one ``(num_pages, 2, ...)`` tensor,
    or with ``paired`` a ``(k_cache, v_cache)`` tuple of 4-D tensors - the form that
    carries different key and value head sizes, chosen by default for such snapshots."""
    if kv_layout not in ("NHD", "HND"):
        raise LayoutError.at("kv_layout", None, kv_layout, "kv_layout is NHD or HND")
    if snapshot.fused:
        raise UnsupportedError.at("kv_role", None, "fused",
                                  "FlashInfer's paged KV caches hold a key and a value per "
                                  "layer; a fused (MLA latent) snapshot is not supported here")
    if paired is None:
        paired = snapshot.head_dim != snapshot.head_dim_v
    caches: list[Any] = []
    for k, v in float_pools(snapshot, "FlashInfer"):
        if kv_layout == "HND":
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if paired:
            caches.append(tuple(place(from_numpy(np.ascontiguousarray(x)), device)
                                for x in (k, v)))
            continue
        if k.shape != v.shape:
            raise LayoutError.at("head_dim", None, [k.shape[-1], v.shape[-1]],
                                 "FlashInfer's single-tensor cache holds equal key and value "
                                 "head sizes (pass paired=True for (k_cache, v_cache))")
        caches.append(place(from_numpy(np.stack([k, v], axis=1)), device))
    t = snapshot.tensor(0, "key")
    pages = t.pages_per_seq
    lens = snapshot.seq_lens
    last = lens - (pages - 1) * t.page_size
    bad = (pages > 0) & ((last < 1) | (last > t.page_size))
    if bad.any():
        s = int(np.flatnonzero(bad)[0])
        raise LayoutError.at(f"seq_lens[{s}]", s, int(lens[s]),
                             f"sequence {s} holds {int(lens[s])} tokens in {int(pages[s])} "
                             "pages: FlashInfer needs every page but the last full",
                             where="index")
    last = np.where(pages > 0, last, 0)
    scales = snapshot.kv_scales
    return FlashInferCache(
        caches,
        place(torch.from_numpy(checked_int32(t.seq_ptr.astype(np.int64), "kv_indptr")), device),
        place(torch.from_numpy(checked_int32(t.block_table.astype(np.int64), "kv_indices")),
              device),
        place(torch.from_numpy(checked_int32(last, "kv_last_page_len")), device),
        None if scales is None else scales[:, 0].tolist(),
        None if scales is None else scales[:, 1].tolist())
