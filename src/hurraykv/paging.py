"""What a BlockPagedTensor is made from: inputs checked, and dense sequences paged.

The helpers the tensor's modules (``paged``, ``paged_reads``, ``paged_derived``) share:
flat byte views of buffers (``byte_view``), kv_role and index-type codes, index arrays
and element types checked as they come in, the size limits NumPy imposes (``MAX_ROW``),
the fp8 scale rule (D5) and the sub-byte page rule (D11); and ``page_sequences``, which
pages a batch of dense ``[T_i, H, D]`` sequences, a full page stored once when every
sequence sharing it has the same pages up to and including it (prefix sharing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .arrays import as_numpy
from .errors import BufferError, HurrayError, LayoutError, QuantizationError, UnsupportedError
from .wire.dtypes import ElementType, element_type
from .wire.layouts import KV_ROLES

ROLE_CODES = {v: k for k, v in KV_ROLES.items()}
INDEX_NAMES = {"uint32": 0, "uint64": 1}


def role_code(kv_role: str | int) -> int:
    if isinstance(kv_role, str) and kv_role in ROLE_CODES:
        return ROLE_CODES[kv_role]
    if isinstance(kv_role, int) and kv_role in KV_ROLES:
        return kv_role
    raise LayoutError.at("kv_role", None, kv_role, "kv_role is 'key', 'value' or 'fused'")


def as_index(values: Any, name: str) -> np.ndarray:
    arr = as_numpy(values, name)
    if arr.ndim != 1:
        raise LayoutError.at(f"{name}.shape", None, arr.shape, f"{name} is one-dimensional")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise LayoutError.at(f"{name}.dtype", None, str(arr.dtype), f"{name} holds integers")
    if arr.dtype.kind == "i" and arr.min() < 0:
        i = int(np.flatnonzero(arr < 0)[0])
        raise LayoutError.at(f"{name}[{i}]", i, int(arr[i]), f"{name} entries are >= 0",
                             where="index")
    return arr


def first_true(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def byte_view(obj: Any) -> memoryview:
    """A flat byte view of a buffer-like object without copying (NumPy arrays of any
    dtype - bfloat16 and float8 included - bytes, memoryviews, mmaps)."""
    if isinstance(obj, np.ndarray):
        return memoryview(np.ascontiguousarray(obj).reshape(-1).view(np.uint8))
    try:
        return memoryview(obj).cast("B")
    except (TypeError, ValueError) as e:
        raise BufferError(f"buffer of type {type(obj).__name__} is not bytes-like: {e}",
                          field="buffers", value=type(obj).__name__,
                          rule="buffers are contiguous bytes-like objects") from None


def resolve_type(sample: np.ndarray, name: str | ElementType | None) -> ElementType:
    if name is not None:
        et = element_type(name)
    else:
        try:
            et = element_type(sample.dtype)
        except HurrayError:
            raise UnsupportedError.at("page_pool.dtype", None, str(sample.dtype),
                                      "pass element_type= for a pool NumPy cannot name") from None
    if et.numpy is None:
        raise UnsupportedError.at("element_type", None, et.name,
                                  "hurraykv holds no data of this element type")
    return et


def check_fp8_scale(et: ElementType, scale: float | None) -> float | None:
    """D5: an fp8 pool carries its per-layer, per-role scale beside the data."""
    if scale is None:
        return None
    if et.name not in ("float8_e4m3", "float8_e5m2"):
        raise QuantizationError.at("fp8_scale", None, scale,
                                   f"fp8_scale belongs to float8 pools, not {et.name}")
    value = float(np.float32(scale))
    if not np.isfinite(value) or value == 0.0:
        raise QuantizationError.at("fp8_scale", None, scale, "fp8_scale MUST be finite and "
                                   "non-zero")
    return value


MAX_ROW = np.iinfo(np.intp).max


def check_row(page_size: int, heads: int, dim: int, itemsize: int = 1) -> None:
    """A page row (page_size*num_heads*head_dim elements) must be an array NumPy can
    shape, even in a pool of 0 pages whose byte size the product never touches: at most
    2^63-1 elements and 2^63-1 bytes."""
    if page_size * heads * dim * itemsize > MAX_ROW:
        raise UnsupportedError.at("shape", None, [page_size, heads, dim],
                                  f"a page of page_size x num_heads x head_dim elements must "
                                  f"be at most {MAX_ROW} (2^63-1) elements and bytes "
                                  f"({itemsize} per element) to be held")


def check_subbyte_pages(et: ElementType, page_elems: int) -> None:
    if not et.whole_bytes(page_elems):
        raise UnsupportedError.at("page_size", None, page_elems,
                                  f"a {et.name} page of {page_elems} elements does not end on a "
                                  "byte boundary (decision D11)")


def page_sequences(seqs: Sequence[np.ndarray], page_size: int, *, share_prefix: bool = True,
                   element_type: str | ElementType | None = None,
                   num_heads: int | None = None, head_dim: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, ElementType]:
    """``(page_pool, block_table, seq_ptr, seq_lens, element type)`` of a batch of dense
    ``[T_i, H, D]`` sequences (``BlockPagedTensor.from_sequences``).

    With ``share_prefix``, a full page is stored once and aliased when every page
    before it, and the page itself, are identical in the sequences that share it -
    the prefix sharing of a paged-attention engine.  Partial last pages are never
    shared.  Found with one sort of the page-content ids (no per-page Python loop).
    """
    arrays = [as_numpy(x, f"seqs[{i}]") for i, x in enumerate(seqs)]
    if page_size < 1:
        raise LayoutError.at("page_size", None, page_size, "page_size MUST be >= 1")
    if not arrays and (num_heads is None or head_dim is None or element_type is None):
        raise LayoutError("an empty batch needs num_heads, head_dim and element_type")
    heads = num_heads if num_heads is not None else arrays[0].shape[1]
    dim = head_dim if head_dim is not None else arrays[0].shape[2]
    et = resolve_type(arrays[0] if arrays else np.empty(0), element_type)
    dtype = et.numpy
    for i, a in enumerate(arrays):
        if a.ndim != 3 or a.shape[1:] != (heads, dim):
            raise LayoutError.at(f"seqs[{i}].shape", i, a.shape,
                                 f"every sequence is [T, {heads}, {dim}]", where="index")
    n = len(arrays)
    row = page_size * heads * dim
    lens = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    npages = -(-lens // page_size)
    maxp = int(npages.max()) if n else 0
    valid = np.arange(maxp)[None, :] < npages[:, None]
    # Content id per full page (partial pages and padding get -1: never equal).
    content = np.full((n, maxp), -1, dtype=np.int64)
    full = np.arange(maxp)[None, :] < (lens // page_size)[:, None]
    if share_prefix and full.any():
        pages = np.concatenate([
            np.ascontiguousarray(a[: (len(a) // page_size) * page_size], dtype=dtype)
            .reshape(-1, row) for a in arrays])
        void = pages.view(np.dtype((np.void, pages.dtype.itemsize * row))).reshape(-1)
        _, ids = np.unique(void, return_inverse=True)
        content[full] = ids.reshape(-1)
        owner = _prefix_owners(content)
    else:
        owner = np.broadcast_to(np.arange(n)[:, None], (n, maxp))
    is_new = valid & (owner == np.arange(n)[:, None])
    new_id = np.cumsum(is_new.reshape(-1)).reshape(n, maxp) - 1
    table = new_id[owner, np.arange(maxp)[None, :]]
    num_pages = int(is_new.sum())
    pool = np.zeros((num_pages, page_size, heads, dim), dtype=dtype)
    flat_pool = pool.reshape(num_pages, row)
    for s, a in enumerate(arrays):  # one vectorised copy per sequence
        own = np.flatnonzero(is_new[s])
        if own.size == 0:
            continue
        padded = np.zeros((int(npages[s]) * page_size, heads, dim), dtype=dtype)
        padded[: len(a)] = a
        flat_pool[new_id[s, own]] = padded.reshape(-1, row)[own]
    seq_ptr = np.concatenate([[0], np.cumsum(npages)])
    return pool, table[valid], seq_ptr, lens, et


def _prefix_owners(content: np.ndarray) -> np.ndarray:
    """For each (sequence, page position), the first sequence whose pages up to and
    including that position are identical: that sequence's page is the one stored.

    Sequences are sorted by their content-id rows; equal prefixes become adjacent,
    and the longest common prefix with the previous row says which positions alias.
    """
    n, maxp = content.shape
    if n == 0 or maxp == 0:
        return np.zeros((n, maxp), dtype=np.int64)
    order = np.lexsort(content.T[::-1])
    srt = content[order]
    same = (srt[1:] == srt[:-1]) & (srt[1:] >= 0)
    lcp = np.concatenate([[0], np.cumprod(same, axis=1).sum(axis=1)])
    pos = np.arange(n)[:, None]
    start = np.where(lcp[:, None] > np.arange(maxp)[None, :], 0, pos)
    rep_sorted = np.maximum.accumulate(start, axis=0)  # group start, per position
    return _lowest_owner(order, rep_sorted)


def _lowest_owner(order: np.ndarray, rep_sorted: np.ndarray) -> np.ndarray:
    """Each (sequence, position) group's lowest sequence index: its page is the one stored
    (so pages are numbered in sequence order)."""
    n, maxp = rep_sorted.shape
    cols = np.broadcast_to(np.arange(maxp), (n, maxp))
    key = rep_sorted * maxp + cols  # group id per (sorted row, position)
    lowest = np.full(n * maxp, n, dtype=np.int64)
    np.minimum.at(lowest, key.reshape(-1), order[:, None].repeat(maxp, 1).reshape(-1))
    out = np.empty((n, maxp), dtype=np.int64)
    out[order] = lowest[key].reshape(n, maxp)
    return out
