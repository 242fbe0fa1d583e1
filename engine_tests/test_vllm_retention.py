"""What stays cached, through a running vLLM: ``LLM.reset_prefix_cache(reset_connector=
True)`` (vLLM's ``Scheduler.reset_connector_cache`` calls the connector's ``reset_cache``,
``vllm/v1/core/sched/scheduler.py:2885-2898``) on every store kind.  The KV events of
evictions over ZMQ under ``vllm serve``: ``test_vllm_serve.py``."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import hurraykv as hk
from engine_tests.conftest import Engine
from engine_tests.test_vllm_connector import BLOCK, conn, prompts
from engine_tests.test_vllm_faults import generate, store_url, want  # noqa: F401 - fixture
from hurraykv.chunks.keys import ChunkKeys, identity_digest, identity_key
from hurraykv.chunks.urls import open_store
from hurraykv.integrations import engine_run
from hurraykv.io import checksums


def other_identitys_segment(url: str) -> tuple[list[str], str]:
    """A segment stored under another cache identity (another model): its keys and
    identity."""
    other = f"model=another-model-{np.random.random()};cache_dtype=float32"
    keys = ChunkKeys(identity_digest(other), BLOCK).upto(list(range(64)), 2)
    pool = np.ones((2, BLOCK, 2, 16), np.float32)
    snap = checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
        [pool], [pool], np.arange(2), [0, 2], [64], model=other))
    store = open_store(url)
    try:
        store.put(keys, 0, snap, {})
    finally:
        store.close()
    return keys, other


@pytest.mark.parametrize("kind", ["file", "hurray", "redis"])
def test_reset_through_vllm_clears_this_engines_identity_from_the_store(
        kind, tiny_llama, tmp_path, want, redis_url):  # noqa: F811 - want is the fixture
    """Before the reset the same prompts reuse the store (192 and 160 tokens); vLLM's
    reset answers True; afterwards nothing of this engine's identity is stored, another
    model's segment is, the prompts compute from scratch with the same tokens, and they
    are stored again."""
    both = list(prompts())
    with contextlib.ExitStack() as stack:
        url = store_url(kind, tmp_path, redis_url, stack)
        theirs, other = other_identitys_segment(url)
        eng = Engine(tiny_llama, block_size=BLOCK, connector=conn(url, async_save=False))
        stack.callback(eng.close)
        connector = eng.core.scheduler.connector
        mine = identity_key(connector.identity)
        generate(eng, both)
        assert generate(eng, both)[1] == [192, 160]
        store = open_store(url)
        stack.callback(store.close)
        assert any(s.identity_key == mine for s in store.catalog())

        assert eng.llm.reset_prefix_cache(reset_connector=True) is True

        left = [s for s in store.catalog() if s.identity_key == mine]
        assert left == [], left
        assert store.locate(theirs)[0] is not None
        assert {s.identity_key for s in store.catalog()} >= {identity_key(other)}
        assert connector.stats["segments_cleared"] >= 2
        tokens, cached, _ = generate(eng, both)
        assert tokens == want and cached == [0, 0]
        assert generate(eng, both)[1] == [192, 160]  # stored again, found again


def run(eng: Engine, prompts_: list[list[int]], params: dict | None = None
        ) -> tuple[list[list[int]], list[int]]:
    """(tokens, num_cached_tokens) of requests sent with ``kv_transfer_params``."""
    tokens, cached, _ = generate(eng, prompts_, kv_transfer_params=params)
    return tokens, cached


def test_a_pinned_prefix_survives_a_flood_that_evicts_everything_else(
        tiny_llama, tmp_path, want):  # noqa: F811 - want is the fixture
    """A system prompt sent with ``{"hurraykv": {"pin": true}}`` and another without,
    then a flood of distinct prompts four times the capped directory: the pinned one is
    still served from the store, the other is gone."""
    system, other = prompts()
    rng = np.random.default_rng(7)
    flood = [rng.integers(1, 1000, 200).tolist() for _ in range(20)]
    store = tmp_path / "kv"
    eng = Engine(tiny_llama, block_size=BLOCK, connector=conn(
        store.as_uri(), async_save=False, max_bytes="1M", max_pinned_bytes="300K"))
    try:
        run(eng, [system], {"hurraykv": {"pin": True}})
        run(eng, [other])
        pinned = [s for s in open_store(store.as_uri()).catalog() if s.pinned]
        assert len(pinned) == 1
        for p in flood:
            run(eng, [p])
        assert sum(s.nbytes for s in open_store(store.as_uri()).catalog()) <= 1 << 20
        tokens, cached = run(eng, [system, other])
        # the other shares its first 64 tokens with the pinned one: only they are found
        assert tokens == want and cached == [192, 64]
        stats = engine_run.connector_stats()  # the worker's: it pinned what it wrote
        assert stats["segments_retained"] >= 1 and stats["pins_refused"] == 0
    finally:
        eng.close()
