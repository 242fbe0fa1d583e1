"""FlashInfer paged KV caches <-> KVCacheSnapshot.

FlashInfer addresses a batch with three int32 tensors (``flashinfer.BatchDecodeWith
PagedKVCacheWrapper.plan`` / ``BatchPrefillWithPagedKVCacheWrapper.plan``, "Page Table"
in FlashInfer's KV-cache layout docs): ``kv_indptr`` [batch + 1] (= ``seq_ptr``),
``kv_indices`` (= ``block_table``) and ``kv_last_page_len`` [batch], the tokens in each
sequence's last page, in ``[1, page_size]``.  A layer's cache is one tensor
``(num_pages, 2, page_size, num_heads, head_dim)`` (NHD) or ``(num_pages, 2, num_heads,
page_size, head_dim)`` (HND), or a ``(k_cache, v_cache)`` pair of 4-D tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import HurrayError
from ..snapshot import KVCacheSnapshot
from ._common import as_array, build, checked_int32, float_pools
from ._torch import from_numpy, place


def _pools(cache: Any, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(cache, tuple | list):
        k, v = cache
    else:
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise HurrayError(f"a FlashInfer paged cache is (num_pages, 2, ...), got "
                              f"{list(cache.shape)}", field="paged_kv_cache",
                              value=list(cache.shape))
        k, v = cache[:, 0], cache[:, 1]
    if kv_layout == "HND":
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    elif kv_layout != "NHD":
        raise HurrayError(f"kv_layout {kv_layout!r} is NHD or HND", field="kv_layout",
                          value=kv_layout)
    return k, v


def from_flashinfer(paged_kv_caches: Sequence[Any], kv_indptr: Any, kv_indices: Any,
                    kv_last_page_len: Any, kv_layout: str = "NHD", lazy: bool | None = None
                    ) -> KVCacheSnapshot:
    pools = [_pools(c, kv_layout) for c in paged_kv_caches]
    if not pools:
        raise HurrayError("paged_kv_caches is empty", field="paged_kv_caches")
    page_size = pools[0][0].shape[1]
    indptr = as_array(kv_indptr).astype(np.int64)
    indices = as_array(kv_indices).astype(np.int64)[: int(indptr[-1]) if len(indptr) else 0]
    last = as_array(kv_last_page_len).astype(np.int64)
    pages = np.diff(indptr)
    if len(last) != len(pages):
        raise HurrayError(f"kv_last_page_len has {len(last)} entries for {len(pages)} "
                          "sequences", field="kv_last_page_len", value=len(last))
    bad = (pages > 0) & ((last < 1) | (last > page_size))
    if bad.any():
        s = int(np.flatnonzero(bad)[0])
        raise HurrayError(f"kv_last_page_len[{s}] = {int(last[s])}; a last page holds 1.."
                          f"{page_size} tokens", field=f"kv_last_page_len[{s}]",
                          value=int(last[s]), rule="FlashInfer page table")
    lens = np.where(pages > 0, (pages - 1) * page_size + last, 0)
    return build(pools, indices, indptr, lens, lazy=lazy)


def to_flashinfer(snapshot: KVCacheSnapshot, kv_layout: str = "NHD", device: Any = None
                  ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(paged_kv_caches, kv_indptr, kv_indices, kv_last_page_len)``, int32 indices."""
    if kv_layout not in ("NHD", "HND"):
        raise HurrayError(f"kv_layout {kv_layout!r} is NHD or HND", field="kv_layout",
                          value=kv_layout)
    caches = []
    for k, v in float_pools(snapshot, "FlashInfer"):
        if kv_layout == "HND":
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        caches.append(place(from_numpy(np.stack([k, v], axis=1)), device))
    t = snapshot.tensor(0, "key")
    pages = t.pages_per_seq
    lens = snapshot.seq_lens
    last = lens - (pages - 1) * t.page_size
    bad = (pages > 0) & ((last < 1) | (last > t.page_size))
    if bad.any():
        s = int(np.flatnonzero(bad)[0])
        raise HurrayError(f"sequence {s} holds {int(lens[s])} tokens in {int(pages[s])} pages: "
                          "FlashInfer needs every page but the last full", field="seq_lens",
                          value=int(lens[s]))
    last = np.where(pages > 0, last, 0)
    return (caches,
            place(torch.from_numpy(checked_int32(t.seq_ptr.astype(np.int64), "kv_indptr")),
                  device),
            place(torch.from_numpy(checked_int32(t.block_table.astype(np.int64),
                                                 "kv_indices")), device),
            place(torch.from_numpy(checked_int32(last, "kv_last_page_len")), device))
