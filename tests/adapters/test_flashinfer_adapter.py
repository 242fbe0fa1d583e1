"""The FlashInfer adapter against flashinfer-python 0.7.4, whose kernels need CUDA: the
caches and page tables are built exactly as its Python layer takes them and its own
shape transforms are replayed here (cited by file and line)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import hurraykv as hk
from hurraykv.adapters import flashinfer
from tests.support.snapshots import make_snapshot

NB, BS, H, D, L = 24, 4, 2, 16, 3
# decode.py, BatchDecodeWithPagedKVCacheWrapper.plan: kv_indptr [batch + 1], kv_indices,
# kv_last_page_len [batch] - the docstring example (decode.py:1380) asks
# 1 <= kv_last_page_len <= page_size; sequence 2 has no pages at all.
INDPTR = torch.tensor([0, 3, 5, 5, 6], dtype=torch.int32)
INDICES = torch.tensor([7, 2, 9, 7, 4, 11], dtype=torch.int32)
LAST = torch.tensor([2, 4, 0, 1], dtype=torch.int32)


def expand_5d(x: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """flashinfer/utils.py:103-118 (_expand_5d), as written there."""
    if x.ndim == 4:
        return x.unsqueeze(-3) if kv_layout == "NHD" else x.unsqueeze(-2)
    return x


def expand_4d(x: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """flashinfer/utils.py:121-136 (_expand_4d)."""
    if x.ndim == 3:
        return x.unsqueeze(-3) if kv_layout == "NHD" else x.unsqueeze(-2)
    return x


def caches(kv_layout: str, page_size: int = BS, dtype=torch.float16, seed: int = 6):
    g = torch.Generator().manual_seed(seed)
    shape = (NB, 2, page_size, H, D) if kv_layout == "NHD" else (NB, 2, H, page_size, D)
    return [torch.randn(*shape, generator=g).to(dtype) for _ in range(L)]


def tokens(cache: torch.Tensor, kv_layout: str, seq: int, role: int) -> torch.Tensor:
    """Sequence ``seq``'s tokens [n, H, D] read the way the kernels address them."""
    k = cache[:, role] if kv_layout == "NHD" else cache[:, role].permute(0, 2, 1, 3)
    pages = INDICES[INDPTR[seq]:INDPTR[seq + 1]].long()
    n = (len(pages) - 1) * k.shape[1] + int(LAST[seq]) if len(pages) else 0
    return k[pages].reshape(-1, H, k.shape[-1])[:n]


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_single_tensor_and_pair_forms_round_trip(kv_layout):
    cs = caches(kv_layout)
    snap = flashinfer.from_flashinfer(cs, INDPTR, INDICES, LAST, kv_layout=kv_layout)
    assert snap.seq_lens.tolist() == [10, 8, 0, 1]
    for s in range(4):
        got = snap.layer(1)[1].gather(s)
        assert np.array_equal(got, tokens(cs[1], kv_layout, s, 1).numpy())
    back = flashinfer.to_flashinfer(snap, kv_layout=kv_layout)
    assert all(torch.equal(a, b) for a, b in zip(cs, back.paged_kv_caches, strict=True))
    assert torch.equal(back.kv_indptr, INDPTR) and torch.equal(back.kv_indices, INDICES)
    assert torch.equal(back.kv_last_page_len, LAST)
    assert back.k_scales is None and back.v_scales is None
    # utils.py:217-222: a tuple (k_cache, v_cache) of 4-D tensors
    pairs = [(c[:, 0].contiguous(), c[:, 1].contiguous()) for c in cs]
    assert flashinfer.from_flashinfer(pairs, INDPTR, INDICES, LAST,
                                      kv_layout=kv_layout).equal(snap)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_page_size_one_lets_the_page_axis_out(kv_layout):
    """utils.py:106-115 and 124-133: with page_size 1 a single 4-D tensor (num_pages, 2,
    num_heads, head_dim) and a pair of 3-D tensors are expanded by one axis."""
    g = torch.Generator().manual_seed(9)
    four = [torch.randn(NB, 2, H, D, generator=g).bfloat16() for _ in range(L)]
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32)
    indices = torch.tensor([5, 1, 8, 2, 3], dtype=torch.int32)
    last = torch.tensor([1, 1], dtype=torch.int32)
    snap = flashinfer.from_flashinfer(four, indptr, indices, last, kv_layout=kv_layout)
    five = [expand_5d(c, kv_layout) for c in four]
    assert snap.equal(flashinfer.from_flashinfer(five, indptr, indices, last,
                                                 kv_layout=kv_layout))
    assert snap.seq_lens.tolist() == [3, 2] and snap.page_size == 1
    three = [(c[:, 0], c[:, 1]) for c in four]
    assert snap.equal(flashinfer.from_flashinfer(three, indptr, indices, last,
                                                 kv_layout=kv_layout))
    pairs4 = [tuple(expand_4d(x, kv_layout) for x in p) for p in three]
    assert snap.equal(flashinfer.from_flashinfer(pairs4, indptr, indices, last,
                                                 kv_layout=kv_layout))
    assert np.array_equal(snap.layer(0)[0].gather(0).view(np.uint16),
                          four[0][[5, 1, 8], 0].view(torch.int16).numpy().view(np.uint16))


