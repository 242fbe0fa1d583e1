"""A hybrid model's KV cache groups without an engine (issue 31): the group layout read
from vLLM's ``kv_cache_config`` (``groups.py``), the segments that hold sliding-window
pages and Mamba states (``hybrid.py``: read back by our store and by pyhurray), the
scheduler's hits and saves for them, and the states' view of vLLM's cache
(``adapters.vllm.StateView``).  Real engines: ``engine_tests/test_vllm_hybrid.py``.

The spec stand-ins carry the class names and fields of vLLM 0.32's
``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec``, ``SlidingWindowSpec``:
``sliding_window``, ``extra_retained_tokens``; ``MambaSpec``: ``shapes``, ``dtypes``,
``mamba_cache_mode``, ``num_speculative_blocks``; ``ChunkedLocalAttentionSpec``:
``attention_chunk_size``), as a Gemma-2 and a Qwen3-Next engine printed them."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import hurray  # pyhurray
import numpy as np
import pytest
import torch

import hurraykv as hk
from hurraykv.adapters.vllm import StateView
from hurraykv.chunks.keys import ChunkKeys, segment_name
from hurraykv.chunks.urls import open_store
from hurraykv.errors import HurrayError, LayoutError
from hurraykv.integrations.vllm import hybrid
from hurraykv.integrations.vllm.config import ConnectorConfig
from hurraykv.integrations.vllm.context import build_context, identity_of, why_disabled
from hurraykv.integrations.vllm.events import SavedSegments
from hurraykv.integrations.vllm.groups import METADATA_KEY, layout_of
from hurraykv.integrations.vllm.scheduler import SchedulerSide
from hurraykv.integrations.vllm.store_format import StoreFormat
from hurraykv.io import checksums
from tests.integrations.vllm.test_vllm_scheduler import scheduler_side


def spec(kind: str, **fields):
    return type(kind, (), {})() if not fields else _with(type(kind, (), {})(), fields)


def _with(obj, fields):
    for k, v in fields.items():
        setattr(obj, k, v)
    return obj


def attention(kind="FullAttentionSpec", block_size=32, **kw):
    base = {"block_size": block_size, "num_kv_heads": 2, "head_size": 32, "head_size_v": 32,
            "dtype": torch.float32, "sliding_window": None, "attention_chunk_size": None}
    return spec(kind, **(base | kw))


def gemma2(window=64, block_size=32):
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=attention("SlidingWindowSpec", block_size,
                                                sliding_window=window,
                                                extra_retained_tokens=0),
                        layer_names=["model.layers.0.self_attn.attn",
                                     "model.layers.2.self_attn.attn"]),
        SimpleNamespace(kv_cache_spec=attention(block_size=block_size),
                        layer_names=["model.layers.1.self_attn.attn",
                                     "model.layers.3.self_attn.attn"])])


def qwen3_next(mode="align", block_size=160):
    mamba = spec("MambaSpec", block_size=block_size, shapes=((3, 512), (4, 64, 64)),
                 dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode,
                 num_speculative_blocks=0)
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=mamba, layer_names=["model.layers.0.linear_attn",
                                                          "model.layers.2.linear_attn"]),
        SimpleNamespace(kv_cache_spec=attention(block_size=block_size, head_size=64,
                                                head_size_v=64, dtype=torch.bfloat16),
                        layer_names=["model.layers.1.self_attn.attn",
                                     "model.layers.3.self_attn.attn"])])


def vllm_config(url: str, block_size: int, mode: str = "none", **extra):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"url": url, **extra},
                                           is_kv_consumer=True, is_kv_producer=True),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto",
                                     mamba_cache_mode=mode),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="tiny", dtype=torch.float32))


# ---------------------------------------------------------------- the group layout
def test_a_sliding_window_group_needs_the_blocks_of_its_window_before_a_hit():
    layout = layout_of(gemma2())
    assert [g.kind for g in layout.groups] == ["sliding_window", "full"]
    assert layout.hybrid and layout.ref == 1 and not layout.unsupported
    sliding = layout.groups[0]
    # vLLM skips tokens before N - window + 1 (get_num_skipped_tokens): at N = 256 it
    # keeps tokens 193..255, blocks 6 and 7
    assert sliding.need == 2
    assert sliding.kept(0, 8, 4).tolist() == [False, False, True, True] * 2
    assert sliding.kept(4, 4, 4).tolist() == [False, False, True, True]
    assert sliding.kept(0, 3, 1).all()  # chunks of one block: every block is some hit's
    assert layout_of(gemma2(window=65)).groups[0].need == 2
    assert layout_of(gemma2(window=66)).groups[0].need == 3
    assert layout.groups[1].kept(0, 8, 4).all()


def test_layouts_that_cannot_be_stored_say_why():
    assert "enable-prefix-caching" in layout_of(qwen3_next("none")).unsupported
    assert not layout_of(qwen3_next("align")).unsupported
    chunked = gemma2()
    chunked.kv_cache_groups[0].kv_cache_spec = attention("ChunkedLocalAttentionSpec",
                                                         attention_chunk_size=128)
    assert "ChunkedLocalAttentionSpec: not supported" in layout_of(chunked).unsupported
    only_mamba = qwen3_next()
    del only_mamba.kv_cache_groups[1]
    assert "no attention layer: not supported" in layout_of(only_mamba).unsupported
    only_sliding = gemma2()  # every layer sliding (Mistral 7B v0.1): its blocks count
    del only_sliding.kv_cache_groups[1]
    assert not layout_of(only_sliding).unsupported and layout_of(only_sliding).ref == 0
    # the hybrid manager off: vLLM makes sliding layers FullAttentionSpecs, their
    # sliding_window set, every page allocated: stored and loaded as full attention
    off = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=attention(sliding_window=64), layer_names=["model.layers.0.attn"])])
    assert [g.kind for g in layout_of(off).groups] == ["full"]
    assert why_disabled(vllm_config("file:///x", 32), off) == ""
    sizes = gemma2()
    sizes.kv_cache_groups[0].kv_cache_spec.block_size = 64
    assert "block sizes [32, 64]" in layout_of(sizes).unsupported
    shapes = gemma2()
    shapes.kv_cache_groups[0].kv_cache_spec.head_size = 64
    assert "different page shapes" in why_disabled(vllm_config("file:///x", 32), shapes)
    assert why_disabled(vllm_config("file:///x", 32), gemma2()) == ""
    assert "Mamba" in why_disabled(vllm_config("file:///x", 160), qwen3_next("none"))


def test_the_identity_covers_the_group_layout(tmp_path):
    url = (tmp_path / "kv").as_uri()
    conf = ConnectorConfig.from_extra({"url": url})
    ident = identity_of(vllm_config(url, 32), gemma2(), conf, 32, StoreFormat())
    assert "groups=sliding_window64:0,2+full:1,3" in ident
    assert identity_of(vllm_config(url, 32), gemma2(window=128), conf, 32,
                       StoreFormat()) != ident
    one = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=attention(), layer_names=[f"model.layers.{i}.self_attn.attn"
                                                for i in range(4)])])
    plain = identity_of(vllm_config(url, 32), one, conf, 32, StoreFormat())
    assert "groups" not in plain  # one full-attention group: the identity of every release
    assert plain.endswith(";layers=4;kv_heads=2;head_size=32;head_size_v=32")
    q = identity_of(vllm_config(url, 160, "align"), qwen3_next(), conf, 160, StoreFormat())
    assert "groups=mamba(bfloat16[3,512],float32[4,64,64]):0,1+full:0,1" in q
    # one sliding-window group (every layer sliding): stored otherwise than as full
    # attention, so another identity than the one its engines had before hybrid models
    only = gemma2()
    del only.kv_cache_groups[1]
    assert "groups=sliding_window64:0,1" in identity_of(vllm_config(url, 32), only, conf, 32,
                                                       StoreFormat())
    # vLLM's one group of full-attention layers of several page sizes: as ever
    uniform = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=spec("UniformTypeKVCacheSpecs", block_size=32, kv_cache_specs={
            "a": attention(), "b": attention(head_size=64)}),
        layer_names=["model.layers.0.attn", "model.layers.1.attn"])])
    assert layout_of(uniform).plain and why_disabled(vllm_config(url, 32), uniform) == ""
    assert "groups" not in identity_of(vllm_config(url, 32), uniform, conf, 32, StoreFormat())


def test_a_model_with_mamba_layers_stores_chunks_of_one_block(tmp_path):
    url = (tmp_path / "kv").as_uri()
    with pytest.raises(HurrayError, match=r"chunk_size 320: a model with Mamba layers") as e:
        build_context(vllm_config(url, 160, "align", chunk_size=320), qwen3_next())
    assert e.value.field == "chunk_size"
    ctx = build_context(vllm_config(url, 160, "align"), qwen3_next())
    assert ctx.hybrid and ctx.layout.mamba and ctx.disabled == ""
    # per_block_affine's quantization blocks are pages: a power of two, which 160 is not
    with pytest.raises(HurrayError, match="needs a power-of-two block size; vLLM's is 160"):
        build_context(vllm_config(url, 160, "align", store_dtype="int8"), qwen3_next())
    build_context(vllm_config(url, 160, "align", store_dtype="int8",
                              quantization="per_channel"), qwen3_next())


# ---------------------------------------------------------------- segments
def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 32, 2, 32)).astype(np.float32)


SHAPES = ([(3, 16), (4, 8)], ["float32", "uint8"])


def hybrid_segment(fmt: StoreFormat | None = None, states: bool = True):
    """Chunks of 4 blocks, 2 chunks: a sliding layer (0) keeping 2 of each 4 pages, a
    full one (1), and two Mamba layers' states."""
    fmt = fmt or StoreFormat()
    layout = layout_of(gemma2())
    kept = layout.groups[0].kept(0, 8, 4)
    sliding = [pages(8, 1)[kept], pages(8, 2)[kept]]
    full = [pages(8, 3), pages(8, 4)]
    tensors = hybrid.encode_layer(fmt, sliding, kept, 0) + hybrid.encode_layer(
        fmt, full, np.ones(8, bool), 1)
    rng = np.random.default_rng(5)
    st = [[rng.standard_normal((3, 16)).astype(np.float32),
           rng.integers(0, 255, (4, 8), dtype=np.uint8)] for _ in range(2)] if states else None
    groups = {"block_size": 32, "groups": [{"kind": "sliding_window", "window": 64}]}
    return hybrid.segment(tensors, st, groups, "model=tiny", 256), st, kept


