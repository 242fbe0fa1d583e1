"""Shared pieces of the engine adapters: padded block tables, layer assembly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import HurrayError, LayoutError
from ..paged import BlockPagedTensor
from ..snapshot import KVCacheSnapshot


def padded_to_csr(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """A padded ``[num_seqs, max_blocks]`` table and lengths -> (block_table, seq_ptr)."""
    table = np.asarray(block_table)
    lens = np.asarray(seq_lens).astype(np.int64).reshape(-1)
    if table.ndim != 2 or table.shape[0] != len(lens):
        raise LayoutError.at("block_table.shape", None, list(table.shape),
                             f"a padded block table is [num_seqs={len(lens)}, max_blocks]")
    pages = -(-lens // block_size)
    if len(pages) and pages.max(initial=0) > table.shape[1]:
        s = int(np.argmax(pages > table.shape[1]))
        raise LayoutError.at(f"seq_lens[{s}]", s, int(lens[s]),
                             f"needs {int(pages[s])} blocks; the table has {table.shape[1]} "
                             "columns", where="index")
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    return table[used].astype(np.int64), np.concatenate([[0], np.cumsum(pages)])


def csr_to_padded(t: BlockPagedTensor, pad: int = 0) -> np.ndarray:
    """(block_table, seq_ptr) -> a padded ``[num_seqs, max_blocks]`` int32 table."""
    pages = t.pages_per_seq
    width = int(pages.max(initial=0))
    out = np.full((t.num_seqs, width), pad, np.int64)
    used = np.arange(width)[None, :] < pages[:, None]
    out[used] = t.block_table
    return checked_int32(out, "block_table")


def checked_int32(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    info = np.iinfo(np.int32)
    flat = a.reshape(-1)
    bad = (flat > info.max) | (flat < info.min)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise HurrayError(f"{name}[{i}] = {int(flat[i])} does not fit int32, which the "
                          "engine's kernels index with", field=name, value=int(flat[i]),
                          rule="engine index tensors are int32")
    return a.astype(np.int32)


def build(pools: Sequence[tuple[np.ndarray, ...]], block_table: np.ndarray, seq_ptr: np.ndarray,
          seq_lens: np.ndarray, scales: Sequence[tuple[float | None, ...]] | None = None
          ) -> KVCacheSnapshot:
    """A snapshot from per-layer (key, value) pools ``[num_pages, page_size, H, D]``."""
    tensors = []
    for i, layer in enumerate(pools):
        roles = ("key", "value") if len(layer) == 2 else ("fused",)
        for r, (role, pool) in enumerate(zip(roles, layer, strict=True)):
            scale = None if scales is None else scales[i][r]
            tensors.append(BlockPagedTensor(pool, block_table, seq_ptr, seq_lens, kv_role=role,
                                            layer_index=i, fp8_scale=scale))
    return KVCacheSnapshot.from_tensors(tensors)


def float_pools(snapshot: KVCacheSnapshot, what: str) -> list[tuple[np.ndarray, ...]]:
    """Per-layer page pools; engines take float or fp8 pools, not integer quantization."""
    out = []
    for layer in snapshot:
        if any(t.quantization is not None for t in layer):
            raise HurrayError(f"{what} takes float or fp8 caches; dequantize() the snapshot "
                              "first", field="quantization", rule=f"{what} layouts")
        out.append(tuple(t.page_pool for t in layer))
    return out


def as_array(x: Any) -> np.ndarray:
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - the adapters import torch anyway
        pass
    return np.asarray(x)
