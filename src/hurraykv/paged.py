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

The class is written in three modules, one concept each: this one holds construction,
geometry, validation and the wire view (descriptor, buffers); ``paged_reads`` the data
paths that read tokens or pages out (gather, to_dense, element, decode_pages);
``paged_derived`` the tensors and buffers made from one (used slots, zeroing, clean
buffers, compact, quantize, dequantize).  ``paging`` holds the input checks and the
paging of dense sequences they share.  The two mixins and every other module use the
tensor's public low-level surface only: ``pool_rows`` (the pool as stored, one row per
page), ``token_counts()``, ``param_count()``, ``derive()`` and ``from_rows()``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from . import quant as _quant
from .arrays import as_numpy
from .errors import (
    BufferError,
    LayoutError,
    QuantizationError,
    SeqLensRequiredError,
    UnsupportedError,
)
from .paged_derived import PagedDerived
from .paged_reads import PagedReads
from .paging import (
    INDEX_NAMES,
    MAX_ROW,
    ROLE_CODES,
    as_index,
    byte_view,
    check_fp8_scale,
    check_row,
    check_subbyte_pages,
    first_true,
    page_sequences,
    resolve_type,
    role_code,
)
from .wire.block_paged import U32_MAX
from .wire.buffers import handle
from .wire.descriptor import TensorDescriptor
from .wire.dtypes import ElementType, pack, unpack
from .wire.layouts import KV_ROLES, BlockPaged
from .wire.quantization import Quantization, storage_range

__all__ = ["MAX_ROW", "BlockPagedTensor", "byte_view"]


