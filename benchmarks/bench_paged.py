"""Block-paged data paths against copies of the same bytes in the same memory state.

One run, one table of ratios (higher is better for throughput rows).  Like is compared
with like: an operation that writes into a buffer reused across runs against a copy into
a reused (already touched) buffer; an operation that allocates its output against a copy
that allocates its output.

* to_dense() of a whole batch (allocates)     vs  an allocating copy on every core, its
                                                  output from the same huge-page-advised
                                                  mapping to_dense uses (``alloc.empty``)
* to_dense(out=) into a reused buffer         vs  a copy on every core into a reused buffer
* gather(s) of every sequence (allocates)     vs  an allocating copy of each sequence's bytes
* gather(s, out=) of every sequence           vs  a copy on every core into a reused buffer
                                                  (the machine's limit), and against
                                                  per-sequence copies into reused buffers
* gather(s, out=) of 1 MiB sequences          vs  np.copyto of the same bytes (small calls
                                                  must not pay for a thread hand-off)
* validate() on a 1M-entry block table        as a fraction of the gather-all time
* descriptor encode + decode, per call        as a fraction of gathering a 16 MiB layer

Two further rows say what the huge-page mapping alone is worth: the allocating copies with
NumPy's own allocator (a page fault per 4 KiB), which an allocating read beats by that.

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

from hurraykv import alloc
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


def touched_copy_seconds(nbytes: int, repeat: int = 5) -> float:
    """The best of ``repeat`` 1-thread copies of ``nbytes`` random bytes into memory
    touched before (a load's baseline: an engine's cache was touched long before)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    return best(lambda: np.copyto(dst, src), repeat)


_THREADS = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)


