"""Block-paged data paths against an allocating NumPy copy of the same bytes.

One run, one table of ratios (higher is better for throughput rows):

* to_dense() of a whole batch                 vs  a copy split over every core (the limit)
* gather(s) of every sequence, one by one     vs  ndarray.copy() of as many bytes
* gather(s, out=) of every sequence           vs  the every-core copy
* gather(s, out=) of 1 MiB sequences          vs  np.copyto of the same bytes (small calls
                                                  must not pay for a thread hand-off)
* validate() on a 1M-entry block table        as a fraction of the gather-all time
* descriptor encode + decode, per call        as a fraction of gathering a 16 MiB layer

Batch: 1 GiB float16 pool, 32 heads x 128 dims, page_size 16 (8192 pages of 128 KiB),
256 sequences of ragged length, ~30% of block-table entries naming shared prefix pages.
Run with ``make bench`` (or ``python benchmarks/bench_paged.py --small`` for a quick look).
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hurraykv.paged import BlockPagedTensor
from hurraykv.wire.descriptor import decode_descriptor

HEADS, DIM, PAGE = 32, 128, 16


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


_THREADS = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)


def parallel_copy(src: np.ndarray, threads: int | None = None) -> np.ndarray:
    """An allocating copy split into one band per core: this machine's copy limit
    (``np.copyto`` releases the GIL)."""
    threads = threads or os.cpu_count() or 1
    out = np.empty_like(src)
    edges = [len(src) * i // threads for i in range(threads + 1)]
    list(_THREADS.map(lambda i: np.copyto(out[edges[i]:edges[i + 1]],
                                          src[edges[i]:edges[i + 1]]), range(threads)))
    return out


def print_table(title: str, rows: list[tuple[str, str, str, str]]) -> None:
    """The benchmark's one table: measurement, value, ratio, target."""
    print(title)
    head = ("measurement", "value", "ratio", "target")
    w = [max(len(x[i]) for x in [*rows, head]) for i in range(4)]
    print(" | ".join(h.ljust(n) for h, n in zip(head, w, strict=True)))
    print("-+-".join("-" * n for n in w))
    for row in rows:
        print(" | ".join(c.ljust(n) for c, n in zip(row, w, strict=True)))