def test_a_sliding_layer_keeps_its_window_pages_and_names_one_zero_page_for_the_rest(
        tmp_path):
    snap, states, kept = hybrid_segment()
    t = snap.tensor(0, "key")
    assert t.num_pages == 5 and np.asarray(t.block_table).tolist() == [4, 4, 0, 1, 4, 4, 2, 3]
    assert not np.asarray(t.page_pool[4]).any()
    np.testing.assert_array_equal(np.asarray(t.page_pool[:4]), pages(8, 1)[kept])
    assert hybrid.physical_run(t, 2, 2) == 0 and hybrid.physical_run(t, 6, 2) == 2
    assert hybrid.physical_run(t, 1, 2) is None  # a left-out page is not a run of kept ones
    assert snap.tensor(1, "value").num_pages == 8
    assert hybrid.has_states(snap)
    assert json.loads(snap.metadata[METADATA_KEY])["groups"][0]["window"] == 64
    # through a store, checksummed: the states come back bit for bit
    store = open_store((tmp_path / "kv").as_uri())
    keys = ChunkKeys(b"seed", 128).upto(list(range(300)), 2)
    store.put(keys, 0, checksums.with_checksums(snap), {})
    back, pending = store.get_checked(segment_name(keys, 0))
    if pending is not None:
        pending.check(frozenset(n for n, _, _ in back.members()))
    for layer, row in zip(hybrid.states_of(back, [SHAPES] * 2), states, strict=True):
        for got, want in zip(layer, row, strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want)
    assert hybrid.groups_of(back) == json.loads(snap.metadata[METADATA_KEY])


