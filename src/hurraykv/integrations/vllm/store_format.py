"""Stored KV at the cache dtype, or at half or a quarter of its bytes (issue 22).

``store_dtype`` in ``kv_connector_extra_config`` says what a segment holds:

* ``"auto"``: the engine's cache dtype, page for page (bytes unchanged; the identity of
  the cache is the one every earlier release used);
* ``"int8"``, ``"int4"``: codes of the Hurray quantization scheme ``"quantization"``
  names (``quant.py``, the compiled kernels of ``kernels.py``), symmetric, float32
  scales: ``"per_block_affine"`` (default) keeps one scale per page slot, i.e. per
  token of a page, shared by its heads and dims; ``"per_channel"`` one per head_dim
  channel of each layer's key (value) pool of the segment;
* ``"fp8"``: float8 e4m3 values with one float32 scale per layer and role (the
  ``kv_scales`` member of fp8 caches, so any Hurray reader dequantizes them).

Error bounds per element ``x`` (``max_error``): int8 ``s / 2`` with ``s = absmax / 127``
(int4: ``absmax / 7``), ``absmax`` over the slot (per_block_affine) or the channel
(per_channel); fp8 ``max(|x| / 16, s / 1024)`` with ``s = absmax / 448`` of the layer's
pool (half a unit in e4m3's last place, or of its subnormal step).

The format is part of the cache identity (``identity_suffix``): an engine looks up, and
loads, the chunks of its own format and of those ``accept_store_dtypes`` lists, nothing
else.  Saving quantizes each layer's pages right after they are copied out of the
engine's blocks (``encode``); loading dequantizes a segment's pages to float32
(``decode``), which ``LayerView.write`` converts into the engine's blocks.  No vLLM or
torch import: tested without an engine (``tests/test_store_format.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ... import alloc, kernels
from ...errors import HurrayError
from ...paged import BlockPagedTensor
from ...quant import params_arrays
from ...snapshot import KVCacheSnapshot
from ...threads import run_bands

STORE_DTYPES = ("auto", "int8", "int4", "fp8")
SCHEMES = ("per_block_affine", "per_channel")
# vLLM cache dtypes whose values are the model's floats ("auto": the model dtype)
FLOAT_CACHES = ("auto", "bfloat16", "float16", "half", "float", "float32")
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
_LEVELS = {"int8": 127, "int4": 7}  # symmetric: codes in [-qmax, qmax]


@dataclass(frozen=True)
class StoreFormat:
    dtype: str = "auto"
    scheme: str | None = None  # int8 and int4 only

    @property
    def name(self) -> str:
        return self.dtype if self.scheme is None else f"{self.dtype}:{self.scheme}"

    @property
    def auto(self) -> bool:
        return self.dtype == "auto"

    def identity_suffix(self) -> str:
        """Appended to the cache identity: empty for ``auto`` (stores stay readable)."""
        return "" if self.auto else f";store={self.name}"

    def segment_dtype(self, cache_segment_dtype: str) -> str:
        """The element type of this format's segments (``KVCacheSnapshot.dtype``)."""
        return {"auto": cache_segment_dtype, "fp8": "float8_e4m3"}.get(self.dtype, self.dtype)

    # ------------------------------------------------------------------ save
    def encode(self, pages: np.ndarray, role: str, layer: int,
               table: np.ndarray | None = None) -> BlockPagedTensor:
        """One layer's pages ``[n, page_size, heads, dim]`` (a float dtype) as the
        stored tensor of this format: one sequence over pages ``0..n-1``, or over the
        pages ``table`` names (a sliding-window layer's, ``hybrid.py``)."""
        n, size = int(pages.shape[0]), int(pages.shape[1])
        table = np.arange(n) if table is None else table
        ptr, lens = [0, len(table)], [len(table) * size]
        if self.dtype == "fp8":
            peak = _peak(pages)
            if not np.isfinite(peak):
                raise HurrayError(f"layer {layer} {role} holds a non-finite value; fp8 "
                                  "stores finite values", field="store_dtype", value="fp8",
                                  rule="finite values")
            scale = np.float32(peak / FP8_MAX) if peak > 0 else np.float32(1.0)
            if not scale > 0:  # peak below float32's range for a scale: store zeros
                scale = np.float32(1.0)
            return BlockPagedTensor(_fp8_codes(pages, scale), table, ptr, lens, kv_role=role,
                                    layer_index=layer, element_type="float8_e4m3",
                                    fp8_scale=float(scale))
        t = BlockPagedTensor(pages, table, ptr, lens, kv_role=role, layer_index=layer)
        if self.auto:
            return t
        return t.quantize(self.scheme, self.dtype, symmetric=True,
                          axis=2 if self.scheme == "per_channel" else None)

    def segment(self, staged: Sequence[Sequence[BlockPagedTensor]], identity: str
                ) -> KVCacheSnapshot:
        """The segment of one request's encoded layers (``staged[layer]``: its roles)."""
        return KVCacheSnapshot.from_tensors([t for parts in staged for t in parts],
                                            model=identity)

    # ------------------------------------------------------------------ load
    def check(self, snap: KVCacheSnapshot, cache_segment_dtype: str,
              tables: dict[int, np.ndarray] | None = None) -> None:
        """Refuse a segment whose members are not of this format (same identity, other
        contents: a forged or foreign object); ``tables``: the block tables of layers
        that keep some of their pages (a hybrid model's sliding-window layers)."""
        t = snap.tensor(*snap.member_keys()[0])
        q = t.quantization
        have = (snap.dtype, None if q is None else type(q).NAME,
                snap.kv_scales is not None)
        want = (self.segment_dtype(cache_segment_dtype),
                self.scheme if self.dtype in _LEVELS else None,
                self.dtype == "fp8" or (self.auto and cache_segment_dtype.startswith(
                    "float8")))
        if have != want:
            raise HurrayError(f"a stored segment of store format {self.name} holds "
                              f"(dtype, quantization, fp8 scales) {have}, not {want}",
                              field="segment.dtype", value=have[0], rule="the store format")
        # loads take a run of pages in storage order (decode_pages, page_pool slices): a
        # segment is one sequence over its pages in order, as encode and segment make it
        for layer, role in snap.member_keys():
            t = snap.tensor(layer, role)
            want = (tables or {}).get(layer)
            if want is None:
                want = np.arange(t.num_pages)
            table = np.asarray(t.block_table)
            n = min(len(table), len(want))
            wrong = np.flatnonzero(table[:n] != want[:n])
            if len(wrong) or len(table) != len(want) or t.num_pages != int(want.max(
                    initial=-1)) + 1:
                i = int(wrong[0]) if len(wrong) else n
                found = int(table[i]) if i < len(table) else "nothing"
                raise HurrayError(f"layers.{layer}.{role}: block_table[{i}] is {found}; a "
                                  f"stored segment is one sequence over its {t.num_pages} "
                                  f"pages in order (block_table {_table_text(want)})",
                                  field=f"layers.{layer}.{role}.block_table[{i}]",
                                  value=found, rule="pages in order")


