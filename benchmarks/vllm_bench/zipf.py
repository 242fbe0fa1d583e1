"""Table 3 (``--only zipf``): a Zipf stream over a cache smaller than the working set.

A Zipf-distributed stream of requests over a cache smaller than the working set, on
the tiny Llama of table 1: 40 distinct prompts of 200 tokens, 200 requests drawn with
a Zipf law (s = 1.1; prompts, stream and popularity order seeded, the same for every
contender), ``generate()`` of 4 tokens one request at a time, one engine process per
contender and vLLM's own prefix cache off, so every reused token came from the
connector (each output's ``num_cached_tokens``).  hurraykv ``file://`` with
``max_bytes`` set to a quarter of the distinct prompts as stored (the bytes of a
prompt measured as the unbounded store's segment files over the prompts it holds),
the same store unbounded, vLLM's ExampleConnector (no capacity), and LMCache 0.5.6 in
server mode with its LRU memory tier set to the same bytes (``--l1-size-gb``, a float
in GiB; its default eviction: 20% of the tier once a second when past 80%).  Every
contender's output tokens are compared with those of an engine without a connector
over the same stream; the capped directory's size is sampled while it runs and
reported against the cap, beside the hit rate an exact LRU of that many prompts
would reach on the stream (simulated).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hurraykv.integrations.tiny_models import tiny_llama
from vllm_bench.engines import LMCACHE_ENV, engine, free_port, hurray_conn, lmcache_python
from vllm_bench.measurement import segment_bytes, tree_bytes
from vllm_bench.simulated import lru_hits
from vllm_bench.workloads import ZIPF_MAX_TOKENS, zipf_capped, zipf_workload


def zipf(work: Path, n_prompts: int, n_requests: int
         ) -> tuple[str, tuple[str, ...], list[tuple[str, ...]]]:
    model = tiny_llama(work / "tiny-zipf")
    prompts, stream, spec = zipf_workload(model, n_prompts, n_requests)
    distinct = len(set(stream))
    prompt_tokens = sum(len(prompts[i]) for i in stream)
    max_tokens = ZIPF_MAX_TOKENS
    mib = 1 << 20
    none = engine(spec(None), work, "zipf-none")
    results: list[tuple[str, dict, str]] = []  # name, result, stored

    unbounded = work / "zipf-hkv-unbounded"
    results.append(("hurraykv file:// unbounded",
                    engine(spec(hurray_conn(unbounded.as_uri())), work, "zipf-hkv-unbounded"),
                    f"{segment_bytes(unbounded) / mib:.2f} MiB (no cap)"))
    # a prompt's KV as stored (segments, headers and all): the unbounded store holds every
    # prompt of the stream once
    per_prompt = segment_bytes(unbounded) / distinct
    kv_bytes = results[0][1]["stats"]["bytes_saved"] / distinct
    cap = int(per_prompt * n_prompts / 4)
    result, peak, final = zipf_capped(work, spec, cap, "zipf-hkv-capped")
    within = "within" if peak <= cap else "OVER"
    results.insert(0, ("hurraykv file:// max_bytes = cap", result,
                       f"{final / mib:.2f} MiB, peak {peak / mib:.2f} of {cap / mib:.2f} "
                       f"MiB cap ({within}; {result['stats'].get('evictions', 0)} evicted)"))

    example_dir = work / "zipf-example"
    example = {"name": "ExampleConnector", "module": "", "role": "kv_both",
               "extra": {"shared_storage_path": str(example_dir)}}
    results.append(("vLLM ExampleConnector", engine(spec(example), work, "zipf-example"),
                    f"{tree_bytes(example_dir) / mib:.2f} MiB (no cap)"))

    py = lmcache_python()
    # LMCache 0.5.6's server: --l1-size-gb is a float in GiB (2**30 bytes), the size of its
    # L1 memory pool; --eviction-policy LRU evicts from it in a thread that wakes once a
    # second and, past --eviction-trigger-watermark (0.8) of the pool, evicts
    # --eviction-ratio (0.2) of it: between wake-ups a full pool turns stores away.  Its
    # defaults, as a deployment would run it.
    l1_gb = cap / (1 << 30)
    port = free_port()
    lmcache = subprocess.Popen(
        [py, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost", "--port",
         str(port), "--chunk-size", "32", "--l1-size-gb", repr(l1_gb), "--eviction-policy",
         "LRU", "--supported-transfer-mode", "engine_driven", "--disable-observability"],
        env=dict(os.environ, **LMCACHE_ENV), stdout=subprocess.DEVNULL,
        stderr=open(work / "zipf-lmcache-server.log", "w"))  # noqa: SIM115 - closed with it
    try:
        time.sleep(8)  # the LMCache server binds its ZMQ socket after imports
        if lmcache.poll() is not None:
            print((work / "zipf-lmcache-server.log").read_text()[-4000:], file=sys.stderr)
            raise SystemExit("bench_vllm: the LMCache server exited")
        lm = {"name": "LMCacheMPConnector", "module": "", "role": "kv_both",
              "extra": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port}}
        results.append(("LMCache 0.5.6 (server mode), L1 LRU = cap",
                        engine(spec(lm, patch_dispatcher=True), work, "zipf-lmcache", py),
                        f"--l1-size-gb {l1_gb:.6f} ({cap / mib:.2f} MiB; evicts 20% "
                        "past 80%, checked once a second)"))
    finally:
        lmcache.terminate()
        lmcache.wait(30)

    def ms(values: list[float]) -> str:
        return f"{np.median(values) * 1e3:.1f}" if values else "-"

    def row(name: str, r: dict, stored: str) -> tuple[str, ...]:
        cached = [o["num_cached_tokens"] for o in r["outputs"]]
        hit = sum(c > 0 for c in cached)
        same = sum(o["tokens"] == b["tokens"] for o, b in zip(r["outputs"], none["outputs"],
                                                             strict=True))
        # the first request of an engine warms up: left out of the times, not the hits
        times = r["times"][1:]
        hits = [t for t, c in zip(times, cached[1:], strict=True) if c > 0]
        misses = [t for t, c in zip(times, cached[1:], strict=True) if not c]
        return (name, f"{hit}/{len(cached)} ({hit / len(cached):.0%})",
                f"{sum(cached) / prompt_tokens:.0%}",
                f"{ms(times)} ms ({ms(hits)} / {ms(misses)})", f"{np.mean(times) * 1e3:.1f} ms",
                f"{same}/{len(cached)}" + ("" if same == len(cached) else " MISMATCH"),
                stored)

    rows = [row("no connector", none, "")]
    rows += [row(*x) for x in results]
    mismatched = [r[0] for r in rows if r[5].endswith("MISMATCH")]
    if mismatched:
        print(f"bench_vllm: outputs differ from the engine without a connector: {mismatched}",
              file=sys.stderr)
    slots = int(cap // per_prompt)
    ideal = lru_hits(stream, slots)
    rows.append((f"exact LRU of {slots} prompts (simulated)",
                 f"{ideal}/{n_requests} ({ideal / n_requests:.0%})", "", "", "", "", ""))
    rows.append(("any unbounded store (simulated)",
                 f"{n_requests - distinct}/{n_requests} ({1 - distinct / n_requests:.0%})",
                 "", "", "", "", ""))
    title = (f"Zipf stream (s = 1.1): {n_requests} requests over {n_prompts} prompts of 200 "
             f"tokens ({distinct} drawn), tiny Llama float32, generate() of {max_tokens} "
             f"tokens one request at a time, vLLM prefix caching off; cap = a quarter of the "
             f"prompts as stored ({per_prompt / 1024:.0f} KiB a prompt in a segment file, "
             f"{kv_bytes / 1024:.0f} KiB of it KV); first request of each engine left out "
             "of the times")
    head = ("contender", "requests reusing KV", "prompt tokens reused",
            "time/request median (hits / misses)", "mean", "outputs = no connector",
            "stored at the end")
    return title, head, rows
