"""``integrations/vllm/metrics.py`` and ``events.py`` against vLLM's own classes (stats logging,
Prometheus, KV events encoding and ZMQ publisher), with the shipped ``HurrayConnector`` as
the class vLLM resolves.  No engine is started: fast.

The main venv has no vLLM (``.venv`` cannot ``import vllm``), so these live here and run
with ``.venv-vllm/bin/python -m pytest engine_tests/test_vllm_metrics.py``."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from prometheus_client import REGISTRY
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from engine_tests.conftest import ask
from hurraykv.integrations.vllm import HurrayConnector
from hurraykv.integrations.vllm import events as vllm_events
from hurraykv.integrations.vllm import metrics as vllm_metrics
from hurraykv.integrations.vllm.events import HurrayKVEvents, SavedSegments, WorkerSegments
from hurraykv.integrations.vllm.metrics import (
    METRICS,
    CounterDeltas,
    HurrayConnectorStats,
)


def _vllm_config() -> VllmConfig:
    """The shipped connector, selected as docs/vllm.md tells users to select it."""
    return VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="HurrayConnector", kv_role="kv_both",
        kv_connector_module_path="hurraykv.integrations.vllm",
        kv_connector_extra_config={"url": "file:///nonexistent"}))


def _unregister_ours() -> None:
    for collector in list(REGISTRY._collector_to_names):
        if any(n.startswith("vllm:hurraykv_") for n in REGISTRY._collector_to_names[collector]):
            REGISTRY.unregister(collector)


# ------------------------------------------------------------------ stats
def test_deltas_aggregate_and_reduce() -> None:
    counters = {"chunks_loaded": 0, "bytes_loaded": 0, "load_seconds": 0.0, "flag": True}
    deltas = CounterDeltas(counters, chunk_size=32, extra=lambda: {"store_outages": 0})
    assert deltas.take() is None  # nothing changed: vLLM sends nothing
    counters.update(chunks_loaded=3, bytes_loaded=3_000_000, load_seconds=0.5)
    first = deltas.take()
    assert first.data == {"chunks_loaded": 3, "bytes_loaded": 3_000_000, "load_seconds": 0.5,
                          "tokens_loaded": 96}
    assert deltas.take() is None
    counters["chunks_loaded"] = 5
    second = deltas.take()
    assert second.data == {"chunks_loaded": 2, "tokens_loaded": 64}
    # rank 1 of a tensor-parallel group reports bytes and seconds, not chunk counts
    other = CounterDeltas({"chunks_loaded": 5, "bytes_loaded": 10}, chunk_size=32, rank=1)
    assert other.take().data == {"bytes_loaded": 10}

    total = first.aggregate(second).aggregate(HurrayConnectorStats(data={}))
    assert total.data["chunks_loaded"] == 5 and total.data["tokens_loaded"] == 160
    sched = HurrayConnectorStats(data={"lookups": 4, "lookup_hits": 1})
    reduced = total.aggregate(sched).reduce()
    assert reduced["lookup_hit_rate"] == 0.25
    assert reduced["loaded_MB_per_s"] == 6.0
    assert HurrayConnectorStats(data={"lookups": 0}).is_empty()
    total.reset()
    assert total.is_empty()


def test_worker_stats_merge_through_vllm_aggregator() -> None:
    # vllm/distributed/kv_transfer/kv_connector/utils.py:132-141 sums the workers' stats
    outs = [ModelRunnerOutput(req_ids=[], req_id_to_index={},
                              kv_connector_output=KVConnectorOutput(
                                  kv_connector_stats=HurrayConnectorStats(data=d)))
            for d in ({"bytes_saved": 10, "chunks_saved": 1}, {"bytes_saved": 7})]
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outs)
    assert merged.kv_connector_output.kv_connector_stats.data == {"bytes_saved": 17,
                                                                  "chunks_saved": 1}


def test_stats_payload_survives_vllm_serialisation() -> None:
    # The scheduler ships to_dict() in SchedulerStats (vllm/v1/core/sched/scheduler.py:2937)
    # to the front end through msgspec (vllm/v1/serial_utils.py MsgpackEncoder).
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = HurrayConnectorStats(data={"lookups": 2, "load_seconds": 0.25})
    sent = SchedulerStats(kv_connector_stats=stats.to_dict())
    got = MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(sent))
    assert got.kv_connector_stats == {"lookups": 2, "load_seconds": 0.25}


def test_vllm_logging_and_prometheus_accept_the_stats() -> None:
    config = _vllm_config()
    # the class vLLM's stats logger and Prometheus exporter ask for their objects
    # (kv_connector/v1/metrics.py:57 and :156) is the one it loads as the connector
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is HurrayConnector
    # vllm/v1/metrics/loggers.py:132 and :239 -- the periodic log line
    logging = KVConnectorLogging(config.kv_transfer_config)
    logging.observe({"lookups": 3, "lookup_hits": 3, "chunks_loaded": 6})
    logging.observe({"lookups": 1, "lookup_misses": 1})
    lines: list[str] = []
    logging.log(lambda fmt, s: lines.append(fmt % s))
    assert lines and "lookups=4" in lines[0] and "lookup_hit_rate=0.75" in lines[0]

    # vllm/v1/metrics/loggers.py:507-520 builds the labels and KVConnectorProm like this,
    # and :1197-1200 calls observe(scheduler_stats.kv_connector_stats, engine_idx)
    _unregister_ours()
    try:
        labelnames = ["model_name", "engine"]
        per_engine_labelvalues = {idx: ["tiny", str(idx)] for idx in (0, 1)}
        prom = KVConnectorProm(config, labelnames, per_engine_labelvalues)
        assert isinstance(prom.prom_metrics, vllm_metrics.HurrayPromMetrics)
        prom.observe({"lookups": 2, "bytes_loaded": 4096, "load_seconds": 0.5,
                      "not_a_metric": 9}, 0)
        prom.observe({"lookups": 1}, 1)
        prom.observe({"lookups": 5}, 0)

        def value(name: str, engine: str) -> float | None:
            return REGISTRY.get_sample_value(f"{name}_total",
                                             {"model_name": "tiny", "engine": engine})

        assert value("vllm:hurraykv_lookups", "0") == 7
        assert value("vllm:hurraykv_lookups", "1") == 1
        assert value("vllm:hurraykv_loaded_bytes", "0") == 4096
        assert value("vllm:hurraykv_load_seconds", "0") == 0.5
        assert value("vllm:hurraykv_evictions", "0") == 0  # every metric exists from start
        # a gauge of the sum of its deltas, per engine (issue 46 item 16: saves in flight)
        prom.observe({"saves_attempted": 5, "saves_pending": 5}, 0)
        prom.observe({"segments_saved": 3, "saves_pending": -3}, 0)
        assert REGISTRY.get_sample_value("vllm:hurraykv_pending_saves",
                                         {"model_name": "tiny", "engine": "0"}) == 2
        assert value("vllm:hurraykv_attempted_saves", "0") == 5
        names = {m.name for m in REGISTRY.collect()}
        assert {METRICS[k][0] for k in METRICS} <= names
    finally:
        _unregister_ours()


def test_each_tier_has_its_counters_labelled_with_its_url() -> None:
    """With ``tiers``, what each tier counted (``tier_KIND.INDEX`` in the payload, from
    ``CounterDeltas`` over the stacks' shared counts) reaches Prometheus labelled
    ``tier`` with the tier's URL (issue 49 item 2: operations)."""
    tiers = [{"url": "mem://", "max_bytes": "1G"}, {"url": "file:///nonexistent"}]
    config = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="HurrayConnector", kv_role="kv_both",
        kv_connector_module_path="hurraykv.integrations.vllm",
        kv_connector_extra_config={"tiers": tiers}))
    counts = {"hits": [0, 0], "promotions": [0, 0], "outages": [0, 0]}
    deltas = CounterDeltas({}, extra=lambda: vllm_metrics.tier_payload(counts))
    counts["hits"][1], counts["promotions"][0] = 2, 1
    first = deltas.take()
    counts["hits"][0] += 1
    _unregister_ours()
    try:
        prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["tiny", "0"]})
        prom.observe(first.data, 0)
        prom.observe(deltas.take().data, 0)

        def value(name: str, tier: str) -> float | None:
            return REGISTRY.get_sample_value(f"{name}_total", {
                "model_name": "tiny", "engine": "0", "tier": tier})

        assert value("vllm:hurraykv_tier_hits", "file:///nonexistent") == 2
        assert value("vllm:hurraykv_tier_hits", "mem://") == 1
        assert value("vllm:hurraykv_tier_promotions", "mem://") == 1
        assert value("vllm:hurraykv_tier_outages", "file:///nonexistent") == 0
    finally:
        _unregister_ours()


