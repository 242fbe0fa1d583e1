"""Snapshot fixtures shared by the container tests: real data, several storage types."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np

from hurraykv.paged import BlockPagedTensor
from hurraykv.snapshot import KVCacheSnapshot


def make_snapshot(kind: str = "float16", layers: int = 3, seed: int = 0, heads: int = 2,
                  dim: int = 8, page_size: int = 4, dim_v: int | None = None) -> KVCacheSnapshot:
    """A batch with a shared prefix and ragged lengths, one table for every layer
    (``dim_v``: the value head size, when it differs from the key's)."""
    rng = np.random.default_rng(seed)
    lens = [10, 6, 5, 1]
    pages = [-(-n // page_size) for n in lens]
    # sequence 1 shares sequence 0's first page (a prefix), the rest are private
    block_table = [0, 1, 2, 0, 3, 4, 5, 6]
    seq_ptr = np.concatenate([[0], np.cumsum(pages)])
    num_pages = 9  # two pages no sequence references
    dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
             "fp8": ml_dtypes.float8_e4m3fn, "int8": np.float32, "int4": np.float32}[kind]
    tensors = []
    for i in range(layers):
        for role in ("key", "value"):
            d = dim if role == "key" or dim_v is None else dim_v
            pool = rng.standard_normal((num_pages, page_size, heads, d)).astype(dtype)
            scale = float(0.5 + i + (role == "value")) if kind == "fp8" else None
            t = BlockPagedTensor(pool, block_table, seq_ptr, lens, kv_role=role, layer_index=i,
                                 fp8_scale=scale)
            if kind in ("int8", "int4"):
                t = t.quantize("per_block_affine", kind, symmetric=kind == "int8")
            tensors.append(t)
    return KVCacheSnapshot.from_tensors(tensors, model=f"test-{kind}")


def make_fused(layers: int = 2) -> KVCacheSnapshot:
    rng = np.random.default_rng(1)
    pools = [rng.standard_normal((3, 4, 2, 8)).astype(np.float16) for _ in range(layers)]
    return KVCacheSnapshot.from_arrays(pools, None, [0, 1, 2], [0, 2, 3], [7, 2])


KINDS = ["float16", "bfloat16", "int8", "int4", "fp8"]


def same_tokens(a: KVCacheSnapshot, b: KVCacheSnapshot) -> bool:
    """The same members holding the same bytes for every token of every sequence (page
    ids, pool order and unused pages may differ: an engine picks its own)."""
    if a.member_keys() != b.member_keys() or not np.array_equal(a.seq_lens, b.seq_lens):
        return False
    if (a.kv_scales is None) != (b.kv_scales is None) or (
            a.kv_scales is not None and not np.array_equal(a.kv_scales, b.kv_scales)):
        return False
    for key in a.member_keys():
        x, y = a.tensor(*key), b.tensor(*key)
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        for s in range(a.num_seqs):
            if x.gather(s).tobytes() != y.gather(s).tobytes():
                return False
    return True


def zeroed(s: KVCacheSnapshot) -> KVCacheSnapshot:
    """What a reader may see of ``s`` after a transfer: every unused page slot zeroed."""
    tensors = [t.copy() for t in s.tensors()]
    for t in tensors:
        t.zero_unused_slots()
    return KVCacheSnapshot.from_tensors(tensors, s.seq_lens, s.kv_scales)


def saving_forever(target, pages: int, pools: int = 2) -> subprocess.Popen:
    """A process that saves one snapshot (``pools`` pools of ``pages`` float16 pages of
    16 x 8 x 128) to ``target`` over and over; it has printed "ready" when this returns."""
    code = ("import numpy as np, hurraykv as hk, sys\n"
            f"pools=[np.ones(({pages},16,8,128),np.float16) for _ in range({pools})]\n"
            f"s=hk.KVCacheSnapshot.from_arrays(pools,pools,np.arange({pages}),[0,{pages}],"
            f"[{pages * 16}])\n"
            "print('ready', flush=True)\n"
            f"while True: hk.save_snapshot(s, {str(target)!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    proc.stdout.readline()
    return proc


def fused(layers: int, mib: int, seed: int = 0) -> KVCacheSnapshot:
    """``layers`` fused members of ``mib`` MiB each (float16 pages of 16 x 16 x 128)."""
    rng = np.random.default_rng(seed)
    pages = mib * 16  # 64 KiB per page
    pools = [rng.standard_normal((pages, 16, 16, 128)).astype(np.float16)
             for _ in range(layers)]
    return KVCacheSnapshot.from_arrays(pools, None, np.arange(pages), [0, pages],
                                       [pages * 16])