def make_batch(num_pages: int, num_seqs: int, prompt_pages: int, prompts: int, seed: int = 0):
    """Pool of random pages; each sequence = one shared prompt prefix + its own pages."""
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((num_pages, PAGE, HEADS, DIM), dtype=np.float32).astype(
        np.float16)
    own_total = num_pages - prompts * prompt_pages
    own = rng.multinomial(own_total - num_seqs, np.ones(num_seqs) / num_seqs) + 1  # >= 1 each
    own_ids = np.arange(prompts * prompt_pages, num_pages)
    rng.shuffle(own_ids)
    which = rng.integers(0, prompts, num_seqs)
    prefix = which[:, None] * prompt_pages + np.arange(prompt_pages)[None, :]
    starts = np.concatenate([[0], np.cumsum(own)])
    tables = [np.concatenate([prefix[s], own_ids[starts[s]:starts[s + 1]]])
              for s in range(num_seqs)]
    pages = np.array([len(t) for t in tables])
    block_table = np.concatenate(tables)
    seq_ptr = np.concatenate([[0], np.cumsum(pages)])
    lens = pages * PAGE - rng.integers(0, PAGE, num_seqs)  # ragged last pages
    t = BlockPagedTensor(pool, block_table, seq_ptr, lens, kv_role="key", layer_index=0)
    shared = prompts * prompt_pages
    frac = float(np.isin(block_table, np.arange(shared)).mean())
    return t, frac


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a 128 MiB pool instead of 1 GiB")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    num_pages = 1024 if args.small else 8192
    t, frac = make_batch(num_pages, 256 if not args.small else 64, 14 if not args.small else 6, 4)
    dense_bytes = t.total_tokens * HEADS * DIM * 2
    src = np.ones(dense_bytes, np.uint8)
    r = args.repeat

    t_copy = best(lambda: src.copy(), r)
    t_pcopy = best(lambda: parallel_copy(src), r)
    t_dense = best(t.to_dense, r)
    t_gather = best(lambda: [t.gather(s) for s in range(t.num_seqs)], r)
    chunks = [np.ones(int(n) * HEADS * DIM * 2, np.uint8) for n in t.seq_lens]
    t_chunks = best(lambda: [c.copy() for c in chunks], r)
    bufs = [np.empty((int(n), HEADS, DIM), np.float16) for n in t.seq_lens]
    t_gather_out = best(lambda: [t.gather(s, out=bufs[s]) for s in range(t.num_seqs)], r)

    # small calls stay on the calling thread: 1 MiB sequences against np.copyto
    small = BlockPagedTensor(t.page_pool[:2048], np.arange(2048), np.arange(0, 2049, 8),
                             np.full(256, 8 * PAGE))
    small_bytes = 256 * 8 * PAGE * HEADS * DIM * 2
    sbufs = [np.empty((8 * PAGE, HEADS, DIM), np.float16) for _ in range(256)]
    srcs = [np.ascontiguousarray(t.page_pool[8 * i:8 * i + 8]).reshape(-1, HEADS, DIM)
            for i in range(256)]
    t_small = best(lambda: [small.gather(s, out=sbufs[s]) for s in range(256)], r)
    t_small_copy = best(lambda: [np.copyto(sbufs[s], srcs[s]) for s in range(256)], r)

    n_big = 1_000_000
    rng = np.random.default_rng(1)
    big = BlockPagedTensor(np.zeros((4096, PAGE, 1, 1), np.int8), rng.integers(0, 4096, n_big),
                           np.linspace(0, n_big, 4097).astype(np.int64),
                           np.full(4096, n_big // 4096 * PAGE - 3))
    t_validate = best(big.validate, r)

    layer = BlockPagedTensor(t.page_pool[:128], np.arange(128), [0, 128], [128 * PAGE])
    t_layer = best(layer.to_dense, r)
    desc = t.descriptor()
    calls = 2000
    t_codec = best(lambda: [decode_descriptor(desc.encode()) for _ in range(calls)], r) / calls

    gib = 1 << 30
    cores = os.cpu_count()
    rows = [
        ("memcpy baseline (ndarray.copy)", f"{dense_bytes / t_copy / gib:.2f} GiB/s", "1.00x", ""),
        (f"{cores}-thread memcpy (machine limit)", f"{dense_bytes / t_pcopy / gib:.2f} GiB/s",
         f"{t_copy / t_pcopy:.2f}x", ""),
        ("to_dense() whole batch", f"{dense_bytes / t_dense / gib:.2f} GiB/s",
         f"{t_pcopy / t_dense:.2f}x of {cores}-thread", ">= 0.8x"),
        ("gather(s) every sequence", f"{dense_bytes / t_gather / gib:.2f} GiB/s",
         f"{t_copy / t_gather:.2f}x", ">= 0.6x"),
        ("  per-sequence allocating copies", f"{dense_bytes / t_chunks / gib:.2f} GiB/s",
         f"{t_copy / t_chunks:.2f}x", "(baseline b)"),
        ("  gather(s) vs baseline b", "", f"{t_chunks / t_gather:.2f}x", ""),
        ("gather(s, out=buf) every sequence", f"{dense_bytes / t_gather_out / gib:.2f} GiB/s",
         f"{t_pcopy / t_gather_out:.2f}x of {cores}-thread", ">= 0.8x"),
        ("gather(s, out=buf), 1 MiB sequences", f"{small_bytes / t_small / gib:.2f} GiB/s",
         f"{t_small_copy / t_small:.2f}x of copyto", ">= 0.8x (no thread hand-off)"),
        ("validate() 1M-entry block table", f"{t_validate * 1e3:.1f} ms",
         f"{t_validate / t_gather:.1%} of gather-all", "< 10%"),
        ("descriptor encode+decode / call", f"{t_codec * 1e6:.1f} us",
         f"{t_codec / t_layer:.2%} of a 16 MiB gather", "< 1%"),
    ]
    print_table(f"pool {t.num_pages * PAGE * HEADS * DIM * 2 / gib:.2f} GiB float16, "
                f"{t.num_seqs} sequences, {t.total_tokens} tokens, "
                f"{frac:.0%} of block-table entries shared; best of {r}", rows)


if __name__ == "__main__":
    main()