def test_pyhurray_reads_a_hybrid_segment_member_for_member(tmp_path):
    snap, _, _ = hybrid_segment()
    snap = checksums.with_checksums(snap)  # as the saver stores it, and save_snapshot
    hk.save_snapshot(snap, tmp_path / "hybrid.hrry")
    group = hurray.load(str(tmp_path / "hybrid.hrry"))["snapshot"]
    assert group.member_count == snap.member_count()
    for (name, desc, bufs), t in zip(snap.members(), group.members, strict=True):
        assert t.descriptor.encode() == desc.encode(), name
        assert [np.asarray(t.buffer(i)).tobytes() for i in range(t.buffer_count)] == [
            np.asarray(memoryview(b).cast("B")).tobytes() for b in bufs], name


def test_quantized_sliding_pages_keep_their_table_and_states_stay_exact():
    snap, states, kept = hybrid_segment(StoreFormat("int8", "per_block_affine"))
    t = snap.tensor(0, "key")
    assert t.quantization is not None and t.num_pages == 5
    window = np.asarray(t.dequantize().page_pool[:4])
    np.testing.assert_allclose(window, pages(8, 1)[kept], atol=np.abs(
        pages(8, 1)).max() / 127)
    assert np.array_equal(hybrid.states_of(snap, [SHAPES] * 2)[1][0], states[1][0])