def test_the_docs_metrics_table_names_every_metric() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    start = docs.index("**Metrics.**")
    table = docs[start:docs.index("**KV events", start)]
    # a row names its first metric whole, then suffixes
    for name, _ in [*METRICS.values(), *vllm_metrics.TIER_METRICS.values()]:
        suffix = name.removeprefix("vllm:hurraykv")
        assert f"`{name}`" in table or f"`{suffix}`" in table, name


def test_the_shipped_connectors_counts_reach_vllms_log_and_prometheus(tiny_llama, tmp_path
                                                                     ) -> None:
    """``HurrayConnector`` built as vLLM builds it: the engine's config from the arguments
    ``LLM(...)`` takes (``EngineArgs.create_engine_config``, as ``LLM.__init__`` does), the
    scheduler's connector from ``KVConnectorFactory.create_connector(config, SCHEDULER,
    kv_cache_config)`` (``vllm/v1/core/sched/scheduler.py:176-180``, which calls
    ``connector_cls(config, role, kv_cache_config)``, ``kv_connector/factory.py:75``).  Its
    lookups, a miss and a hit, travel as ``Scheduler.update_from_output`` and
    ``make_stats`` send them (``scheduler.py:2342`` and ``:2938``) to vLLM's log line
    and Prometheus counters."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    import hurraykv as hk
    from hurraykv.chunks.keys import ChunkKeys
    from hurraykv.chunks.urls import open_store
    from hurraykv.integrations import engine_run
    from hurraykv.io import checksums

    url = (tmp_path / "kv").as_uri()
    config = EngineArgs(**engine_run.engine_kwargs(
        {"model": str(tiny_llama), "connector": {"url": url}})).create_engine_config()
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)
    try:
        assert type(connector) is HurrayConnector
        prompt = list(range(1, 101))

        def lookup(req_id: str) -> int:
            request = Request(req_id, prompt, SamplingParams(max_tokens=1), None)
            try:
                return ask(connector, request)[0]
            finally:
                connector.request_finished(request, [])

        assert lookup("miss") == 0
        pages = 2
        pool = np.zeros((pages, 32, 1, 8), np.float16)
        segment = checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
            [pool], [pool], np.arange(pages), [0, pages], [pages * 32]))
        store = open_store(url)
        store.put(ChunkKeys(connector.seed, 32).upto(prompt, 2), 0, segment, {})
        store.close()
        assert lookup("hit") == 64
        stats = connector.get_kv_connector_stats()
        assert connector.get_kv_connector_stats() is None  # deltas: nothing new since
        payload = MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(
            SchedulerStats(kv_connector_stats=stats.to_dict()))).kv_connector_stats
        lines: list[str] = []
        logging = KVConnectorLogging(config.kv_transfer_config)
        logging.observe(payload)
        logging.log(lambda fmt, s: lines.append(fmt % s))
        assert "lookups=2" in lines[0] and "lookup_hit_rate=0.5" in lines[0]
        _unregister_ours()
        try:
            prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["tiny", "0"]})
            prom.observe(payload, 0)
            labels = {"model_name": "tiny", "engine": "0"}
            assert [REGISTRY.get_sample_value(f"vllm:hurraykv_{name}_total", labels)
                    for name in ("lookups", "lookup_hits", "lookup_misses")] == [2, 1, 1]
        finally:
            _unregister_ours()
    finally:
        connector.shutdown()


# ------------------------------------------------------------------ events
BLOCK = 4


def _request(tokens: list[int], lora: LoRARequest | None = None) -> Request:
    """A vLLM Request with the engine's own block hasher (as EngineCore builds it:
    vllm/v1/engine/core.py:239, get_request_block_hasher(hash_block_size, caching_hash_fn))."""
    init_none_hash(sha256_cbor)
    return Request("r", tokens, SamplingParams(max_tokens=1), None, lora_request=lora,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


def _published(req: Request) -> list:
    """The request's block hashes as vLLM publishes them (bytes, or 64-bit ints under
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: vllm/v1/core/kv_cache_utils.py:96-99)."""
    return [maybe_convert_block_hash(h) for h in req.block_hashes]


def test_events_carry_vllm_block_hashes_and_round_trip() -> None:
    req = _request(list(range(100, 124)))  # 6 blocks of 4, chunks of 8 tokens: 3 chunks
    ev = HurrayKVEvents(BLOCK, 8, ranks=2, locality="REMOTE")
    ev.expect("r/k1", req, 1, 2)  # chunks 1-2: blocks 2..5
    ev.confirm(["r/k1"])
    assert ev.take_events() == []  # one rank of two has written it
    ev.confirm(["r/k1", "unknown"])
    stored, = ev.take_events()
    assert stored.block_hashes == _published(req)[2:6]  # vLLM's own hashes
    assert stored.parent_block_hash == _published(req)[1]
    assert stored.token_ids == list(range(108, 124)) and stored.block_size == BLOCK
    assert (stored.medium, stored.ownership, stored.locality) == (
        MEDIUM_STORAGE, "hurraykv", "REMOTE")
    ev.expect("r/k0", req, 0, 1)
    ev.forget(["r/k0"])
    ev.confirm(["r/k0", "r/k0"])
    assert ev.take_events() == []  # dropped: never announced
    assert ev.removed(req, 0, 3) == 4  # only the announced blocks 2..5
    removed, = ev.take_events()
    assert removed.block_hashes == _published(req)[2:6]
    assert ev.removed(req, 0, 3) == 0 and ev.take_events() == []

    # the scheduler publishes KVEventBatch(ts, events) (vllm/v1/core/sched/scheduler.py:2381)
    # and ZmqEventPublisher encodes it with msgspec.msgpack.Encoder
    # (vllm/distributed/kv_events.py:472-495); a router decodes it as KVEventBatch
    batch = KVEventBatch(ts=time.time(), events=[stored, removed], data_parallel_rank=0)
    got = msgspec.msgpack.Decoder(type=KVEventBatch).decode(
        msgspec.msgpack.Encoder().encode(batch))
    assert got.events == [stored, removed]
    assert isinstance(got.events[0], BlockStored) and isinstance(got.events[1], BlockRemoved)
    assert got.events[0].block_hashes[0] == _published(req)[2]


def test_disabled_events_are_noops_and_lora_is_carried() -> None:
    req = _request(list(range(16)), lora=LoRARequest("ad", 3, "/nonexistent"))
    off = HurrayKVEvents(BLOCK, 4, enabled=False)
    off.stored(req, 0, 2)
    assert off.take_events() == []
    on = HurrayKVEvents(BLOCK, 4)
    on.stored(req, 0, 2)
    e, = on.take_events()
    assert (e.lora_id, e.lora_name, e.parent_block_hash) == (3, "ad", None)
    assert e.block_hashes == _published(req)[:2]


def test_saved_segments_merge_through_vllm_aggregator() -> None:
    # vllm/distributed/kv_transfer/kv_connector/utils.py:155-166 merges the workers'
    # kv_cache_events; KVConnectorOutput.is_empty (vllm/v1/outputs.py:235) tests truth
    SavedSegments.register()
    workers = [WorkerSegments(), WorkerSegments()]
    workers[0].saved("r/a")
    workers[1].saved("r/a")
    workers[1].saved("r/b")
    assert WorkerSegments().take() is None
    assert KVConnectorOutput(kv_cache_events=SavedSegments()).is_empty()
    outs = [ModelRunnerOutput(req_ids=[], req_id_to_index={},
                              kv_connector_output=KVConnectorOutput(kv_cache_events=w.take()))
            for w in workers]
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outs)
    events = merged.kv_connector_output.kv_cache_events
    assert sorted(events.get_all_events()) == ["r/a", "r/a", "r/b"]
    assert events.get_number_of_workers() == 2


def test_zmq_subscriber_receives_hurraykv_events() -> None:
    req = _request(list(range(50, 66)))
    ev = HurrayKVEvents(BLOCK, 8, locality=vllm_events.locality_of("hurray://h:1"))
    ev.stored(req, 0, 2)
    events = ev.take_events()
    endpoint = "inproc://hurraykv-events-test"
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic="kv")
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        got = None
        deadline = time.time() + 20
        while got is None and time.time() < deadline:  # PUB drops until SUB has joined
            pub.publish(KVEventBatch(ts=time.time(), events=events))
            try:
                topic, seq, payload = sub.recv_multipart()
            except zmq.Again:
                continue
            got = decoder.decode(payload)
        assert got is not None, "no batch received"
        assert topic == b"kv" and int.from_bytes(seq, "big") >= 0
        assert got.data_parallel_rank == 0
        stored, = got.events
        assert stored.block_hashes == _published(req)[:4]
        assert stored.medium == "STORAGE" and stored.locality == "REMOTE"
    finally:
        sub.close(linger=0)
        pub.shutdown()
    assert not pub._thread.is_alive()


def test_each_tier_is_announced_with_vllms_medium_once_every_rank_wrote_it(tmp_path
                                                                          ) -> None:
    """With tiers (issue 49): two tensor-parallel ranks' stacks over ``mem://`` >
    ``file://``, opened as the connector opens them (``open_stack``: each tier behind its
    guard, a rank's suffix), report into their ``WorkerSegments``; the scheduler's
    ``TierKVEvents`` announces a ``BlockStored`` in a tier once both ranks wrote their part
    there, with vLLM's ``MEDIUM_CPU`` for memory and ``MEDIUM_STORAGE`` for the directory
    and ownership ``hurraykv:INDEX:SCHEME``; what a rank's memory drops to make room is a
    ``BlockRemoved`` there, merged through vLLM's ``KVOutputAggregator``; a router
    decodes them as vLLM's classes."""
    from hurraykv.chunks.keys import segment_name
    from hurraykv.chunks.memory import copied
    from hurraykv.integrations.vllm.config import ConnectorConfig
    from hurraykv.integrations.vllm.context import open_stack
    from hurraykv.integrations.vllm.events import split_records
    from hurraykv.integrations.vllm.tier_events import TierKVEvents, TierReports, tier_tags
    from hurraykv.testing import keys, segment

    one = copied(segment(6, 0).with_info(metadata={}))[1]  # a segment of 3 chunks
    kv = (tmp_path / "kv").as_uri()
    ranks = []
    for r in range(2):  # each rank its own process, so its own memory pool
        conf = ConnectorConfig.from_extra({"tiers": [
            {"url": f"mem://events-{time.monotonic_ns()}-{r}", "max_bytes": one + one // 2},
            {"url": kv}]})
        reports = TierReports()
        ranks.append((open_stack(conf, f".tp{r}", report=reports.add),
                      WorkerSegments(reports)))
    req = _request(list(range(100, 124)))  # 6 blocks of 4: 3 chunks of 8 tokens
    ev = TierKVEvents(BLOCK, 8, ranks=2, tiers=tier_tags(["mem://", kv]))
    held, other = keys(3), keys(3)
    name = segment_name(held, 0)
    ev.expect("r/held", req, 0, 3, name)

    def step(stored: list[str]) -> list:
        """Each rank stores ``stored``; their records merged as vLLM merges them."""
        outs = []
        for stack, recorder in ranks:
            for k in stored:
                stack.put(k, 0, segment(6, 1), {})
            stack.settle()
            outs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={},
                        kv_connector_output=KVConnectorOutput(kv_cache_events=recorder.take())))
        merged = KVOutputAggregator(expected_finished_count=2).aggregate(outs)
        return split_records(merged.kv_connector_output.kv_cache_events.get_all_events())[3]

    reports = step([held])
    assert sorted(reports) == sorted([("stored", name, 0), ("stored", name, 1)] * 2)
    for _, n, tier in reports[:2]:  # rank 0's first: not whole in any tier yet
        assert not ev.tier_stored(n, tier)
    assert ev.take_events() == []
    for _, n, tier in reports[2:]:
        assert ev.tier_stored(n, tier)
    stored = ev.take_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    assert [(e.medium, e.ownership, e.locality) for e in stored] == [
        (MEDIUM_CPU, "hurraykv:0:mem", "LOCAL"), (MEDIUM_STORAGE, "hurraykv:1:file", "LOCAL")]
    assert all(e.block_hashes == _published(req) and e.token_ids == list(range(100, 124))
               for e in stored)

    for kind, n, tier in step([other]):  # memory makes room for it on each rank
        if kind == "removed":
            ev.tier_removed(n, tier)
        else:
            assert not ev.tier_stored(n, tier) and n == segment_name(other, 0)  # not planned
    removed, = ev.take_events()  # told once, by the first rank's report
    assert isinstance(removed, BlockRemoved)
    assert (removed.medium, removed.ownership, removed.block_hashes) == (
        MEDIUM_CPU, "hurraykv:0:mem", _published(req))
    batch = KVEventBatch(ts=time.time(), events=[*stored, removed])
    assert msgspec.msgpack.Decoder(type=KVEventBatch).decode(
        msgspec.msgpack.Encoder().encode(batch)).events == [*stored, removed]
    for stack, _ in ranks:
        stack.close()


