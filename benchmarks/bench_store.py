"""The Redis page store against plain redis-py SET/GET of the same bytes.

One run, one table, against a redis-server this script starts on loopback:

* ``PageStore.put`` / ``get`` of a 512 MiB float16 snapshot (32 KiB pages: 16 tokens x
  8 KV heads x 128 dims), against SET / GET of the same bytes as 1 MiB values through
  redis-py pipelines (target >= 0.8x each); every write run starts from an empty server;
  the GET baseline ends with the values redis-py returns (not joined into one buffer,
  which would add a copy the baseline does not need);
* storage of 64 snapshots that share a 75% prefix, against 64 independent blobs (the
  dedup ratio ``logical_bytes / stored_bytes``).

Run with ``make bench`` (or ``--small`` for 1/8 of the sizes).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time

import numpy as np
import redis

import hurraykv as hk
from bench_paged import best, print_table, verdict
from hurraykv.store import PageStore

HEADS, DIM, PAGE = 8, 128, 16


def snapshot(layers: int, pages: int, seqs: int, seed: int, shared: np.ndarray | None = None
             ) -> hk.KVCacheSnapshot:
    """``seqs`` sequences of ``pages // seqs`` pages; the first pages may be ``shared``."""
    rng = np.random.default_rng(seed)
    per = pages // seqs
    block_table = np.arange(per * seqs)
    seq_ptr = np.arange(0, per * seqs + 1, per)
    lens = np.full(seqs, per * PAGE)
    pools = []
    for i in range(2 * layers):
        pool = rng.integers(0, 1 << 16, (pages, PAGE, HEADS, DIM), dtype=np.uint16)
        if shared is not None:
            pool[: len(shared[i])] = shared[i]
        pools.append(pool.view(np.float16))
    return hk.KVCacheSnapshot.from_arrays(pools[0::2], pools[1::2], block_table, seq_ptr, lens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="1/8 of the sizes")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    scale = 8 if args.small else 1
    layers, pages = 8, 1024 // scale  # 16 members x 32 MiB = 512 MiB
    r = args.repeat
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(prefix="hurraykv-redis-")
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--dir", work],
                              stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        store = PageStore(client)
        snap = snapshot(layers, pages, 16, seed=0)
        total = snap.nbytes - sum(len(b) for t in snap.tensors() for b in t.buffers()[1:])
        blob = np.concatenate([np.frombuffer(t.buffers()[0], np.uint8) for t in snap.tensors()])
        chunk = 1 << 20

        def plain_set() -> float:
            client.flushall()  # like the store, each run writes into an empty server
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k, a in enumerate(range(0, len(blob), chunk)):
                pipe.set(f"plain:{k}", memoryview(blob[a:a + chunk]))
                if k % 64 == 63:
                    pipe.execute()
            pipe.execute()
            return time.perf_counter() - t0

        def plain_get() -> list[bytes]:
            pipe = client.pipeline(transaction=False)
            for k in range(-(-len(blob) // chunk)):
                pipe.get(f"plain:{k}")
            return pipe.execute()  # the values as redis-py returns them: no join, no copy

        def store_put() -> float:
            client.flushall()  # each put starts from an empty store (untimed)
            t0 = time.perf_counter()
            store.put("bench", snap)
            return time.perf_counter() - t0

        t_set = min(plain_set() for _ in range(r))
        t_get = best(plain_get, r)
        client.flushall()
        t_put = min(store_put() for _ in range(r))
        t_getsnap = best(lambda: store.get("bench"), r)
        assert store.get("bench").equal(snap)
        client.flushall()
        # 64 snapshots sharing 75% of their pages (a common system prompt / few-shot prefix)
        small_pages = 64 // min(scale, 4)
        shared_rng = np.random.default_rng(99)
        prefix = [shared_rng.integers(0, 1 << 16, (small_pages * 3 // 4, PAGE, HEADS, DIM),
                                      dtype=np.uint16) for _ in range(2 * 4)]
        for i in range(64):
            store.put(f"req-{i}", snapshot(4, small_pages, 1, seed=1000 + i, shared=prefix))
        stats = store.stats()
        memory = client.info("memory")["used_memory"]
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    gib = 1 << 30
    rows = [
        ("plain SET, 1 MiB values, pipelined", f"{total / t_set / gib:.2f} GiB/s", "1.00x", ""),
        ("PageStore.put (hash, dedup, refcount)", f"{total / t_put / gib:.2f} GiB/s",
         f"{t_set / t_put:.2f}x", verdict(t_set / t_put, 0.8)),
        ("plain GET, 1 MiB values, pipelined", f"{total / t_get / gib:.2f} GiB/s", "1.00x", ""),
        ("PageStore.get (reassembled snapshot)", f"{total / t_getsnap / gib:.2f} GiB/s",
         f"{t_get / t_getsnap:.2f}x", verdict(t_get / t_getsnap, 0.8)),
        ("64 snapshots, 75% shared: logical", f"{stats['logical_bytes'] / (1 << 20):.1f} MiB",
         "", ""),
        ("64 snapshots, 75% shared: stored", f"{stats['stored_bytes'] / (1 << 20):.1f} MiB",
         f"{stats['logical_bytes'] / stats['stored_bytes']:.2f}x dedup", "~3.7x at 75%"),
        ("redis used_memory after the 64", f"{memory / (1 << 20):.1f} MiB", "", ""),
    ]
    print_table(f"snapshot {total / gib:.2f} GiB of float16 pages ({2 * layers} members, "
                f"{PAGE * HEADS * DIM * 2 // 1024} KiB pages), redis-server on loopback; "
                f"best of {r}", rows)


if __name__ == "__main__":
    main()
