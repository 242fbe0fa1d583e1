"""Table 5 (``--only store_dtype_speed``): store dtypes' load throughput and TTFT.

Store dtypes, speed: the model of table 2 with a 4096-token prompt, per store dtype
(auto, int8, int4, fp8) over ``file://`` and over ``hurray://`` (a ``hurraykv serve`` on
loopback): one engine stores it, three fresh ones (the store dtypes taking turns)
load the full prefix 5 times each; load
throughput counted in the engine cache's bytes (tokens x 16 KiB over the connector's
load time), against auto in the same run (target: int8 at >= 0.8x), and the median
TTFT of the hits against auto's and a cold prefill's.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import numpy as np

from vllm_bench.connector import heavy_workload
from vllm_bench.engines import engine, hurray_conn

SPEED_FORMATS = ("auto", "int8", "int4", "fp8")


def _store(fmt: str) -> dict:
    return {} if fmt == "auto" else {"store_dtype": fmt}


def store_dtype_speed(work: Path, long_tokens: int, rounds: int = 5, repeats: int = 3
                      ) -> tuple[str, tuple[str, ...], list[tuple[str, ...]]]:
    """Load throughput into the engine's cache and TTFT of a full-prefix hit, per store
    dtype, over file:// and over hurray:// on loopback (one hurraykv server), each
    against store_dtype auto in the same run."""
    _, spec = heavy_workload(work, long_tokens, seed=17)
    per_token = 4 * 2 * 8 * 128 * 2  # bytes of bfloat16 KV per token in the engine's cache

    cold = engine(spec(None, rounds=rounds), work, "speed-cold")
    ttft_cold = float(np.median(cold["times"]))
    rows = []
    with contextlib.ExitStack() as stack:
        hs = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                               "127.0.0.1:0", "--memory-budget", "2G", "--log-level",
                               "warning"], stdout=subprocess.PIPE, text=True)
        stack.callback(lambda: (hs.terminate(), hs.wait(10)))
        address = hs.stdout.readline().split()[-1]
        for label, url in (("file://", (work / "speed-kv").as_uri()),
                           ("hurray:// loopback", f"hurray://{address}")):
            save_us, loads, ttfts, per_hit = {}, {}, {}, {}
            for fmt in SPEED_FORMATS:
                saved = engine(spec(hurray_conn(url, "kv_producer", **_store(fmt))), work,
                               f"speed-{label[:4]}-{fmt}-store")["stats"]
                save_us[fmt] = saved["save_seconds"] / (saved.get("tokens_saved") or
                                                        saved["chunks_saved"] * 32) * 1e6
                loads[fmt], ttfts[fmt] = [], []
            # hit engines alternate, each repetition in another order, so that the
            # shared machine's drift meets every store dtype alike
            for rep in range(repeats):
                order = SPEED_FORMATS[rep % 4:] + SPEED_FORMATS[:rep % 4]
                for fmt in order:
                    hit = engine(spec(hurray_conn(url, "kv_consumer", **_store(fmt)),
                                      rounds=rounds, touch_kv_cache=True, round_stats=True),
                                 work, f"speed-{label[:4]}-{fmt}-hit{rep}")
                    st = hit["stats"]
                    tokens = (st.get("tokens_loaded") or st["chunks_loaded"] * 32) / rounds
                    per_hit[fmt] = (tokens, st["bytes_loaded"] / rounds / tokens)
                    marks = [0.0] + [r["load_seconds"] for r in hit["round_stats"]]
                    loads[fmt] += np.diff(marks).tolist()
                    ttfts[fmt] += hit["times"]
            for fmt in SPEED_FORMATS:
                tokens, stored = per_hit[fmt]
                load = float(np.median(loads[fmt]))  # one hit's load, median of all rounds
                rate = tokens * per_token / load  # the engine cache's bytes written per s
                base = tokens * per_token / float(np.median(loads["auto"]))
                ttft, ttft_auto = float(np.median(ttfts[fmt])), float(np.median(
                    ttfts["auto"]))
                target = ""
                if fmt == "int8":
                    target = ">= 0.8x " + ("met" if rate >= 0.8 * base else "MISSED")
                rows.append((label, fmt, f"{stored:,.0f} B", f"{load * 1e3:.1f} ms",
                             f"{rate / (1 << 30):.2f} GiB/s", f"{rate / base:.2f}x", target,
                             f"{ttft * 1e3:.1f} ms",
                             f"{ttft / ttft_auto:.2f}x / {ttft_cold / ttft:.1f}x faster",
                             f"{save_us[fmt]:.1f} us"))
    title = (f"Store dtypes, speed: a {long_tokens}-token prompt stored by one engine and "
             f"loaded by fresh ones ({repeats} engines per store dtype, taking turns, "
             f"{rounds} full-prefix hits each; medians of all hits), "
             f"model with 16 KiB of bfloat16 KV per token (4 layers x 8 KV heads x 128); load "
             f"throughput in the engine cache's bytes (tokens x 16 KiB over the connector's "
             f"load time: reading, verifying, decoding, writing the blocks); the save "
             f"column: the storing engine's save_kv_layer and wait_for_save time (copying "
             f"out and quantizing) over the tokens stored; cold prefill TTFT "
             f"{ttft_cold * 1e3:.1f} ms")
    head = ("store", "store dtype", "page bytes loaded per token", "load per hit",
            "load throughput (cache bytes)", "vs auto", "target", "TTFT, full prefix hit",
            "TTFT vs auto / vs cold", "save on the forward pass per stored token")
    return title, head, rows