def _table_text(table: np.ndarray) -> str:
    if np.array_equal(table, np.arange(len(table))):
        return f"0..{len(table) - 1}"
    return f"{table.tolist()}: the kept pages, a zero page for the others"


def _slot_bits(pages: np.ndarray):
    """``(kernels, input kind, slot rows as the unsigned bits the kernels read)``, or
    None where the compiled path does not apply (no numba, another dtype, a view)."""
    kind = kernels.input_kind(pages.dtype)
    kern = kernels.impl() if kind is not None and pages.flags.c_contiguous else None
    if kern is None or not pages.size:
        return None
    return kern, kind, kernels.as_bits(pages.reshape(pages.shape[0] * pages.shape[1], -1),
                                       kind)


def _peak(pages: np.ndarray) -> float:
    """The largest magnitude in ``pages`` (inf or nan when one is not finite)."""
    compiled = _slot_bits(pages)
    if compiled is None:
        return float(np.abs(np.asarray(pages, np.float32)).max()) if pages.size else 0.0
    kern, kind, rows = compiled
    n = rows.shape[0]
    used = np.ones(n, np.bool_)
    lo, hi = np.empty(n, np.float32), np.empty(n, np.float32)
    ok: list[bool] = []
    run_bands(lambda a, b: ok.append(kern.row_ranges(rows, kind, used, lo, hi, a, b)), n,
              pages.nbytes)
    if not all(ok):
        return float("nan")
    return float(max(-lo.min(), hi.max()))


