"""Preemption in a real engine: a request vLLM preempts and later resumes is asked for its
external tokens again (vllm/v1/core/sched/scheduler.py, ``schedule()``: the connector is
asked whenever ``num_computed_tokens == 0``, preempted requests included) and scheduled
as a resumed request whose blocks are all new; the connector must load the stored prefix
into those blocks, since vLLM counts it computed."""

from __future__ import annotations

import numpy as np
import pytest

from engine_tests.conftest import run_engine, shared_store

BLOCK = 32


def _spec(model, connector, prompts, **kw) -> dict:
    return {"model": str(model), "dtype": "float32", "prompts": prompts, "max_tokens": 250,
            "connector": connector, "block_size": BLOCK} | kw


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_preempted_requests_reload_their_stored_prefix_and_keep_the_tokens(
        tiny_llama, tmp_path, load_mode, tmp_path_factory, plain_run):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 1000, 200).tolist() for _ in range(8)]
    url = (tmp_path / "kv").as_uri()
    # the same store and reference for both load modes: one engine each a run
    stored = shared_store(tmp_path_factory, lambda url: _spec(
        tiny_llama, {"url": url, "role": "kv_producer", "extra": {"url": url}}, prompts,
        max_tokens=1), tmp_path / "kv")
    assert stored["stats"]["chunks_saved"] == 8 * (199 // BLOCK)
    reference = plain_run(_spec(tiny_llama, None, prompts))
    # two requests admitted at 7 blocks each grow to 15 (450 tokens): 20 blocks of 32
    # make vLLM preempt one, which later resumes into other blocks
    tight = {"num_blocks": 20, "max_model_len": 512}
    consumer = {"url": url, "role": "kv_consumer",
                "extra": {"url": url, "load_mode": load_mode}}
    out = run_engine(_spec(tiny_llama, consumer, prompts, **tight), tmp_path, "preempted")
    stats = out["stats"]
    # each request loads its 6 chunks when first scheduled; more: resumed requests reloaded
    assert stats["chunks_loaded"] > len(prompts) * (199 // BLOCK), stats
    assert stats["chunks_failed"] == 0, stats
    assert [o["tokens"] for o in out["outputs"]] == \
        [o["tokens"] for o in reference["outputs"]]
