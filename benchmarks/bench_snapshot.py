"""Saving and loading whole KV snapshots against raw file I/O and safetensors.

One run, one table:

* save a 2 GiB snapshot (32 layers x key/value, bfloat16)   vs  raw write + fsync of the
  same bytes (target >= 0.9x) and safetensors ``save_file`` of the same page pools
* load it fully (every buffer read into memory)             vs  safetensors ``load_file``,
  a raw ``readinto`` of the file and the file read in one band per core (target >= 0.8x)
* open a file and read one layer, 200 MiB file vs 2 GiB file (target: within 2x)

Files are written to a temporary directory and read back through the page cache (both
sides alike).  Run with ``make bench`` (or ``--small`` for 1/8 of the sizes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

import hurraykv as hk
from bench_paged import best, print_table

HEADS, DIM, PAGE = 8, 128, 16


def make(layers: int, pages: int, seed: int = 0) -> hk.KVCacheSnapshot:
    rng = np.random.default_rng(seed)
    seqs = max(1, min(64, pages // 2))
    per = pages // seqs
    block_table = rng.permutation(pages)[: per * seqs]
    seq_ptr = np.arange(0, per * seqs + 1, per)
    lens = np.full(seqs, per * PAGE) - rng.integers(0, PAGE, seqs)
    raw = rng.integers(0, 1 << 16, (pages, PAGE, HEADS, DIM), dtype=np.uint16)
    pools = [(raw + i).view(ml_dtypes.bfloat16) for i in range(2 * layers)]
    return hk.KVCacheSnapshot.from_arrays(pools[0::2], pools[1::2], block_table, seq_ptr, lens)


def best_new_file(fn, directory: str, name: str, repeat: int) -> float:
    """Best time of ``fn(path)`` writing a new file each time; the old one is removed
    outside the timing, so neither side pays for freeing a replaced file's pages."""
    times = []
    for k in range(repeat):
        path = os.path.join(directory, f"{name}.{k}")
        t0 = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - t0)
        if k < repeat - 1:
            os.unlink(path)
    os.replace(path, os.path.join(directory, name))
    return min(times)


def raw_write(path: str, arrays: list[np.ndarray]) -> None:
    with open(path, "wb", buffering=0) as f:
        for a in arrays:
            f.write(memoryview(a.view(np.uint8).reshape(-1)))
        os.fsync(f.fileno())


def raw_read(path: str) -> np.ndarray:
    out = np.empty(os.path.getsize(path), np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(out))
    return out


def raw_read_bands(path: str, threads: int) -> np.ndarray:
    """``raw_read`` with the file split into one band per thread (preadv on each)."""
    size = os.path.getsize(path)
    out = np.empty(size, np.uint8)
    view = memoryview(out)
    edges = [size * i // threads for i in range(threads + 1)]
    fd = os.open(path, os.O_RDONLY)
    try:
        def band(i: int) -> None:
            pos = edges[i]
            while pos < edges[i + 1]:
                pos += os.preadv(fd, [view[pos:edges[i + 1]]], pos)
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(band, range(threads)))
    finally:
        os.close(fd)
    return out


def load_fully(path: str) -> list[np.ndarray]:
    """Every member in memory: one readinto of the file, members are views of it."""
    snap = hk.load_snapshot(path, mmap=False)
    return [t.page_pool for t in snap.tensors()]


def load_mmap_touch(path: str) -> list[np.ndarray]:
    snap = hk.load_snapshot(path)
    return [np.array(b, copy=True) for _, _, bufs in snap.members() for b in bufs]


def one_layer(path: str, i: int) -> list[np.ndarray]:
    snap = hk.load_snapshot(path)
    return [t.page_pool.copy() for t in snap.layer(i)]


