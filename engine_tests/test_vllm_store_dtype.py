"""``store_dtype`` in running vLLM engines (issue 22): segments stored at int8, int4 or
fp8 are reloaded by a fresh engine of the same configuration (``num_cached_tokens`` the
stored prefix), a reloaded int8 cache keeps the tiny model's greedy tokens, every format
its first token and the log-probabilities of it within a documented tolerance, and chunks of
another precision are loaded only by an engine that lists them in
``accept_store_dtypes``."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hurraykv as hk
from engine_tests.conftest import run_engine, shared_store, skip_unless_cpu_takes
from engine_tests.test_vllm_connector import BLOCK, conn, prompts, spec
from hurraykv.integrations import engine_run

LOGPROBS = 5  # top log-probabilities asked of each generated token
# docs/vllm.md: how far a reloaded format's first-token log-probabilities may be from an
# engine's without a connector on the test prompts (measured: at most 0.0003, 0.0027 and
# 0.001; over 200 prompts, the chosen token's at most 0.00043, 0.007 and 0.0012: docs/benchmarks.md)
TOLERANCE = {"int8": 0.002, "int4": 0.01, "fp8": 0.005}


@pytest.fixture(scope="module")
def plain(tiny_llama, plain_run) -> list[dict]:
    """Each prompt's output (greedy tokens, log-probabilities) without a connector."""
    return plain_run(dict(spec(tiny_llama, None, list(prompts())), logprobs=LOGPROBS))["outputs"]


def _segments(store):
    return sorted(store.glob("*.hrry"))


def stored_int4(tmp_path_factory, model, store) -> None:
    """The first prompt stored at int4 into ``store`` by an engine of its own (one engine
    a run for the tests that start from it, its directory copied)."""
    first, _ = prompts()
    shared_store(tmp_path_factory,
                 lambda url: spec(model, conn(url, store_dtype="int4"), [first]), store)


@pytest.mark.parametrize(("store_dtype", "quantization", "dtype"), [
    ("int8", None, "int8"), ("int4", None, "int4"), ("fp8", None, "float8_e4m3"),
    ("int8", "per_channel", "int8")])
def test_each_store_dtype_stores_and_reloads(tiny_llama, tmp_path, plain, store_dtype,
                                             quantization, dtype):
    store = tmp_path / "kv"
    extra = {"store_dtype": store_dtype}
    if quantization:
        extra["quantization"] = quantization
    first, second = prompts()
    saved = run_engine(spec(tiny_llama, conn(store.as_uri(), **extra), [first]), tmp_path,
                       "store")
    assert saved["stats"]["chunks_saved"] == len(first) // BLOCK
    out = run_engine(dict(spec(tiny_llama, conn(store.as_uri(), **extra), [first, second]),
                          logprobs=LOGPROBS), tmp_path, "reuse")
    assert [o["num_cached_tokens"] for o in out["outputs"]] == [192, 64]
    assert out["stats"]["chunks_loaded"] == 8 and out["stats"]["chunks_failed"] == 0
    segments = _segments(store)
    snap = hk.load_snapshot(segments[0])
    assert snap.dtype == dtype and snap.model.endswith(f";store={store_dtype}" + (
        f":{quantization or 'per_block_affine'}" if store_dtype != "fp8" else ""))
    # a quarter (int8, fp8) or an eighth (int4) of the float32 pages, plus the scales
    pages = snap.tensor(0, "key")
    full = pages.num_pages * pages.page_size * pages.num_heads * pages.head_dim * 4
    stored = snap.descriptor(0, "key").buffers[0].byte_size
    assert stored == full // (8 if store_dtype == "int4" else 4)
    p = subprocess.run([sys.executable, "-m", "hurraykv.cli", "inspect", str(segments[0])],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    assert ("fp8 scales" if store_dtype == "fp8" else f"quantization: "
            f"{quantization or 'per_block_affine'} {store_dtype}") in p.stdout
    # docs/vllm.md ("Choosing a store dtype"): on the test prompts every format keeps the
    # first greedy token, and the first token's log-probabilities (of the tokens in both
    # engines' top 5) within TOLERANCE of an engine without a connector.  A load that
    # wrote zeros moved them by 0.05 (the chosen token) to 92 (others).
    for got, without in zip(out["outputs"], plain, strict=True):
        assert got["tokens"][0] == without["tokens"][0]
        ours, theirs = got["logprobs"][0], without["logprobs"][0]
        both = ours.keys() & theirs.keys()
        assert str(without["tokens"][0]) in both
        worst = max(abs(ours[t] - theirs[t]) for t in both)
        assert worst <= TOLERANCE[store_dtype], (store_dtype, worst)
    if store_dtype == "int8":
        # Measured on the tiny random Llama (float32): the reloaded int8 cache gives the
        # reference's greedy tokens exactly, for both prompts.
        assert [o["tokens"] for o in out["outputs"]] == [w["tokens"] for w in plain]


def test_int4_chunks_load_only_where_accepted(tiny_llama, tmp_path, tmp_path_factory):
    store = tmp_path / "kv"
    first, _ = prompts()
    stored_int4(tmp_path_factory, tiny_llama, store)
    plain = run_engine(spec(tiny_llama, conn(store.as_uri()), [first]), tmp_path, "auto")
    assert plain["outputs"][0]["num_cached_tokens"] == 0
    assert plain["stats"]["chunks_loaded"] == 0
    # the auto engine stored its own chunks: at full precision, under its own identity
    assert {hk.load_snapshot(p).dtype for p in _segments(store)} == {"int4", "float32"}
    accepting = run_engine(spec(tiny_llama, conn(store.as_uri(), accept_store_dtypes=[
        "int4"]), [first]), tmp_path, "accepting")
    # its own full-precision chunks win the tie with the int4 ones
    assert accepting["outputs"][0]["num_cached_tokens"] == 192
    assert accepting["stats"]["chunks_loaded"] == 6


def test_int4_chunks_alone_are_loaded_by_an_accepting_auto_engine(tiny_llama, tmp_path,
                                                                   tmp_path_factory):
    store = tmp_path / "kv"
    first, _ = prompts()
    stored_int4(tmp_path_factory, tiny_llama, store)
    out = run_engine(spec(tiny_llama, conn(store.as_uri(), accept_store_dtypes="int4"),
                          [first]), tmp_path, "accepting")
    assert out["outputs"][0]["num_cached_tokens"] == 192
    assert out["stats"]["chunks_loaded"] == 6 and out["stats"]["chunks_failed"] == 0
    # what it loaded at int4 is not stored again as full precision
    assert out["stats"]["chunks_saved"] == 0
    assert {hk.load_snapshot(p).dtype for p in _segments(store)} == {"int4"}


def test_a_store_dtype_the_cache_cannot_take_is_refused_at_start(tiny_llama, tmp_path):
    skip_unless_cpu_takes("float32", "fp8")  # else vLLM refuses the fp8 cache itself
    result = engine_run.run(spec(tiny_llama, conn((tmp_path / "kv").as_uri(),
                                                  store_dtype="int8"), [[1, 2, 3]],
                                 kv_cache_dtype="fp8"), tmp_path, "refused")
    assert result["code"] != 0
    assert ("kv_connector_extra_config['store_dtype'] is 'int8' but kv_cache_dtype is "
            "'fp8'") in result["log"]
