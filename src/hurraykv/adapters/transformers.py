"""Transformers caches <-> KVCacheSnapshot.

Checked against transformers 5.24.0 (``transformers/cache_utils.py``), with real caches
filled by real models (tests/adapters/test_transformers_adapter.py).  A ``Cache`` holds one layer
object per model layer; the keys and values of an attention layer are ``[batch,
num_kv_heads, seq, head_dim]`` (``v_head_dim`` may differ).  A batch of ragged prompts is
padded; the attention mask (1 = token, 0 = padding, left or right) says which positions
are real.  Each layer's *valid length* comes from the layer itself:

==============================  ==========================================================
``DynamicLayer``                every stored position (``keys.shape[-2]``)
``DynamicSlidingWindowLayer``   ``cumulative_length``; once it passes the window the layer
                                has dropped its oldest tokens and the cache is refused
``StaticLayer``                 the first ``cumulative_length`` of ``max_cache_len`` slots
                                (the rest are zeros no token wrote)
``StaticSlidingWindowLayer``    the first ``cumulative_length_int`` slots, refused once the
                                ring has rolled
``Fp8QuantizedLayer``           the float8_e4m3fn states and their per-tensor scales: an
                                fp8 snapshot with ``kv_scales`` (D5), bit for bit
==============================  ==========================================================

Every layer of a snapshot holds the same tokens (one ``seq_lens``), so layers that disagree
are refused, naming them; nothing is truncated or padded to make them agree.  Layers with
no per-token KV or with state a snapshot cannot carry are refused by type: ``DummyLayer``
(KV-sharing or attention-free layers), the linear-attention and hybrid layers (recurrent
state), ``DynamicIndexedLayer``/``StaticIndexedLayer`` (a sparse-attention indexer cache),
``QuantizedLayer`` (quanto/HQQ group quantization with a full-precision residual).

``from_dynamic_cache`` pages each sequence's real tokens (identical leading pages shared);
``to_dynamic_cache`` left-pads them back and returns the matching attention mask; given the
model's ``config`` it builds the layer types the model expects (sliding layers keep their
window), and an fp8 snapshot is dequantized to ``dtype``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import LayoutError, UnsupportedError, require
from ..paged import BlockPagedTensor
from ..snapshot import KVCacheSnapshot
from ._common import as_array
from ._torch import from_numpy, place, scalar, to_numpy

REFUSED = {
    "DummyLayer": "stores no KV of its own (a KV-sharing or attention-free layer)",
    "LinearAttentionCacheLayerMixin": "keeps a recurrent state, not per-token KV",
    "DynamicIndexedLayer": "keeps a sparse-attention indexer cache beside its KV",
    "StaticIndexedLayer": "keeps a sparse-attention indexer cache beside its KV",
    "QuantizedLayer": "holds group-quantized states plus a full-precision residual",
}


def _kinds(layer: Any) -> list[str]:
    return [c.__name__ for c in type(layer).__mro__]


def _layer_kv(i: int, layer: Any) -> tuple[torch.Tensor, torch.Tensor, int, tuple | None]:
    """``(keys, values, tokens, fp8 scales)`` of layer ``i``: its valid positions only."""
    name = type(layer).__name__
    kinds = _kinds(layer)
    for kind, why in REFUSED.items():
        if kind in kinds:
            raise UnsupportedError.at(f"cache.layers[{i}]", i, name,
                                      f"a {name} {why}; it is not supported", where="index")
    if not getattr(layer, "is_initialized", True) or getattr(layer, "keys", None) is None:
        raise LayoutError.at(f"cache.layers[{i}]", i, name,
                             "every layer holds states (this one was never updated)",
                             where="index")
    if "Fp8QuantizedLayer" in kinds:
        (k, ks), (v, vs) = layer._quantized_keys, layer._quantized_values
        return k, v, int(layer.cumulative_length), (scalar(ks), scalar(vs))
    k, v = layer.keys, layer.values
    stored = int(k.shape[-2])
    if "StaticSlidingWindowLayer" in kinds:
        total = int(layer.cumulative_length_int)
        if total > layer.max_cache_len:
            raise _dropped(i, name, total, layer.max_cache_len, layer.max_cache_len)
        return k[:, :, :total], v[:, :, :total], total, None
    if "StaticLayer" in kinds:
        total = int(layer.cumulative_length)
        return k[:, :, :total], v[:, :, :total], total, None
    if "DynamicSlidingWindowLayer" in kinds:
        total = int(layer.cumulative_length)
        if total > stored:
            raise _dropped(i, name, total, stored, layer.sliding_window)
        return k, v, total, None
    if "DynamicLayer" in kinds and "BaseQuantizedLayer" not in kinds:
        return k, v, stored, None
    raise UnsupportedError.at(f"cache.layers[{i}]", i, name,
                              f"{name} is not a cache layer hurraykv knows how to read",
                              where="index")


def _dropped(i: int, name: str, total: int, kept: int, window: int) -> UnsupportedError:
    return UnsupportedError.at(
        f"cache.layers[{i}]", i, name,
        f"a sliding-window layer (window {window}) that has seen {total} tokens keeps only "
        f"the last {kept}; a snapshot's layers hold the same tokens, so a cache past its "
        "window is not supported (snapshot before the window fills)", where="index")


def _cache_layers(cache: Any) -> list[Any]:
    if hasattr(cache, "self_attention_cache"):
        raise UnsupportedError.at("cache", None, type(cache).__name__,
                                  "an encoder-decoder cache: pass its self_attention_cache "
                                  "(cross-attention states are not a paged KV cache)")
    if hasattr(cache, "layers"):
        return list(cache.layers)
    raise LayoutError.at("cache", None, type(cache).__name__,
                         "a transformers Cache (DynamicCache, StaticCache, QuantizedCache)")


def from_dynamic_cache(cache: Any, attention_mask: Any = None, page_size: int = 16
                       ) -> KVCacheSnapshot:
    """A snapshot of every sequence's real tokens in ``cache`` (any ``Cache`` whose layers
    are all readable, see the module docstring)."""
    layers = [_layer_kv(i, layer) for i, layer in enumerate(_cache_layers(cache))]
    if not layers:
        raise LayoutError("the cache holds no layer", field="cache",
                          rule="at least one layer")
    tokens = [n for _, _, n, _ in layers]
    if any(n != tokens[0] for n in tokens):
        i = next(j for j, n in enumerate(tokens) if n != tokens[0])
        raise LayoutError.at(f"cache.layers[{i}]", i, tokens[i],
                             f"layer 0 holds {tokens[0]} tokens; every layer of a snapshot "
                             "holds the same tokens", where="index")
    fp8 = [s is not None for *_, s in layers]
    if any(fp8) and not all(fp8):
        i = fp8.index(not fp8[0])
        raise LayoutError.at(f"cache.layers[{i}]", i, type(cache.layers[i]).__name__,
                             "an fp8 snapshot's layers are all fp8 (one kv_scales row each)",
                             where="index")
    batch, length = int(layers[0][0].shape[0]), tokens[0]
    mask = np.ones((batch, length), bool) if attention_mask is None else \
        as_array(attention_mask).astype(bool)
    if mask.shape != (batch, length):
        raise LayoutError.at("attention_mask.shape", None, list(mask.shape),
                             f"one column per cached position: [{batch}, {length}]")
    lens = mask.sum(axis=1)
    tensors = []
    for i, (k, v, _, scales) in enumerate(layers):
        for r, (role, x) in enumerate((("key", k), ("value", v))):
            a = to_numpy(x)  # [batch, heads, seq, dim]
            if a.shape[:3] != (batch, a.shape[1], length):
                raise LayoutError.at(f"cache.layers[{i}].{role}s.shape", i, list(a.shape),
                                     f"[batch={batch}, heads, seq={length}, head_dim]",
                                     where="index")
            flat = a.transpose(0, 2, 1, 3)[mask]  # real tokens, sequence after sequence
            seqs = np.split(flat, np.cumsum(lens)[:-1])
            tensors.append(BlockPagedTensor.from_sequences(
                seqs, page_size, kv_role=role, layer_index=i, element_type=None,
                num_heads=a.shape[1], head_dim=a.shape[3],
                fp8_scale=None if scales is None else scales[r]))
    return KVCacheSnapshot.from_tensors(tensors)


def to_dynamic_cache(snapshot: KVCacheSnapshot, device: Any = None, *, config: Any = None,
                     dtype: torch.dtype | None = None) -> tuple[Any, torch.Tensor]:
    """``(DynamicCache, attention_mask)``: sequences left-padded with zeros.

    With ``config`` the cache has the model's layer types (``DynamicCache(config=...)``:
    sliding layers keep their window as they would have during prefill).  fp8 snapshots
    are dequantized (value x scale) to ``dtype``."""
    DynamicCache = require("transformers", "adapters", "to_dynamic_cache").DynamicCache

    lens = snapshot.seq_lens
    batch, width = len(lens), int(lens.max(initial=0))
    mask = np.arange(width)[None, :] >= (width - lens)[:, None]
    cache = DynamicCache() if config is None else DynamicCache(config=config)
    if config is not None:
        if len(cache.layers) != snapshot.num_layers:
            raise LayoutError.at("config", None, len(cache.layers),
                                 f"the model has as many cache layers as the snapshot has "
                                 f"layers ({snapshot.num_layers})")
        for i, layer in enumerate(cache.layers):
            _check_writable(i, layer)
    scales = snapshot.kv_scales
    if scales is not None and dtype is None:
        raise LayoutError.at("dtype", None, None, "an fp8 snapshot is dequantized for "
                             "transformers: pass dtype (the model's, e.g. torch.bfloat16)")
    for i in range(snapshot.num_layers):
        pair = []
        for r, t in enumerate(snapshot.layer(i)):
            dense = np.zeros((batch, width, t.num_heads, t.head_dim), t.dtype)
            dense[mask] = t.to_dense()  # tokens in order, right-aligned per sequence
            x = from_numpy(np.ascontiguousarray(dense.transpose(0, 2, 1, 3)))
            if scales is not None:
                x = (x.float() * float(scales[i, r])).to(dtype)
            elif dtype is not None:
                x = x.to(dtype)
            pair.append(place(x, device))
        cache.update(pair[0], pair[1], i)
    return cache, place(torch.from_numpy(mask.astype(np.int64)), device)


def _check_writable(i: int, layer: Any) -> None:
    name = type(layer).__name__
    for kind, why in REFUSED.items():
        if kind in _kinds(layer):
            raise UnsupportedError.at(f"config layer {i}", i, name,
                                      f"the model's layer {i} is a {name}, which {why}; "
                                      "not supported", where="index")
