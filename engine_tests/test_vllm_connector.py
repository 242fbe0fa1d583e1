"""``HurrayConnector`` in running vLLM engines, each in its own process as a separate
deployment would be: store, reuse by prefix, proof of loading, faults, every URL kind,
disaggregated prefill/decode, bfloat16 and fp8."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hurraykv as hk
from engine_tests.conftest import run_engine, shared_store, skip_unless_cpu_takes
from hurraykv.io import checksums
from hurraykv.io.hrry import HrryFile

BLOCK = 32


def prompts() -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(1)
    first = rng.integers(1, 1000, 200).tolist()
    second = first[:64] + rng.integers(1, 1000, 100).tolist()  # shares only 64 tokens
    return first, second


def spec(model: Path, connector: dict | None, prompts_: list[list[int]], *,
         dtype: str = "float32", kv_cache_dtype: str = "auto", max_tokens: int = 8) -> dict:
    return {"model": str(model), "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
            "prompts": prompts_, "max_tokens": max_tokens, "connector": connector,
            "block_size": BLOCK}


def conn(url: str, role: str = "kv_both", **extra) -> dict:
    return {"url": url, "role": role, "extra": {"url": url, **extra}}


@pytest.fixture(scope="module")
def reference(tiny_llama, plain_run):
    """Greedy tokens of an engine without a connector, per dtype."""
    def get(dtype: str = "float32", kv_cache_dtype: str = "auto") -> list[list[int]]:
        out = plain_run(spec(tiny_llama, None, list(prompts()), dtype=dtype,
                             kv_cache_dtype=kv_cache_dtype))
        return [o["tokens"] for o in out["outputs"]]

    return get


def stored_first(tmp_path_factory, model: Path, store: Path) -> dict:
    """The first prompt stored into ``store`` by an engine of its own (``kv_both``, the
    store's defaults), as every test that starts from it stores it: one engine a run,
    its directory copied."""
    first, _ = prompts()
    out = shared_store(tmp_path_factory, lambda url: spec(model, conn(url), [first]), store)
    assert out["stats"]["chunks_saved"] == len(first) // BLOCK
    return out


def stored_both(tmp_path_factory, model: Path, store: Path) -> dict:
    """Both prompts stored into ``store`` by an engine of its own, shared as
    ``stored_first``."""
    return shared_store(tmp_path_factory, lambda url: spec(model, conn(url), list(prompts())),
                        store)


def store_then_reuse(model: Path, url: str, tmp_path: Path, *, store_role: str = "kv_both",
                     load_role: str = "kv_both", extra: dict | None = None,
                     load_extra: dict | None = None, **kw) -> dict:
    first, second = prompts()
    out = run_engine(spec(model, conn(url, store_role, **(extra or {})), [first],
                          max_tokens=1 if store_role == "kv_producer" else 8, **kw),
                     tmp_path, "store")
    assert out["stats"]["chunks_saved"] == len(first) // BLOCK
    return run_engine(spec(model, conn(url, load_role, **(load_extra or {})), [first, second],
                           **kw), tmp_path, "reuse")


@pytest.mark.parametrize("load_mode", ["auto", "async"])
def test_file_url_reuses_whole_blocks_and_keeps_the_tokens(tiny_llama, tmp_path, reference,
                                                           load_mode, tmp_path_factory):
    store = tmp_path / "kv"
    stored_first(tmp_path_factory, tiny_llama, store)  # store_then_reuse's first engine
    out = run_engine(spec(tiny_llama, conn(store.as_uri(), load_mode=load_mode),
                          list(prompts())), tmp_path, "reuse")
    first, second = out["outputs"]
    assert [first["tokens"], second["tokens"]] == reference()
    assert first["num_cached_tokens"] == (200 - 1) // BLOCK * BLOCK  # 192: the stored blocks
    assert second["num_cached_tokens"] == 64  # the shared prefix, in whole blocks
    stats = out["stats"]
    # auto: small file hits load before the forward pass; async: across steps
    kind = "loads_async" if load_mode == "async" else "loads_sync"
    assert stats["chunks_loaded"] == 8 and stats[kind] == 2
    # each load wrote both layers (a step's loads share a layer's call), from one segment
    assert stats["layers_written"] in (2, 2 * 2) and stats["segments_loaded"] == 2
    segments = _segments(store)
    aliases = (store / "aliases.log").read_text().split()[1::2]
    assert len(segments) == 2 and sorted(set(aliases)) == [p.stem for p in segments]
    assert len(aliases) == 6 + 3  # every stored chunk names its segment
    snap = hk.load_snapshot(segments[0])  # every segment is a snapshot anyone can read
    assert snap.num_layers == 2 and snap.total_tokens in (192, 96) and "float32" in snap.model
    p = subprocess.run([sys.executable, "-m", "hurraykv.cli", "inspect", str(segments[0])],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "KVCacheSnapshot(2 layers" in p.stdout


def _segments(store: Path) -> list[Path]:
    """The segment files (the chunk keys that name them are lines of aliases.log)."""
    return sorted(store.glob("*.hrry"))


def _scribble_keys(path: Path) -> None:
    """Overwrite every layer's key pages of a chunk file, in place.  The tiny random model
    attends almost uniformly, so the new keys are large enough to sharpen its attention."""
    f = HrryFile.open(path)
    spans = [(f.entry(n).data_offset, f.descriptor(n).buffers[0].byte_size) for n in f.names
             if n.endswith(".key")]
    del f
    rng = np.random.default_rng(5)
    with open(path, "r+b") as fh:
        for offset, size in spans:
            fh.seek(offset)
            fh.write((30 * rng.standard_normal(size // 4)).astype(np.float32).tobytes())


def test_altered_stored_keys_change_a_fresh_engines_tokens(tiny_llama, tmp_path, reference,
                                                           tmp_path_factory):
    store = tmp_path / "kv"
    first, _ = prompts()
    stored_first(tmp_path_factory, tiny_llama, store)
    for path in _segments(store):
        _scribble_keys(path)
        # checksummed anew, as anyone who can write the store can: a checksum detects
        # damage, not tampering, and the point here is that loaded bytes are used
        hk.save_snapshot(checksums.with_checksums(hk.load_snapshot(path)), path)
    out = run_engine(spec(tiny_llama, conn(store.as_uri()), [first]), tmp_path, "altered")
    assert out["outputs"][0]["num_cached_tokens"] == 192
    assert out["outputs"][0]["tokens"] != reference()[0]  # it loaded, it did not recompute


def test_loaded_blocks_hold_exactly_the_stored_pages(tiny_llama, tmp_path, tmp_path_factory):
    """Bit for bit: after the load, the engine's blocks are the chunk files' pages."""
    from engine_tests.conftest import Engine
    from hurraykv.adapters import vllm as hv
    from hurraykv.chunks.file.store import FileChunks
    from hurraykv.chunks.keys import ChunkKeys, identity_digest

    store = tmp_path / "kv"
    first, _ = prompts()
    stored_first(tmp_path_factory, tiny_llama, store)
    eng = Engine(tiny_llama, connector=conn(store.as_uri(), "kv_consumer"), block_size=BLOCK)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    (rid,) = eng.add([first], max_tokens=4)
    eng.step_until_computed(rid, 192)
    blocks = eng.state([rid])[0]
    loaded = hv.from_vllm(eng.kv_caches, [blocks[0][:6]], [192], backend="CPU_ATTN")
    keys = ChunkKeys(identity_digest(connector.identity), BLOCK).upto(first, 6)
    chunks = FileChunks(store)
    (name,) = set(chunks.locate(keys))  # one segment holds the six chunks
    segment = chunks.get(name)
    for layer in range(2):
        for ours, theirs in zip(loaded.layer(layer), segment.layer(layer), strict=True):
            assert np.array_equal(ours.gather(0).view(np.uint8), theirs.gather(0).view(np.uint8))
    assert connector.stats["chunks_loaded"] == 6
    # read from the file straight into the blocks (one pass) wherever the engine's
    # cache is laid out by strides (VEC); AMX tiles are read through a buffer
    tiled = any(view._tiles is not None for _, view in connector.worker.target.layers)
    direct = connector.stats["bytes_loaded_direct"]
    assert direct == (0 if tiled else connector.stats["bytes_loaded"]) and (
        tiled or direct > 0)
    eng.close()


def test_damaged_segments_are_recomputed_not_used(tiny_llama, tmp_path, reference,
                                                  tmp_path_factory):
    store = tmp_path / "kv"
    first, second = prompts()
    stored_both(tmp_path_factory, tiny_llama, store)
    truncated, corrupt = _segments(store)  # both runs stored: one cut short, one mangled
    truncated.write_bytes(truncated.read_bytes()[:1000])
    data = bytearray(corrupt.read_bytes())
    data[:8] = b"NOTHRRY!"
    corrupt.write_bytes(bytes(data))
    out = run_engine(spec(tiny_llama, conn(store.as_uri()), [first, second]), tmp_path,
                     "damaged")
    assert [o["tokens"] for o in out["outputs"]] == reference()
    assert out["stats"]["chunks_failed"] >= 1
    # both damages are parse failures, counted as corrupt: each chunk a request wanted
    # from the damaged segment it read (the chunks after it are failed, never read)
    assert 0 < out["stats"]["chunks_corrupt"] <= out["stats"]["chunks_failed"]
    assert "could not be loaded" in out["log"] and "will be recomputed" in out["log"]
    for segment in _segments(store):  # stored again, whole, once recomputed
        assert hk.load_snapshot(segment).num_layers == 2
    again = run_engine(spec(tiny_llama, conn(store.as_uri()), [first, second]), tmp_path,
                       "healed")
    assert [o["num_cached_tokens"] for o in again["outputs"]] == [192, 160]
    assert again["stats"]["chunks_failed"] == 0


def test_hurray_server_url_for_disaggregated_prefill_and_decode(tiny_llama, tmp_path,
                                                                 reference):
    server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                               "127.0.0.1:0", "--log-level", "warning"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().split()[-1]
        out = store_then_reuse(tiny_llama, f"hurray://{address}", tmp_path,
                               store_role="kv_producer", load_role="kv_consumer")
    finally:
        server.terminate()
        server.wait(10)
    assert [o["tokens"] for o in out["outputs"]] == reference()
    assert [o["num_cached_tokens"] for o in out["outputs"]] == [192, 64]
    assert out["stats"]["chunks_saved"] == 0  # a consumer only loads


def test_redis_url_for_disaggregated_prefill_and_decode(tiny_llama, tmp_path, reference,
                                                         redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushall()
    out = store_then_reuse(tiny_llama, redis_url, tmp_path, store_role="kv_producer",
                           load_role="kv_consumer")
    assert [o["tokens"] for o in out["outputs"]] == reference()
    assert [o["num_cached_tokens"] for o in out["outputs"]] == [192, 64]


def test_redis_cluster_url_with_saving_in_the_engine_thread(tiny_llama, tmp_path, reference,
                                                           redis_cluster_url):
    out = store_then_reuse(tiny_llama, redis_cluster_url, tmp_path,
                           extra={"async_save": False})
    assert [o["tokens"] for o in out["outputs"]] == reference()
    assert [o["num_cached_tokens"] for o in out["outputs"]] == [192, 64]


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("bfloat16", "auto"),
                                                       ("bfloat16", "fp8")])
def test_bfloat16_and_fp8_caches(tiny_llama, tmp_path, reference, dtype, kv_cache_dtype):
    skip_unless_cpu_takes(dtype, kv_cache_dtype)
    store = tmp_path / "kv"
    out = store_then_reuse(tiny_llama, store.as_uri(), tmp_path, dtype=dtype,
                           kv_cache_dtype=kv_cache_dtype)
    assert [o["tokens"] for o in out["outputs"]] == reference(dtype, kv_cache_dtype)
    assert [o["num_cached_tokens"] for o in out["outputs"]] == [192, 64]
    snap = hk.load_snapshot(_segments(store)[0])
    want = "float8_e4m3" if kv_cache_dtype == "fp8" else "bfloat16"
    assert snap.dtype == want and (snap.kv_scales is not None) == (kv_cache_dtype == "fp8")


def test_chunks_of_another_dtype_are_never_reused(tiny_llama, tmp_path, tmp_path_factory):
    store = tmp_path / "kv"
    first, _ = prompts()
    stored_first(tmp_path_factory, tiny_llama, store)  # float32
    out = run_engine(spec(tiny_llama, conn(store.as_uri()), [first], dtype="bfloat16"),
                     tmp_path, "bf16")
    assert out["outputs"][0]["num_cached_tokens"] == 0


def test_a_consumer_with_an_unreachable_server_computes_instead(tiny_llama, tmp_path,
                                                                 reference):
    """Nothing listens: each request waits no more than docs/vllm.md promises (the first
    store call waits up to 2 s for the connection opened at start, each failing call its
    deadline, none once 3 in a row failed), one request at a time."""
    from tests.integrations.vllm.test_vllm_stalls import CONNECT_S, FAILURES, LOOKUP_S, MARGIN

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first, second = prompts()
    out = run_engine(dict(spec(tiny_llama, conn(f"hurray://127.0.0.1:{port}"),
                               [first, second]), rounds=1), tmp_path, "unreachable")
    assert [o["tokens"] for o in out["outputs"]] == reference()
    # at most one line for the outage, not one per request and chunk (two requests'
    # lookups may be one call, and failing at once, stay under failures_before_down)
    assert out["log"].count("is failing") <= 1
    # both requests, computing included (some 50 ms here)
    assert sum(out["times"]) < CONNECT_S + FAILURES * LOOKUP_S + MARGIN, out["times"]