def test_a_segment_without_states_says_so_and_a_missing_state_is_named():
    snap, _, _ = hybrid_segment(states=False)
    assert not hybrid.has_states(snap)
    with pytest.raises(HurrayError, match="holds 0 state members, this engine's 2") as e:
        hybrid.states_of(snap, [SHAPES] * 2)
    assert e.value.field == "segment.members"
    snap, _, _ = hybrid_segment()
    with pytest.raises(HurrayError, match=r"states\.0\.1 is uint8 \[4, 8\], the group map "
                       r"says float32 \[4, 8\]"):
        hybrid.states_of(snap, [(SHAPES[0], ["float32", "float32"])] * 2)


# ---------------------------------------------------------------- the scheduler
BLOCK = 16
LOADED = "loaded"


@pytest.fixture
def mamba_side(tmp_path):
    yield from scheduler_side(tmp_path, BLOCK, BLOCK, "model=q",
                              layout=layout_of(qwen3_next(block_size=BLOCK)))


def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens,
                           all_token_ids=list(tokens), cache_salt=None, lora_request=None,
                           prompt_embeds=None, mm_features=None)


def match(sched: SchedulerSide, req: SimpleNamespace) -> tuple[int, bool]:
    for _ in range(100):
        got = sched.matched(req, 0)
        if got[0] is not None:
            return got
        sched.lookups.wait(req.request_id, 5.0)
    raise AssertionError("no answer")


def put(store, seed: bytes, tokens: list[int], first: int, count: int) -> None:
    n = count
    pool = np.zeros((n, BLOCK, 1, 8), np.float16)
    snap = hk.KVCacheSnapshot.from_arrays([pool], [pool], np.arange(n), [0, n], [n * BLOCK])
    keys = ChunkKeys(seed, BLOCK).upto(tokens, first + count)[first:]
    store.put(keys, first, checksums.with_checksums(snap), {})


PROMPT = list(range(1, 101))  # 6 whole chunks of 16 before the last token


def test_a_mamba_hit_ends_where_a_stored_segment_ends(mamba_side):
    """A state is stored at a segment's end only: chunks 0..3 in one segment (a step that
    ended at token 64) give a hit of 64 tokens to a prompt sharing 4 chunks, none to one
    sharing 2 (no state at token 32): loading its pages without the state would be the
    garbled output of LMCache #2863."""
    sched, store = mamba_side
    put(store, sched.ctx.seed, PROMPT, 0, 4)
    assert match(sched, request("a", PROMPT)) == (64, True)  # always async: see below
    assert match(sched, request("b", PROMPT[:32] + [999] * 60))[0] == 0
    put(store, sched.ctx.seed, PROMPT, 4, 1)  # a later step stored chunk 4 alone
    assert match(sched, request("c", PROMPT))[0] == 80


