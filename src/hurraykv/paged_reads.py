"""BlockPagedTensor's data paths: tokens and pages read out of the page pool.

A mixin of ``BlockPagedTensor`` (``paged.py``): it uses the tensor's low-level surface
(``pool_rows``, ``block_table``, ``seq_ptr``, the geometry, ``token_counts``,
``param_count``) and imports no other part of the class.  Every path treats the pool as
rows, one per page slot (``H*D`` elements), and moves them with ``np.take(...,
out=...)`` in bands (``threads.run_bands``); the slot of every valid token is worked out
vectorised over tokens.  Sub-byte pools are unpacked page by page (D11).  Dequantizing reads follow
the spec formula (``quant/``), fused with the gather for per-block-affine pools.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import alloc
from . import quant as _quant
from .errors import LayoutError, UnsupportedError
from .paging import MAX_ROW
from .threads import run_bands
from .wire.dtypes import unpack


class PagedReads:
    """Gather, to_dense and element of a BlockPagedTensor, dequantizing or not."""

    def _slots(self, seqs: np.ndarray) -> np.ndarray:
        """Pool slot (phys_page*page_size + t%page_size) of every valid token of ``seqs``."""
        lens = self.token_counts()[seqs]
        n = int(lens.sum())
        starts = self.seq_ptr[seqs].astype(np.int64)
        first_tok = np.cumsum(lens) - lens
        t = np.arange(n, dtype=np.int64) - np.repeat(first_tok, lens)
        ps = self.page_size
        pages = self.block_table[np.repeat(starts, lens) + t // ps].astype(np.int64)
        return pages * ps + t % ps

    def _take_slots(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        n = len(slots)
        out_shape = (n, self.num_heads, self.head_dim)
        if out is not None:
            self._check_out(out, n)
        if self.element_type.sub_byte and n:
            # Packed pages are byte-aligned, slots may not be: unpack the pages touched.
            ps = self.page_size
            pages, inv = np.unique(slots // ps, return_inverse=True)
            rows = np.take(self.pool_rows, pages, axis=0)
            vals = unpack(rows, self.element_type, rows.shape[0] * ps * self.num_heads
                          * self.head_dim).reshape(-1, self.num_heads, self.head_dim)
            res = vals[inv * ps + slots % ps].reshape(out_shape)
            if out is None:
                return res
            out[...] = res
            return out
        out = self._check_out(out, n)
        if n == 0:
            return out
        slot_rows = self.pool_rows.reshape(self.num_pages * self.page_size,
                                       self.num_heads * self.head_dim)
        flat = out.reshape(n, self.num_heads * self.head_dim)
        # large copies run in bands on every core (take releases the GIL)
        run_bands(lambda a, b: np.take(slot_rows, slots[a:b], axis=0, out=flat[a:b],
                                       mode="clip"), n, flat.nbytes)
        return out

    def _empty(self, tokens: int, dequantize: bool) -> np.ndarray:
        dtype = np.float32 if dequantize and not self.element_type.is_float else self.dtype
        return np.empty((tokens, self.num_heads, self.head_dim), dtype)

    def gather(self, s: int, out: np.ndarray | None = None, *,
               dequantize: bool = False) -> np.ndarray:
        """Sequence ``s`` as a dense ``[T_s, H, D]`` array (a copy; never reads past T_s).

        ``dequantize=True`` returns float32 values (quantized pools per the spec formula,
        fp8 pools times ``fp8_scale``).  ``out`` lets a caller reuse one buffer."""
        if not 0 <= s < self.num_seqs:
            raise LayoutError.at("s", None, s, f"sequence index in [0, {self.num_seqs})")
        self._check_output(int(self.token_counts()[s]), dequantize)
        if not self.has_data():
            return self._empty(int(self.token_counts()[s]), dequantize)
        if self._plain(dequantize) and not self.element_type.sub_byte:
            return self._gather_pages(s, out)
        return self._read(self._slots(np.array([s])), out, dequantize)

    def _plain(self, dequantize: bool) -> bool:
        """True when reading returns the stored elements (no dequantization to do)."""
        return not dequantize or (self.quantization is None and self.fp8_scale is None
                                  and self.element_type.is_float)

    def _gather_pages(self, s: int, out: np.ndarray | None) -> np.ndarray:
        """One sequence by whole pages (one row each) and the partial last page: no
        per-token index is built, which dominates small gathers."""
        n, ps = int(self.token_counts()[s]), self.page_size
        out = self._check_out(out, n)
        full, rem = divmod(n, ps)
        first = int(self.seq_ptr[s])
        pages = self.block_table[first:first + full + (rem > 0)]
        rows = out[:full * ps].reshape(full, ps * self.num_heads * self.head_dim)
        run_bands(lambda a, b: np.take(self.pool_rows, pages[a:b], axis=0, out=rows[a:b],
                                       mode="clip"), full, rows.nbytes)
        if rem:
            last = min(int(pages[full]), self.num_pages - 1)  # as mode="clip"
            out[full * ps:] = self.pool_rows[last].reshape(ps, self.num_heads, self.head_dim)[:rem]
        return out

    def _check_out(self, out: np.ndarray | None, n: int) -> np.ndarray:
        shape = (n, self.num_heads, self.head_dim)
        if out is None:
            return alloc.empty(shape, self.dtype)
        if out.shape != shape or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise LayoutError.at("out", None, f"{out.shape} {out.dtype}",
                                 f"out must be a C-contiguous {shape} {self.dtype} array")
        return out

    def to_dense(self, out: np.ndarray | None = None, *,
                 dequantize: bool = False) -> np.ndarray:
        """The logical tensor ``[total_tokens, H, D]``, sequences back to back."""
        self._check_output(int(self.token_counts().sum()), dequantize)
        if not self.has_data():
            return self._empty(int(self.token_counts().sum()), dequantize)
        return self._read(self._slots(np.arange(self.num_seqs)), out, dequantize)

    def _check_output(self, tokens: int, dequantize: bool) -> None:
        """An output ``[tokens, H, D]`` must be an array NumPy can shape: the product of
        its non-zero dimensions times the element size at most 2^63-1 bytes (a strictly
        valid descriptor may declare ``(0, 4683743612465315842, 0)``)."""
        shape = [tokens, self.num_heads, self.head_dim]
        nbytes = max(self.dtype.itemsize, 4 if dequantize else 1)
        for n in shape:
            nbytes *= n or 1
        if nbytes > MAX_ROW:
            raise UnsupportedError.at("shape", None, shape,
                                      "an output [tokens, num_heads, head_dim] must hold at "
                                      f"most {MAX_ROW} (2^63-1) bytes counting its non-zero "
                                      "dimensions (what NumPy can shape)")

    def _read(self, slots: np.ndarray, out: np.ndarray | None, dequantize: bool) -> np.ndarray:
        if self._plain(dequantize):
            return self._take_slots(slots, out)
        shape = (len(slots), self.num_heads, self.head_dim)
        if out is not None and (out.shape != shape or out.dtype != np.float32
                                or not out.flags.c_contiguous):
            raise LayoutError.at("out", None, f"{out.shape} {out.dtype}",
                                 f"out must be a C-contiguous {shape} float32 array")
        if self.quantization is not None:
            self.check_params_once()
            fused = None
            if self.quantization.per_slot and self.quantization.AFFINE:
                fused = _quant.gather_dequantized(self.pool_rows, self.element_type,
                                                  self.page_size, self.num_heads,
                                                  self.head_dim, slots, *self._slot_params(),
                                                  out)
            if fused is not None:
                return fused
        values = self._float_values(self._take_slots(slots), slots)
        if out is None:
            return values
        out[...] = values
        return out

    def decode_pages(self, first: int, count: int, dtype: Any = np.float32,
                     out: np.ndarray | None = None) -> np.ndarray:
        """Pool pages ``first .. first + count - 1`` (physical pages, not a sequence) as
        ``[count, page_size, H, D]`` values of ``dtype``: quantized pools per the spec
        formula, fp8 pools times ``fp8_scale``, float pools converted.

        Where the compiled kernels apply (int8, int4 and float8 e4m3 codes of a scheme
        whose ``GRANULARITY`` has a plan in ``quant.KERNEL_PLANS``, into float32 or
        bfloat16) it is one pass from codes and scales to the output's bits; elsewhere
        the NumPy formula, the same values.  ``out``: bytes of any dtype, at least the
        output's size, reused between calls (the result is a view of it)."""
        if first < 0 or count < 0 or first + count > self.num_pages:
            raise LayoutError.at("first", None, first,
                                 f"pages first .. first + count - 1 (count {count}) lie in "
                                 f"[0, {self.num_pages})")
        if self.quantization is not None:
            self.check_params_once()
        dtype = np.dtype(dtype)
        shape = (count, self.page_size, self.num_heads, self.head_dim)
        nbytes = math.prod(shape) * dtype.itemsize
        if out is None:
            values = alloc.empty(shape, dtype)
        elif out.nbytes < nbytes or not out.flags.c_contiguous:
            raise LayoutError.at("out", None, out.nbytes,
                                 f"out holds at least {nbytes} bytes, C-contiguous")
        else:
            values = out.reshape(-1).view(np.uint8)[:nbytes].view(dtype).reshape(shape)
        if self._decode_compiled(first, count, values):
            return values
        slots = np.arange(first * self.page_size, (first + count) * self.page_size)
        if dtype == np.float32 and not self._plain(True):  # dequantized straight into it
            self._read(slots, values.reshape(-1, self.num_heads, self.head_dim), True)
        else:
            values[...] = self._read(slots, None, True).reshape(shape)
        return values

    def _decode_compiled(self, first: int, count: int, values: np.ndarray) -> bool:
        """``decode_pages`` by ``quant.decode_rows``; False where it does not apply."""
        et, q = self.element_type, self.quantization
        slots, elems = count * self.page_size, self.num_heads * self.head_dim
        if not slots or not elems or elems % 2:
            return False
        if q is None and self.fp8_scale is not None and et.name == "float8_e4m3":
            plan = (np.full(slots, np.float32(self.fp8_scale)), None)
        elif q is not None:
            plan = _quant.kernel_scales(q, self.quant_params, self.param_count(),
                                        first * self.page_size, slots, self.num_heads,
                                        self.head_dim)
        else:
            plan = None
        if plan is None:
            return False
        rows = self.pool_rows[first:first + count]
        codes = rows.reshape(slots, -1) if rows.flags.c_contiguous else None
        return codes is not None and _quant.decode_rows(codes, et, *plan,
                                                         values.reshape(slots, elems))

    def _float_values(self, codes: np.ndarray, slots: np.ndarray) -> np.ndarray:
        if self.quantization is not None:
            return _quant.dequantize(codes, slots, self.quantization, self.quant_params,
                                     self.num_pages * self.page_size)
        values = codes.astype(np.float32)
        if self.fp8_scale is not None:
            values *= np.float32(self.fp8_scale)
        return values

    def element(self, s: int, t: int, h: int, d: int) -> Any:
        """The value at token ``t`` of sequence ``s``, head ``h``, dim ``d`` (spec formula)."""
        lens = self.token_counts()
        for name, v, hi in (("s", s, self.num_seqs), ("h", h, self.num_heads),
                            ("d", d, self.head_dim)):
            if not 0 <= v < hi:
                raise LayoutError.at(name, None, v, f"{name} in [0, {hi})")
        if not 0 <= t < lens[s]:
            raise LayoutError.at("t", None, t,
                                 f"sequence {s} has {int(lens[s])} valid tokens; a reader "
                                 "MUST NOT read past them")
        ps, H, D = self.page_size, self.num_heads, self.head_dim
        phys = int(self.block_table[int(self.seq_ptr[s]) + t // ps])
        flat = ((phys * ps + t % ps) * H + h) * D + d
        if self.element_type.sub_byte:
            per = self.element_type.packing if self.element_type.bits != 6 else 4
            start = flat - flat % per
            nbytes = self.element_type.nbytes(per)
            raw = self.pool_rows.reshape(-1)[self.element_type.nbytes(start):][:nbytes]
            return unpack(raw, self.element_type, per)[flat % per]
        return self.pool_rows.reshape(-1)[flat]

    def _slot_params(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Per-block-affine scales (float32) and zero-points (int32, or None), writable
        and contiguous, converted once per ``quant_params`` (which is only ever replaced
        whole), not on every dequantizing read."""
        cached = getattr(self, "_slot_params_cache", None)
        if cached is None or cached[0] is not self.quant_params:
            scales, zps = _quant.params_arrays(self.quantization, self.quant_params,
                                               self.param_count())
            cached = (self.quant_params, np.array(scales, np.float32),
                      None if zps is None else np.array(zps, np.int32))
            self._slot_params_cache = cached
        return cached[1], cached[2]