@pytest.mark.parametrize("bad", [3, 6])
def test_chunk_size_must_be_a_multiple_of_the_block(bad: int) -> None:
    with pytest.raises(ValueError):
        HurrayKVEvents(BLOCK, bad)


@pytest.mark.parametrize(("url", "source"), [("file", "disk"),
                                             ("hurray://127.0.0.1:9", "external_unspecified"),
                                             ("redis://127.0.0.1:9", "external_unspecified")])
def test_hits_are_reported_from_the_stores_tier(tiny_llama, tmp_path, url, source) -> None:
    """What vLLM counts in ``vllm:prompt_tokens_cached_by_source`` (its scheduler calls
    ``get_external_cache_hit_sources`` after ``update_state_after_alloc``,
    ``scheduler.py:1306``): a ``file://`` store is this host's disk, a server or Redis a
    remote store (vLLM's ``external_unspecified``).  The OpenAI-server test reads the
    disk count from /metrics."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from hurraykv.integrations import engine_run

    url = (tmp_path / "kv").as_uri() if url == "file" else url
    config = EngineArgs(**engine_run.engine_kwargs(
        {"model": str(tiny_llama), "connector": {"url": url}})).create_engine_config()
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)
    try:
        request = Request("r", list(range(1, 101)), SamplingParams(max_tokens=1), None)
        assert {k.value: v for k, v in connector.get_external_cache_hit_sources(
            request, 64).items()} == {source: 64}
    finally:
        connector.shutdown()
