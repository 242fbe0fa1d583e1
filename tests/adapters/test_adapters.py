"""Engine adapters on real torch tensors: bitwise round trips, zero-copy, layouts; torch
tensors where NumPy arrays go."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import hurraykv as hk
from hurraykv.adapters import transformers as tf_adapter
from hurraykv.adapters import vllm
from hurraykv.adapters._common import checked_int32

NB, BS, H, D, L = 24, 4, 2, 16, 3


def vllm_tables(seed: int):
    """Random padded block tables: three sequences share two prefix blocks; ragged tails."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(NB))
    prefix = [free.pop(), free.pop()]
    lens = [9, 11, 3, 6]
    rows = []
    for i, n in enumerate(lens):
        pages = -(-n // BS)
        own = prefix[: min(2, pages)] if i < 3 else []
        rows.append(own + [free.pop() for _ in range(pages - len(own))])
    width = max(len(r) for r in rows)
    table = torch.zeros((len(lens), width), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return table, torch.tensor(lens, dtype=torch.int32)


LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLNHC": (1, 0, 3, 2, 4)}


def random_caches(dtype=torch.float16, seed: int = 0, layout: str = "LBHNC", content=2 * D):
    """Per-layer [num_blocks, H, block_size, C] views of one backing buffer whose physical
    order is ``layout`` (the engine's allocation, see engine_tests for vLLM's own)."""
    g = torch.Generator().manual_seed(seed)
    order = LAYOUTS[layout]
    logical = (L, NB, H, BS, content)
    shape = [logical[i] for i in order]
    if dtype == torch.uint8:
        raw = torch.randint(0, 120, shape, generator=g, dtype=torch.uint8)
    else:
        raw = torch.randn(*shape, generator=g).to(dtype)
    five = raw.permute(*np.argsort(order).tolist())
    return [five[i] for i in range(L)]


def same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_vllm_split_round_trip_bitwise(layout, dtype):
    caches = random_caches(dtype, seed=1, layout=layout)
    table, lens = vllm_tables(2)
    snap = vllm.from_vllm(caches, table, lens, backend="FLASH_ATTN")
    assert snap.num_layers == L and snap.page_size == BS and snap.num_kv_heads == H
    assert len(snap.tensor(0, "key").shared_pages) == 2  # the shared prefix blocks
    assert snap.tensor(0, "key").num_pages == len(np.unique(table[table > 0]))
    back, table2, lens2 = vllm.to_vllm(snap, backend="FLASH_ATTN", layout=layout)
    assert torch.equal(lens2, lens)
    for a, b in zip(caches, back, strict=True):
        for s in range(len(lens)):
            n = -(-int(lens[s]) // BS)
            assert same(a[table[s, :n].long()], b[table2[s, :n].long()])
    # token 5 of sequence 0: block 1, slot 1, key = the first D of the content axis
    block = int(table[0, 1])
    expected = caches[1][block, :, 1, :D].float().numpy()
    np.testing.assert_array_equal(snap.layer(1)[0].gather(0)[5].astype(np.float32), expected)


def test_vllm_cpu_attn_keys_are_transposed_in_each_page():
    caches = random_caches(torch.float32, seed=3)
    table, lens = vllm_tables(3)
    snap = vllm.from_vllm(caches, table, lens, backend="CPU_ATTN", isa="vec")
    page = caches[0][int(table[0, 1])].reshape(H, 2 * BS * D)  # each head's page, flat
    key_t = page[:, :BS * D].reshape(H, D, BS)  # the first half holds K as [D, block_size]
    value = page[:, BS * D:].reshape(H, BS, D)  # the second half V as [block_size, D]
    got_k, got_v = (t.gather(0)[BS + 2] for t in snap.layer(0))  # token 6: block 1, slot 2
    np.testing.assert_array_equal(got_k, key_t[:, :, 2].numpy())
    np.testing.assert_array_equal(got_v, value[:, 2, :].numpy())
    back, table2, _ = vllm.to_vllm(snap, backend="CPU_ATTN")
    assert same(back[0][table2[0, 1].long()], caches[0][int(table[0, 1])])


@pytest.mark.parametrize(("kind", "dtype"), [("cpu", torch.float32), ("cpu", torch.bfloat16),
                                             ("split", torch.float16), ("mla", torch.uint8)])
@pytest.mark.parametrize("ids", [[5], [4, 5, 6, 7], [3, 5, 4, 6], [9, 8, 7], [2, 3, 7, 8, 1],
                                 list(range(1, 140, 2))])
def test_vllm_layer_view_reads_the_blocks_pages_bit_for_bit(kind, dtype, ids):
    """``LayerView.read``'s copies per run of consecutive blocks (and its one run found
    without a pass over the ids) give every block's pages in the order asked, whatever
    the element type and whatever the order (a span as long as a run's, but not one:
    [3, 5, 4, 6]), as a plain gather of the views does; more than ``MAX_RUNS`` runs too."""
    raw = torch.randint(0, 250, (160, 1 if kind == "mla" else 2, 16, 16), dtype=torch.uint8)
    cache = raw if dtype == torch.uint8 else raw.to(dtype) / 7
    view = vllm.LayerView(cache, kind, kv_cache_dtype="fp8" if dtype == torch.uint8
                          else "auto")
    got = view.read(ids)
    want = [p[torch.as_tensor(ids)] for p in view.parts]
    assert [g.dtype for g in got] == [w.dtype for w in want]
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous()
        assert torch.equal(g.view(torch.uint8), w.contiguous().view(torch.uint8))



@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_vllm_fp8_cache_keeps_its_scales(kv_cache_dtype):
    caches = random_caches(torch.uint8)  # vLLM holds fp8 caches as uint8
    table, lens = vllm_tables(4)
    k_scales = [0.5, 0.25, 2.0]
    v_scales = [torch.tensor(1.5), torch.tensor(3.0), torch.tensor(0.125)]
    snap = vllm.from_vllm(caches, table, lens, backend="CPU_ATTN", isa="vec",
                          k_scales=k_scales, v_scales=v_scales, kv_cache_dtype=kv_cache_dtype)
    assert snap.dtype == ("float8_e4m3" if kv_cache_dtype == "fp8" else "float8_e5m2")
    np.testing.assert_array_equal(snap.kv_scales, [[0.5, 1.5], [0.25, 3.0], [2.0, 0.125]])
    back, table2, _ = vllm.to_vllm(snap, backend="CPU_ATTN")
    assert back[0].dtype == torch.uint8
    assert same(back[2][table2[1, 0].long()], caches[2][int(table[1, 0])])
    raw = snap.layer(2)[0].gather(0).astype(np.float32)
    np.testing.assert_array_equal(snap.layer(2)[0].gather(0, dequantize=True), raw * 2.0)


def test_vllm_layer_order_comes_from_the_names():
    caches = random_caches(seed=6)
    names = {f"model.layers.{i}.self_attn.attn": c for i, c in zip((2, 0, 1), caches,
                                                                    strict=True)}
    table, lens = vllm_tables(6)
    snap = vllm.from_vllm(names, table, lens, backend="FLASH_ATTN")
    direct = vllm.from_vllm([caches[1], caches[2], caches[0]], table, lens,
                            backend="FLASH_ATTN")
    assert snap.equal(direct)


def test_vllm_load_into_running_caches_in_place():
    caches = random_caches(seed=7)
    table, lens = vllm_tables(7)
    snap = vllm.from_vllm(caches, table, lens, backend="FLASH_ATTN")
    target = random_caches(seed=8)
    storage = [c.untyped_storage().data_ptr() for c in target]
    free = iter([5, 20, 21, 17, 18, 19, 1, 0, 22, 23, 12])
    blocks = [[next(free) for _ in range(-(-int(n) // BS))] for n in lens.tolist()]
    written = vllm.load_into_vllm(snap, target, blocks, backend="FLASH_ATTN")
    assert written == sum(len(b) for b in blocks)
    assert [c.untyped_storage().data_ptr() for c in target] == storage  # no reallocation
    for a, b in zip(caches, target, strict=True):
        assert same(b[blocks[0]], a[table[0, :3].long()])
    blocks[1][0] = NB  # one past the last block: refused before anything is written
    before = [c.clone() for c in target]
    with pytest.raises(hk.LayoutError, match=rf"block_ids\[3\].*found {NB} .*0\.\.{NB - 1}"):
        vllm.load_into_vllm(snap, target, blocks, backend="FLASH_ATTN")
    assert all(torch.equal(a, b) for a, b in zip(before, target, strict=True))


def test_vllm_rejects_what_does_not_fit():
    caches = random_caches()
    table, lens = vllm_tables(5)
    with pytest.raises(hk.UnsupportedError, match="XFORMERS"):
        vllm.from_vllm(caches, table, lens, backend="XFORMERS")
    with pytest.raises(hk.LayoutError, match="needs 9 blocks"):
        vllm.from_vllm(caches, table, torch.tensor([33, 4, 1, 2]), backend="FLASH_ATTN")
    with pytest.raises(hk.LayoutError, match="4-D logical view"):
        vllm.from_vllm([torch.zeros(2, NB, BS, H, D)], table, lens, backend="FLASH_ATTN")
    with pytest.raises(hk.LayoutError, match="uint8 cache is fp8"):
        vllm.from_vllm(random_caches(torch.uint8), table, lens, backend="FLASH_ATTN")
    with pytest.raises(hk.UnsupportedError, match=r"int8_per_token_head.*not supported"):
        vllm.from_vllm(caches, table, lens, backend="TRITON_ATTN",
                       kv_cache_dtype="int8_per_token_head")
    q = vllm.from_vllm(caches, table, lens, backend="FLASH_ATTN")
    q = hk.KVCacheSnapshot.from_tensors([t.quantize("per_block_affine", "int8")
                                         for t in q.tensors()])
    with pytest.raises(hk.HurrayError, match="dequantize"):
        vllm.to_vllm(q, backend="FLASH_ATTN")


def test_int32_overflow_is_a_clear_error():
    with pytest.raises(hk.HurrayError, match=r"kv_indices\[1\] = 4294967296 does not fit int32"):
        checked_int32(np.array([1, 1 << 32]), "kv_indices")


def tiny_llama_cache():
    from hurraykv.demo import build_model, prefill, prompts

    model = build_model()
    ids, mask = prompts()
    _, cache = prefill(model, ids, mask)
    return cache, mask


def test_transformers_dynamic_cache_round_trip():
    cache, mask = tiny_llama_cache()
    snap = tf_adapter.from_dynamic_cache(cache, mask, page_size=16)
    assert snap.seq_lens.tolist() == mask.sum(-1).tolist()
    cache2, mask2 = tf_adapter.to_dynamic_cache(snap)
    assert torch.equal(mask2, mask)
    valid = mask.bool()
    for (k1, v1), layer in zip(((layer.keys, layer.values) for layer in cache.layers),
                               cache2.layers, strict=True):
        for a, b in ((k1, layer.keys), (v1, layer.values)):
            assert torch.equal(a.permute(0, 2, 1, 3)[valid], b.permute(0, 2, 1, 3)[valid])
            assert not b.permute(0, 2, 1, 3)[~valid].any()  # padding is zero


def test_transformers_shared_prompt_pages_are_stored_once():
    """Identical leading keys/values (a shared system prompt) become shared pages.  (A
    model's own batch need not reproduce them bitwise across padding offsets, so the
    cache is built here with a known prefix.)"""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(12)
    prefix = torch.randn(2, 32, 8, generator=g)  # [heads, 32 tokens, dim]: two pages of 16
    lens, width = [45, 40, 33], 45
    cache = DynamicCache()
    mask = torch.zeros((3, width), dtype=torch.long)
    for i in range(2):
        k = torch.zeros(3, 2, width, 8)
        for b, n in enumerate(lens):
            k[b, :, width - n:] = torch.cat([prefix, torch.randn(2, n - 32, 8, generator=g)],
                                            dim=1)
            mask[b, width - n:] = 1
        cache.update(k, k * 2, i)
    snap = tf_adapter.from_dynamic_cache(cache, mask, page_size=16)
    for t in snap.tensors():
        firsts = t.block_table[t.seq_ptr[:-1].astype(np.int64)[:, None] + np.arange(2)]
        assert (firsts == firsts[0]).all() and set(firsts[0]) == set(t.shared_pages)
    cache2, mask2 = tf_adapter.to_dynamic_cache(snap)
    assert torch.equal(mask2, mask)
    assert torch.equal(cache2.layers[1].keys * mask[:, None, :, None],
                       cache.layers[1].keys * mask[:, None, :, None])


def test_end_to_end_demo_is_bitwise_identical(capsys):
    from hurraykv import demo

    assert demo.main() == 0
    out = capsys.readouterr().out
    assert out.count("bitwise identical") == 2 and "demo OK" in out


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="GPU-only: needs a CUDA device (none on CI)")


@needs_cuda
def test_vllm_cuda_caches_round_trip_through_the_host():
    caches = [c.cuda() for c in random_caches(seed=9)]
    table, lens = vllm_tables(9)
    snap = vllm.from_vllm(caches, table.cuda(), lens.cuda(), backend="FLASH_ATTN")
    back, table2, lens2 = vllm.to_vllm(snap, backend="FLASH_ATTN", device="cuda")
    assert all(b.is_cuda for b in back) and torch.equal(lens2.cpu(), lens)
    for a, b in zip(caches, back, strict=True):
        assert same(a[table[0, :3].long().cuda()], b[table2[0, :3].long()])


def test_lazy_members_stay_with_the_engine_until_written(tmp_path):
    """The mechanism that keeps GPU caches on the GPU, exercised with CPU tensors."""
    caches = random_caches(seed=10)
    table, lens = vllm_tables(10)
    snap = vllm.from_vllm(caches, table, lens, backend="FLASH_ATTN", lazy=True)
    buffers = [snap._members[k][1]() for k in snap.member_keys()]
    assert not any(b.copied for b in buffers)  # validated, described, nothing copied yet
    assert snap.descriptor(1, "value").buffers[0].device_tag == 0
    hk.save_snapshot(snap, tmp_path / "lazy.hrry")  # writing is when the pools are copied
    assert all(b.copied for b in buffers)
    eager = vllm.from_vllm(caches, table, lens, backend="FLASH_ATTN")
    assert hk.load_snapshot(tmp_path / "lazy.hrry").equal(eager)


@needs_cuda
def test_cuda_caches_record_their_device_and_copy_only_when_written(tmp_path):
    caches = [c.cuda() for c in random_caches(seed=11)]
    table, lens = vllm_tables(11)
    snap = vllm.from_vllm(caches, table.cuda(), lens.cuda(), backend="FLASH_ATTN")
    assert snap.descriptor(0, "key").buffers[0].device_tag == 1  # CUDA
    buffers = [snap._members[k][1]() for k in snap.member_keys()]
    assert not any(b.copied for b in buffers)
    hk.save_snapshot(snap, tmp_path / "gpu.hrry")
    assert all(b.copied for b in buffers)
    loaded = hk.load_snapshot(tmp_path / "gpu.hrry")
    assert loaded.descriptor(0, "key").buffers[0].device_tag == 0  # the file holds host bytes
    assert loaded.equal(vllm.from_vllm([c.cpu() for c in caches], table, lens,
                                       backend="FLASH_ATTN"))


# ---- torch tensors where NumPy arrays go (BlockPagedTensor, from_arrays) ---------------
def test_torch_tensors_bfloat16_included_are_accepted():
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(6, 4, 2, 8, generator=g).bfloat16()
    t = hk.BlockPagedTensor(pool, torch.tensor([3, 1, 4]), torch.tensor([0, 2, 3]),
                            torch.tensor([7, 2]))
    assert t.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(t.gather(1).view(np.uint16),
                          pool[4, :2].view(torch.int16).numpy().view(np.uint16))
    snap = hk.KVCacheSnapshot.from_arrays([pool], [pool * 2], torch.tensor([3, 1, 4]),
                                          torch.tensor([0, 2, 3]), torch.tensor([7, 2]))
    assert np.array_equal(snap.tensor(0, "value").page_pool.astype(np.float32),
                          (pool * 2).float().numpy())
    seqs = hk.BlockPagedTensor.from_sequences([pool[0], pool[1, :3]], 4)
    assert seqs.seq_lens.tolist() == [4, 3]
