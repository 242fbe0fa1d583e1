"""The Transformers adapter at its edges, with real caches filled by real models (random
weights, configs built here, no downloads).  Layer classes and their bookkeeping are those
of transformers 5.24.0 ``cache_utils.py``: ``DynamicSlidingWindowLayer`` keeps the last
``sliding_window - 1`` states (line 244-247), ``StaticLayer`` zero-fills ``max_cache_len``
slots and counts ``cumulative_length`` (lines 418-483), ``Fp8QuantizedLayer`` keeps
float8_e4m3fn states with a frozen per-tensor scale (lines 1009-1063)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    QuantizedCache,
    StaticCache,
)
from transformers import cache_utils as cu

import hurraykv as hk
from hurraykv.adapters.transformers import from_dynamic_cache, to_dynamic_cache

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def gemma2(window: int):
    torch.manual_seed(0)
    cfg = Gemma2Config(**SMALL, sliding_window=window, attn_implementation="eager")
    return cfg, Gemma2ForCausalLM(cfg).eval()


def gemma3(window: int):
    torch.manual_seed(1)
    cfg = Gemma3TextConfig(**SMALL, sliding_window=window, attn_implementation="eager",
                           layer_types=["sliding_attention", "full_attention"])
    return cfg, Gemma3ForCausalLM(cfg).eval()


def llama():
    torch.manual_seed(2)
    cfg = LlamaConfig(**SMALL, attn_implementation="eager")
    return cfg, LlamaForCausalLM(cfg).eval()


def prompt(batch: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy(model, cache, first: torch.Tensor, steps: int) -> tuple[list, list]:
    """Decode ``steps`` tokens after ``first`` ([batch, 1]); the tokens and logits."""
    tokens, logits, nxt = [], [], first
    for _ in range(steps):
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        nxt = out.logits[:, -1:].argmax(-1)
        tokens.append(nxt[:, 0].tolist())
    return tokens, logits


@pytest.mark.parametrize("make", [gemma2, gemma3], ids=["gemma2", "gemma3"])
@torch.no_grad()
def test_sliding_layers_inside_their_window_round_trip_and_keep_decoding(make):
    cfg, model = make(window=8)
    ids = prompt(2, 5)
    cache = DynamicCache(config=cfg)
    out = model(input_ids=ids, cache=cache, use_cache=True)
    assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    assert type(cache.layers[1]).__name__ == "DynamicLayer"
    snap = from_dynamic_cache(cache, page_size=4)
    assert snap.seq_lens.tolist() == [5, 5]
    for i, layer in enumerate(cache.layers):
        k, v = snap.layer(i)
        assert np.array_equal(k.to_dense(), layer.keys.numpy().transpose(0, 2, 1, 3)
                              .reshape(10, 1, 16))
        assert np.array_equal(v.to_dense(), layer.values.numpy().transpose(0, 2, 1, 3)
                              .reshape(10, 1, 16))
    restored, _ = to_dynamic_cache(snap, config=cfg)
    assert [type(x).__name__ for x in restored.layers] == [type(x).__name__
                                                           for x in cache.layers]
    first = out.logits[:, -1:].argmax(-1)
    # 5 + 6 tokens: the sliding layer passes its window while decoding, in both caches
    want, want_logits = greedy(model, cache, first, 6)
    got, got_logits = greedy(model, restored, first, 6)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits, strict=True))


@torch.no_grad()
def test_a_sliding_layer_past_its_window_is_refused_not_truncated():
    cfg, model = gemma2(window=4)
    cache = DynamicCache(config=cfg)
    model(input_ids=prompt(1, 7), cache=cache, use_cache=True)
    assert cache.layers[0].keys.shape[-2] == 3  # 3 of 7 tokens kept
    with pytest.raises(hk.UnsupportedError, match=r"DynamicSlidingWindowLayer.*window 4.*"
                                                  r"7 tokens keeps only the last 3") as e:
        from_dynamic_cache(cache)
    assert e.value.field == "cache.layers[0]"


@pytest.mark.parametrize("make", [llama, gemma3], ids=["llama", "gemma3"])
@torch.no_grad()
def test_static_cache_counts_written_slots_not_its_capacity(make):
    cfg, model = make() if make is llama else make(window=8)
    ids = prompt(2, 5, seed=4)
    static = StaticCache(config=cfg, max_cache_len=16)
    model(input_ids=ids, cache=static, use_cache=True)
    dynamic = DynamicCache()
    model(input_ids=ids, cache=dynamic, use_cache=True)
    assert static.layers[1].keys.shape[-2] == 16  # zero-filled capacity
    a, b = from_dynamic_cache(static, page_size=4), from_dynamic_cache(dynamic, page_size=4)
    assert a.seq_lens.tolist() == [5, 5]
    for i, layer in enumerate(static.layers):
        for t, x in zip(a.layer(i), (layer.keys, layer.values), strict=True):
            assert np.array_equal(t.to_dense(), x[:, :, :5].numpy().transpose(0, 2, 1, 3)
                                  .reshape(10, 1, 16))
    # the same tokens as a DynamicCache run (layer 0 bit for bit; later layers attend
    # over the padded static slots, so their sums may round differently)
    assert a.layer(0)[0].equal(b.layer(0)[0])
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        assert np.allclose(x.to_dense(), y.to_dense(), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_static_sliding_layer_that_rolled_is_refused():
    cfg, model = gemma3(window=4)
    static = StaticCache(config=cfg, max_cache_len=16)
    model(input_ids=prompt(1, 6), cache=static, use_cache=True)
    assert type(static.layers[0]).__name__ == "StaticSlidingWindowLayer"
    with pytest.raises(hk.UnsupportedError, match=r"StaticSlidingWindowLayer.*6 tokens"):
        from_dynamic_cache(static)


@torch.no_grad()
def test_left_padded_batch_keeps_only_real_tokens():
    _, model = llama()
    ids = prompt(2, 6, seed=5)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    cache = DynamicCache()
    model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    snap = from_dynamic_cache(cache, mask, page_size=4)
    assert snap.seq_lens.tolist() == [4, 6]
    keys = cache.layers[0].keys.numpy()
    assert np.array_equal(snap.layer(0)[0].gather(0), keys[0, :, 2:].transpose(1, 0, 2))
    back, mask2 = to_dynamic_cache(snap)
    assert mask2.tolist() == mask.tolist()
    assert torch.equal(back.layers[0].keys[0, :, 2:], cache.layers[0].keys[0, :, 2:])
    assert not back.layers[0].keys[0, :, :2].any()  # padding comes back as zeros
    with pytest.raises(hk.LayoutError, match=r"attention_mask.shape.*\[2, 6\]"):
        from_dynamic_cache(cache, mask[:, 1:])


@torch.no_grad()
def test_fp8_quantized_cache_travels_as_fp8_with_its_scales():
    cfg, model = llama()
    cache = QuantizedCache("fp8", cfg)
    model(input_ids=prompt(2, 5, seed=6), cache=cache, use_cache=True)
    snap = from_dynamic_cache(cache, page_size=4)
    for i, layer in enumerate(cache.layers):
        (qk, sk), (qv, sv) = layer._quantized_keys, layer._quantized_values
        for t, q in zip(snap.layer(i), (qk, qv), strict=True):
            assert t.dtype.name == "float8_e4m3fn"
            assert np.array_equal(t.to_dense().view(np.uint8),
                                  q.view(torch.uint8).numpy().transpose(0, 2, 1, 3)
                                  .reshape(10, 1, 16))
        assert snap.kv_scales[i].tolist() == [sk.item(), sv.item()]
    back, _ = to_dynamic_cache(snap, dtype=torch.float32)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(back.layers[i].keys, layer._dequantize(layer._quantized_keys))
        assert torch.equal(back.layers[i].values, layer._dequantize(layer._quantized_values))
    with pytest.raises(hk.LayoutError, match="dtype"):
        to_dynamic_cache(snap)


class _GroupQuantized(cu.QuantizedLayer):
    """A QuantizedLayer as a quanto/HQQ backend subclasses it (those need packages that
    are not installed here)."""

    def _quantize(self, tensor, axis):
        return tensor.clone()

    def _dequantize(self, q):
        return q


def _filled(*layers) -> cu.Cache:
    cache = cu.Cache(layers=list(layers))
    k = torch.zeros(1, 1, 3, 16)
    for i, layer in enumerate(cache.layers):
        if type(layer).__name__ not in ("DummyLayer",):
            with contextlib.suppress(Exception):  # a linear-attention layer takes no KV
                cache.update(k, k, i)
    return cache


@pytest.mark.parametrize("layer", [
    lambda: cu.DummyLayer(),
    lambda: cu.LinearAttentionLayer(),
    lambda: cu.LinearAttentionAndFullAttentionLayer(),
    lambda: cu.DynamicIndexedLayer(),
    lambda: _GroupQuantized(),
], ids=["dummy", "linear", "hybrid", "indexed", "quantized"])
def test_layers_without_a_paged_kv_form_are_refused_by_type(layer):
    cache = _filled(cu.DynamicLayer(), layer())
    name = type(cache.layers[1]).__name__
    with pytest.raises(hk.UnsupportedError, match=f"{name}.*not supported") as e:
        from_dynamic_cache(cache)
    assert e.value.field == "cache.layers[1]"


def test_layers_of_different_lengths_are_refused_naming_the_layer():
    cache = cu.Cache(layers=[cu.DynamicLayer(), cu.DynamicLayer()])
    cache.update(torch.zeros(1, 1, 3, 16), torch.zeros(1, 1, 3, 16), 0)
    cache.update(torch.zeros(1, 1, 5, 16), torch.zeros(1, 1, 5, 16), 1)
    with pytest.raises(hk.LayoutError, match="layer 0 holds 3 tokens") as e:
        from_dynamic_cache(cache)
    assert e.value.field == "cache.layers[1]" and e.value.value == 5


def test_encoder_decoder_cache_names_what_to_pass():
    enc = cu.EncoderDecoderCache(DynamicCache(), DynamicCache())
    with pytest.raises(hk.UnsupportedError, match="self_attention_cache"):
        from_dynamic_cache(enc)


def test_key_and_value_head_dims_may_differ_through_a_file(tmp_path):
    cache = DynamicCache()
    g = torch.Generator().manual_seed(7)
    for i in range(2):
        cache.update(torch.randn(2, 2, 5, 16, generator=g), torch.randn(2, 2, 5, 8, generator=g), i)
    snap = from_dynamic_cache(cache, page_size=4)
    assert (snap.head_dim, snap.head_dim_v) == (16, 8)
    hk.save_snapshot(snap, tmp_path / "d.hrry")
    back, _ = to_dynamic_cache(hk.load_snapshot(tmp_path / "d.hrry"))
    for a, b in zip(back.layers, cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
