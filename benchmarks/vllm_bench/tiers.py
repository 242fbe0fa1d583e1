"""Tables of ``--only tiers`` (issue 49): each tier's loads, and a Zipf stream through a
small ``mem://`` over a larger tier.

*Per tier*: the realistic-KV model of the connector table (16 KiB of bfloat16 KV a
token), one ``kv_both`` engine per tier with that tier alone, saves written before
``wait_for_save`` returns (``async_save`` false: the next round finds what the first
stored); its first round computes and stores the prompt, the next five are full prefix
hits loaded from the tier (vLLM's prefix cache off).  Load throughput against a 1-thread
copy of the same bytes into memory touched before, and time to first token against the
same engine without a connector.  ``s3://`` is a SeaweedFS on loopback, started here.

*Zipf*: the Zipf table's stream (tiny Llama, 200-token prompts) through a stack of a
``mem://`` of a quarter of the prompts' stored bytes over an unbounded ``file://``,
against that ``file://`` alone: the share of requests each tier served (the tier
counters), and in all.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np

from hurraykv.integrations.tiny_models import tiny_llama
from vllm_bench.connector import copy_rate, heavy_workload, per_load
from vllm_bench.engines import ROOT, engine
from vllm_bench.workloads import zipf_workload

GIB = 1 << 30


def tier_conn(tiers: list[dict], role: str = "kv_both", **extra) -> dict:
    return {"url": tiers[0]["url"], "role": role, "extra": {"tiers": tiers, **extra}}


@contextlib.contextmanager
def s3_server(work: Path):
    """A SeaweedFS on loopback (the test suite's, ``tests/support/s3_servers.py``) and
    the AWS variables an engine's ``s3://`` store reads; yields the bucket's URL."""
    import os

    sys.path.insert(0, str(ROOT))
    from tests.support.s3_servers import ACCESS_KEY, REGION, SECRET_KEY, seaweed

    with seaweed(work / "seaweed", "bench") as server:
        before = dict(os.environ)
        os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                          AWS_ENDPOINT_URL=server.endpoint, AWS_REGION=REGION)
        try:
            yield "s3://bench/kv"
        finally:
            os.environ.clear()
            os.environ.update(before)


def tier_loads(work: Path, long_tokens: int) -> list[tuple[str, str, str, str]]:
    _, spec = heavy_workload(work, long_tokens)
    cold = engine(spec(None, rounds=5), work, "tiers-cold")
    ttft_cold = float(np.median(cold["times"][1:]))
    rows: list[tuple[str, str, str, str]] = []
    rate = 0.0
    with s3_server(work) as s3:
        for tier in ({"url": "mem://", "max_bytes": "4G"},
                     {"url": (work / "tiers-file").as_uri(), "max_bytes": "8G"},
                     {"url": s3, "max_bytes": "8G"}):
            scheme = tier["url"].split(":")[0]
            r = engine(spec(tier_conn([tier], async_save=False), rounds=6,
                            touch_kv_cache=True, round_stats=True), work, f"tiers-{scheme}")
            loads = per_load(r)[1:]  # round 1 computed and stored the prompt
            if not rate:
                rate = copy_rate(int(loads[0][0]))
                rows.append(("1-thread copy of the loaded bytes into touched memory",
                             f"{rate / GIB:.2f} GiB/s", "1.00x", ""))
                rows.append((f"TTFT, {long_tokens}-token prompt, no connector (median)",
                             f"{ttft_cold * 1e3:.1f} ms", "1.00x", ""))
            rates = [b / s for b, s, _ in loads if s > 0]
            if len(rates) != len(loads) or any(b != loads[0][0] for b, _, _ in loads):
                raise SystemExit(f"bench_vllm: the {scheme}:// engine's rounds 2-6 were not "
                                 f"all full hits: {loads}")
            target = ">= 0.8x " + ("met" if max(rates[1:]) >= 0.8 * rate else "MISSED") \
                if scheme == "mem" else ""
            rows.append((f"{scheme}:// load ({int(loads[0][0]) >> 20} MiB): a process's "
                         "first, then best and median of loads 2-5",
                         f"{rates[0] / GIB:.2f}; {max(rates[1:]) / GIB:.2f}, "
                         f"{np.median(rates[1:]) / GIB:.2f} GiB/s",
                         f"{rates[0] / rate:.2f}x; {max(rates[1:]) / rate:.2f}x, "
                         f"{np.median(rates[1:]) / rate:.2f}x", target))
            hits = r["times"][1:]
            rows.append((f"{scheme}:// TTFT, full hit (first, then median)",
                         f"{hits[0] * 1e3:.1f}, {np.median(hits[1:]) * 1e3:.1f} ms",
                         f"{ttft_cold / hits[0]:.1f}x, {ttft_cold / np.median(hits[1:]):.1f}x "
                         "faster", "faster than cold " + (
                             "met" if max(hits) < ttft_cold else "MISSED")))
    return rows


def tier_zipf(work: Path, n_prompts: int, n_requests: int
              ) -> tuple[str, tuple[str, ...], list[tuple[str, ...]]]:
    model = tiny_llama(work / "tiny-tiers-zipf")
    _, stream, spec = zipf_workload(model, n_prompts, n_requests)
    alone = engine(spec({"url": (work / "tz-alone").as_uri(), "role": "kv_both",
                         "extra": {"url": (work / "tz-alone").as_uri(),
                                   "async_save": False}}), work, "tiers-zipf-file")
    per_prompt = alone["stats"]["bytes_saved"] / len(set(stream))
    cap = int(per_prompt * n_prompts / 4)
    stacked = engine(spec(tier_conn([{"url": "mem://", "max_bytes": cap},
                                     {"url": (work / "tz-lower").as_uri()}],
                                    async_save=False)), work, "tiers-zipf-stack")
    none = engine(spec(None), work, "tiers-zipf-none")

    def row(name: str, r: dict, tiers: int) -> tuple[str, ...]:
        n = len(r["outputs"])
        hit = sum(o["num_cached_tokens"] > 0 for o in r["outputs"])
        served = [r["stats"].get(f"tier_hits.{t}", 0) for t in range(tiers)] \
            if tiers > 1 else [r["stats"].get("segments_loaded", 0)]
        same = sum(o["tokens"] == b["tokens"] for o, b in zip(r["outputs"], none["outputs"],
                                                             strict=True))
        return (name, f"{hit}/{n} ({hit / n:.0%})",
                ", ".join(f"{s}" for s in served),
                f"{np.median(r['times'][1:]) * 1e3:.1f} ms",
                f"{same}/{n}" + ("" if same == n else " MISMATCH"))

    rows = [row("file:// alone", alone, 1),
            row(f"mem:// of {cap >> 10} KiB over file://", stacked, 2)]
    title = (f"Zipf stream (s = 1.1): {n_requests} requests over {n_prompts} prompts of 200 "
             f"tokens, tiny Llama float32, vLLM prefix caching off; mem:// holds a quarter "
             f"of the prompts ({per_prompt / 1024:.0f} KiB of KV a prompt)")
    head = ("stores", "requests reusing KV", "segments loaded per tier (fastest first)",
            "time/request median", "outputs = no connector")
    return title, head, rows


__all__ = ["tier_loads", "tier_zipf"]
