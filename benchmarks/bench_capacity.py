"""The cost of a ``file://`` capacity (``max_bytes``): the bookkeeping per stored and per
loaded segment, against the same store without a capacity, measured in one run.

A connector's request stores at most one segment and loads at most a few, so the cost
per request is the per-segment cost below.  Segments of 256 tokens of a 4-layer, 8-head,
head-dim-128 bfloat16 model (4 MiB each), on the machine's temporary directory; the
capped store holds 32 of them and evicts (down to 90%) as the stream passes it.  The
ratio is capped / uncapped time per operation (target: within 10% for a store, 5% for a
load).  Run with ``python benchmarks/bench_capacity.py``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import hurraykv as hk  # noqa: E402
from bench_paged import print_table  # noqa: E402
from hurraykv.integrations.chunks import ChunkKeys, identity_digest  # noqa: E402
from hurraykv.integrations.file_capacity import Capacity  # noqa: E402
from hurraykv.integrations.file_store import FileChunks  # noqa: E402
from hurraykv.io import checksums  # noqa: E402

TOKENS, PAGE, LAYERS, HEADS, DIM = 256, 32, 4, 8, 128
SEGMENTS, KEPT = 160, 32


def segment(rng: np.random.Generator) -> hk.KVCacheSnapshot:
    pages = TOKENS // PAGE
    pools = [rng.standard_normal((pages, PAGE, HEADS, DIM), np.float32).astype(
        ml_dtypes.bfloat16) for _ in range(LAYERS)]
    return checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
        pools, pools, np.arange(pages), [0, pages], [TOKENS]))


SPENT = {"admit": 0.0, "touch": 0.0}


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t0
    return wrapper


Capacity.admit = timed("admit", Capacity.admit)
Capacity.touch = staticmethod(timed("touch", Capacity.touch))


def run(directory: Path, max_bytes: int | None, snaps: list) -> tuple[float, float, int]:
    """Median seconds per store and per load, and the evictions."""
    store = FileChunks(directory, max_bytes=max_bytes)
    puts, gets = [], []
    for i in range(SEGMENTS):
        keys = ChunkKeys(identity_digest(f"s{i}"), PAGE).upto(list(range(TOKENS)), PAGE // PAGE)
        t0 = time.perf_counter()
        store.put(keys, 0, snaps[i % len(snaps)], {})
        puts.append(time.perf_counter() - t0)
        name = store.locate(keys)[0]
        t0 = time.perf_counter()
        store.get_verified(name)
        gets.append(time.perf_counter() - t0)
    return float(np.median(puts)), float(np.median(gets)), store.evictions


def main() -> None:
    rng = np.random.default_rng(0)
    snaps = [segment(rng) for _ in range(8)]
    with tempfile.TemporaryDirectory(prefix="hurraykv-bench-capacity-") as tmp:
        probe = FileChunks(Path(tmp) / "probe")
        keys = ChunkKeys(identity_digest("probe"), PAGE).upto(list(range(TOKENS)), 1)
        probe.put(keys, 0, snaps[0], {})
        size = (Path(tmp) / "probe" / f"{probe.locate(keys)[0]}.hrry").stat().st_size
        results = {}
        SPENT.update(admit=0.0, touch=0.0)
        for rep in range(3):  # interleaved, so drift meets both alike
            for label, cap in (("uncapped", None), ("capped", KEPT * size)):
                if label == "capped":
                    before = dict(SPENT)
                got = run(Path(tmp) / f"{label}-{rep}", cap, snaps)
                if label == "capped":
                    admit = (SPENT["admit"] - before["admit"]) / SEGMENTS
                    touch = (SPENT["touch"] - before["touch"]) / SEGMENTS
                best = results.get(label)
                results[label] = got if best is None else (min(best[0], got[0]),
                                                           min(best[1], got[1]), got[2])
    (put0, get0, _), (put1, get1, evictions) = results["uncapped"], results["capped"]
    # the capped store's own writes are faster (it reuses the memory of what it evicted):
    # the bookkeeping is timed by itself too, against the uncapped store's operations
    print_table(f"file:// store, {SEGMENTS} segments of {size >> 20} MiB, capacity {KEPT} "
                f"segments ({evictions} evicted), median per operation, best of 3", [
                    ("store a segment, no capacity", f"{put0 * 1e3:.2f} ms", "1.00x", ""),
                    ("store a segment, capacity (evicting)", f"{put1 * 1e3:.2f} ms",
                     f"{put1 / put0:.2f}x", "<= 1.10x " + ("met" if put1 <= 1.1 * put0
                                                           else "MISSED")),
                    ("load a segment, no capacity", f"{get0 * 1e3:.2f} ms", "1.00x", ""),
                    ("load a segment, capacity (a use recorded)", f"{get1 * 1e3:.2f} ms",
                     f"{get1 / get0:.2f}x", "<= 1.05x " + ("met" if get1 <= 1.05 * get0
                                                           else "MISSED")),
                    ("bookkeeping per store (scan, evict, compact)", f"{admit * 1e6:.0f} us",
                     f"{admit / put0:.1%} of a store", ""),
                    ("bookkeeping per load (utime)", f"{touch * 1e6:.1f} us",
                     f"{touch / get0:.1%} of a load", ""),
                ])


if __name__ == "__main__":
    main()