def _fp8_codes(pages: np.ndarray, scale: np.float32) -> np.ndarray:
    """e4m3 codes of ``clip(pages / scale, -448, 448)`` (finite ``pages``): one compiled
    pass from the cache's bits, else NumPy's conversion (the same bits, tested)."""
    compiled = _slot_bits(pages)
    if compiled is None:
        values = np.asarray(pages, np.float32)
        return np.clip(values / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    kern, kind, rows = compiled
    codes = alloc.empty(rows.shape, np.uint8)
    run_bands(lambda a, b: kern.fp8_e4m3_encode(rows, kind, scale, codes, a, b),
              rows.shape[0], pages.nbytes)
    return codes.view(ml_dtypes.float8_e4m3fn).reshape(pages.shape)


def decode(t: BlockPagedTensor, first: int, count: int) -> np.ndarray:
    """Pages ``first .. first + count - 1`` of a stored segment tensor (one sequence over
    its pages in order) as float32 ``[count, page_size, heads, dim]``: the dequantizing
    gather (fused and compiled for per_block_affine, ``gather(dequantize=True)``)."""
    values = t.gather(0, dequantize=True)
    pages = values.reshape(t.num_pages, t.page_size, t.num_heads, t.head_dim)
    return pages[first:first + count]


_WRITES = {np.dtype(np.float32): False, np.dtype(ml_dtypes.bfloat16): True}  # -> to_bf16
_NO_COLUMNS = np.ones(1, np.float32)  # what the kernels get for column scales they skip


def decode_pages(t: BlockPagedTensor, first: int, count: int, dtype: Any,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Pages ``first .. first + count - 1`` of a stored segment tensor as ``dtype`` (the
    engine's cache dtype) ``[count, page_size, heads, dim]``, in one compiled pass from
    codes and scales to the cache's bits (bfloat16 rounded to nearest even, as torch
    converts), into ``out`` (bytes of any dtype, reused between loads) when given.  The
    same values as ``decode`` converted to ``dtype``.  Where the kernels do not apply
    (no numba, a float16 cache, a foreign scheme) it is ``decode``'s float32 pages, which
    the cache write converts."""
    dtype = np.dtype(dtype)
    kern = kernels.impl()
    plan = _rows_and_scales(t, first, count) if kern is not None and dtype in _WRITES \
        else None
    if plan is None:
        return decode(t, first, count)
    codes, fp8, rows, cols, packed = plan
    shape = (count, t.page_size, t.num_heads, t.head_dim)
    nbytes = math.prod(shape) * dtype.itemsize
    if out is None or out.nbytes < nbytes:
        out = alloc.empty(shape, dtype)
    values = out.reshape(-1).view(np.uint8)[:nbytes].view(dtype).reshape(shape)
    to_bf16 = _WRITES[dtype]
    o2 = values.reshape(codes.shape[0], -1)
    if to_bf16:
        o2 = o2.view(np.uint16)
    per_column = cols is not None
    cols = cols if per_column else _NO_COLUMNS
    if packed:
        run_bands(lambda a, b: kern.dequantize_packed_rows(codes, rows, cols, per_column, o2,
                                                           to_bf16, a, b), len(codes), nbytes)
    else:
        run_bands(lambda a, b: kern.dequantize_rows(codes, fp8, rows, cols, per_column, o2,
                                                    to_bf16, a, b), len(codes), nbytes)
    return values


class DecodeBuffers:
    """The buffers a worker decodes stored pages into, one per role, kept between layers
    and loads: a fresh multi-megabyte output costs a page fault per 4 KiB as it is first
    written, as much as the decoding itself.  Each is overwritten by the next decode, so
    its pages must be written into the cache before then (``LayerView.write`` copies)."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        self._buffers: list[np.ndarray] = []

    def pages(self, role: int, t: BlockPagedTensor, first: int, count: int) -> np.ndarray:
        while len(self._buffers) <= role:
            self._buffers.append(np.zeros(0, np.uint8))
        need = count * t.page_size * t.num_heads * t.head_dim * self.dtype.itemsize
        if self._buffers[role].nbytes < need:
            self._buffers[role] = alloc.empty((need,), np.uint8)
            self._buffers[role][::4096] = 0  # faulted in now, not inside a load
        return decode_pages(t, first, count, self.dtype, self._buffers[role])


def warm(formats: Any, dtype: Any) -> None:
    """Compile (or load from numba's cache) the kernels that save and load ``formats`` on
    a cache of ``dtype`` (codes writable and read-only), so that no forward pass does."""
    pages = np.linspace(-1, 1, 2 * 4 * 2 * 8, dtype=np.float32).reshape(2, 4, 2, 8)
    for fmt in formats:
        if fmt.auto:
            continue
        t = fmt.encode(pages.astype(dtype), "key", 0)
        frozen = t._derive(np.frombuffer(t._rows.tobytes(), t._rows.dtype
                                         ).reshape(t._rows.shape))
        for each in (t, frozen):
            decode_pages(each, 0, 2, dtype)


def _rows_and_scales(t: BlockPagedTensor, first: int, count: int):
    """``(codes [slots, bytes], fp8 (else int8), per-slot scales, per-element scales or
    None (per_channel only), packed)`` of the pages, or None for what ``decode_pages``
    leaves to ``decode`` (zero-points, another scheme or type)."""
    size, elems = t.page_size, t.num_heads * t.head_dim
    slots = count * size
    rows = t._rows[first:first + count]
    q, name = t.quantization, t.element_type.name
    if q is None and t.fp8_scale is not None and name == "float8_e4m3":
        return (rows.view(np.uint8).reshape(slots, elems), True,
                np.full(slots, np.float32(t.fp8_scale)), None, False)
    if q is None or not q.AFFINE or name not in _LEVELS or elems % 2:
        return None
    scales, zps = params_arrays(q, t.quant_params, t._param_count())
    if zps is not None:
        return None
    if q.per_slot:
        row_scales = np.ascontiguousarray(scales[first * size:first * size + slots])
        col_scales = None
    elif q.GRANULARITY == "channel" and q.axis in (1, 2):
        col_scales = (np.tile(scales, t.num_heads) if q.axis == 2 else
                      np.repeat(scales, t.head_dim)).astype(np.float32)
        row_scales = np.ones(slots, np.float32)
    else:
        return None
    if name == "int4":
        return rows.reshape(slots, elems // 2), False, row_scales, col_scales, True
    return rows.view(np.int8).reshape(slots, elems), False, row_scales, col_scales, False


def max_error(fmt: StoreFormat, values: np.ndarray, per_slot_axis: int = 0) -> np.ndarray:
    """The bound on ``|decode(encode(values)) - values|`` per element of ``values``
    ``[slots, heads, dim]`` (the module docstring's formulas; float32 rounding of the
    scale and of the product adds a few units in the last place)."""
    x = np.abs(np.asarray(values, np.float32))
    if fmt.auto:
        return np.zeros_like(x)
    if fmt.dtype == "fp8":
        scale = np.float32(x.max() / FP8_MAX) if x.size else np.float32(1.0)
        return np.maximum(x / 16, scale / 1024)
    axes = (1, 2) if fmt.scheme == "per_block_affine" else (0, 1)
    return np.broadcast_to(x.max(axis=axes, keepdims=True) / _LEVELS[fmt.dtype] / 2, x.shape)


def reconstruction_error(fmt: StoreFormat, pages: np.ndarray) -> dict[str, float]:
    """What storing ``pages`` ``[n, page_size, heads, dim]`` at ``fmt`` loses: relative
    RMS error (RMS of the error over RMS of the values), largest error over the largest
    value, and the stored bytes over the bytes of ``pages`` (for docs and benchmarks)."""
    values = np.asarray(pages, np.float32)
    t = fmt.encode(pages, "key", 0)
    back = decode(t, 0, t.num_pages)
    err = back - values
    stored = sum(memoryview(b).nbytes for b in t.buffers()[:1]) + sum(
        p.nbytes for p in t.quant_params) + (4 if t.fp8_scale is not None else 0)
    rms = float(np.sqrt(np.mean(values ** 2))) or 1.0
    peak = float(np.abs(values).max()) or 1.0
    return {"relative_rms": float(np.sqrt(np.mean(err ** 2))) / rms,
            "max_over_peak": float(np.abs(err).max()) / peak,
            "bytes_ratio": stored / np.asarray(pages).nbytes}


# ---------------------------------------------------------------------- configuration
def parse(text: str, key: str, default_scheme: str | None) -> StoreFormat:
    """``"int8"``, ``"int4:per_channel"``, ``"fp8"``, ``"auto"``: a format, or a refusal
    naming ``key``, the value and the rule."""
    dtype, _, scheme = str(text).partition(":")
    if dtype not in STORE_DTYPES:
        raise HurrayError(f"kv_connector_extra_config[{key!r}] names {text!r}; a store dtype "
                          f"is one of {', '.join(STORE_DTYPES)}", field=key, value=text,
                          rule=f"one of {', '.join(STORE_DTYPES)}")
    if dtype not in _LEVELS:
        if scheme:
            raise HurrayError(f"kv_connector_extra_config[{key!r}] names {text!r}; a "
                              f"quantization scheme applies to int8 and int4, not {dtype}",
                              field=key, value=text, rule="a scheme for int8 and int4 only")
        return StoreFormat(dtype)
    scheme = scheme or default_scheme or SCHEMES[0]
    if scheme not in SCHEMES:
        raise HurrayError(f"kv_connector_extra_config[{key!r}] names {text!r}; quantization "
                          f"is one of {', '.join(SCHEMES)}", field=key, value=text,
                          rule=f"one of {', '.join(SCHEMES)}")
    return StoreFormat(dtype, scheme)


def check_cache_dtype(fmt: StoreFormat, kv_cache_dtype: str, key: str = "store_dtype",
                      block_size: int | None = None) -> None:
    """A format the engine's cache can take: quantizing is from the model's floats, so an
    fp8 (or other quantized) cache stores ``auto`` only; ``per_block_affine`` keeps a
    scale per page slot in quantization blocks of one page, which Hurray requires to be a
    power of two (vLLM sizes a Qwen3-Next's pages to 160 tokens)."""
    if fmt.scheme == "per_block_affine" and block_size and block_size & (block_size - 1):
        raise HurrayError(f"kv_connector_extra_config[{key!r}] {fmt.dtype!r} with quantization "
                          f"'per_block_affine' needs a power-of-two block size; vLLM's is "
                          f"{block_size} for this model: use quantization 'per_channel'",
                          field="quantization", value="per_block_affine",
                          rule="a Hurray quantization block is a power of two >= 2")
    if fmt.auto or kv_cache_dtype in FLOAT_CACHES:
        return
    raise HurrayError(f"kv_connector_extra_config[{key!r}] is {fmt.dtype!r} but "
                      f"kv_cache_dtype is {kv_cache_dtype!r}: a store dtype other than auto "
                      "quantizes the model's float values, and this cache already holds "
                      f"{kv_cache_dtype} codes; use \"auto\"", field=key, value=fmt.dtype,
                      rule="store_dtype other than auto needs a float KV cache "
                      "(kv_cache_dtype auto, bfloat16, float16 or float32)")


__all__ = ["FLOAT_CACHES", "SCHEMES", "STORE_DTYPES", "DecodeBuffers", "StoreFormat",
           "check_cache_dtype", "decode", "decode_pages", "max_error", "parse",
           "reconstruction_error", "warm"]