class BlockPagedTensor(PagedReads, PagedDerived):
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
        et = resolve_type(pool, element_type)
        num_pages, page_size, heads, dim = (int(x) for x in pool.shape)
        if page_size < 1:
            raise LayoutError.at("page_size", None, page_size, "page_size MUST be >= 1")
        if et.sub_byte:
            check_subbyte_pages(et, page_size * heads * dim)
            rows = np.frombuffer(pack(pool, et), np.uint8).reshape(
                num_pages, et.nbytes(page_size * heads * dim))
        else:
            rows = np.ascontiguousarray(pool, dtype=et.numpy).reshape(
                num_pages, page_size * heads * dim)
        self._setup(rows, et, page_size, heads, dim, as_index(block_table, "block_table"),
                    as_index(seq_ptr, "seq_ptr"), seq_lens, role_code(kv_role), layer_index,
                    index_type, None, ())
        self.fp8_scale = check_fp8_scale(et, fp8_scale)
        self.validate()

    @classmethod
    def from_rows(cls, pool_rows: np.ndarray, element_type: ElementType, page_size: int,
                  num_heads: int, head_dim: int, block_table: np.ndarray, seq_ptr: np.ndarray,
                  seq_lens: Any = None, *, kv_role: str | int = "key",
                  layer_index: int | None = None, index_type: str | None = None,
                  quantization: Quantization | None = None,
                  quant_params: tuple[np.ndarray, ...] = (), total_tokens: int | None = None,
                  fp8_scale: float | None = None) -> Self:
        """A tensor over pool rows as stored (``pool_rows``: one row per page, packed for
        sub-byte types), no copy and no check: the caller validates (``validate``,
        ``check_quant_params``) what it did not build itself."""
        out = cls.__new__(cls)
        out._setup(pool_rows, element_type, page_size, num_heads, head_dim, block_table,
                   seq_ptr, seq_lens, role_code(kv_role), layer_index, index_type,
                   quantization, quant_params, total_tokens)
        out.fp8_scale = fp8_scale
        return out

    def _setup(self, rows: np.ndarray, et: ElementType, page_size: int, heads: int, dim: int,
               block_table: np.ndarray, seq_ptr: np.ndarray, seq_lens: Any, role: int,
               layer_index: int | None, index_type: str | None, quantization: Quantization | None,
               params: tuple[np.ndarray, ...], total_tokens: int | None = None) -> None:
        self.pool_rows = rows
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
        if index_type not in INDEX_NAMES:
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
            lens = as_index(seq_lens, "seq_lens").astype(np.int64)
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
        pool, table, seq_ptr, lens, et = page_sequences(
            seqs, page_size, share_prefix=share_prefix, element_type=element_type,
            num_heads=num_heads, head_dim=head_dim)
        return cls(pool, table, seq_ptr, lens, kv_role=kv_role, layer_index=layer_index,
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
        check_row(ps, heads, dim, 1 if et.sub_byte else et.itemsize)
        if et.sub_byte:
            rows = np.frombuffer(views[0], np.uint8).reshape(
                layout.num_pages, et.nbytes(ps * heads * dim))
        else:
            rows = np.frombuffer(views[0], et.numpy).reshape(layout.num_pages, ps * heads * dim)
        idx = np.dtype("<u8" if layout.index_type == 1 else "<u4")
        bt = np.frombuffer(views[1], idx)
        sp = np.frombuffer(views[2], idx)
        params = tuple(np.frombuffer(v, np.uint8) for v in views[3:])
        self = cls.from_rows(rows, et, ps, heads, dim, bt, sp, kv_role=layout.kv_role,
                             layer_index=layout.layer_index,
                             index_type=layout.index_type_name,
                             quantization=desc.quantization, quant_params=params,
                             total_tokens=total)
        self._check_index_buffers()
        self.seq_lens = self._derive_seq_lens() if seq_lens is None else as_index(
            seq_lens, "seq_lens").astype(np.int64)
        self._check_seq_lens()
        self.check_quant_params()
        self.fp8_scale = check_fp8_scale(et, fp8_scale)
        return self

    # ------------------------------------------------------------------ geometry
    @property
    def num_pages(self) -> int:
        return int(self.pool_rows.shape[0])

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
            return unpack(self.pool_rows, self.element_type, math.prod(shape)).reshape(shape)
        return self.pool_rows.reshape(shape)

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

    def has_data(self) -> bool:
        """False when heads or head_dim is 0: every token is empty, and token counts (which
        then cost no bytes) must not size any index array."""
        return self.num_heads * self.head_dim > 0

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
                i = first_true(dec) + 1
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
                i = first_true(bt >= self.num_pages)
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
            s = first_true(over)
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

    def check_quant_params(self) -> None:
        """Row 31, the zero-point range and scales that decode within float32 (H74: the
        code farthest from its zero-point times the scale), on the parameter arrays
        themselves; a refusal names the member (``layers.L.role``).  A tensor from
        ``from_rows`` or ``derive`` with new parameters is checked here on its first
        dequantizing read."""
        q = self.quantization
        if q is None or not q.AFFINE:
            return
        try:
            self._check_params(q)
        except QuantizationError as e:
            if self.layer_index is None:
                raise
            raise QuantizationError(f"layers.{self.layer_index}.{self.kv_role}: {e}",
                                    field=e.field, offset=e.offset, value=e.value,
                                    rule=e.rule) from None
        self._params_checked = (q, self.quant_params)

    def _check_params(self, q: Any) -> None:
        scales, zps = _quant.params_arrays(q, self.quant_params, self.param_count())
        if q.buffers:  # per-tensor: row 31 and its zero-point are the decoder's
            bad = ~np.isfinite(scales) | (scales == 0)
            if bad.any():
                i = first_true(bad)
                raise QuantizationError.at(f"scales[{i}]", i, float(scales[i]),
                                           "every scale MUST be finite and non-zero",
                                           where="index")
            if zps is not None:
                lo, hi = storage_range(self.element_type.name)
                out = (zps < lo) | (zps > hi)
                if out.any():
                    i = first_true(out)
                    raise QuantizationError.at(f"zero_points[{i}]", i, int(zps[i]),
                                               f"zero-points MUST lie in [{lo}, {hi}]",
                                               where="index")
        _quant.check_decodable(scales, zps, self.element_type.name,
                               "scales" if q.buffers else "q.scale")

    def check_params_once(self) -> None:
        """``check_quant_params`` unless these parameters passed it already: what a
        dequantizing read runs first, so that no scale decodes to Inf unseen."""
        checked = getattr(self, "_params_checked", None)
        if checked is None or checked[0] is not self.quantization \
                or checked[1] is not self.quant_params:
            self.check_quant_params()

    def param_count(self) -> int:
        """Entries of each quantization parameter array: one per page slot
        (per-block-affine), else what the scheme needs for ``shape``."""
        q = self.quantization
        if q is not None and not q.per_slot:
            return q.param_count(self.shape)
        return self.num_pages * self.page_size

    def token_counts(self) -> np.ndarray:
        """``seq_lens``, or :class:`SeqLensRequiredError` where they are not known (D6)."""
        if self.seq_lens is None:
            raise SeqLensRequiredError(
                f"per-sequence token counts are not on the wire and cannot be derived: "
                f"{self.num_seqs} sequences share {self.total_tokens} tokens in "
                f"{len(self.block_table)} pages of {self.page_size}; supply seq_lens "
                "(decision D6)", field="seq_lens", rule="D6")
        return self.seq_lens

    # ------------------------------------------------------------------ copies
    def copy(self) -> BlockPagedTensor:
        return self.derive(self.pool_rows.copy(), params=tuple(p.copy() for p in self.quant_params))

    def derive(self, rows: np.ndarray, *, element_type: ElementType | None = None,
                block_table: np.ndarray | None = None, quantization: Any = "keep",
                params: tuple[np.ndarray, ...] | None = None,
                fp8_scale: Any = "keep") -> BlockPagedTensor:
        """A tensor over new pool rows (``pool_rows``' layout) with this tensor's
        sequences (tables copied); what is not given is kept."""
        return self.from_rows(
            rows, element_type or self.element_type, self.page_size, self.num_heads,
            self.head_dim, self.block_table.copy() if block_table is None else block_table,
            self.seq_ptr.copy(), None if self.seq_lens is None else self.seq_lens.copy(),
            kv_role=self.kv_role, layer_index=self.layer_index,
            index_type=self.index_type if block_table is None else None,
            quantization=self.quantization if quantization == "keep" else quantization,
            quant_params=self.quant_params if params is None else params,
            total_tokens=self._total_tokens,
            fp8_scale=self.fp8_scale if fp8_scale == "keep" else fp8_scale)

    # ------------------------------------------------------------------ wire
    def layout(self) -> BlockPaged:
        return BlockPaged(page_size=self.page_size, num_pages=self.num_pages,
                          num_seqs=self.num_seqs, kv_role=ROLE_CODES[self.kv_role],
                          layer_index=self.layer_index, index_type=INDEX_NAMES[self.index_type])

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
        return tuple(byte_view(a) for a in (self.pool_rows, self.block_table, self.seq_ptr,
                                             *self.quant_params))

    def equal(self, other: BlockPagedTensor) -> bool:
        """Same descriptor and the same bytes in every buffer."""
        return (self.descriptor() == other.descriptor()
                and all(a == b for a, b in zip(self.buffers(), other.buffers(), strict=True))
                and (self.seq_lens is None) == (other.seq_lens is None)
                and (self.seq_lens is None or np.array_equal(self.seq_lens, other.seq_lens)))

