"""Transformers ``DynamicCache`` <-> KVCacheSnapshot.

A ``DynamicCache`` holds, per layer, ``keys`` and ``values`` of shape ``[batch,
num_kv_heads, seq, head_dim]`` (``transformers/cache_utils.py``, ``DynamicLayer``; older
releases: ``key_cache[i]`` / ``value_cache[i]``).  A batch of ragged prompts is padded; the
attention mask (1 = token, 0 = padding, left or right) says which positions are real.
``from_dynamic_cache`` pages each sequence's real tokens (identical leading pages shared);
``to_dynamic_cache`` left-pads them back and returns the matching attention mask.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import HurrayError
from ..paged import BlockPagedTensor
from ..snapshot import KVCacheSnapshot
from ._common import as_array
from ._torch import from_numpy, place, to_numpy


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    raise HurrayError(f"{type(cache).__name__} is not a DynamicCache", field="cache")


def from_dynamic_cache(cache: Any, attention_mask: Any = None, page_size: int = 16
                       ) -> KVCacheSnapshot:
    layers = _layers(cache)
    if not layers:
        raise HurrayError("the cache holds no layer", field="cache")
    batch, _, length, _ = layers[0][0].shape
    mask = np.ones((batch, length), bool) if attention_mask is None else \
        as_array(attention_mask).astype(bool)
    if mask.shape != (batch, length):
        raise HurrayError(f"attention_mask is {list(mask.shape)}, the cache [{batch}, "
                          f"{length}]", field="attention_mask", value=list(mask.shape))
    rows = [np.flatnonzero(mask[b]) for b in range(batch)]  # one index array per sequence
    tensors = []
    for i, (k, v) in enumerate(layers):
        for role, x in (("key", k), ("value", v)):
            a = to_numpy(x)  # [batch, heads, seq, dim]
            seqs = [a[b][:, rows[b], :].transpose(1, 0, 2) for b in range(batch)]
            tensors.append(BlockPagedTensor.from_sequences(
                seqs, page_size, kv_role=role, layer_index=i, element_type=None,
                num_heads=a.shape[1], head_dim=a.shape[3]))
    return KVCacheSnapshot.from_tensors(tensors)


def to_dynamic_cache(snapshot: KVCacheSnapshot, device: Any = None
                     ) -> tuple[Any, torch.Tensor]:
    """``(DynamicCache, attention_mask)``: sequences left-padded with zeros."""
    from transformers import DynamicCache

    lens = snapshot.seq_lens
    batch, width = len(lens), int(lens.max(initial=0))
    mask = np.arange(width)[None, :] >= (width - lens)[:, None]
    cache = DynamicCache()
    for i in range(snapshot.num_layers):
        pair = []
        for t in snapshot.layer(i):
            dense = np.zeros((batch, width, t.num_heads, t.head_dim), t.dtype)
            dense[mask] = t.to_dense()  # tokens in order, right-aligned per sequence
            pair.append(place(from_numpy(np.ascontiguousarray(dense.transpose(0, 2, 1, 3))),
                              device))
        cache.update(pair[0], pair[1], i)
    return cache, place(torch.from_numpy(mask.astype(np.int64)), device)