def test_a_hybrid_hit_starts_on_a_block_boundary(mamba_side):
    """vLLM's own prefix hit may end inside a block (hashes finer than blocks): the block
    it copied for the request is not written by a load, so there is no hybrid load."""
    sched, store = mamba_side
    put(store, sched.ctx.seed, PROMPT, 0, 4)
    assert match(sched, request("i", PROMPT)) == (64, True)
    got = sched.matched(request("j", PROMPT), 8)
    assert got == (0, False)


def test_hybrid_loads_carry_every_groups_blocks_and_fail_by_request(mamba_side):
    sched, store = mamba_side
    put(store, sched.ctx.seed, PROMPT, 0, 4)
    req = request("d", PROMPT)
    assert match(sched, req) == (64, True)
    mamba_blocks, attn_blocks = [0, 0, 0, 7, 8], [10, 11, 12, 13, 14]
    sched.after_alloc(req, SimpleNamespace(get_block_ids=lambda: (mamba_blocks, attn_blocks)),
                      64)
    plan = sched.plan(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=
                                      SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                      new_block_ids=[],
                                                      num_computed_tokens=[]),
                                      num_scheduled_tokens={}, finished_req_ids=set(),
                                      total_num_scheduled_tokens=0))
    load, = plan.async_loads
    assert load.blocks == [[10], [11], [12], [13]]  # the full-attention group's
    # the state at token 64 goes into the Mamba group's block 3 (64 / 16 - 1)
    assert load.groups == [[0, 0, 0, 7], [10, 11, 12, 13]] and load.groups[0][-1] == 7
    # vLLM takes no block ids from a hybrid model: a failure is the request's
    sched.output(SimpleNamespace(invalid_block_ids=set(), failed_recving={"d"},
                                 kv_cache_events=SavedSegments([(LOADED, "d")])))
    stats = sched.ctx.stats
    assert (stats["tokens_hit"], stats["tokens_failed"]) == (0, 64)
    assert sched.requests["d"].load_failed and sched.requests["d"].rewrite


def step(req_id, blocks, computed, scheduled):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=blocks,
                                            num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req_id: scheduled}, finished_req_ids=set())


def new_request(sched, req_id: str, tokens: list[int]) -> SimpleNamespace:
    req = request(req_id, tokens)
    assert match(sched, req)[0] == 0
    sched.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
    return req


def test_mamba_saves_are_whole_runs_ending_on_a_state(mamba_side):
    """vLLM keeps a Mamba state in block i after token (i + 1) * block_size where a step
    ended or a prefill checkpoint was taken, null blocks elsewhere: a segment ends on a
    state, whole, and chunks without one wait for a later segment."""
    sched, _ = mamba_side
    new_request(sched, "e", PROMPT)
    mamba, attn = [0, 0, 0, 5], [20, 21, 22, 23]
    save, = sched.plan(step("e", (mamba, attn), 0, 64)).saves  # the step ended at 64
    assert (save.first_chunk, len(save.keys), save.state) == (0, 4, True)
    assert save.groups == [mamba, attn] and save.first_block == 0
    # a step ending inside block 4 (the prompt's end): no state after block 3, nothing
    # stored yet; the step that ends on block 5 stores all five chunks
    tokens = [9] * 30 + PROMPT[:50]
    req = new_request(sched, "f", tokens)
    assert sched.plan(step("f", ([0, 0, 0, 0, 9], [30, 31, 32, 33, 34]), 0, 70)).saves == []
    req.all_token_ids = tokens + [1] * 10
    cached = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
        req_ids=["f"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[70]),
        num_scheduled_tokens={"f": 10}, finished_req_ids=set())
    sched.ctx.config = dataclasses.replace(sched.ctx.config, save_decode=True)
    save, = sched.plan(cached).saves
    assert (save.first_chunk, len(save.keys)) == (0, 5) and save.groups[0][-1] == 9
    # a prefill checkpoint (Mamba2's num_prefill_checkpoint_blocks): the state after block
    # 3 of a step that ran on to 70
    new_request(sched, "g", [8] * 80)
    save, = sched.plan(step("g", ([0, 0, 0, 8, 9], [40, 41, 42, 43, 44]), 0, 70)).saves
    assert (save.first_chunk, len(save.keys)) == (0, 4) and save.groups[0][-1] == 8


