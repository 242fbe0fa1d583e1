"""Stored KV at the cache dtype, or at half or a quarter of its bytes (issue 22): the
store format's configuration, its encoding on save and its check on load.

``store_dtype`` in ``kv_connector_extra_config`` says what a segment holds:

* ``"auto"``: the engine's cache dtype, page for page (bytes unchanged; the identity of
  the cache is the one every earlier release used);
* ``"int8"``, ``"int4"``: symmetric codes with float32 scales of the Hurray
  quantization scheme ``"quantization"`` names: ``"per_block_affine"`` (default) keeps
  one scale per page slot, i.e. per token of a page, shared by its heads and dims;
  ``"per_channel"`` one per head_dim channel of each layer's key (value) pool of the
  segment.  The choices are the scheme registry's (``scheme_names``): every affine
  block-paged scheme whose scales travel in buffers (which the segment's checksums
  cover) and that the compiled decode has a plan for (``quant.KERNEL_PLANS``);
* ``"fp8"``: float8 e4m3 values with one float32 scale per layer and role (the
  ``kv_scales`` member of fp8 caches, so any Hurray reader dequantizes them).

Error bounds per element ``x`` (``max_error``): int8 ``s / 2`` with ``s = absmax / 127``
(int4: ``absmax / 7``), ``absmax`` over the slot (per_block_affine) or the channel
(per_channel); fp8 ``max(|x| / 16, s / 1024)`` with
``s = absmax / 448`` of the layer's pool (half a unit in e4m3's last place, or of its
subnormal step).

The format is part of the cache identity (``identity_suffix``): an engine looks up, and
loads, the chunks of its own format and of those ``accept_store_dtypes`` lists, nothing
else.  Saving quantizes each layer's pages right after they are copied out of the
engine's blocks (``encode``: ``BlockPagedTensor.quantize``, ``quant.fp8_e4m3``); loading
decodes a segment's pages into the cache dtype on the tensor's floor
(``BlockPagedTensor.decode_pages``), which ``LayerView.write`` copies into the engine's
blocks.  No vLLM or torch import: tested without an engine
(``tests/test_store_format.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import HurrayError
from ...paged import BlockPagedTensor
from ...quant import DECODE_CODES, FP8_MAX, KERNEL_PLANS, fp8_e4m3
from ...snapshot import KVCacheSnapshot
from ...wire.quantization import scheme_by_name, schemes, storage_range

# The integer store dtypes: those the compiled decode reads, symmetric (codes in
# [-qmax, qmax]); the schemes: every registered affine block-paged scheme the compiled
# decode has a plan for (quant.KERNEL_PLANS), so a scheme registered later is offered too,
# but for per-tensor granularity: its scale sits in the descriptor, where a segment's
# checksums (which cover buffers) would not catch a flipped byte scaling every value.
_LEVELS = {n: storage_range(n)[1] for n in DECODE_CODES if n.startswith("int")}
STORE_DTYPES = ("auto", *_LEVELS, "fp8")
DEFAULT_SCHEME = "per_block_affine"


def scheme_names() -> tuple[str, ...]:
    """The quantization schemes ``store_dtype`` int8 and int4 take, the default first."""
    names = [c.NAME for c in schemes() if c.AFFINE and c.BLOCK_PAGED
             and c.GRANULARITY in KERNEL_PLANS and c.GRANULARITY != "tensor"]
    return tuple(sorted(names, key=lambda n: n != DEFAULT_SCHEME))


# vLLM cache dtypes whose values are the model's floats ("auto": the model dtype)
FLOAT_CACHES = ("auto", "bfloat16", "float16", "half", "float", "float32")


def _granularity(scheme: str | None) -> str | None:
    cls = scheme_by_name(scheme) if scheme else None
    return None if cls is None else cls.GRANULARITY


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
            codes, scale = fp8_e4m3(pages, f"layer {layer} {role} pages")
            return BlockPagedTensor(codes, table, ptr, lens, kv_role=role, layer_index=layer,
                                    element_type="float8_e4m3", fp8_scale=scale)
        t = BlockPagedTensor(pages, table, ptr, lens, kv_role=role, layer_index=layer)
        if self.auto:
            return t
        # a per-channel scheme: one scale per head_dim channel (the axis keys vary along)
        return t.quantize(self.scheme, self.dtype, symmetric=True,
                          axis=2 if _granularity(self.scheme) == "channel" else None)

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


def decode(t: BlockPagedTensor, first: int, count: int) -> np.ndarray:
    """Pages ``first .. first + count - 1`` of a stored segment tensor as float32
    ``[count, page_size, heads, dim]`` (``BlockPagedTensor.decode_pages``)."""
    return t.decode_pages(first, count)


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
    axes = {"slot": (1, 2), "channel": (0, 1)}.get(_granularity(fmt.scheme), (0, 1, 2))
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
    scheme, known = scheme or default_scheme or DEFAULT_SCHEME, scheme_names()
    if scheme not in known:
        raise HurrayError(f"kv_connector_extra_config[{key!r}] names {text!r}; quantization "
                          f"is one of {', '.join(known)}", field=key, value=text,
                          rule=f"one of {', '.join(known)}")
    return StoreFormat(dtype, scheme)


def check_cache_dtype(fmt: StoreFormat, kv_cache_dtype: str, key: str = "store_dtype",
                      block_size: int | None = None) -> None:
    """A format the engine's cache can take: quantizing is from the model's floats, so an
    fp8 (or other quantized) cache stores ``auto`` only; ``per_block_affine`` keeps a
    scale per page slot in quantization blocks of one page, which Hurray requires to be a
    power of two (vLLM sizes a Qwen3-Next's pages to 160 tokens)."""
    if _granularity(fmt.scheme) == "slot" and block_size and block_size & (block_size - 1):
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


__all__ = ["DEFAULT_SCHEME", "FLOAT_CACHES", "STORE_DTYPES", "StoreFormat",
           "check_cache_dtype", "decode", "max_error", "parse", "reconstruction_error",
           "scheme_names"]
