"""BlockPagedTensor: one block-paged KV tensor (one kv_role of one layer) in memory.

Storage is the spec's: ``page_pool`` ``[num_pages, page_size, num_heads, head_dim]``,
``block_table`` (physical page per logical page, sequences back to back) and
``seq_ptr`` (``num_seqs + 1`` offsets into the block table), plus ``seq_lens``,
the per-sequence token counts that are not on the wire (decision D6).

Element lookup, exactly as block-paged.md § Element Lookup::

    phys_page = block_table[seq_ptr[s] + t // page_size]
    flat      = ((phys_page * page_size + t % page_size) * num_heads + h) * head_dim + d

Every data path treats the pool as rows: one row per page (``page_size*H*D``
elements) or, for token-granular copies, one row per page *slot* (``H*D``
elements), and moves rows with ``np.take(..., out=...)``; index arithmetic is
vectorised over tokens, never looped in Python.  Sub-byte pools (int4, int2, ...)
are held packed, one byte-aligned row per page (decision D11).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from . import alloc
from . import quant as _quant
from .arrays import as_numpy
from .errors import (
    BufferError,
    HurrayError,
    LayoutError,
    QuantizationError,
    SeqLensRequiredError,
    UnsupportedError,
)
from .threads import run_bands
from .wire.block_paged import U32_MAX
from .wire.buffers import handle
from .wire.descriptor import TensorDescriptor
from .wire.dtypes import ElementType, element_type, pack, unpack
from .wire.layouts import KV_ROLES, BlockPaged
from .wire.quantization import Quantization, storage_range

_ROLE_CODES = {v: k for k, v in KV_ROLES.items()}
_INDEX_NAMES = {"uint32": 0, "uint64": 1}


def _role_code(kv_role: str | int) -> int:
    if isinstance(kv_role, str) and kv_role in _ROLE_CODES:
        return _ROLE_CODES[kv_role]
    if isinstance(kv_role, int) and kv_role in KV_ROLES:
        return kv_role
    raise LayoutError.at("kv_role", None, kv_role, "kv_role is 'key', 'value' or 'fused'")


def _as_index(values: Any, name: str) -> np.ndarray:
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


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


class BlockPagedTensor:
    """A block-paged tensor: ``[total_tokens, num_heads, head_dim]`` over a page pool."""

    # ------------------------------------------------------------------ construction
    def __init__(
        self,
        page_pool: np.ndarray,
        block_table: Any,
        seq_ptr: Any,
        seq_lens: Any = None,
        *,
        kv_role: str | int = "key",
        layer_index: int | None = None,
        index_type: str | None = None,
        element_type: str | ElementType | None = None,
        fp8_scale: float | None = None,
    ) -> None:
        pool = as_numpy(page_pool, "page_pool")
        if pool.ndim != 4:
            raise LayoutError.at("page_pool.shape", None, pool.shape,
                                 "page_pool is [num_pages, page_size, num_heads, head_dim]")
        et = _resolve_type(pool, element_type)
        num_pages, page_size, heads, dim = (int(x) for x in pool.shape)
        if page_size < 1:
            raise LayoutError.at("page_size", None, page_size, "page_size MUST be >= 1")
        if et.sub_byte:
            _check_subbyte_pages(et, page_size * heads * dim)
            rows = np.frombuffer(pack(pool, et), np.uint8).reshape(
                num_pages, et.nbytes(page_size * heads * dim))
        else:
            rows = np.ascontiguousarray(pool, dtype=et.numpy).reshape(
                num_pages, page_size * heads * dim)
        self._setup(rows, et, page_size, heads, dim, _as_index(block_table, "block_table"),
                    _as_index(seq_ptr, "seq_ptr"), seq_lens, _role_code(kv_role), layer_index,
                    index_type, None, ())
        self.fp8_scale = _check_fp8_scale(et, fp8_scale)
        self.validate()

    def _setup(self, rows: np.ndarray, et: ElementType, page_size: int, heads: int, dim: int,
               block_table: np.ndarray, seq_ptr: np.ndarray, seq_lens: Any, role: int,
               layer_index: int | None, index_type: str | None, quantization: Quantization | None,
               params: tuple[np.ndarray, ...], total_tokens: int | None = None) -> None:
        self._rows = rows
        self.element_type = et
        self.page_size = page_size
        self.num_heads = heads
        self.head_dim = dim
        self.kv_role = KV_ROLES[role]
        if layer_index is not None and not 0 <= int(layer_index) < U32_MAX:
            raise LayoutError.at("layer_index", None, layer_index,
                                 "layer_index is None or in [0, 0xFFFFFFFE]")
        self.layer_index = None if layer_index is None else int(layer_index)
        if len(seq_ptr) == 0:
            raise LayoutError.at("seq_ptr", None, "[]", "seq_ptr holds num_seqs + 1 >= 1 entries")
        need64 = self.num_pages > U32_MAX or len(block_table) > U32_MAX
        if index_type is None:
            index_type = "uint64" if need64 else "uint32"
        if index_type not in _INDEX_NAMES:
            raise LayoutError.at("index_type", None, index_type, "index_type is uint32 or uint64")
        if index_type == "uint32" and need64:
            raise LayoutError.at("index_type", None, index_type,
                                 f"{self.num_pages} pages / {len(block_table)} block-table "
                                 "entries need uint64 indices")
        self.index_type = index_type
        idx = np.dtype("<u8" if index_type == "uint64" else "<u4")
        self.block_table = block_table.astype(idx, copy=False)
        self.seq_ptr = seq_ptr.astype(idx, copy=False)
        self.quantization = quantization
        self.quant_params = params
        self.fp8_scale: float | None = None
        if seq_lens is None:
            self.seq_lens = None
            self._total_tokens = total_tokens
        else:
            lens = _as_index(seq_lens, "seq_lens").astype(np.int64)
            self.seq_lens = lens
            self._total_tokens = int(lens.sum()) if total_tokens is None else total_tokens

    @classmethod
    def from_sequences(
        cls,
        seqs: Sequence[np.ndarray],
        page_size: int,
        *,
        share_prefix: bool = True,
        kv_role: str | int = "key",
        layer_index: int | None = None,
        index_type: str | None = None,
        element_type: str | ElementType | None = None,
        num_heads: int | None = None,
        head_dim: int | None = None,
        fp8_scale: float | None = None,
    ) -> BlockPagedTensor:
        """Page a batch of dense ``[T_i, H, D]`` sequences.

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
        et = _resolve_type(arrays[0] if arrays else np.empty(0), element_type)
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
        return cls(pool, table[valid], seq_ptr, lens, kv_role=kv_role, layer_index=layer_index,
                   index_type=index_type, element_type=et, fp8_scale=fp8_scale)

    @classmethod
    def from_descriptor(cls, desc: TensorDescriptor, buffers: Sequence[Any],
                        seq_lens: Any = None, *, fp8_scale: float | None = None
                        ) -> BlockPagedTensor:
        """Wrap decoded buffers without copying them; validate sizes and index invariants.

        Without ``seq_lens`` the per-sequence token counts are derived only where
        unambiguous (decision D6); otherwise reading sequence data raises
        :class:`SeqLensRequiredError`.
        """
        desc.permissively_decoded_check()
        layout = desc.layout
        if not isinstance(layout, BlockPaged):
            raise LayoutError.at("layout_tag", 15, desc.layout_tag,
                                 "a BlockPagedTensor needs a block-paged (0x0A) descriptor")
        if len(buffers) != len(desc.buffers):
            raise BufferError.at("buffers", None, len(buffers),
                                 f"the descriptor declares {len(desc.buffers)} buffers")
        views = []
        for i, (buf, h) in enumerate(zip(buffers, desc.buffers, strict=True)):
            mv = byte_view(buf)
            if mv.nbytes != h.byte_size:
                raise BufferError.at(f"buffers[{i}]", i, mv.nbytes,
                                     f"the descriptor declares byte_size {h.byte_size}",
                                     where="buffer")
            views.append(mv)
        et = desc.element_type
        if et is None or et.numpy is None:
            raise UnsupportedError.at("type_tag", 14, desc.type_tag,
                                      f"hurraykv holds no data of element type "
                                      f"{desc.element_type_name}")
        total, heads, dim = desc.shape
        ps = layout.page_size
        _check_row(ps, heads, dim, 1 if et.sub_byte else et.itemsize)
        if et.sub_byte:
            rows = np.frombuffer(views[0], np.uint8).reshape(
                layout.num_pages, et.nbytes(ps * heads * dim))
        else:
            rows = np.frombuffer(views[0], et.numpy).reshape(layout.num_pages, ps * heads * dim)
        idx = np.dtype("<u8" if layout.index_type == 1 else "<u4")
        bt = np.frombuffer(views[1], idx)
        sp = np.frombuffer(views[2], idx)
        params = tuple(np.frombuffer(v, np.uint8) for v in views[3:])
        self = cls.__new__(cls)
        self._setup(rows, et, ps, heads, dim, bt, sp, None, layout.kv_role,
                    layout.layer_index, layout.index_type_name, desc.quantization, params,
                    total_tokens=total)
        self._check_index_buffers()
        self.seq_lens = self._derive_seq_lens() if seq_lens is None else _as_index(
            seq_lens, "seq_lens").astype(np.int64)
        self._check_seq_lens()
        self._check_quant_params()
        self.fp8_scale = _check_fp8_scale(et, fp8_scale)
        return self

    # ------------------------------------------------------------------ geometry
    @property
    def num_pages(self) -> int:
        return int(self._rows.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ptr) - 1

    @property
    def total_tokens(self) -> int:
        return int(self._total_tokens or 0)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.total_tokens, self.num_heads, self.head_dim)

    @property
    def dtype(self) -> np.dtype:
        return self.element_type.numpy

    @property
    def page_pool(self) -> np.ndarray:
        """``[num_pages, page_size, H, D]``: a view, or an unpacked copy for sub-byte types."""
        shape = (self.num_pages, self.page_size, self.num_heads, self.head_dim)
        if self.element_type.sub_byte:
            return unpack(self._rows, self.element_type, math.prod(shape)).reshape(shape)
        return self._rows.reshape(shape)

    @property
    def pages_per_seq(self) -> np.ndarray:
        return np.diff(self.seq_ptr.astype(np.int64))

    @property
    def referenced_pages(self) -> np.ndarray:
        """Sorted physical page IDs named by the block table."""
        return np.unique(self.block_table)

    @property
    def shared_pages(self) -> np.ndarray:
        """Sorted physical page IDs named more than once (aliased prefixes)."""
        pages, counts = np.unique(self.block_table, return_counts=True)  # O(entries), not
        return pages[counts > 1].astype(np.int64)  # O(num_pages): pools may be huge

    def __repr__(self) -> str:
        layer = "-" if self.layer_index is None else self.layer_index
        return (f"BlockPagedTensor({self.kv_role}, layer={layer}, shape={self.shape}, "
                f"{self.element_type.name}, page_size={self.page_size}, "
                f"num_pages={self.num_pages}, num_seqs={self.num_seqs}, "
                f"index_type={self.index_type})")

    # ------------------------------------------------------------------ validation
    def _check_index_buffers(self) -> None:
        """Storage invariants (1)-(3): seq_ptr starts at 0, never decreases, ends at the
        block table's length; every page ID is below num_pages."""
        sp, bt = self.seq_ptr, self.block_table
        if sp[0] != 0:
            raise LayoutError.at("seq_ptr[0]", 0, int(sp[0]), "seq_ptr[0] MUST be 0 (invariant 1)",
                                 where="index")
        if len(sp) > 1:
            dec = sp[1:] < sp[:-1]
            if dec.any():
                i = _first(dec) + 1
                raise LayoutError.at(f"seq_ptr[{i}]", i, int(sp[i]),
                                     f"seq_ptr MUST be non-decreasing; seq_ptr[{i - 1}] is "
                                     f"{int(sp[i - 1])} (invariant 2)", where="index")
        if int(sp[-1]) != len(bt):
            raise LayoutError.at(f"seq_ptr[{len(sp) - 1}]", len(sp) - 1, int(sp[-1]),
                                 f"seq_ptr[num_seqs] MUST equal the block table's length "
                                 f"{len(bt)} (invariant 1)", where="index")
        if len(bt):
            hi = int(bt.max())
            if hi >= self.num_pages:
                i = _first(bt >= self.num_pages)
                raise LayoutError.at(f"block_table[{i}]", i, int(bt[i]),
                                     f"page IDs MUST be < num_pages ({self.num_pages}) "
                                     "(invariant 3)", where="index")

    def validate(self) -> BlockPagedTensor:
        """Storage invariants (1)-(3), (6) and the token counts (D6); O(n), vectorised."""
        self._check_index_buffers()
        self._check_seq_lens()
        return self

    def _check_seq_lens(self) -> None:
        lens = self.seq_lens
        if lens is None:
            return
        if len(lens) != self.num_seqs:
            raise LayoutError.at("seq_lens", None, len(lens),
                                 f"seq_lens holds one count per sequence ({self.num_seqs})")
        cap = self.pages_per_seq * self.page_size
        over = lens > cap
        if over.any():
            s = _first(over)
            raise LayoutError.at(f"seq_lens[{s}]", s, int(lens[s]),
                                 f"sequence {s} has {int(self.pages_per_seq[s])} pages of "
                                 f"{self.page_size} slots: at most {int(cap[s])} tokens",
                                 where="index")
        total = int(lens.sum())
        if total != self.total_tokens:
            raise LayoutError.at("seq_lens", None, total,
                                 f"sum(seq_lens) MUST equal shape[0] = total_tokens "
                                 f"({self.total_tokens})")

    def _derive_seq_lens(self) -> np.ndarray | None:
        """D6: lengths are known only for one sequence, or when every page is full."""
        if self.num_seqs == 0:
            return np.zeros(0, np.int64)
        if self.num_seqs == 1:
            return np.array([self.total_tokens], np.int64)
        full = self.pages_per_seq * self.page_size
        return full if int(full.sum()) == self.total_tokens else None

    def _check_quant_params(self) -> None:
        """Row 31 and the zero-point range, on the parameter arrays themselves."""
        q = self.quantization
        if q is None or not q.AFFINE or not q.buffers:
            return  # per-tensor parameters are checked by the decoder
        scales, zps = _quant.params_arrays(q, self.quant_params, self._param_count())
        bad = ~np.isfinite(scales) | (scales == 0)
        if bad.any():
            i = _first(bad)
            raise QuantizationError.at(f"scales[{i}]", i, float(scales[i]),
                                       "every scale MUST be finite and non-zero", where="index")
        if zps is not None:
            lo, hi = storage_range(self.element_type.name)
            out = (zps < lo) | (zps > hi)
            if out.any():
                i = _first(out)
                raise QuantizationError.at(f"zero_points[{i}]", i, int(zps[i]),
                                           f"zero-points MUST lie in [{lo}, {hi}]",
                                           where="index")

    def _slot_params(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Per-block-affine scales (float32) and zero-points (int32, or None), writable
        and contiguous, converted once per ``quant_params`` (which is only ever replaced
        whole), not on every dequantizing read."""
        cached = getattr(self, "_slot_params_cache", None)
        if cached is None or cached[0] is not self.quant_params:
            scales, zps = _quant.params_arrays(self.quantization, self.quant_params,
                                               self._param_count())
            cached = (self.quant_params, np.array(scales, np.float32),
                      None if zps is None else np.array(zps, np.int32))
            self._slot_params_cache = cached
        return cached[1], cached[2]

    @property
    def _per_slot(self) -> bool:
        """Quantization parameters per page slot (per-block-affine, D4)."""
        return self.quantization is not None and self.quantization.per_slot

    def _param_count(self) -> int:
        q = self.quantization
        if q is not None and not q.per_slot:
            return q.param_count(self.shape)
        return self.num_pages * self.page_size

    def _lens(self) -> np.ndarray:
        if self.seq_lens is None:
            raise SeqLensRequiredError(
                f"per-sequence token counts are not on the wire and cannot be derived: "
                f"{self.num_seqs} sequences share {self.total_tokens} tokens in "
                f"{len(self.block_table)} pages of {self.page_size}; supply seq_lens "
                "(decision D6)", field="seq_lens", rule="D6")
        return self.seq_lens

    # ------------------------------------------------------------------ data paths
    def _slots(self, seqs: np.ndarray) -> np.ndarray:
        """Pool slot (phys_page*page_size + t%page_size) of every valid token of ``seqs``."""
        lens = self._lens()[seqs]
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
            rows = np.take(self._rows, pages, axis=0)
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
        slot_rows = self._rows.reshape(self.num_pages * self.page_size,
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
        self._check_output(int(self._lens()[s]), dequantize)
        if not self._has_data():
            return self._empty(int(self._lens()[s]), dequantize)
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
        n, ps = int(self._lens()[s]), self.page_size
        out = self._check_out(out, n)
        full, rem = divmod(n, ps)
        first = int(self.seq_ptr[s])
        pages = self.block_table[first:first + full + (rem > 0)]
        rows = out[:full * ps].reshape(full, ps * self.num_heads * self.head_dim)
        run_bands(lambda a, b: np.take(self._rows, pages[a:b], axis=0, out=rows[a:b],
                                       mode="clip"), full, rows.nbytes)
        if rem:
            last = min(int(pages[full]), self.num_pages - 1)  # as mode="clip"
            out[full * ps:] = self._rows[last].reshape(ps, self.num_heads, self.head_dim)[:rem]
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
        self._check_output(int(self._lens().sum()), dequantize)
        if not self._has_data():
            return self._empty(int(self._lens().sum()), dequantize)
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

    def _has_data(self) -> bool:
        """False when heads or head_dim is 0: every token is empty, and token counts (which
        then cost no bytes) must not size any index array."""
        return self.num_heads * self.head_dim > 0

    def _read(self, slots: np.ndarray, out: np.ndarray | None, dequantize: bool) -> np.ndarray:
        if self._plain(dequantize):
            return self._take_slots(slots, out)
        shape = (len(slots), self.num_heads, self.head_dim)
        if out is not None and (out.shape != shape or out.dtype != np.float32
                                or not out.flags.c_contiguous):
            raise LayoutError.at("out", None, f"{out.shape} {out.dtype}",
                                 f"out must be a C-contiguous {shape} float32 array")
        if self.quantization is not None:
            fused = None
            if self._per_slot and self.quantization.AFFINE:
                fused = _quant.gather_dequantized(self._rows, self.element_type,
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
        lens = self._lens()
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
            raw = self._rows.reshape(-1)[self.element_type.nbytes(start):][:nbytes]
            return unpack(raw, self.element_type, per)[flat % per]
        return self._rows.reshape(-1)[flat]

    # ------------------------------------------------------------------ maintenance
    def used_slots(self) -> np.ndarray:
        """Boolean mask over the ``num_pages*page_size`` slots that hold a valid token.

        Worked out per block-table entry, not per token: the first ``len // page_size``
        pages of a sequence are full, the next holds ``len % page_size`` tokens, any
        further (look-ahead) pages hold none."""
        ps = self.page_size
        mask = np.zeros((self.num_pages, ps), dtype=bool)
        lens = self._lens()
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
        if not self._rows.flags.writeable:
            raise BufferError("page_pool is read-only (e.g. memory-mapped); copy() first",
                              field="page_pool", rule="zeroing needs a writable pool")
        if not self._has_data():
            return 0
        unused = ~self.used_slots()
        self._zero_rows(self._rows, unused)
        if self._per_slot:
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
        if self.seq_lens is None or self.num_pages == 0 or not self._has_data():
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
                segments.append(byte_view(self._rows[start:a]))
            copy = self._rows[a:b].copy()
            self._zero_rows(copy, unused[a * self.page_size:b * self.page_size])
            segments.append(byte_view(copy))
            start = b
        if start < self.num_pages:
            segments.append(byte_view(self._rows[start:]))
        return [*segments, *views[1:]]

    def compact(self) -> BlockPagedTensor:
        """A copy holding only referenced pages, renumbered in ascending order; aliasing
        (shared prefixes) and per-page-slot scales follow their pages."""
        keep = self.referenced_pages.astype(np.int64)
        return self._derive(np.take(self._rows, keep, axis=0),
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

    def copy(self) -> BlockPagedTensor:
        return self._derive(self._rows.copy(), params=tuple(p.copy() for p in self.quant_params))

    def _derive(self, rows: np.ndarray, *, element_type: ElementType | None = None,
                block_table: np.ndarray | None = None, quantization: Any = "keep",
                params: tuple[np.ndarray, ...] | None = None,
                fp8_scale: Any = "keep") -> BlockPagedTensor:
        """A tensor over new pool rows with this tensor's sequences (tables copied)."""
        out = self.__class__.__new__(self.__class__)
        out._setup(rows, element_type or self.element_type, self.page_size, self.num_heads,
                   self.head_dim,
                   self.block_table.copy() if block_table is None else block_table,
                   self.seq_ptr.copy(), None if self.seq_lens is None else self.seq_lens.copy(),
                   _ROLE_CODES[self.kv_role], self.layer_index,
                   self.index_type if block_table is None else None,
                   self.quantization if quantization == "keep" else quantization,
                   self.quant_params if params is None else params,
                   total_tokens=self._total_tokens)
        out.fp8_scale = self.fp8_scale if fp8_scale == "keep" else fp8_scale
        return out

    # ------------------------------------------------------------------ quantization
    def quantize(self, scheme: str, dtype: str, symmetric: bool = True, axis: int | None = None,
                 *, scale_dtype: str = "float32") -> BlockPagedTensor:
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
            _check_subbyte_pages(et, self.page_size * self.num_heads * self.head_dim)
        slots = self._rows.reshape(-1, self.num_heads, self.head_dim)
        # Converted to float32 chunk by chunk inside; only fp8 needs its scale first.
        values = slots if self.fp8_scale is None else self._float_values(
            slots, np.arange(len(slots)))
        codes, q, params = _quant.quantize_slots(
            values, self.used_slots(), scheme, et, symmetric, axis,
            _quant.SCALE_TAGS[scale_dtype])
        if q.per_slot:  # one parameter per page slot: block_size == page_size (D4)
            q = replace(q, block_size=self.page_size)
        if et.sub_byte:
            rows = _quant.pack_codes(codes, et).reshape(self.num_pages, -1)
        else:
            rows = codes.reshape(self.num_pages, -1)
        return self._derive(rows, element_type=et, quantization=q, params=params,
                            fp8_scale=None)

    def dequantize(self) -> BlockPagedTensor:
        """A float32 copy: quantized pools per the spec formula, fp8 pools times
        ``fp8_scale``, float pools widened.  Tables and aliasing are unchanged."""
        slots = np.arange(self.num_pages * self.page_size)
        values = _quant.gather_dequantized(
            self._rows, self.element_type, self.page_size, self.num_heads, self.head_dim,
            slots, *self._slot_params()) if self._per_slot and self.quantization.AFFINE \
            and self._has_data() else None
        if values is None:
            codes = self.page_pool.reshape(-1, self.num_heads, self.head_dim)
            values = self._float_values(codes, slots)
        return self._derive(values.reshape(self.num_pages, -1), element_type=element_type(
            "float32"), quantization=None, params=(), fp8_scale=None)

    to_float = dequantize

    # ------------------------------------------------------------------ wire
    def layout(self) -> BlockPaged:
        return BlockPaged(page_size=self.page_size, num_pages=self.num_pages,
                          num_seqs=self.num_seqs, kv_role=_ROLE_CODES[self.kv_role],
                          layer_index=self.layer_index, index_type=_INDEX_NAMES[self.index_type])

    def descriptor(self, *, alignment: int = 64, device_tag: int = 0,
                   memory_class: int = 0) -> TensorDescriptor:
        """The tensor's Hurray descriptor.  ``alignment`` is what the carrier of the
        buffers guarantees (a file or IPC segment declares its own, >= 4096)."""
        handles = tuple(handle(len(b), alignment, device_tag, 0, memory_class)
                        for b in self.buffers())
        return TensorDescriptor(self.element_type.tag, self.shape, self.layout(), handles,
                                quantization=self.quantization)

    def buffers(self) -> tuple[memoryview, ...]:
        """Zero-copy byte views: page_pool, block_table, seq_ptr, then quantization params."""
        return tuple(byte_view(a) for a in (self._rows, self.block_table, self.seq_ptr,
                                             *self.quant_params))

    def equal(self, other: BlockPagedTensor) -> bool:
        """Same descriptor and the same bytes in every buffer."""
        return (self.descriptor() == other.descriptor()
                and all(a == b for a, b in zip(self.buffers(), other.buffers(), strict=True))
                and (self.seq_lens is None) == (other.seq_lens is None)
                and (self.seq_lens is None or np.array_equal(self.seq_lens, other.seq_lens)))


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


def _resolve_type(sample: np.ndarray, name: str | ElementType | None) -> ElementType:
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


def _check_fp8_scale(et: ElementType, scale: float | None) -> float | None:
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


def _check_row(page_size: int, heads: int, dim: int, itemsize: int = 1) -> None:
    """A page row (page_size*num_heads*head_dim elements) must be an array NumPy can
    shape, even in a pool of 0 pages whose byte size the product never touches: at most
    2^63-1 elements and 2^63-1 bytes."""
    if page_size * heads * dim * itemsize > MAX_ROW:
        raise UnsupportedError.at("shape", None, [page_size, heads, dim],
                                  f"a page of page_size x num_heads x head_dim elements must "
                                  f"be at most {MAX_ROW} (2^63-1) elements and bytes "
                                  f"({itemsize} per element) to be held")


def _check_subbyte_pages(et: ElementType, page_elems: int) -> None:
    if not et.whole_bytes(page_elems):
        raise UnsupportedError.at("page_size", None, page_elems,
                                  f"a {et.name} page of {page_elems} elements does not end on a "
                                  "byte boundary (decision D11)")


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