@pytest.mark.parametrize("stored", ["float8", "uint8"])
def test_fp8_caches_keep_their_per_layer_scales(stored):
    """k_scale / v_scale are run-time arguments (decode.py:1263-1264 folds k_scale into
    sm_scale, 1342-1347 multiplies the output by v_scale): the real key is stored x k_scale."""
    real = caches("NHD", dtype=torch.float32, seed=11)
    ks, vs = [0.5, 2.0, 0.25], [1.5, 0.75, 4.0]
    fp8 = [torch.stack([c[:, 0] / k, c[:, 1] / v], dim=1).to(torch.float8_e4m3fn)
           for c, k, v in zip(real, ks, vs, strict=True)]
    given = fp8 if stored == "float8" else [c.view(torch.uint8) for c in fp8]
    kw = {} if stored == "float8" else {"kv_cache_dtype": "fp8_e4m3"}
    snap = flashinfer.from_flashinfer(given, INDPTR, INDICES, LAST, k_scales=ks, v_scales=vs,
                                      **kw)
    assert snap.dtype == "float8_e4m3"
    assert snap.kv_scales.tolist() == [[k, v] for k, v in zip(ks, vs, strict=True)]
    got = snap.layer(2)[0].gather(0, dequantize=True).astype(np.float32)
    want = (fp8[2][:, 0].float() * ks[2])[[7, 2, 9]].reshape(-1, H, D)[:10].numpy()
    assert np.array_equal(got, want)
    back = flashinfer.to_flashinfer(snap)
    assert back.k_scales == ks and back.v_scales == vs
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(back.paged_kv_caches, fp8, strict=True))
    if stored == "uint8":
        with pytest.raises(hk.LayoutError, match="a uint8 cache is fp8"):
            flashinfer.from_flashinfer(given, INDPTR, INDICES, LAST)


def test_last_page_len_zero_only_for_a_sequence_without_pages():
    cs = caches("NHD")
    with pytest.raises(hk.LayoutError,
                       match=r"kv_last_page_len\[1\].*found 0 .*1\.\.4 tokens") as e:
        flashinfer.from_flashinfer(cs, INDPTR, INDICES, torch.tensor([2, 0, 0, 1]))
    assert e.value.offset == 1
    with pytest.raises(hk.LayoutError,
                       match=r"kv_last_page_len\[2\].*found 3 .*0 for a sequence with no pages"):
        flashinfer.from_flashinfer(cs, INDPTR, INDICES, torch.tensor([2, 4, 3, 1]))
    with pytest.raises(hk.LayoutError, match=r"kv_last_page_len\[1\].*found 5 "):
        flashinfer.from_flashinfer(cs, INDPTR, INDICES, torch.tensor([2, 5, 0, 1]))
    # on the way back an empty sequence gets 0, the one value its missing page allows
    snap = flashinfer.from_flashinfer(cs, INDPTR, INDICES, LAST)
    assert flashinfer.to_flashinfer(snap).kv_last_page_len.tolist() == [2, 4, 0, 1]


def test_different_key_and_value_head_sizes_travel_as_pairs():
    snap = make_snapshot("bfloat16", dim=16, dim_v=8)
    back = flashinfer.to_flashinfer(snap, kv_layout="HND")
    k, v = back.paged_kv_caches[0]
    assert k.shape[-1] == 16 and v.shape[-1] == 8 and k.shape[2] == snap.page_size
    again = flashinfer.from_flashinfer(back.paged_kv_caches, back.kv_indptr,
                                       back.kv_indices, back.kv_last_page_len, kv_layout="HND")
    for a, b in zip(again.tensors(), snap.tensors(), strict=True):
        for s in range(snap.num_seqs):
            assert np.array_equal(a.gather(s), b.gather(s))
    with pytest.raises(hk.LayoutError, match="paired=True"):
        flashinfer.to_flashinfer(snap, paired=False)


@pytest.mark.parametrize(("cache", "why"), [
    (torch.zeros(NB, 3, BS, H, D), r"\(num_pages, 2, \.\.\.\) 5-D \(NHD\)"),
    (torch.zeros(NB, BS, H, D), "4-D with page_size 1"),
    ((torch.zeros(NB, BS, H, D), torch.zeros(NB, H, D)), "pair of 4-D tensors"),
    (np.zeros((NB, 2, BS, H, D), np.float16), "torch tensors"),
])
def test_shapes_that_are_not_flashinfer_caches_are_named(cache, why):
    with pytest.raises(hk.LayoutError, match=why):
        flashinfer.from_flashinfer([cache], INDPTR, INDICES, LAST)


def test_mla_snapshots_are_refused():
    from tests.support.snapshots import make_fused

    with pytest.raises(hk.UnsupportedError, match=r"fused.*not supported"):
        flashinfer.to_flashinfer(make_fused())


def test_contiguous_pools_are_shared_not_copied_on_the_way_in():
    cs = caches("NHD", dtype=torch.bfloat16)
    pairs = [(c[:, 0].contiguous(), c[:, 1].contiguous()) for c in cs]
    snap = flashinfer.from_flashinfer(pairs, INDPTR, INDICES, LAST)
    pool = snap.tensor(0, "key").page_pool
    assert pool.dtype == ml_dtypes.bfloat16
    assert np.shares_memory(pool.view(np.uint16), pairs[0][0].view(torch.int16).numpy())
    back = flashinfer.to_flashinfer(snap, paired=True)  # and views of the snapshot back
    assert np.shares_memory(back.paged_kv_caches[0][0].view(torch.int16).numpy(),
                            pool.view(np.uint16))