def main() -> None:
    from safetensors.numpy import load_file, save_file

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="1/8 of the sizes")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    layers, pages = 32, 1024  # 64 members x 32 MiB = 2 GiB
    small_layers = 3  # 6 members x 32 MiB = 192 MiB
    if args.small:
        pages = 128
    r = args.repeat
    tmp = tempfile.mkdtemp(prefix="hurraykv-bench-")
    try:
        snap = make(layers, pages)
        arrays = [t.page_pool for t in snap.tensors()]
        total = sum(a.nbytes for a in arrays)
        st_arrays = {f"layers.{i // 2}.{'value' if i % 2 else 'key'}": a.view(np.uint16)
                     for i, a in enumerate(arrays)}
        p_hrry, p_st = (os.path.join(tmp, n) for n in ("s.hrry", "s.st"))
        t_raw = best_new_file(lambda p: raw_write(p, arrays), tmp, "raw.bin", r)
        # the raw write's work: the bytes, no checksums (the default adds a hash pass)
        t_save = best_new_file(lambda p: hk.save_snapshot(snap, p, checksums=False), tmp,
                               "s.hrry", r)
        # checksums fit the info member up to about 65,000 pages: 2 GiB of pages of 32 KiB
        # is just past it, so the row with them saves 31 of the 32 layers (checksums=True
        # insists), its rate against the raw write's
        sums = make(layers - 1, pages)
        sums_total = sum(t.page_pool.nbytes for t in sums.tensors())
        t_sums = best_new_file(lambda p: hk.save_snapshot(sums, p, checksums=True), tmp,
                               "c.hrry", r)
        t_nosync = best_new_file(lambda p: hk.save_snapshot(snap, p, fsync=False,
                                                            checksums=False), tmp, "s.hrry", r)
        t_st = best_new_file(lambda p: save_file(st_arrays, p), tmp, "s.st", r)
        t_rread = best(lambda: raw_read(p_hrry), r)
        cores = os.cpu_count() or 1
        t_pread = best(lambda: raw_read_bands(p_hrry, cores), r)
        t_load = best(lambda: load_fully(p_hrry), r)
        t_mmap = best(lambda: load_mmap_touch(p_hrry), r)
        t_stload = best(lambda: load_file(p_st), r)
        small = make(small_layers, pages, seed=1)  # same layer size, ~1/10 of the file
        p_small = os.path.join(tmp, "small.hrry")
        hk.save_snapshot(small, p_small)
        t_layer_big = best(lambda: one_layer(p_hrry, 1), r)
        t_layer_small = best(lambda: one_layer(p_small, 1), r)
        t0 = time.perf_counter()
        hk.load_snapshot(p_hrry)
        t_open = time.perf_counter() - t0
        size_big, size_small = os.path.getsize(p_hrry), os.path.getsize(p_small)
    finally:
        shutil.rmtree(tmp)
    gib = 1 << 30
    rows = [
        ("raw write + fsync", f"{total / t_raw / gib:.2f} GiB/s", "1.00x", ""),
        ("save_snapshot(checksums=False) (atomic, fsync)",
         f"{total / t_save / gib:.2f} GiB/s", f"{t_raw / t_save:.2f}x", ">= 0.9x"),
        ("save_snapshot(checksums=True), 31 layers", f"{sums_total / t_sums / gib:.2f} GiB/s",
         f"{sums_total / t_sums / (total / t_raw):.2f}x", "one hash pass more"),
        ("save_snapshot(fsync=False, checksums=False)", f"{total / t_nosync / gib:.2f} GiB/s",
         f"{t_raw / t_nosync:.2f}x", ""),
        ("safetensors save_file (no fsync)", f"{total / t_st / gib:.2f} GiB/s",
         f"{t_raw / t_st:.2f}x", "below fsync=False row"),
        ("raw readinto of the file", f"{total / t_rread / gib:.2f} GiB/s", "1.00x", ""),
        (f"raw preadv, {cores} threads", f"{total / t_pread / gib:.2f} GiB/s",
         f"{t_rread / t_pread:.2f}x", ""),
        ("load_snapshot(mmap=False)", f"{total / t_load / gib:.2f} GiB/s",
         f"{t_pread / t_load:.2f}x of {cores} threads", ">= 0.8x"),
        ("load_snapshot + copy every buffer", f"{total / t_mmap / gib:.2f} GiB/s",
         f"{t_rread / t_mmap:.2f}x", ""),
        ("safetensors load_file", f"{total / t_stload / gib:.2f} GiB/s",
         f"{t_rread / t_stload:.2f}x", ""),
        (f"open + one layer, {size_small / (1 << 20):.0f} MiB file",
         f"{t_layer_small * 1e3:.1f} ms", "1.00x", ""),
        (f"open + one layer, {size_big / (1 << 20):.0f} MiB file",
         f"{t_layer_big * 1e3:.1f} ms", f"{t_layer_big / t_layer_small:.2f}x", "<= 2x"),
        ("open only (validate index, seq_ptr)", f"{t_open * 1e3:.1f} ms", "", ""),
    ]
    print_table(f"snapshot {total / gib:.2f} GiB: {layers} layers x key/value bfloat16, "
                f"{HEADS} heads x {DIM} dims, page_size {PAGE}; page cache warm; best of {r}", rows)


if __name__ == "__main__":
    main()
