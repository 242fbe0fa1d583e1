"""A stack of tiers under a running vLLM (issue 49 item 5): ``mem://`` over ``file://``
over ``s3://`` (a real SeaweedFS, ``tests/support/s3_servers.py``).  The engine runs in
this process, so its ``mem://`` pool is this process's and a test empties a tier between
rounds as an eviction would; every output is compared token by token with an engine
without a connector, and which tier served a hit is read from the tier counters
(``tier_hits.N`` in the connector's stats, ``vllm:hurraykv_tier_hits`` in /metrics)."""

from __future__ import annotations

import contextlib
import time
import uuid
from pathlib import Path

import pytest
from tests.support.s3_fixtures import s3_server, s3_url  # noqa: F401 - fixtures
from tests.support.s3_servers import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3

from engine_tests.conftest import Engine, docs_shell_blocks, kv_transfer_config
from engine_tests.test_vllm_connector import BLOCK, prompts
from engine_tests.test_vllm_faults import generate, want  # noqa: F401 - fixture
from hurraykv.chunks.urls import open_store
from hurraykv.integrations import engine_run

BOTH = [192, 160]  # the prompts' tokens a full hit reuses (whole blocks, not the last)


def tiered(tiers: list[dict], **extra) -> dict:
    return {"url": tiers[0]["url"], "role": "kv_both", "extra": {"tiers": tiers, **extra}}


def mem_tier() -> dict:
    """A ``mem://`` pool of this test's own (pools live as long as this process)."""
    return {"url": f"mem://t{uuid.uuid4().hex[:12]}", "max_bytes": "256M"}


def counts(kind: str, tiers: int) -> list[int]:
    stats = engine_run.connector_stats()
    return [stats.get(f"tier_{kind}.{t}", 0) for t in range(tiers)]


def settled(tiers: int, timeout: float = 30.0) -> None:
    """Wait until every tier below the first holds what the first was written
    (write-through copies and promotions go through the stack's queue)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        writes, failed = counts("writes", tiers), counts("writes_failed", tiers)
        if all(w + f >= writes[0] for w, f in zip(writes[1:], failed[1:], strict=True)):
            return
        time.sleep(0.05)
    raise AssertionError(f"the lower tiers did not catch up: writes {writes}")


def emptied(url: str, **options) -> int:
    """Every segment of tier ``url`` removed (as its evictions would); how many."""
    store = open_store(url, **options)
    try:
        return len(store.clear(None))
    finally:
        store.close()


def test_a_prompt_is_served_from_each_tier_and_promoted_into_memory(
        tiny_llama, tmp_path, want, s3_url):  # noqa: F811 - fixtures
    """Stored through ``mem://`` > ``file://`` > ``s3://`` (write-through), then served
    by each tier in turn once the tiers above it are emptied, tokens equal to no
    connector's every time; a hit from a lower tier is promoted, so the next one comes
    from ``mem://``."""
    mem = mem_tier()
    tiers = [mem, {"url": (tmp_path / "kv").as_uri()}, {"url": s3_url}]
    eng = Engine(tiny_llama, block_size=BLOCK, connector=tiered(tiers, async_save=False))
    both = list(prompts())
    try:
        tokens, cached, _ = generate(eng, both)
        assert tokens == want and cached == [0, 0]
        settled(3)
        written = counts("writes", 3)
        assert written[0] >= 2 and written[1] == written[2] == written[0]

        served = counts("hits", 3)
        tokens, cached, _ = generate(eng, both)
        assert tokens == want and cached == BOTH
        hits = [a - b for a, b in zip(counts("hits", 3), served, strict=True)]
        assert hits[0] >= 2 and hits[1:] == [0, 0], hits

        for emptied_tier in (0, 1):  # then served by file://, then by s3://
            for tier in tiers[:emptied_tier + 1]:
                assert emptied(tier["url"], **({"max_bytes": 1} if tier is mem else {}))
            served, promoted = counts("hits", 3), counts("promotions", 3)
            tokens, cached, _ = generate(eng, both)
            assert tokens == want and cached == BOTH
            hits = [a - b for a, b in zip(counts("hits", 3), served, strict=True)]
            assert hits[emptied_tier + 1] >= 2 and sum(hits) == hits[emptied_tier + 1], hits
            deadline = time.monotonic() + 30
            while counts("promotions", 3)[0] - promoted[0] < hits[emptied_tier + 1]:
                assert time.monotonic() < deadline, counts("promotions", 3)
                time.sleep(0.05)
            served = counts("hits", 3)
            tokens, cached, _ = generate(eng, both)  # promoted: from memory now
            assert tokens == want and cached == BOTH
            hits = [a - b for a, b in zip(counts("hits", 3), served, strict=True)]
            assert hits[0] >= 2 and sum(hits) == hits[0], hits

        # what vLLM's hits by source are told (vllm:prompt_tokens_cached_by_source): the
        # host's memory, this host's disk, a remote store
        for emptied_tiers, source in ((0, "host"), (1, "disk"), (2, "external_unspecified")):
            for tier in tiers[:emptied_tiers]:
                emptied(tier["url"], **({"max_bytes": 1} if tier is mem else {}))
            promoted = counts("promotions", 3)[0]
            assert hit_sources(eng, both[0]) == {source: BOTH[0]}
            if emptied_tiers:  # its promotion done before a tier is emptied again
                until_counted(lambda p=promoted: counts("promotions", 3)[0] > p)
    finally:
        eng.close()


