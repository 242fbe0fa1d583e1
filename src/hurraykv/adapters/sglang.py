"""SGLang token-to-KV pools <-> KVCacheSnapshot.

SGLang keeps, per layer, ``k_buffer`` and ``v_buffer`` of shape ``(size + page_size,
head_num, head_dim)`` (``python/sglang/srt/mem_cache/memory_pool.py``,
``MHATokenToKVPool._create_buffers``) and maps request ``r``'s token ``t`` to a slot with
``req_to_token[r, t]`` (``ReqToTokenPool.req_to_token``, int32 ``[size, max_context_len]``).
With ``page_size`` > 1 the paged allocator hands out whole pages, so the slots of one page
are ``page * page_size + offset``; a pool is then ``(size + page_size) // page_size`` pages
and converts without copying.  Slots that do not follow pages are rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import HurrayError, LayoutError
from ..snapshot import KVCacheSnapshot
from ._common import as_array, build, checked_int32, float_pools
from ._torch import from_numpy, place


def from_sglang(k_buffers: Sequence[Any], v_buffers: Sequence[Any], req_to_token: Any,
                seq_lens: Any, page_size: int = 1, req_pool_indices: Any = None,
                lazy: bool | None = None) -> KVCacheSnapshot:
    """A snapshot of the requests ``req_pool_indices`` (default: rows 0..len(seq_lens)-1)."""
    lens = as_array(seq_lens).astype(np.int64)
    table = as_array(req_to_token)
    rows = (table[as_array(req_pool_indices).astype(np.int64)] if req_pool_indices is not None
            else table[: len(lens)]).astype(np.int64)
    ps = int(page_size)
    pools = []
    for ka, va in zip(k_buffers, v_buffers, strict=True):
        slots, heads, dim = ka.shape
        if slots % ps:
            raise LayoutError.at("k_buffer.shape[0]", None, slots,
                                 f"size + page_size must be a multiple of page_size {ps}")
        pools.append((ka.reshape(slots // ps, ps, heads, dim),
                      va.reshape(slots // ps, ps, heads, dim)))
    if not pools:
        raise HurrayError("k_buffers is empty", field="k_buffers")
    if len(lens) and lens.max() > rows.shape[1]:
        raise LayoutError.at("seq_lens", None, int(lens.max()),
                             f"req_to_token has {rows.shape[1]} columns")
    # every valid token's slot, sequences back to back (vectorised, no per-token loop)
    seq = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    slot = rows[seq, pos]
    page = slot // ps
    first = pos % ps == 0
    expected = np.repeat(page[first], np.minimum(ps, lens[seq[first]] - pos[first])) * ps + pos % ps
    if not np.array_equal(slot, expected):
        bad = int(np.flatnonzero(slot != expected)[0])
        raise LayoutError.at(f"req_to_token[{int(seq[bad])}, {int(pos[bad])}]", None,
                             int(slot[bad]), f"with page_size {ps} the slots of one page are "
                             "page * page_size + offset")
    pages = -(-lens // ps)
    return build(pools, page[first], np.concatenate([[0], np.cumsum(pages)]), lens, lazy=lazy)


def to_sglang(snapshot: KVCacheSnapshot, device: Any = None
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(k_buffers, v_buffers, req_to_token, seq_lens)``: the buffers are views of the
    snapshot's pools; request ``r`` is row ``r`` of ``req_to_token`` (unused columns 0)."""
    ks, vs = [], []
    for k, v in float_pools(snapshot, "SGLang"):
        n, ps, heads, dim = k.shape
        ks.append(place(from_numpy(k.reshape(n * ps, heads, dim)), device))
        vs.append(place(from_numpy(v.reshape(n * ps, heads, dim)), device))
    t = snapshot.tensor(0, "key")
    lens = snapshot.seq_lens
    ps = t.page_size
    width = int(lens.max(initial=0))
    table = np.zeros((len(lens), width), np.int64)
    seq = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    pages = t.block_table[t.seq_ptr[seq].astype(np.int64) + pos // ps].astype(np.int64)
    table[seq, pos] = pages * ps + pos % ps
    return (ks, vs, place(torch.from_numpy(checked_int32(table, "req_to_token")), device),
            place(torch.from_numpy(checked_int32(lens, "seq_lens")), device))
