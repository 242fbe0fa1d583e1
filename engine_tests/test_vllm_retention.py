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
from hurraykv.integrations.chunks import ChunkKeys, identity_digest, identity_key, open_store
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
