"""Shared pieces of the engine adapters: int32 tables, layer assembly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import HurrayError, LayoutError, UnsupportedError
from ..paged import BlockPagedTensor
from ..snapshot import KVCacheSnapshot
from ..wire.dtypes import element_type


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


DEVICE_TAGS = {"cpu": 0, "cuda": 1, "mps": 3, "xpu": 7}


class DeviceBuffers(Sequence):
    """A member's buffers whose page pool stays where the engine keeps it (a GPU) until
    something reads or writes it: item 0 copies it to the host, once; the index buffers
    are small host arrays already."""

    def __init__(self, pool: Any, rest: list[np.ndarray]) -> None:
        self._pool = pool
        self._host: np.ndarray | None = None
        self._rest = rest

    def __len__(self) -> int:
        return 1 + len(self._rest)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = i + len(self) if i < 0 else i
        if i == 0:
            if self._host is None:
                from ._torch import to_numpy

                self._host = np.ascontiguousarray(to_numpy(self._pool))  # the one copy
            return self._host
        return self._rest[i - 1]

    @property
    def copied(self) -> bool:
        return self._host is not None


def _device_member(pool: Any, block_table: np.ndarray, seq_ptr: np.ndarray,
                   seq_lens: np.ndarray, role: str, layer: int) -> tuple[Any, Any]:
    """Descriptor and loader of a member left on its device: the indices are validated
    now, on the host; the pool is copied only when read or written."""
    from ..wire.buffers import handle
    from ..wire.descriptor import TensorDescriptor
    from ._torch import numpy_dtype

    num_pages, page_size, heads, dim = (int(x) for x in pool.shape)
    et = element_type(numpy_dtype(pool.dtype))
    probe = BlockPagedTensor.from_rows(  # geometry and indices, no data
        np.empty((num_pages, 0), et.numpy), et, page_size, heads, dim,
        np.asarray(block_table), np.asarray(seq_ptr), seq_lens, kv_role=role,
        layer_index=layer)
    probe.validate()
    device = DEVICE_TAGS.get(pool.device.type, 0)
    layout = probe.layout()
    pool_bytes = et.nbytes(num_pages * page_size * heads * dim)
    bt, sp = probe.block_table, probe.seq_ptr
    handles = tuple(handle(n, 64, device) for n in (pool_bytes, bt.nbytes, sp.nbytes))
    desc = TensorDescriptor(et.tag, probe.shape, layout, handles)
    buffers = DeviceBuffers(pool, [bt, sp])
    return desc, (lambda: buffers)


def build(pools: Sequence[tuple[Any, ...]], block_table: np.ndarray, seq_ptr: np.ndarray,
          seq_lens: np.ndarray, scales: Sequence[tuple[float | None, ...]] | None = None,
          *, lazy: bool | None = None) -> KVCacheSnapshot:
    """A snapshot from per-layer (key, value) pools ``[num_pages, page_size, H, D]``:
    NumPy arrays, or torch tensors.  Tensors on a device (or any tensor with ``lazy``)
    stay where they are until the snapshot is read or written; their descriptors record
    the device."""
    members: dict[tuple[int, str], Any] = {}
    tensors = []
    kv_scales = None if scales is None else np.array(
        [[1.0 if x is None else x for x in (layer * 2)[:2]] for layer in scales], np.float32)
    for i, layer in enumerate(pools):
        roles = ("key", "value") if len(layer) == 2 else ("fused",)
        for r, (role, pool) in enumerate(zip(roles, layer, strict=True)):
            scale = None if scales is None else scales[i][r]
            on_device = hasattr(pool, "device") and pool.device.type != "cpu"
            if on_device or (lazy and hasattr(pool, "device")):
                members[(i, role)] = _device_member(pool, block_table, seq_ptr, seq_lens,
                                                    role, i)
                continue
            if hasattr(pool, "device"):
                from ._torch import to_numpy

                pool = to_numpy(pool)
            tensors.append(BlockPagedTensor(pool, block_table, seq_ptr, seq_lens, kv_role=role,
                                            layer_index=i, fp8_scale=scale))
    if not members:
        return KVCacheSnapshot.from_tensors(tensors)
    for t in tensors:
        members[(t.layer_index, t.kv_role)] = (t.descriptor(), t.buffers)
    return KVCacheSnapshot(members, seq_lens, kv_scales)


def float_pools(snapshot: KVCacheSnapshot, what: str) -> list[tuple[np.ndarray, ...]]:
    """Per-layer page pools; engines take float or fp8 pools, not integer quantization."""
    out = []
    for layer in snapshot:
        if any(t.quantization is not None for t in layer):
            raise HurrayError(f"{what} takes float or fp8 caches; dequantize() the snapshot "
                              "first", field="quantization", rule=f"{what} layouts")
        out.append(tuple(t.page_pool for t in layer))
    return out


def as_cache_dtype(t: Any, kv_cache_dtype: str, where: str) -> Any:
    """An engine's cache tensor as the values it holds: fp8 caches are kept as uint8 by
    vLLM and SGLang (``index_put`` has no float8 kernels) and read as float8 here."""
    import torch

    from ._torch import FP8

    if not isinstance(t, torch.Tensor):
        raise LayoutError.at(where, None, type(t).__name__, "engine caches are torch tensors")
    if kv_cache_dtype in FP8:
        if t.dtype not in (torch.uint8, FP8[kv_cache_dtype]):
            raise LayoutError.at(f"{where}.dtype", None, str(t.dtype),
                                 f"an {kv_cache_dtype} cache is stored as uint8")
        return t.view(FP8[kv_cache_dtype])
    if kv_cache_dtype != "auto":
        raise UnsupportedError.at("kv_cache_dtype", None, kv_cache_dtype,
                                  f"caches of kv_cache_dtype {kv_cache_dtype!r} are not "
                                  f"supported; hurraykv reads auto, {', '.join(FP8)}")
    if t.dtype == torch.uint8:
        raise LayoutError.at(f"{where}.dtype", None, "uint8",
                             "a uint8 cache is fp8: pass kv_cache_dtype='fp8_e4m3' (or "
                             "'fp8', 'fp8_e5m2')")
    return t


def scales_of(k_scales: Any, v_scales: Any, layers: int, kv_cache_dtype: str, *,
              fused: bool = False) -> list[tuple[float, float]] | None:
    """Per-layer ``(k_scale, v_scale)`` of an fp8 cache (D5); engines keep a scale on
    every layer, so scales given for other caches are ignored.  A fused (MLA) member
    uses its layer's k_scale."""
    from ._torch import FP8, scalar

    if kv_cache_dtype not in FP8 or (k_scales is None and v_scales is None):
        return None
    ks = list(k_scales) if k_scales is not None else [1.0] * layers
    vs = list(v_scales) if v_scales is not None and not fused else list(ks)
    if len(ks) != layers or len(vs) != layers:
        raise LayoutError.at("k_scales", None, (len(ks), len(vs)),
                             f"one k_scale and one v_scale per layer ({layers})")
    return [(scalar(k), scalar(v)) for k, v in zip(ks, vs, strict=True)]


def as_array(x: Any) -> np.ndarray:
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - the adapters import torch anyway
        pass
    return np.asarray(x)
