"""The SGLang adapter against sglang 0.5.23, which needs CUDA: pools, request rows and
slots are built here exactly as its allocators and ``set_kv_buffer`` build them (files
under ``python/sglang/srt/mem_cache/``, cited by line)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import hurraykv as hk
from hurraykv.adapters import sglang
from tests.support.snapshots import same_tokens

LAYERS, HEADS, HEAD_DIM, V_HEAD_DIM = 2, 2, 16, 8


class Pools:
    """ReqToTokenPool + a page allocator + MHATokenToKVPool, as upstream sets them up."""

    def __init__(self, size: int, page_size: int, *, hnd: bool = False,
                 dtype: torch.dtype = torch.bfloat16, v_head_dim: int = V_HEAD_DIM,
                 requests: int = 6, context: int = 64) -> None:
        self.page_size, self.hnd, self.dtype = page_size, hnd, dtype
        # memory_pool.py:402-409: [size + 1, max_context_len] int32, free rows from 1
        self.req_to_token = torch.zeros((requests + 1, context), dtype=torch.int32)
        self.free_rows = list(range(1, requests + 1))
        # allocator/paged.py:395-399 (token.py:42-45 for page_size 1): free pages from 1
        self.num_pages = size // page_size
        self.free_pages = list(range(1, self.num_pages + 1))
        # memory_pool.py:2029-2033: fp8 pools store uint8
        store = torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
        # memory_pool.py:2567-2578 (_kv_buffer_shapes): NHD rows = size + page_size,
        # HND [num_pages, head_num, page_size, head_dim] with num_pages = (size +
        # page_size) // page_size (line 2265)
        pages_total = (size + page_size) // page_size
        shapes = [(pages_total, HEADS, page_size, d) if hnd else (size + page_size, HEADS, d)
                  for d in (HEAD_DIM, v_head_dim)]
        self.k_buffer = [torch.zeros(shapes[0], dtype=store) for _ in range(LAYERS)]
        self.v_buffer = [torch.zeros(shapes[1], dtype=store) for _ in range(LAYERS)]
        self.written: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def alloc_request(self, n: int, g: torch.Generator, k_scale: float | None = None,
                      v_scale: float | None = None) -> int:
        # memory_pool.py:447-448: rows are taken from the end of free_slots
        row = self.free_rows.pop()
        pages = [self.free_pages.pop(0) for _ in range(-(-n // self.page_size))]
        loc = torch.tensor([pages[t // self.page_size] * self.page_size + t % self.page_size
                            for t in range(n)])
        self.req_to_token[row, :n] = loc.int()
        self.written[row] = []
        for layer in range(LAYERS):
            k = torch.randn(n, HEADS, HEAD_DIM, generator=g)
            v = torch.randn(n, HEADS, self.v_buffer[0].shape[-1], generator=g)
            self.written[row].append((k.clone(), v.clone()))
            self.set_kv_buffer(layer, loc, k, v, k_scale, v_scale)
        return row

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale, v_scale) -> None:
        """memory_pool.py:2926-2984 (MHATokenToKVPool.set_kv_buffer)."""
        if cache_k.dtype != self.dtype:
            if k_scale is not None:
                cache_k.div_(k_scale)
            if v_scale is not None:
                cache_v.div_(v_scale)
            cache_k, cache_v = cache_k.to(self.dtype), cache_v.to(self.dtype)
        if self.k_buffer[0].dtype != self.dtype:
            cache_k, cache_v = cache_k.view(torch.uint8), cache_v.view(torch.uint8)
        if self.hnd:
            pages, offs = loc // self.page_size, loc % self.page_size
            self.k_buffer[layer][pages, :, offs, :] = cache_k
            self.v_buffer[layer][pages, :, offs, :] = cache_v
        else:
            self.k_buffer[layer][loc] = cache_k
            self.v_buffer[layer][loc] = cache_v


def filled(page_size: int, hnd: bool = False, k_scale: float | None = None,
           v_scale: float | None = None, **kw) -> tuple[Pools, list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    pools = Pools(64, page_size, hnd=hnd, **kw)
    lens = [7, 5, 9]
    rows = [pools.alloc_request(n, g, k_scale, v_scale) for n in lens]
    return pools, rows, torch.tensor(lens)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_requests_read_back_what_set_kv_buffer_wrote(page_size, layout):
    pools, rows, lens = filled(page_size, hnd=layout == "HND")
    assert 0 not in rows  # row 0 is the padding row
    snap = sglang.from_sglang(pools.k_buffer, pools.v_buffer, pools.req_to_token, lens,
                              torch.tensor(rows), page_size=page_size, layout=layout)
    assert (snap.head_dim, snap.head_dim_v) == (HEAD_DIM, V_HEAD_DIM)
    for s, row in enumerate(rows):
        for layer in range(LAYERS):
            k, v = snap.layer(layer)
            want_k, want_v = pools.written[row][layer]
            assert np.array_equal(k.gather(s).astype(np.float32),
                                  want_k.bfloat16().float().numpy())
            assert np.array_equal(v.gather(s).astype(np.float32),
                                  want_v.bfloat16().float().numpy())
    out = sglang.to_sglang(snap, layout=layout)
    assert out.req_pool_indices.tolist() == [1, 2, 3]
    assert not out.req_to_token[0].any()  # the padding row stays free
    first_page = (out.k_buffers[0][0] if layout == "HND"
                  else out.k_buffers[0][:page_size])
    assert not first_page.float().any()  # page 0, the padding sink, stays free
    assert not (out.req_to_token[1:] // page_size == 0)[
        torch.arange(out.req_to_token.shape[1])[None] < out.seq_lens[:, None]].any()
    again = sglang.from_sglang(out.k_buffers, out.v_buffers, out.req_to_token, out.seq_lens,
                               out.req_pool_indices, page_size=page_size, layout=layout)
    assert same_tokens(again, snap)


def test_row_zero_and_missing_rows_are_refused():
    pools, rows, lens = filled(4)
    with pytest.raises(hk.LayoutError, match=r"req_pool_indices\[1\].*found 0 .*padding row") as e:
        sglang.from_sglang(pools.k_buffer, pools.v_buffer, pools.req_to_token, lens,
                           torch.tensor([rows[0], 0, rows[2]]), page_size=4)
    assert e.value.offset == 1
    with pytest.raises(hk.LayoutError, match=r"req_pool_indices.*padding row"):
        sglang.from_sglang(pools.k_buffer, pools.v_buffer, pools.req_to_token, lens, None,
                           page_size=4)


def test_a_slot_in_the_padding_page_is_refused():
    pools, rows, lens = filled(1)
    pools.req_to_token[rows[1], 2] = 0  # slot 0: where dummy padded tokens write
    with pytest.raises(hk.LayoutError, match=rf"req_to_token\[{rows[1]}, 2\].*padding sink"):
        sglang.from_sglang(pools.k_buffer, pools.v_buffer, pools.req_to_token, lens,
                           torch.tensor(rows), page_size=1)


def test_slots_that_do_not_follow_pages_are_refused():
    pools, rows, lens = filled(4)
    pools.req_to_token[rows[0], 2] += 1  # within-page offsets out of order
    with pytest.raises(hk.LayoutError, match=rf"req_to_token\[{rows[0]}, 2\].*page_size 4"):
        sglang.from_sglang(pools.k_buffer, pools.v_buffer, pools.req_to_token, lens,
                           torch.tensor(rows), page_size=4)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pools_are_read_with_their_scales(dtype):
    kv_cache_dtype = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}[dtype]
    pools, rows, lens = filled(4, dtype=dtype, k_scale=0.5, v_scale=2.0)
    ks, vs = [0.5] * LAYERS, [2.0] * LAYERS
    assert pools.k_buffer[0].dtype == torch.uint8
    with pytest.raises(hk.LayoutError, match="uint8 cache is fp8"):
        sglang.from_sglang(pools.k_buffer, pools.v_buffer, pools.req_to_token, lens,
                           torch.tensor(rows), page_size=4)
    snap = sglang.from_sglang(pools.k_buffer, pools.v_buffer, pools.req_to_token, lens,
                              torch.tensor(rows), page_size=4, kv_cache_dtype=kv_cache_dtype,
                              k_scales=ks, v_scales=vs)
    assert snap.kv_scales.tolist() == [[0.5, 2.0]] * LAYERS
    want = (pools.written[rows[2]][1][0] / 0.5).to(dtype).float() * 0.5
    got = snap.layer(1)[0].gather(2, dequantize=True).astype(np.float32)
    assert np.array_equal(got, want.numpy())
    out = sglang.to_sglang(snap)
    assert out.k_buffers[0].dtype == torch.uint8 and out.k_scales == ks
    assert out.v_scales == vs


def test_pool_objects_name_their_layout_and_dtype():
    """from_sglang_pool reads what a live pool records (memory_pool.py: page_size, dtype,
    use_hnd at line 2250, k_buffer / v_buffer; MLATokenToKVPool.kv_buffer at 4864-4871)."""
    pools, rows, lens = filled(4, hnd=True)
    pool = SimpleNamespace(k_buffer=pools.k_buffer, v_buffer=pools.v_buffer, page_size=4,
                           dtype=torch.bfloat16, use_hnd=True, kv_cache_layout="hnd")
    snap = sglang.from_sglang_pool(pool, pools.req_to_token, lens, torch.tensor(rows))
    assert snap.equal(sglang.from_sglang(pools.k_buffer, pools.v_buffer, pools.req_to_token,
                                         lens, torch.tensor(rows), page_size=4, layout="HND"))


@pytest.mark.parametrize(("name", "attrs", "why"), [
    ("MHATokenToKVPoolFP4", {}, "FP4.*not supported"),
    ("MHATokenToKVPoolMXFP8", {}, "MXFP8.*not supported"),
    ("UnifiedMHATokenToKVPool", {}, "virtual slot ids.*not supported"),
    ("MHATokenToKVPool", {"kv_cache_layout": "vectorized_5d"}, "vectorized_5d"),
    ("MHATokenToKVPool", {"dtype": torch.float8_e4m3fnuz}, "e4m3fnuz"),
])
def test_pools_hurraykv_cannot_read_are_refused_by_name(name, attrs, why):
    pool = type(name, (), {"page_size": 4, "dtype": torch.bfloat16, **attrs})()
    with pytest.raises(hk.UnsupportedError, match=why):
        sglang.from_sglang_pool(pool, torch.zeros(2, 4, dtype=torch.int32), [1], [1])


def test_mla_latent_pool_is_one_fused_member_per_layer():
    """MLATokenToKVPool._create_buffers (memory_pool.py:4864-4871): one kv_buffer
    [size + page_size, 1, kv_lora_rank + qk_rope_head_dim] per layer."""
    g = torch.Generator().manual_seed(5)
    size, ps, dim = 32, 4, 512 + 64
    kv = [torch.zeros(size + ps, 1, dim, dtype=torch.bfloat16) for _ in range(LAYERS)]
    table = torch.zeros(3, 16, dtype=torch.int32)
    loc = torch.tensor([4 * 3 + t % 4 if t < 4 else 4 * 1 + t % 4 for t in range(6)])
    table[1, :6] = loc.int()
    for layer in range(LAYERS):
        kv[layer][loc] = torch.randn(6, 1, dim, generator=g).bfloat16()
    snap = sglang.from_sglang(kv, None, table, [6], [1], page_size=ps)
    assert snap.fused and snap.head_dim == dim
    assert np.array_equal(snap.layer(1)[0].gather(0).view(np.uint16),
                          kv[1][loc].view(torch.int16).numpy().view(np.uint16))
    out = sglang.to_sglang(snap)
    assert out.v_buffers is None and out.k_buffers[0].shape[1:] == (1, dim)
    assert same_tokens(sglang.from_sglang(out.k_buffers, None, out.req_to_token,
                                          out.seq_lens, out.req_pool_indices, page_size=ps),
                       snap)
    with pytest.raises(hk.LayoutError, match="MLA pool buffer"):
        sglang.from_sglang([torch.zeros(size + ps, 2, dim)], None, table, [6], [1],
                           page_size=ps)


@pytest.mark.parametrize(("bufs", "layout", "why"), [
    ([torch.zeros(17, 2, 4, 16)], "NHD", "pass layout='HND'"),
    ([torch.zeros(66, 2, 16)], "NHD", "multiple of page_size 4"),
    ([torch.zeros(17, 2, 3, 16)], "HND", "page_size=4"),
    ([torch.zeros(68, 2, 16)], "vectorized_5d", "vectorized_5d is not supported"),
])
def test_buffer_shapes_are_checked_against_the_layout(bufs, layout, why):
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[1, :4] = torch.arange(4, 8)
    with pytest.raises(hk.LayoutError, match=why):
        sglang.from_sglang(bufs, bufs, table, [4], [1], page_size=4, layout=layout)
