"""Quantizing and dequantizing a block-paged pool against an allocating NumPy copy.

One run, one table: int8 and int4 per-block-affine ``quantize`` of a 1 GiB float16 pool
and the dequantizing ``gather`` of every sequence, each as a throughput ratio against
``ndarray.copy()`` of the same number of float16 bytes (target >= 0.3x each), with the
compiled kernels (``hurraykv[fast]``) and with the NumPy fallback; and the bytes of the
quantized tensor (pool + scales) against float16 for int8 and int4.
Run with ``make bench`` (or ``--small`` for a 128 MiB pool).
"""

from __future__ import annotations

import argparse

import numpy as np

from bench_paged import DIM, HEADS, best, make_batch, print_table
from hurraykv import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a 128 MiB pool instead of 1 GiB")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    pages = 1024 if args.small else 8192
    t, _ = make_batch(pages, 64 if args.small else 256, 6 if args.small else 14, 4)
    r = args.repeat
    pool_bytes = t.num_pages * t.page_size * HEADS * DIM * 2
    dense_bytes = t.total_tokens * HEADS * DIM * 2
    src_pool = np.ones(pool_bytes, np.uint8)
    src_dense = np.ones(dense_bytes, np.uint8)
    t_copy_pool = best(src_pool.copy, r)
    t_copy_dense = best(src_dense.copy, r)
    del src_pool, src_dense

    def measure() -> dict[str, float]:
        q8 = t.quantize("per_block_affine", "int8")
        q4 = t.quantize("per_block_affine", "int4")
        return {
            "q8": best(lambda: t.quantize("per_block_affine", "int8"), r),
            "q4": best(lambda: t.quantize("per_block_affine", "int4"), r),
            "d8": best(lambda: [q8.gather(s, dequantize=True) for s in range(q8.num_seqs)], r),
            "d4": best(lambda: [q4.gather(s, dequantize=True) for s in range(q4.num_seqs)], r),
        }

    fast = measure() if kernels.ENABLED else None
    kernels.ENABLED = False  # the NumPy path, same run
    slow = measure()
    q8 = t.quantize("per_block_affine", "int8")
    q4 = t.quantize("per_block_affine", "int4")
    size8 = sum(len(b) for b in q8.buffers())
    size4 = sum(len(b) for b in q4.buffers())
    size16 = sum(len(b) for b in t.buffers())

    gib = 1 << 30
    rows = [("memcpy baseline (pool bytes)", f"{pool_bytes / t_copy_pool / gib:.2f} GiB/s",
             "1.00x", "")]
    work = [("quantize int8 per-block-affine", "q8", pool_bytes, t_copy_pool),
            ("quantize int4 per-block-affine", "q4", pool_bytes, t_copy_pool),
            ("dequantizing gather int8, every seq", "d8", dense_bytes, t_copy_dense),
            ("dequantizing gather int4, every seq", "d4", dense_bytes, t_copy_dense)]
    for name, key, nbytes, base in work:
        for label, times in (("kernels", fast), ("NumPy", slow)):
            if times is None:
                rows.append((f"{name} ({label})", "numba not installed", "", ">= 0.3x"))
                continue
            rows.append((f"{name} ({label})", f"{nbytes / times[key] / gib:.2f} GiB/s",
                         f"{base / times[key]:.2f}x", ">= 0.3x" if label == "kernels" else ""))
    rows += [
        ("int8 tensor bytes vs float16", f"{size8 / gib:.3f} GiB", f"{size8 / size16:.3f}x",
         "~0.5x + scales"),
        ("int4 tensor bytes vs float16", f"{size4 / gib:.3f} GiB", f"{size4 / size16:.3f}x",
         "~0.25x + scales"),
    ]
    print_table(f"pool {pool_bytes / gib:.2f} GiB float16, {t.num_seqs} sequences, "
                f"{t.total_tokens} tokens; dequantized output float32; best of {r}", rows)


if __name__ == "__main__":
    main()
