"""SGLang token-to-KV pools <-> KVCacheSnapshot.

Checked against sglang 0.5.23 (files under ``python/sglang/srt/mem_cache/``):

* ``ReqToTokenPool`` (``memory_pool.py``): ``req_to_token`` is int32 ``[size + 1,
  max_context_len]``; **row 0 is a padding row** that is never allocated (``_alloc_size =
  size + 1``, ``free_slots = range(1, ...)``): CUDA-graph padded batches point their
  dummy requests at it.  Requests are named by ``req_pool_indices`` (never 0).
* ``MHATokenToKVPool``: per layer ``k_buffer`` ``[size + page_size, head_num, head_dim]``
  and ``v_buffer`` ``[size + page_size, head_num, v_head_dim]`` (NHD, ``_kv_buffer_shapes``)
  or, with ``SGLANG_USE_HND_KVCACHE``, ``[num_pages, head_num, page_size, head_dim]``.
  Slot ``s`` is page ``s // page_size``, offset ``s % page_size``.  **Slot 0 / page 0 is the
  padding sink** dummy writes clobber (``allocator/token.py`` and ``allocator/paged.py``:
  free slots and pages start at 1).  ``v_head_dim`` may differ from ``head_dim``.
* fp8 pools (``dtype`` float8_e4m3fn / float8_e5m2) are stored as uint8 and written
  divided by the layer's ``k_scale``/``v_scale`` (``set_kv_buffer``): give
  ``kv_cache_dtype`` and the scales, as for vLLM.  ROCm's e4m3fnuz has no Hurray type.
* ``MLATokenToKVPool``: one ``kv_buffer`` ``[size + page_size, 1, kv_lora_rank +
  qk_rope_head_dim]`` per layer: one fused member per layer (decision H60).
* ``req_to_token`` holds *virtual* slot ids, equal to physical slots only on a plain pool
  (``kv_index_translator.py``); the unified-memory pools (``unified_memory_pool.py``)
  translate them through their allocator and are refused, as are the quantized pools
  (``MHATokenToKVPoolFP4``, ``MHATokenToKVPoolMXFP8``, ``MLATokenToKVPoolFP4``) and ROCm's
  ``vectorized_5d`` layout.

``to_sglang`` keeps row 0 and page 0 free: the snapshot's pages start at page 1 and its
requests at row 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import LayoutError, UnsupportedError
from ..snapshot import KVCacheSnapshot
from ._common import as_array, as_cache_dtype, build, checked_int32, float_pools, scales_of
from ._torch import from_numpy, place

LAYOUTS = ("NHD", "HND")
REFUSED_POOLS = {
    "MHATokenToKVPoolFP4": "packs FP4 values with block scales",
    "MHATokenToKVPoolMXFP8": "packs MXFP8 values with e8m0 block scales",
    "MLATokenToKVPoolFP4": "packs FP4 latents with block scales",
    "DSATokenToKVPool": "keeps a sparse-attention index cache beside the latents",
    "PageMajorMHATokenToKVPool": "has no per-layer contiguous regions",
}


class SGLangCache(NamedTuple):
    k_buffers: list[torch.Tensor]  # or the MLA kv_buffers
    v_buffers: list[torch.Tensor] | None
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    k_scales: list[float] | None
    v_scales: list[float] | None


def _pages(buf: Any, page_size: int, layout: str, kv_cache_dtype: str, where: str) -> Any:
    """One layer's buffer as ``[num_pages, page_size, heads, dim]`` (a view for NHD)."""
    t = as_cache_dtype(buf, kv_cache_dtype, where)
    if layout == "HND":
        if t.dim() != 4 or t.shape[2] != page_size:
            raise LayoutError.at(f"{where}.shape", None, list(t.shape),
                                 f"an HND pool buffer is [num_pages, head_num, page_size="
                                 f"{page_size}, head_dim]")
        return t.permute(0, 2, 1, 3)
    if t.dim() != 3:
        raise LayoutError.at(f"{where}.shape", None, list(t.shape),
                             "an NHD pool buffer is [size + page_size, head_num, head_dim]"
                             + (" (a 4-D buffer: pass layout='HND')" if t.dim() == 4 else ""))
    slots, heads, dim = (int(x) for x in t.shape)
    if slots % page_size:
        raise LayoutError.at(f"{where}.shape[0]", None, slots,
                             f"size + page_size must be a multiple of page_size {page_size}")
    return t.reshape(slots // page_size, page_size, heads, dim)


def from_sglang(k_buffers: Sequence[Any], v_buffers: Sequence[Any] | None, req_to_token: Any,
                seq_lens: Any, req_pool_indices: Any, *, page_size: int = 1,
                layout: str = "NHD", kv_cache_dtype: str = "auto", k_scales: Any = None,
                v_scales: Any = None, lazy: bool | None = None) -> KVCacheSnapshot:
    """A snapshot of the requests in rows ``req_pool_indices`` of ``req_to_token``.

    ``v_buffers=None`` reads an MLA pool (``k_buffers`` are its ``kv_buffer``s).  Slots
    must follow whole pages (``page * page_size + offset``) and never name page 0."""
    if layout not in LAYOUTS:
        raise LayoutError.at("layout", None, layout,
                             "SGLang pools are NHD or HND (vectorized_5d is not supported)")
    ps = int(page_size)
    lens = as_array(seq_lens).astype(np.int64).reshape(-1)
    table = as_array(req_to_token)
    if table.ndim != 2:
        raise LayoutError.at("req_to_token.shape", None, list(table.shape),
                             "req_to_token is [size + 1, max_context_len]")
    if req_pool_indices is None:
        raise LayoutError.at("req_pool_indices", None, None,
                             "name the requests' rows: row 0 of req_to_token is SGLang's "
                             "padding row and rows are not in request order")
    rows_idx = as_array(req_pool_indices).astype(np.int64).reshape(-1)
    if len(rows_idx) != len(lens):
        raise LayoutError.at("req_pool_indices", None, len(rows_idx),
                             f"one row per sequence ({len(lens)})")
    bad = (rows_idx < 1) | (rows_idx >= table.shape[0])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LayoutError.at(f"req_pool_indices[{i}]", i, int(rows_idx[i]),
                             f"request rows are 1..{table.shape[0] - 1}: row 0 of "
                             "req_to_token is the padding row no request owns",
                             where="index")
    if len(lens) and lens.max() > table.shape[1]:
        raise LayoutError.at("seq_lens", None, int(lens.max()),
                             f"req_to_token has {table.shape[1]} columns")
    roles = [k_buffers] if v_buffers is None else [k_buffers, v_buffers]
    if v_buffers is not None and len(v_buffers) != len(k_buffers):
        raise LayoutError.at("v_buffers", None, len(v_buffers),
                             f"one value buffer per layer ({len(k_buffers)})")
    pools = [tuple(_pages(bufs[i], ps, layout, kv_cache_dtype,
                          f"{'kv' if v_buffers is None else 'kv'[r]}_buffers[{i}]")
                   for r, bufs in enumerate(roles)) for i in range(len(k_buffers))]
    if not pools:
        raise LayoutError("k_buffers is empty", field="k_buffers", rule="one buffer per layer")
    if v_buffers is None and pools[0][0].shape[2] != 1:
        raise LayoutError.at("kv_buffers[0].shape", None, list(k_buffers[0].shape),
                             "an MLA pool buffer is [size + page_size, 1, kv_lora_rank + "
                             "qk_rope_head_dim]")
    rows = table[rows_idx].astype(np.int64)
    # every valid token's slot, sequences back to back (vectorised, no per-token loop)
    seq = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    slot = rows[seq, pos]
    page = slot // ps
    if (page < 1).any():
        i = int(np.flatnonzero(page < 1)[0])
        raise LayoutError.at(f"req_to_token[{int(rows_idx[seq[i]])}, {int(pos[i])}]", None,
                             int(slot[i]), "slot 0's page is SGLang's padding sink, written by "
                             "dummy tokens; no request's token lives there")
    first = pos % ps == 0
    expected = np.repeat(page[first], np.minimum(ps, lens[seq[first]] - pos[first])) * ps \
        + pos % ps
    if not np.array_equal(slot, expected):
        bad_at = int(np.flatnonzero(slot != expected)[0])
        raise LayoutError.at(f"req_to_token[{int(rows_idx[seq[bad_at]])}, {int(pos[bad_at])}]",
                             None, int(slot[bad_at]), f"with page_size {ps} the slots of one "
                             "page are page * page_size + offset")
    num_pages = pools[0][0].shape[0]
    if len(page) and page.max() >= num_pages:
        raise LayoutError.at("req_to_token", None, int(page.max() * ps),
                             f"names a slot past the pool's {num_pages * ps} slots")
    pages = -(-lens // ps)
    scales = scales_of(k_scales, v_scales, len(pools), kv_cache_dtype,
                       fused=v_buffers is None)
    return build(pools, page[first], np.concatenate([[0], np.cumsum(pages)]), lens, scales,
                 lazy=lazy)


def from_sglang_pool(pool: Any, req_to_token: Any, seq_lens: Any, req_pool_indices: Any, *,
                     k_scales: Any = None, v_scales: Any = None, lazy: bool | None = None
                     ) -> KVCacheSnapshot:
    """A snapshot read from a live ``MHATokenToKVPool`` / ``MLATokenToKVPool``: its layout
    (NHD or HND), page size and fp8 dtype come from the pool itself."""
    name = type(pool).__name__
    if name in REFUSED_POOLS:
        raise UnsupportedError.at("pool", None, name, f"{name} {REFUSED_POOLS[name]} (not "
                                  "supported)")
    if name.startswith("Unified"):
        raise UnsupportedError.at("pool", None, name,
                                  f"{name} stores virtual slot ids in req_to_token that only "
                                  "its allocator translates to physical slots "
                                  "(kv_index_translator.py); not supported")
    if getattr(pool, "is_quantized_kv_cache", False):
        raise UnsupportedError.at("pool", None, name, f"{name} holds quantized KV with "
                                  "in-pool scales (not supported)")
    if getattr(pool, "kv_cache_layout", "nhd") == "vectorized_5d":
        raise UnsupportedError.at("kv_cache_layout", None, "vectorized_5d",
                                  "ROCm's vectorized_5d pool layout is not supported")
    dtype = getattr(pool, "dtype", None)
    fp8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
    if dtype == getattr(torch, "float8_e4m3fnuz", None):
        raise UnsupportedError.at("dtype", None, "float8_e4m3fnuz",
                                  "Hurray has no element type for e4m3fnuz (ROCm); not "
                                  "supported")
    kv_cache_dtype = fp8.get(dtype, "auto")
    layout = "HND" if getattr(pool, "use_hnd", False) else "NHD"
    if hasattr(pool, "kv_buffer") and not hasattr(pool, "k_buffer"):
        return from_sglang(pool.kv_buffer, None, req_to_token, seq_lens, req_pool_indices,
                           page_size=pool.page_size, kv_cache_dtype=kv_cache_dtype,
                           k_scales=k_scales, lazy=lazy)
    return from_sglang(pool.k_buffer, pool.v_buffer, req_to_token, seq_lens,
                       req_pool_indices, page_size=pool.page_size, layout=layout,
                       kv_cache_dtype=kv_cache_dtype, k_scales=k_scales, v_scales=v_scales,
                       lazy=lazy)


def to_sglang(snapshot: KVCacheSnapshot, *, layout: str = "NHD",
              max_context_len: int | None = None, device: Any = None) -> SGLangCache:
    """Pool buffers, ``req_to_token`` and ``req_pool_indices`` as SGLang holds them: page 0
    (the padding sink) and row 0 (the padding row) stay free - the snapshot's pages are
    pages 1.. and its requests rows 1..  fp8 pools come back as uint8 with their scales;
    MLA snapshots (fused members) as ``k_buffers`` = the ``kv_buffer``s."""
    if layout not in LAYOUTS:
        raise LayoutError.at("layout", None, layout, "SGLang pools are NHD or HND")
    bufs: list[list[torch.Tensor]] = []
    for layer in float_pools(snapshot, "SGLang"):
        row = []
        for pool in layer:
            n, ps, heads, dim = pool.shape
            padded = np.zeros((n + 1, ps, heads, dim), pool.dtype)  # page 0: padding sink
            padded[1:] = pool
            if padded.dtype.name.startswith("float8"):
                padded = padded.view(np.uint8)  # SGLang's store dtype for fp8 pools
            if layout == "HND":
                out = np.ascontiguousarray(padded.transpose(0, 2, 1, 3))
            else:
                out = padded.reshape((n + 1) * ps, heads, dim)
            row.append(place(from_numpy(out), device))
        bufs.append(row)
    t = snapshot.tensor(0, snapshot.roles[0])
    lens = snapshot.seq_lens
    ps = t.page_size
    width = max(int(lens.max(initial=0)), int(max_context_len or 0))
    table = np.zeros((len(lens) + 1, width), np.int64)  # row 0: the padding row
    seq = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    pages = t.block_table[t.seq_ptr[seq].astype(np.int64) + pos // ps].astype(np.int64) + 1
    table[seq + 1, pos] = pages * ps + pos % ps
    scales = snapshot.kv_scales
    return SGLangCache(
        [b[0] for b in bufs], None if snapshot.fused else [b[1] for b in bufs],
        place(torch.from_numpy(checked_int32(table, "req_to_token")), device),
        place(torch.arange(1, len(lens) + 1, dtype=torch.int64), device),
        place(torch.from_numpy(checked_int32(lens, "seq_lens")), device),
        None if scales is None else scales[:, 0].tolist(),
        None if scales is None or snapshot.fused else scales[:, 1].tolist())