@pytest.fixture
def sliding_side(tmp_path):
    yield from scheduler_side(tmp_path, BLOCK, BLOCK, "model=g",  # need: 2 blocks
                              layout=layout_of(gemma2(window=32, block_size=BLOCK)))


def test_sliding_window_pages_vllm_never_computed_are_not_stored(sliding_side):
    """vLLM's own prefix cache gave the first 64 tokens; its sliding-window group names
    the null block for what fell out of the window: those chunks are not stored (their
    pages would be the null block's), the rest are."""
    sched, _ = sliding_side
    new_request(sched, "h", PROMPT)
    sliding, full = [0, 0, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]
    save, = sched.plan(step("h", (sliding, full), 64, 32)).saves
    assert (save.first_chunk, len(save.keys)) == (2, 4)  # chunks 0, 1 hold null blocks
    assert save.groups == [sliding[2:], full[2:]]


# ---------------------------------------------------------------- the states in vLLM's cache
def test_state_view_moves_a_blocks_states_as_vllm_lays_them_out():
    """vLLM hands a connector a Mamba layer as an int8 view [num_blocks, 1, 1, content]
    of pages padded to the attention page size, and binds the layer's states at running
    byte offsets of each page (gpu_model_runner.py ``_reshape_kv_cache_tensors``)."""
    blocks, page, content = 6, 81920, 3 * 512 * 2 + 4 * 64 * 64 * 4
    raw = torch.zeros(blocks * page, dtype=torch.int8)
    given = torch.as_strided(raw, (blocks, 1, 1, content), (page, content, content, 1))
    conv = torch.as_strided(raw.view(torch.bfloat16), (blocks, 3, 512), (page // 2, 512, 1))
    ssm = torch.as_strided(raw.view(torch.float32), (blocks, 4, 64, 64),
                           (page // 4, 4096, 64, 1), 3 * 512 * 2 // 4)
    conv[2].normal_()
    ssm[2].normal_()
    view = StateView(given, [(3, 512), (4, 64, 64)], [torch.bfloat16, torch.float32])
    got = view.read(2)
    assert got[0].shape == (3, 512) and np.array_equal(got[1], ssm[2].numpy())
    view.write(4, got)
    assert torch.equal(conv[4], conv[2]) and torch.equal(ssm[4], ssm[2])
    assert not ssm[3].any() and not ssm[5].any()  # nothing else written
    listed = StateView([conv, ssm], [(3, 512), (4, 64, 64)], [torch.bfloat16, torch.float32])
    assert np.array_equal(listed.read(4)[1], got[1])
    with pytest.raises(LayoutError, match="state 1 is 65536 bytes per block"):
        view.write(1, [got[0], got[1][:2]])
    with pytest.raises(LayoutError, match="state bytes contiguously"):
        StateView(given[:, :, :, :100], [(3, 512)], [torch.bfloat16])


# ---------------------------------------------------------------- a hybrid load, written
def small_layout():
    """A full-attention group (group 1) and a Mamba group of one float32 state (group 0)."""
    mamba = spec("MambaSpec", block_size=BLOCK, shapes=((2, 8),), dtypes=(torch.float32,),
                 mamba_cache_mode="align", num_speculative_blocks=0)
    return layout_of(SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=mamba, layer_names=["model.layers.0.mixer"]),
        SimpleNamespace(kv_cache_spec=attention(block_size=BLOCK, head_size=8, head_size_v=8,
                                                num_kv_heads=1),
                        layer_names=["model.layers.1.attn"])]))


def test_a_hybrid_load_is_done_only_once_its_states_are_written(mamba_side):
    """The attention pages and then the state at the hit's end go into the engine's
    blocks; the job is not done (vLLM would run the request) before the state is
    written; a segment without states is a failed receive, not a load."""
    from hurraykv.adapters.vllm import LayerView
    from hurraykv.integrations.vllm.common import Transfer
    from hurraykv.integrations.vllm.decode_buffers import DecodeBuffers
    from hurraykv.integrations.vllm.loads import LoadJob, Target, run_job

    sched, store = mamba_side
    ctx, layout = sched.ctx, small_layout()
    ctx.layout = layout
    names = ["model.layers.0.mixer", "model.layers.1.attn"]
    cache = torch.zeros(8, 1, BLOCK, 16)  # [blocks, heads, block, key + value]
    raw = torch.zeros(8, 1, 1, 64, dtype=torch.int8)  # one float32 [2, 8] state a block
    target = Target(ctx, [(names[1], LayerView(cache, "split", head_size=8))], "float32",
                    StoreFormat(), [layout.groups[1]],
                    [(StateView(raw, [(2, 8)], ["float32"]), layout.groups[0])],
                    layout.describe(names))
    keys, values = pages(2, 1)[:, :, :1, :8], pages(2, 2)[:, :, :1, :8]
    state = np.arange(16, dtype=np.float32).reshape(2, 8)

    def stored(states):
        snap = hybrid.segment(hybrid.encode_layer(StoreFormat(), [keys[:, :BLOCK].copy(),
                                                                  values[:, :BLOCK].copy()],
                                                  np.ones(2, bool), 0),
                              states, layout.describe(names), ctx.identity, 2 * BLOCK)
        k = ChunkKeys(ctx.seed, BLOCK).upto(list(range(40 + len(states or ()))), 2)
        store.put(k, 0, checksums.with_checksums(snap), {})
        return segment_name(k, 0)

    name = stored([[state]])
    job = LoadJob(Transfer("r", names=[name, name], blocks=[[3], [4]], pages=[0, 1],
                           groups=[[0, 6], [3, 4]]))
    job.fetch(target, {})
    job.write_layer(target, 0, DecodeBuffers("float32"))
    assert job.state == "writing" and not job.done  # the state is not there yet
    job.write_states(target)
    assert job.state == "written" and job.done and not job.failed_whole
    assert np.array_equal(raw[6, 0, 0].view(torch.float32).numpy(), state.reshape(-1))
    np.testing.assert_array_equal(cache[3, 0, :, :8].numpy(), keys[0, :BLOCK, 0])
    # a segment without its end states: the whole request is recomputed
    bare = LoadJob(Transfer("s", names=[stored(None)] * 2, blocks=[[3], [4]], pages=[0, 1],
                            groups=[[0, 7], [3, 4]]))
    run_job(bare, target, DecodeBuffers("float32"))
    assert bare.state == "failed" and bare.failed_whole and bare.failed_blocks() == []
    assert not raw[7].any()


@pytest.fixture
def plain_side(tmp_path):
    yield from scheduler_side(tmp_path)


def test_a_plain_models_failed_receive_is_counted_and_its_segments_left_alone(plain_side):
    """One full-attention group: a failed receive (a load the scheduler could not plan)
    counts its tokens failed; the stored segments are not taken for damaged (no events
    of removal, nothing stored again), as before hybrid models."""
    from tests.integrations.vllm.test_vllm_scheduler import CHUNK, store_chunks

    sched, store = plain_side
    sched.ctx.config = dataclasses.replace(sched.ctx.config, load_mode="async")
    store_chunks(store, sched.ctx.seed, PROMPT, 3)
    req = request("k", PROMPT)
    assert match(sched, req) == (3 * CHUNK, True)
    sched.after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(range(10, 17)),)),
                      3 * CHUNK)
    sched.output(SimpleNamespace(invalid_block_ids=set(), failed_recving={"k"},
                                 kv_cache_events=SavedSegments([(LOADED, "k")])))
    assert sched.ctx.stats["tokens_failed"] == 3 * CHUNK
    st = sched.requests["k"]
    assert not st.rewrite and not st.load_failed and st.stored == 3
