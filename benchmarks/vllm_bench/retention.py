"""Tables 8 (``--only retention``): what stays in a capped store, and how soon a removal
is announced.

Retention (issue 32), ``retention``: a scan (a hot set repeated while one-off prompts
pass through a capped ``file://`` store) with plain LRU, ``store_threshold`` 2 and a
pinned system prompt; the Zipf stream with and without admission; two tenants
(``cache_salt``) with and without ``max_bytes_per_tenant``; each against exact LRU,
LRU with admission and ARC simulated at the same capacity; then the staleness window:
seconds from a segment's removal behind the engine's back to its ``BlockRemoved`` at a
ZMQ subscriber, per store and ``removal_check_s``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hurraykv.integrations.engine_run import run
from hurraykv.integrations.tiny_models import tiny_llama
from vllm_bench.engines import engine, free_port, hurray_conn
from vllm_bench.measurement import segment_bytes
from vllm_bench.simulated import arc_hits, lru_served
from vllm_bench.workloads import hot_and_one_offs, zipf_workload


def rate(served: list[bool], chosen: list[bool]) -> str:
    hits = sum(s for s, c in zip(served, chosen, strict=True) if c)
    return f"{hits}/{sum(chosen)} ({hits / max(sum(chosen), 1):.0%})"


def retention(work: Path, quick: bool) -> list[tuple[str, tuple[str, ...], list]]:
    """Issue 32: what stays in a capped ``file://`` store, one request at a time.

    1. A scan (a hot set repeated while one-off prompts pass through): the hot requests
       served with plain LRU (``store_threshold`` 1), with admission at the second
       computation (2), and with the first hot prompt sent pinned (``{"hurraykv":
       {"pin": true}}``, a system prompt: want 100%), against exact LRU, LRU with the same
       admission and ARC simulated at the same capacity.
    2. The Zipf table's stream under its quarter cap, plain LRU and admission, against the
       same simulations.
    3. Two tenants (``cache_salt``): a quiet one repeating a hot set, a noisy one sending
       one-off prompts, without and with ``max_bytes_per_tenant`` of half the cap: the
       quiet tenant's hit rate and each tenant's share of the directory at the end.
    """
    model = tiny_llama(work / "tiny-retention")
    rng = np.random.default_rng(32)
    hot, rounds, between = 4, 6 if quick else 12, 3
    stream, n_prompts = hot_and_one_offs(hot, rounds, between)
    prompts = [rng.integers(1, 1000, 200).tolist() for _ in range(n_prompts)]
    is_hot = [i < hot for i in stream]
    # the system prompt's requests after its first (which computes it: nothing can serve it)
    is_system = [i == 0 and at > stream.index(0) for at, i in enumerate(stream)]

    def spec(connector: dict | None, order: list[int], **kw) -> dict:
        return {"model": str(model), "dtype": "float32", "prompts": [prompts[i] for i in order],
                "max_tokens": 1, "rounds": 1, "connector": connector, "block_size": 32,
                "prefix_caching": False} | kw

    probe = work / "retention-probe"
    engine(spec(hurray_conn(probe.as_uri()), [0]), work, "probe")
    per_prompt = segment_bytes(probe)
    slots = hot + 2
    cap = per_prompt * slots  # a hot set and two prompts more

    def served_by(out: dict) -> list[bool]:
        return [o["num_cached_tokens"] > 0 for o in out["outputs"]]

    scan_rows = []
    pin = [{"hurraykv": {"pin": True}} if i == 0 else None for i in stream]
    for label, name, extra, kw in (
            ("hurraykv, store_threshold 1 (plain LRU)", "ret-1", {}, {}),
            ("hurraykv, store_threshold 2", "ret-2", {"store_threshold": 2}, {}),
            ("hurraykv, store_threshold 1, system prompt pinned", "ret-pin",
             {"max_pinned_bytes": per_prompt + 4096}, {"kv_transfer_params": pin})):
        store = work / name
        out = engine(spec(hurray_conn(store.as_uri(), max_bytes=cap, **extra), stream, **kw),
                     work, name)
        served = served_by(out)
        scan_rows.append((label, rate(served, is_hot), rate(served, is_system),
                          f"{sum(served)}/{len(served)}",
                          f"{out['stats']['chunks_saved']} chunks stored, "
                          f"{out['stats'].get('evictions', 0)} segments evicted"))
    for label, served in ((f"exact LRU of {slots} prompts (simulated)", lru_served(stream, slots)),
                          ("exact LRU, admitted at the 2nd computation (simulated)",
                           lru_served(stream, slots, 2)),
                          (f"ARC of {slots} prompts (simulated)", arc_hits(stream, slots))):
        scan_rows.append((label, rate(served, is_hot), rate(served, is_system),
                          f"{sum(served)}/{len(served)}", ""))
    grids = [(f"A scan: {hot} hot prompts of 200 tokens repeated {rounds} times, {between} "
              f"one-off prompts between hot requests ({len(stream)} requests, one at a time), "
              f"file:// max_bytes = {slots} prompts' segments ({cap / (1 << 20):.2f} MiB); "
              f"served from the store",
              ("contender", "hot requests", "system prompt (hot prompt 0) after its first",
               "all requests", "store"), scan_rows)]

    # 2. the Zipf stream, with admission
    n_zipf, n_requests = (20, 100) if quick else (40, 200)
    _, zstream, zspec = zipf_workload(model, n_zipf, n_requests)
    zcap = per_prompt * n_zipf // 4
    zslots = n_zipf // 4
    zipf_rows = []
    everyone = [True] * len(zstream)
    for threshold in (1, 2):
        name = f"ret-zipf-{threshold}"
        out = engine(zspec(hurray_conn((work / name).as_uri(), max_bytes=zcap,
                                       store_threshold=threshold)), work, name)
        zipf_rows.append((f"hurraykv, store_threshold {threshold}",
                          rate(served_by(out), everyone),
                          f"{out['stats'].get('evictions', 0)} evicted"))
    for label, served in ((f"exact LRU of {zslots} prompts (simulated)",
                           lru_served(zstream, zslots)),
                          ("exact LRU, admitted at the 2nd computation (simulated)",
                           lru_served(zstream, zslots, 2)),
                          (f"ARC of {zslots} prompts (simulated)", arc_hits(zstream, zslots))):
        zipf_rows.append((label, rate(served, everyone), ""))
    grids.append((f"The Zipf stream (s = 1.1, {n_requests} requests over {n_zipf} prompts of 200 "
                  f"tokens) under a cap of a quarter of its prompts ({zslots}); requests "
                  "served from the store", ("contender", "requests served", "store"),
                  zipf_rows))

    # 3. a quiet tenant and a noisy one, in a directory of room for both hot sets (each
    # tenant's quota holds the quiet one's hot set and one prompt more)
    salts = ["quiet" if i < hot else "noisy" for i in stream]
    tslots = 2 * (hot + 1)
    tcap = per_prompt * tslots
    tenant_rows = []
    for label, name, extra in (("no quota", "ret-tenants", {}),
                               ("max_bytes_per_tenant = a half", "ret-quota",
                                {"max_bytes_per_tenant": tcap // 2})):
        store = work / name
        out = engine(spec(hurray_conn(store.as_uri(), max_bytes=tcap, **extra), stream,
                          cache_salts=salts), work, name)
        owners = {}
        log = store / "tenants.log"
        for line in (log.read_text().splitlines() if log.exists() else ()):
            seg, _, tenant = line.partition(" ")
            owners[seg] = tenant
        quiet_digest = hashlib.blake2b(b"quiet", digest_size=8).hexdigest()
        shares = {"quiet": 0, "noisy": 0}
        for f in store.glob("*.hrry"):
            shares["quiet" if owners.get(f.stem) == quiet_digest else "noisy"] += \
                f.stat().st_size
        total = max(sum(shares.values()), 1)
        tenant_rows.append((label, rate(served_by(out), is_hot),
                            f"{shares['quiet'] / total:.0%} / {shares['noisy'] / total:.0%}",
                            f"{out['stats'].get('evictions', 0)} evicted"))
    grids.append((f"Two tenants (cache_salt) in one file:// directory of {tslots} prompts' "
                  f"segments: the quiet one repeats {hot} hot prompts, the noisy one sends "
                  f"{between} one-off prompts between them",
                  ("setting", "quiet tenant's requests served",
                   "directory at the end (quiet / noisy)", "store"), tenant_rows))
    return grids


def _staleness_main(spec_path: str) -> int:
    """In an engine process with KV events over ZMQ and a subscriber of its own: each
    round stores a prompt, waits for its ``BlockStored``, then removes its segment behind
    the engine's back (as another engine's eviction, a server's budget or Redis's
    maxmemory would) and keeps the engine stepping with short requests (nothing stored)
    until the ``BlockRemoved`` arrives: the seconds a router saw a prefix that was gone."""
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    import msgspec
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.inputs import TokensPrompt

    from hurraykv.chunks.urls import open_store
    from hurraykv.integrations.engine_run import engine_kwargs

    port = spec["events_port"]
    llm = LLM(**engine_kwargs(spec), kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
        topic="kv"))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 5)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False, ignore_eos=True)
    rng = np.random.default_rng(5)

    def events() -> list:
        out = []
        with contextlib.suppress(zmq.Again):
            while True:
                out += [e for e in decoder.decode(sub.recv_multipart()[-1]).events
                        if getattr(e, "medium", None) == "STORAGE"]
        return out

    store = open_store(spec["connector"]["url"])
    windows = []
    for _ in range(spec["rounds_measured"]):
        llm.generate([TokensPrompt(prompt_token_ids=rng.integers(1, 1000, 96).tolist())],
                     params, use_tqdm=False)
        deadline = time.monotonic() + 30
        while not any(isinstance(e, BlockStored) for e in events()):
            llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
            if time.monotonic() > deadline:
                raise SystemExit("no BlockStored")
        gone = time.monotonic()
        for s in store.catalog():
            store.remove(s.name)
        while not any(isinstance(e, BlockRemoved) for e in events()):
            llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
            if time.monotonic() - gone > 60:
                raise SystemExit("no BlockRemoved in 60 s")
        windows.append(time.monotonic() - gone)
    print("RESULT " + json.dumps({"windows": windows}), flush=True)
    return 0


def staleness(work: Path) -> tuple[str, tuple[str, ...], list[tuple[str, ...]]]:
    """The staleness window per backend (``_staleness_main``) with ``removal_check_s``
    at its default (1 s) and at 0.2 s."""
    model = tiny_llama(work / "tiny-staleness")
    rows = []
    with contextlib.ExitStack() as stack:
        server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                                   "127.0.0.1:0", "--log-level", "warning"],
                                  stdout=subprocess.PIPE, text=True)
        stack.callback(lambda: (server.terminate(), server.wait(10)))
        address = server.stdout.readline().split()[-1]
        redis_port = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--save", "",
                                  "--appendonly", "no"], stdout=subprocess.DEVNULL)
        stack.callback(lambda: (redis.terminate(), redis.wait(10)))
        time.sleep(0.5)
        for check in (1.0, 0.2):
            for kind, url in (("file://", (work / f"stale-{check}").as_uri()),
                              ("hurray://", f"hurray://{address}"),
                              ("redis://", f"redis://127.0.0.1:{redis_port}")):
                spec = {"model": str(model), "dtype": "float32", "block_size": 32,
                        "prefix_caching": False, "events_port": free_port(),
                        "rounds_measured": 5, "connector": hurray_conn(
                            url, async_save=False, removal_check_s=check)}
                out = run(spec, work, f"stale-{kind[:-3]}-{check}", timeout=600,
                          entry=_staleness_main)
                if out["code"] or "windows" not in out:
                    print(out["log"][-4000:], file=sys.stderr)
                    raise SystemExit(f"bench_vllm: staleness {kind} failed")
                w = out["windows"]
                rows.append((kind, f"{check:g} s", f"{np.median(w):.2f} s", f"{max(w):.2f} s",
                             str(len(w))))
    rows.append(("any, before issue 32", "-", "until a load fails", "never announced", ""))
    return ("Staleness: a segment removed behind the engine's back (another engine's "
            "eviction, a server's budget, Redis's maxmemory), the engine busy with short "
            "requests: seconds until its BlockRemoved reaches a ZMQ subscriber",
            ("store", "removal_check_s", "median", "max", "rounds"), rows)
