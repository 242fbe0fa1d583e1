"""BlockPagedTensor's derived tensors and buffers: what is made from one tensor.

A mixin of ``BlockPagedTensor`` (``paged.py``): it uses the tensor's low-level surface
(``pool_rows``, ``token_counts``, ``derive``, the geometry and tables) and imports no
other part of the class.
It holds the slots in use (``used_slots``) and what depends on them: unused slots zeroed
in place or in the buffers handed out (``zero_unused_slots``, ``clean_buffers``), only
the referenced pages kept (``compact``), and the quantized and dequantized copies
(``quantize``, ``dequantize``).  The copies keep the tensor's tables and aliasing, but
``compact``'s, which renumbers pages.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Self

import numpy as np

from . import quant as _quant
from .errors import BufferError, QuantizationError
from .paging import byte_view, check_subbyte_pages
from .wire.dtypes import element_type, pack, unpack


class PagedDerived:
    """Used slots, zeroing, clean buffers, compact, quantize and dequantize."""

    def used_slots(self) -> np.ndarray:
        """Boolean mask over the ``num_pages*page_size`` slots that hold a valid token.

        Worked out per block-table entry, not per token: the first ``len // page_size``
        pages of a sequence are full, the next holds ``len % page_size`` tokens, any
        further (look-ahead) pages hold none."""
        ps = self.page_size
        mask = np.zeros((self.num_pages, ps), dtype=bool)
        lens = self.token_counts()
        pages = self.pages_per_seq
        starts = self.seq_ptr[:-1].astype(np.int64)
        position = np.arange(len(self.block_table)) - np.repeat(starts, pages)
        full = position < np.repeat(lens // ps, pages)
        mask[self.block_table[full].astype(np.int64)] = True
        rem = lens % ps
        part = rem > 0
        tail_pages = self.block_table[starts[part] + lens[part] // ps].astype(np.int64)
        np.logical_or.at(mask, tail_pages, np.arange(ps)[None, :] < rem[part][:, None])
        return mask.reshape(-1)

    def zero_unused_slots(self) -> int:
        """Zero every slot no sequence reads (partial-page tails, unreferenced pages), in
        place, before the pool crosses a trust boundary.  Returns the number of slots
        zeroed."""
        if not self.pool_rows.flags.writeable:
            raise BufferError("page_pool is read-only (e.g. memory-mapped); copy() first",
                              field="page_pool", rule="zeroing needs a writable pool")
        if not self.has_data():
            return 0
        unused = ~self.used_slots()
        self._zero_rows(self.pool_rows, unused)
        if self.quantization is not None and self.quantization.per_slot:
            self.quant_params = _quant.reset_unused(self.quantization, self.quant_params,
                                                    unused)
        return int(unused.sum())

    def _zero_rows(self, rows: np.ndarray, unused: np.ndarray) -> None:
        """Zero the slots flagged in ``unused`` (``rows.shape[0] * page_size`` flags)."""
        slot = self.num_heads * self.head_dim
        if self.element_type.sub_byte:
            n = rows.shape[0] * self.page_size * slot
            vals = unpack(rows, self.element_type, n).reshape(-1, slot).copy()
            vals[unused] = 0
            rows[...] = np.frombuffer(pack(vals, self.element_type), np.uint8).reshape(
                rows.shape)
        else:
            rows.reshape(-1, slot)[unused] = 0

    def clean_buffers(self) -> list[memoryview]:
        """``buffers()`` as they may leave the process: slots no sequence reads are zero.

        The pool is returned as consecutive views - straight onto this tensor's memory
        for pages every slot of which is in use, zeroed copies for the others - so the
        tensor is not modified and the bulk is not copied."""
        views = list(self.buffers())
        if self.seq_lens is None or self.num_pages == 0 or not self.has_data():
            return views
        unused = ~self.used_slots()
        dirty = unused.reshape(self.num_pages, self.page_size).any(axis=1)
        if not dirty.any():
            return views
        edges = np.flatnonzero(np.diff(np.concatenate([[False], dirty, [False]])))
        segments: list[memoryview] = []
        start = 0
        for a, b in zip(edges[0::2], edges[1::2], strict=True):  # runs of dirty pages
            if a > start:
                segments.append(byte_view(self.pool_rows[start:a]))
            copy = self.pool_rows[a:b].copy()
            self._zero_rows(copy, unused[a * self.page_size:b * self.page_size])
            segments.append(byte_view(copy))
            start = b
        if start < self.num_pages:
            segments.append(byte_view(self.pool_rows[start:]))
        return [*segments, *views[1:]]

    def compact(self) -> Self:
        """A copy holding only referenced pages, renumbered in ascending order; aliasing
        (shared prefixes) and per-page-slot scales follow their pages."""
        keep = self.referenced_pages.astype(np.int64)
        return self.derive(np.take(self.pool_rows, keep, axis=0),
                            block_table=np.searchsorted(keep, self.block_table),
                            params=self._page_params(keep))

    def _page_params(self, keep: np.ndarray) -> tuple[np.ndarray, ...]:
        """Quantization parameters of the kept pages: per-page-slot arrays (per-block
        affine, D4) follow their page; per-tensor and per-channel ones are unchanged."""
        q = self.quantization
        if q is None or not q.per_slot or self.num_pages == 0:
            return tuple(p.copy() for p in self.quant_params)
        out = []
        for i, p in enumerate(self.quant_params, start=3):
            parts = 2 if i == q.scale_buffer == q.zero_point_buffer else 1
            halves = p.reshape(parts, self.num_pages, -1)  # [scales | zero_points]
            out.append(np.take(halves, keep, axis=1).reshape(-1))
        return tuple(out)

    # ------------------------------------------------------------------ quantization
    def quantize(self, scheme: str, dtype: str, symmetric: bool = True, axis: int | None = None,
                 *, scale_dtype: str = "float32") -> Self:
        """A quantized copy of a float pool.

        ``scheme``: "per_tensor", "per_channel" (``axis`` 1 heads or 2 head_dim) or
        "per_block_affine" (one scale per physical page slot, D4).  ``dtype``: the storage
        type (int8, uint8, int4, uint4, int2, uint2; per-tensor and per-channel also 16-
        and 32-bit integers).  Sub-byte pools are packed per page (D11).
        """
        if self.quantization is not None or not self.element_type.is_float:
            raise QuantizationError.at("element_type", None, self.element_type.name,
                                       "quantize() takes an unquantized float pool")
        et = element_type(dtype)
        if scale_dtype not in _quant.SCALE_TAGS:
            raise QuantizationError.at("scale_dtype", None, scale_dtype,
                                       "scale_dtype is float32, float16 or bfloat16")
        if et.sub_byte:
            check_subbyte_pages(et, self.page_size * self.num_heads * self.head_dim)
        # Converted to float32 chunk by chunk inside; only fp8 needs its scale first.
        values = self.pool_rows if self.fp8_scale is None else self.decode_pages(
            0, self.num_pages)
        values = values.reshape(-1, self.num_heads, self.head_dim)
        codes, q, params = _quant.quantize_slots(
            values, self.used_slots(), scheme, et, symmetric, axis,
            _quant.SCALE_TAGS[scale_dtype])
        if q.per_slot:  # one parameter per page slot: block_size == page_size (D4)
            q = replace(q, block_size=self.page_size)
        if et.sub_byte:
            rows = _quant.pack_codes(codes, et).reshape(self.num_pages, -1)
        else:
            rows = codes.reshape(self.num_pages, -1)
        return self.derive(rows, element_type=et, quantization=q, params=params,
                            fp8_scale=None)

    def dequantize(self) -> Self:
        """A float32 copy: quantized pools per the spec formula, fp8 pools times
        ``fp8_scale``, float pools widened.  Tables and aliasing are unchanged."""
        values = self.decode_pages(0, self.num_pages)
        return self.derive(values.reshape(self.num_pages, -1), element_type=element_type(
            "float32"), quantization=None, params=(), fp8_scale=None)

    to_float = dequantize
