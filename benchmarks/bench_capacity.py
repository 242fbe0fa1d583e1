"""The cost of a ``file://`` store: what a capacity (``max_bytes``) adds to a save, and how
fast a segment is loaded, each against its baseline measured in the same run.

Table 1, saves.  ``FileChunks.put`` of segments of three shapes (page size 32, 8 KV heads,
head dim 128): 2 layers x 16 pages in bfloat16 (4 MiB) and in float32 (8 MiB), and 4
layers x 128 pages in bfloat16 (4096 tokens at 16 KiB a token, 64 MiB), each stored into
an uncapped directory, a capped one whose ``max_bytes`` is far above the data, and a
capped one holding 8 segments (every save past them evicts, down to 90%, in batches).
Each run writes the same segments into a fresh directory after ``sync`` (so no run
inherits another's dirty pages); the runs of one shape are interleaved, repeated, and the
median save of each taken.  Same work, same memory state: the stores that do not evict
have their oldest segment unlinked after each save past 8, timed with the save (a
directory that only grows was throttled by the kernel's dirty-page limits, 10x slower,
and an unlink is most of what an eviction costs); "the put alone" row is the uncapped
put without it.  The ratio is capped / uncapped (target: < 1.05x); the
bookkeeping rows time the capacity's own calls (lock, usage record, reservation, scan,
eviction, compaction of the alias log) as a share of a save.

Table 2, loads.  ``FileChunks.get_checked`` of the 64 MiB segment from the page cache
(read before; layers 1-3 left for later, as the vLLM connector asks), against
``np.copyto`` of its bytes into a buffer touched before (target: >= 0.8x), and where the
load's time goes.  Then ``get_verified`` from a capped store against an uncapped one
(the load records a use: target < 1.05x).

Run with ``python benchmarks/bench_capacity.py`` (``--quick``: fewer repetitions).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import hurraykv as hk  # noqa: E402
from bench_paged import print_table  # noqa: E402
from hurraykv.chunks.file import layouts as file_layouts  # noqa: E402
from hurraykv.chunks.file.capacity import Capacity, Reservation  # noqa: E402
from hurraykv.chunks.file.store import FileChunks  # noqa: E402
from hurraykv.chunks.keys import ChunkKeys, identity_digest  # noqa: E402
from hurraykv.io import checksums  # noqa: E402
from hurraykv.snapshot_members import member_name  # noqa: E402
from hurraykv.store.buffers import ReadBuffers  # noqa: E402

PAGE, HEADS, DIM = 32, 8, 128
SHAPES = [  # (label, layers, pages, dtype, segments a run)
    ("4 MiB bf16 (2 layers x 16 pages)", 2, 16, ml_dtypes.bfloat16, 64),
    ("8 MiB f32 (2 layers x 16 pages)", 2, 16, np.float32, 48),
    ("64 MiB bf16 (4096 tokens)", 4, 128, ml_dtypes.bfloat16, 16),
]
KEPT = 8  # segments the evicting store holds

SPENT: dict[str, float] = defaultdict(float)


def timed(name: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t0
    return wrapper


def timed_lock(fn: Callable) -> Callable:
    """The time to take the lock (not the time it is held)."""
    @contextlib.contextmanager
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            t0 = time.perf_counter()
            stack.enter_context(fn(*args, **kwargs))
            SPENT["lock"] += time.perf_counter() - t0
            yield
    return wrapper


def instrument() -> None:
    """Time the capacity's calls (admit holds the lock, record, reservation, scan, ...;
    release and the alias log's compaction run outside admit) and the load's steps."""
    for name in ("admit", "_usage", "_record", "_reserve", "_list", "_reserved", "_take",
                 "_remove", "_evict"):
        if hasattr(Capacity, name):  # _evict: inside _take in code before issue 30
            setattr(Capacity, name, timed(name, getattr(Capacity, name)))
    Capacity.lock = timed_lock(Capacity.lock)
    Capacity.touch = staticmethod(timed("touch", Capacity.touch))
    Reservation.release = timed("release", Reservation.release)
    FileChunks._compact = timed("_compact", FileChunks._compact)
    checksums.ReadPlan.read = timed("read+hash", checksums.ReadPlan.read)
    file_layouts.FileLayout.matches = timed("parse", file_layouts.FileLayout.matches)
    file_layouts.FileLayout.read = timed("parse", file_layouts.FileLayout.read)
    FileChunks._verified = timed("verify", FileChunks._verified)
    ReadBuffers.take = timed("buffer", ReadBuffers.take)


def segment(rng: np.random.Generator, layers: int, pages: int, dtype: Any
            ) -> hk.KVCacheSnapshot:
    pools = [rng.standard_normal((pages, PAGE, HEADS, DIM), np.float32).astype(dtype)
             for _ in range(2 * layers)]
    return checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
        pools[0::2], pools[1::2], np.arange(pages), [0, pages], [pages * PAGE]))


def keys_of(i: int, pages: int) -> list[str]:
    return ChunkKeys(identity_digest(f"s{i}"), PAGE).upto(list(range(pages * PAGE)), pages)


def store_run(directory: Path, max_bytes: int | None, snaps: list, count: int, pages: int,
              size: int) -> tuple[list[float], list[float], dict[str, float], int]:
    """Seconds of each save (a put, and for a store that does not evict, the unlink of its
    oldest segment past ``KEPT``), of each put alone, the capacity's share (seconds per
    call site), evictions."""
    os.sync()  # no run inherits another's dirty pages
    store = FileChunks(directory, max_bytes=max_bytes)
    store.put(keys_of(-1, pages), 0, snaps[0], {})  # the structure learned: not timed
    before = dict(SPENT)
    puts, bare = [], []
    for i in range(count):
        t0 = time.perf_counter()
        store.put(keys_of(i, pages), 0, snaps[i % len(snaps)], {})
        t1 = time.perf_counter()
        if i >= KEPT and (max_bytes is None or max_bytes > count * size):
            # the work and memory state of the evicting store: the kernel throttles a
            # writer by the dirty pages it holds (a directory that only grows ran 10x
            # slower here), and an unlink is most of what an eviction costs
            store.path(store.locate(keys_of(i - KEPT, pages))[0]).unlink()
        puts.append(time.perf_counter() - t0)
        bare.append(t1 - t0)
    spent = {k: v - before.get(k, 0.0) for k, v in SPENT.items()}
    store.close()  # the evicted files removed before the next run
    evictions = store.evictions
    shutil.rmtree(directory)
    return puts, bare, spent, evictions


def store_table(work: Path, repeat: int) -> None:
    rows = []
    parts: dict[str, float] = defaultdict(float)
    capped_puts = 0.0
    for label, layers, pages, dtype, count in SHAPES:
        rng = np.random.default_rng(0)
        snaps = [segment(rng, layers, pages, dtype) for _ in range(4)]
        probe = FileChunks(work / "probe")
        probe.put(keys_of(0, pages), 0, snaps[0], {})
        size = probe.path(probe.locate(keys_of(0, pages))[0]).stat().st_size
        shutil.rmtree(work / "probe")
        modes = (("uncapped", None), ("capped, room", 1000 * count * size),
                 ("capped, evicting", KEPT * size))
        times: dict[str, list[float]] = defaultdict(list)
        alone: dict[str, list[float]] = defaultdict(list)
        evicted = 0
        for rep in range(repeat):  # interleaved, so drift meets every mode alike
            for mode, cap in modes:
                puts, bare, spent, n = store_run(work / f"{rep}-{mode}", cap, snaps, count,
                                                 pages, size)
                times[mode] += puts
                alone[mode] += bare
                if cap is not None:
                    evicted += n
                    capped_puts += sum(puts)
                    for k, v in spent.items():
                        parts[k] += v
        base = float(np.median(times["uncapped"]))
        for mode, _ in modes:
            t = float(np.median(times[mode]))
            ratio = t / base
            target = "" if mode == "uncapped" else (
                "< 1.05x " + ("met" if ratio < 1.05 else "MISSED"))
            extra = f", {evicted / repeat:.0f} evicted a run" if mode.endswith("evicting") \
                else ""
            rows.append((f"{label}: {mode}", f"{t * 1e3:.2f} ms (p90 "
                         f"{np.percentile(times[mode], 90) * 1e3:.2f}{extra})",
                         f"{ratio:.3f}x", target))
        put = float(np.median(alone["uncapped"]))
        rows.append((f"{label}: uncapped, the put alone", f"{put * 1e3:.2f} ms",
                     f"{put / base:.3f}x", ""))
    kept = ("admit", "lock", "_usage", "_record", "_reserve", "_list", "_reserved", "_take",
            "_remove", "_evict", "_compact", "release")
    for k in kept:
        rows.append((f"capped saves, time in {k}", f"{parts[k] * 1e3:.1f} ms",
                     f"{parts[k] / capped_puts:.2%} of the saves", ""))
    print_table(f"file:// saves: median per put over {repeat} interleaved runs a mode, "
                f"each run a fresh directory after sync; the evicting cap holds {KEPT} "
                "segments", rows)


def load_table(work: Path, repeat: int) -> None:
    layers, pages = 4, 128
    rng = np.random.default_rng(1)
    snap = segment(rng, layers, pages, ml_dtypes.bfloat16)
    later = frozenset(member_name(layer, role) for layer in range(1, layers)
                      for role in ("key", "value", "fused"))
    checksums.warm()
    rows = []
    store = FileChunks(work / "load")
    keys = keys_of(0, pages)
    store.put(keys, 0, snap, {})
    name = store.locate(keys)[0]
    src = np.fromfile(store.path(name), np.uint8)  # in the page cache from now on
    dst = np.ones_like(src)
    for _ in range(3):
        store.get_checked(name, later)  # the structure learned, the buffers touched
    copies, loads = [], []
    before = dict(SPENT)
    for _ in range(repeat * 20):  # interleaved: copy, load, copy, ...
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got, _ = store.get_checked(name, later)
        loads.append(time.perf_counter() - t0)
        del got
    spent = {k: (v - before.get(k, 0.0)) / len(loads) for k, v in SPENT.items()}
    copy, load = float(np.median(copies)), float(np.median(loads))
    gib = len(src) / (1 << 30)
    rows.append(("np.copyto into a touched buffer", f"{copy * 1e3:.2f} ms "
                 f"({gib / copy:.1f} GiB/s)", "1.00x", ""))
    rows.append(("get_checked, layers 1-3 later", f"{load * 1e3:.2f} ms ({gib / load:.1f} "
                 "GiB/s)", f"{copy / load:.2f}x", ">= 0.8x " + (
                     "met" if copy / load >= 0.8 else "MISSED")))
    steps = ("read+hash", "parse", "verify", "buffer", "touch")
    for k in steps:
        rows.append((f"  of it: {k}", f"{spent.get(k, 0.0) * 1e6:.0f} us",
                     f"{spent.get(k, 0.0) / load:.1%}", ""))
    other = load - sum(spent.get(k, 0.0) for k in steps)
    rows.append(("  of it: open, stat, the rest", f"{other * 1e6:.0f} us",
                 f"{other / load:.1%}", ""))
    # a use recorded: the same loads from a capped store
    for label, cap in (("uncapped", None), ("capped", 1 << 40)):
        s = FileChunks(work / "load", max_bytes=cap)
        for _ in range(3):
            s.get_verified(name)
        ts = []
        for _ in range(repeat * 10):
            t0 = time.perf_counter()
            s.get_verified(name)
            ts.append(time.perf_counter() - t0)
        rows.append((f"get_verified, {label}", f"{np.median(ts) * 1e3:.2f} ms", "", ""))
    shutil.rmtree(work / "load")
    print_table(f"file:// loads of a {len(src) >> 20} MiB segment (4096 tokens, 16 KiB a "
                f"token) from the page cache, median of {len(loads)}", rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--only", choices=("store", "load"))
    args = ap.parse_args()
    repeat = 2 if args.quick else 5
    instrument()
    with tempfile.TemporaryDirectory(prefix="hurraykv-bench-capacity-",
                                     dir=os.environ.get("TMPDIR")) as tmp:
        if args.only != "load":
            store_table(Path(tmp), repeat)
        if args.only != "store":
            load_table(Path(tmp), repeat)


if __name__ == "__main__":
    main()