def parallel_copy(src: np.ndarray, out: np.ndarray | None = None,
                  threads: int | None = None) -> np.ndarray:
    """A copy split into one band per core: this machine's copy limit (``np.copyto``
    releases the GIL).  Into ``out`` when given (a reused buffer), else into a new array
    from NumPy's allocator."""
    threads = threads or os.cpu_count() or 1
    out = np.empty_like(src) if out is None else out
    edges = [len(src) * i // threads for i in range(threads + 1)]
    list(_THREADS.map(lambda i: np.copyto(out[edges[i]:edges[i + 1]],
                                          src[edges[i]:edges[i + 1]]), range(threads)))
    return out


def alloc_copy(src: np.ndarray) -> np.ndarray:
    """An allocating copy whose output comes from ``alloc.empty``, as a read's does."""
    out = alloc.empty(src.shape, src.dtype)
    np.copyto(out, src)
    return out


def verdict(ratio: float, target: float) -> str:
    return f">= {target}x: {'met' if ratio >= target else 'MISSED'}"


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

    reused = np.ones_like(src)  # touched once, as every reused buffer below
    t_copy = best(lambda: src.copy(), r)
    t_pcopy = best(lambda: parallel_copy(src), r)
    t_pcopy_huge = best(lambda: parallel_copy(src, alloc.empty(src.shape, src.dtype)), r)
    t_pcopy_reused = best(lambda: parallel_copy(src, reused), r)
    t_dense = best(t.to_dense, r)
    dense_out = np.ones((t.total_tokens, HEADS, DIM), np.float16)
    t_dense_out = best(lambda: t.to_dense(out=dense_out), r)
    t_gather = best(lambda: [t.gather(s) for s in range(t.num_seqs)], r)
    chunks = [np.ones(int(n) * HEADS * DIM * 2, np.uint8) for n in t.seq_lens]
    t_chunks = best(lambda: [c.copy() for c in chunks], r)
    t_chunks_huge = best(lambda: [alloc_copy(c) for c in chunks], r)  # kept, as gather's
    bufs = [np.ones((int(n), HEADS, DIM), np.float16) for n in t.seq_lens]
    t_gather_out = best(lambda: [t.gather(s, out=bufs[s]) for s in range(t.num_seqs)], r)
    chunk_bufs = [np.ones_like(c) for c in chunks]
    t_chunks_reused = best(lambda: [np.copyto(b, c) for b, c in zip(chunk_bufs, chunks,
                                                                    strict=True)], r)

    # small calls stay on the calling thread: 1 MiB sequences against np.copyto
    n_small = min(256, t.num_pages // 8)  # --small: a pool of 1024 pages holds 128
    small = BlockPagedTensor(t.page_pool[:8 * n_small], np.arange(8 * n_small),
                             np.arange(0, 8 * n_small + 1, 8), np.full(n_small, 8 * PAGE))
    small_bytes = n_small * 8 * PAGE * HEADS * DIM * 2
    sbufs = [np.ones((8 * PAGE, HEADS, DIM), np.float16) for _ in range(n_small)]
    srcs = [np.ascontiguousarray(t.page_pool[8 * i:8 * i + 8]).reshape(-1, HEADS, DIM)
            for i in range(n_small)]
    t_small = best(lambda: [small.gather(s, out=sbufs[s]) for s in range(n_small)], r)
    t_small_copy = best(lambda: [np.copyto(sbufs[s], srcs[s]) for s in range(n_small)], r)

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
    def rate(seconds: float, nbytes: int = dense_bytes) -> str:
        return f"{nbytes / seconds / gib:.2f} GiB/s"

    rows = [
        ("baseline: 1-thread allocating copy", rate(t_copy), "", ""),
        (f"baseline: {cores}-thread allocating copy, huge-page output", rate(t_pcopy_huge),
         "", "(baseline A)"),
        (f"baseline: {cores}-thread copy into a reused buffer", rate(t_pcopy_reused), "",
         "(baseline R: the machine's limit)"),
        ("to_dense() whole batch (allocates)", rate(t_dense),
         f"{t_pcopy_huge / t_dense:.2f}x of A", verdict(t_pcopy_huge / t_dense, 0.8)),
        ("to_dense(out=) into a reused buffer", rate(t_dense_out),
         f"{t_pcopy_reused / t_dense_out:.2f}x of R", verdict(t_pcopy_reused / t_dense_out,
                                                              0.8)),
        ("gather(s) every sequence (allocates)", rate(t_gather),
         f"{t_chunks_huge / t_gather:.2f}x of per-sequence allocating copies",
         verdict(t_chunks_huge / t_gather, 0.8)),
        ("gather(s, out=) every sequence", rate(t_gather_out),
         f"{t_pcopy_reused / t_gather_out:.2f}x of R", verdict(t_pcopy_reused / t_gather_out,
                                                               0.8)),
        ("  the same against per-sequence copies into reused buffers", "",
         f"{t_chunks_reused / t_gather_out:.2f}x", "(same calls, no threads)"),
        (f"gather(s, out=), {small_bytes // n_small >> 20} MiB sequences", rate(t_small,
                                                                             small_bytes),
         f"{t_small_copy / t_small:.2f}x of copyto", verdict(t_small_copy / t_small, 0.8)),
        ("validate() 1M-entry block table", f"{t_validate * 1e3:.1f} ms",
         f"{t_validate / t_gather:.1%} of gather-all",
         f"< 10%: {'met' if t_validate / t_gather < 0.1 else 'MISSED'}"),
        ("descriptor encode+decode / call", f"{t_codec * 1e6:.1f} us",
         f"{t_codec / t_layer:.2%} of a 16 MiB gather",
         f"< 1%: {'met' if t_codec / t_layer < 0.01 else 'MISSED'}"),
        ("what huge pages alone are worth:", "", "", ""),
        (f"  {cores}-thread allocating copy, NumPy's allocator", rate(t_pcopy),
         f"to_dense() {t_pcopy / t_dense:.2f}x of it", "(4 KiB faults: not a target)"),
        ("  per-sequence allocating copies, NumPy's allocator", rate(t_chunks),
         f"gather(s) {t_chunks / t_gather:.2f}x of it", "(4 KiB faults: not a target)"),
    ]
    print_table(f"pool {t.num_pages * PAGE * HEADS * DIM * 2 / gib:.2f} GiB float16, "
                f"{t.num_seqs} sequences, {t.total_tokens} tokens, "
                f"{frac:.0%} of block-table entries shared; best of {r}", rows)


if __name__ == "__main__":
    main()