def until_counted(done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not counted in time"
        time.sleep(0.05)


def hit_sources(eng: Engine, prompt: list[int]) -> dict[str, int]:
    """``get_external_cache_hit_sources`` of a request of ``prompt`` once its hit is
    loaded, as vLLM's scheduler calls it after the allocation (``scheduler.py:1306``)."""
    [rid] = eng.add([prompt], max_tokens=8)
    eng.step_until_computed(rid, BOTH[0])
    request = eng.core.scheduler.requests[rid]
    got = eng.core.scheduler.connector.get_external_cache_hit_sources(request, BOTH[0])
    eng.run_to_end()
    return {k.value: v for k, v in got.items()}


def test_the_s3_tier_stopped_fails_no_request_and_serves_again_once_back(
        tiny_llama, tmp_path, want, monkeypatch):  # noqa: F811 - fixture
    """``mem://`` > ``s3://``; the S3 server killed while requests that only it can serve
    are under way: every request still succeeds with the same tokens (loaded before it
    went, or recomputed), hits from memory go on, new prompts are stored in memory;
    restarted (its data on disk), the tier's breaker lets it back by itself and what it
    stored before is served from it again."""
    server = SeaweedS3(tmp_path / "seaweed")
    server.start("stopped")
    for name, value in (("AWS_ACCESS_KEY_ID", ACCESS_KEY), ("AWS_SECRET_ACCESS_KEY",
                        SECRET_KEY), ("AWS_REGION", REGION),
                        ("AWS_ENDPOINT_URL", server.endpoint)):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    mem = mem_tier()
    with contextlib.ExitStack() as stack:
        stack.callback(server.stop)
        eng = Engine(tiny_llama, block_size=BLOCK, connector=tiered(
            [mem, {"url": "s3://stopped/kv"}], async_save=False, max_backoff_s=1.0))
        stack.callback(eng.close)
        both = list(prompts())
        assert generate(eng, both)[:2] == (want, [0, 0])
        settled(2)

        emptied(mem["url"], max_bytes=1)  # in s3:// alone now
        tokens, cached, _ = generate(eng, both, after_step=server.kill)  # down mid-run
        assert tokens == want
        generate(eng, both)  # what the kill kept out of memory (a promotion) is there now
        tokens, cached, _ = generate(eng, both)
        assert tokens == want and cached == BOTH  # memory serves
        tokens, cached, _ = generate(eng, [p[::-1] for p in both])  # new: stored above
        assert cached == [0, 0]
        looked_up = eng.core.scheduler.connector.ctx.tier_counts  # the scheduler's stack
        assert looked_up["outages"][1] >= 1  # its lookups: the other tier answered
        deadline = time.monotonic() + 30
        while not counts("writes_failed", 2)[1]:  # the write-through copy, behind
            assert time.monotonic() < deadline, counts("writes", 2)
            time.sleep(0.1)

        server.start("stopped")  # back, with what it stored before
        time.sleep(1.2)  # past the breaker's backoff: the next call probes it
        served = counts("hits", 2)
        deadline = time.monotonic() + 30
        while True:  # the probe may be the first lookup: a miss, then served
            emptied(mem["url"], max_bytes=1)  # what a miss stored again too
            tokens, cached, _ = generate(eng, both)
            assert tokens == want
            if cached == BOTH:
                break
            assert time.monotonic() < deadline, "the s3:// tier never served again"
            time.sleep(0.5)
        assert counts("hits", 2)[1] - served[1] >= 2


def docs_tiers(store: Path) -> dict:
    """docs/vllm.md's two-tier quickstart: its ``--kv-transfer-config`` as written, the
    directory moved to ``store``."""
    config = kv_transfer_config(docs_shell_blocks("Tiers")[0])
    assert [t["url"] for t in config["kv_connector_extra_config"]["tiers"]] == [
        "mem://", "file:///tmp/hurraykv"]
    config["kv_connector_extra_config"]["tiers"][1]["url"] = store.as_uri()
    return config


def test_the_docs_two_tiers_keep_cache_salts_apart_and_a_reset_clears_both(
        tiny_llama, tmp_path, want):  # noqa: F811 - fixture
    """The Tiers quickstart's config as written (``mem://`` over ``file://``), in an
    engine: a prompt stored under one ``cache_salt`` is not served to another salt from
    either tier; vLLM's ``reset_prefix_cache(reset_connector=True)`` empties both tiers
    of this engine's segments, and the prompts are computed again with the same
    tokens."""
    config = docs_tiers(tmp_path / "kv")
    extra = config["kv_connector_extra_config"]
    mem, lower = extra["tiers"][0]["url"], extra["tiers"][1]["url"]
    emptied(mem, max_bytes=1)  # the process's unnamed pool: another test's leftovers
    eng = Engine(tiny_llama, block_size=BLOCK, connector={
        "name": config["kv_connector"], "url": mem, "role": config["kv_role"],
        "extra": dict(extra, async_save=False)})
    both = list(prompts())
    try:
        assert generate(eng, both, salts=["a", "a"])[:2] == (want, [0, 0])
        settled(2)
        assert generate(eng, both, salts=["b", "b"])[:2] == (want, [0, 0])
        assert emptied(mem, max_bytes=1)  # "a" only in the lower tier now
        assert generate(eng, both, salts=["b", "b"])[:2] == (want, BOTH)  # b's own
        assert generate(eng, both, salts=["a", "a"])[:2] == (want, BOTH)
        settled(2)

        assert eng.llm.reset_prefix_cache(reset_connector=True) is True
        for url, options in ((mem, {"max_bytes": 1}), (lower, {})):
            store = open_store(url, **options)
            try:
                assert store.catalog() == [], url
            finally:
                store.close()
        assert generate(eng, both, salts=["a", "a"])[:2] == (want, [0, 0])
    finally:
        eng.close()
        emptied(mem, max_bytes=1)


pytestmark = pytest.mark.xdist_group("tiers")
