"""The Redis page store against plain redis-py SET/GET of the same bytes.

One run, one table, against a redis-server this script starts on loopback:

* ``PageStore.put`` / ``get`` of a 512 MiB float16 snapshot (32 KiB pages: 16 tokens x
  8 KV heads x 128 dims), against SET / GET of the same bytes as 1 MiB values through
  redis-py pipelines (target >= 0.8x each); every write run starts from an empty server;
  the GET baseline ends with the values redis-py returns (not joined into one buffer,
  which would add a copy the baseline does not need);
* storage of 64 snapshots that share a 75% prefix, against 64 independent blobs (the
  dedup ratio ``logical_bytes / stored_bytes``);
* the ``redis://`` chunk store's get of a 64 MiB segment (``get``, and ``get_verified``
  as the vLLM connector's ``get_checked`` reads it: every page hashed and checked, by the
  compiled hasher the connector builds at start),
  against raw pipelined GETs of the same pages on a socket of its own, every reply
  received into one buffer already touched (the fastest way to move the same bytes out
  of the same server; target >= 0.8x), and redis-py pipelined GETs of them; the runs
  interleaved (each round runs each once), best and median printed.

Run with ``make bench`` (or ``--small`` for 1/8 of the sizes).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

import numpy as np
import redis

import hurraykv as hk
from bench_paged import best, print_table, verdict
from hurraykv.chunks.keys import ChunkKeys, identity_digest
from hurraykv.chunks.urls import open_store
from hurraykv.io import checksums
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


def snapshot_table(client: Any, scale: int, r: int
                   ) -> tuple[str, list[tuple[str, str, str, str]]]:
    """The PageStore table: put and get of 512 MiB (1/``scale`` of it), and dedup."""
    layers, pages = 8, 1024 // scale  # 16 members x 32 MiB = 512 MiB
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
    return (f"snapshot {total / gib:.2f} GiB of float16 pages ({2 * layers} members, "
            f"{PAGE * HEADS * DIM * 2 // 1024} KiB pages), redis-server on loopback; "
            f"best of {r}", rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="1/8 of the sizes")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds of the "
                    "redis:// get table")
    ap.add_argument("--only", choices=("snapshot", "segment"), help="one of the tables")
    args = ap.parse_args()
    scale = 8 if args.small else 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(prefix="hurraykv-redis-")
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--dir", work],
                              stdout=subprocess.DEVNULL)
    tables = []
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        if args.only != "segment":
            tables.append(snapshot_table(client, scale, args.repeat))
            client.flushall()
        if args.only != "snapshot":
            tables.append(chunk_get_rows(client, port, scale, args.rounds))
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    for i, table in enumerate(tables):
        if i:
            print()
        print_table(*table)


def raw_gets(port: int, keys: list[bytes], window: int = 1 << 20) -> tuple[Any, int]:
    """``run()``: GETs of ``keys`` pipelined on a socket of its own, ``window`` bytes of
    replies asked for ahead of those being received (all at once, Redis builds one big
    output buffer: half as fast here), every reply received into one buffer touched
    beforehand; and the bytes of the values."""
    probe = redis.Redis(port=port)
    pipe = probe.pipeline(transaction=False)
    for k in keys:
        pipe.strlen(k)
    sizes = pipe.execute()
    probe.close()
    ends = np.cumsum([n + len(b"$%d\r\n\r\n" % n) for n in sizes]).tolist()
    commands = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys]
    cuts = [0]
    for i, end in enumerate(ends):
        if end - (ends[cuts[-1] - 1] if cuts[-1] else 0) >= window or i == len(ends) - 1:
            cuts.append(i + 1)
    into = np.ones(ends[-1], np.uint8)  # touched: no page faults in the timed receives
    sock = socket.create_connection(("127.0.0.1", port))

    def run() -> None:
        view = memoryview(into)
        sock.sendall(b"".join(commands[cuts[0]:cuts[1]]))
        for w in range(len(cuts) - 1):
            if w + 2 < len(cuts):  # the next window asked for before this one is read
                sock.sendall(b"".join(commands[cuts[w + 1]:cuts[w + 2]]))
            got, end = (ends[cuts[w] - 1] if cuts[w] else 0), ends[cuts[w + 1] - 1]
            while got < end:
                n = sock.recv_into(view[got:end])
                if not n:
                    raise ConnectionError("redis-server closed the connection")
                got += n
    return run, sum(sizes)


def chunk_get_rows(client: Any, port: int, scale: int, rounds: int
                   ) -> tuple[str, list[tuple[str, str, str, str]]]:
    """The redis:// get table: one segment of 8 layers (64 MiB, 1/``scale`` of it)."""
    pages = 128 // scale
    checksums.warm()  # the compiled hasher built at start, as the vLLM connector does
    snap = checksums.with_checksums(snapshot(8, pages, 1, seed=7))
    chunks = ChunkKeys(identity_digest("bench"), PAGE).upto(list(range(pages * PAGE)), pages)
    store = open_store(f"redis://127.0.0.1:{port}")
    store.put(chunks, 0, snap, {})
    name = store.locate(chunks)[0]
    assert store.get_verified(name).equal(snap)
    keys = sorted(client.scan_iter(match="hkv:p:*", count=1000))
    raw, nbytes = raw_gets(port, keys)

    def redis_py() -> None:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        pipe.execute()

    def ours(method: Any) -> Any:
        def run() -> None:
            method(name)  # the snapshot dropped at once: the next get recycles its buffer
        return run

    runs = {"raw": raw, "redis-py": redis_py, "get": ours(store.get),
            "get_verified": ours(store.get_verified)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}  # this process's, not Redis's
    gc.collect()
    for i in range(rounds):
        order = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]
        for k in order:
            c0, t0 = time.thread_time(), time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.thread_time() - c0)
    store.close()
    best_of = {k: min(v) for k, v in times.items()}
    median = {k: float(np.median(v)) for k, v in times.items()}
    gib = 1 << 30

    def row(label: str, k: str, target: float | None) -> tuple[str, str, str, str]:
        ratio_best, ratio_median = best_of["raw"] / best_of[k], median["raw"] / median[k]
        return (label, f"{best_of[k] * 1e3:.1f} ms best, {median[k] * 1e3:.1f} median "
                f"({nbytes / best_of[k] / gib:.2f} GiB/s); CPU {min(cpu[k]) * 1e3:.1f} ms",
                f"{ratio_best:.2f}x best, {ratio_median:.2f}x median",
                "" if target is None else verdict(ratio_median, target))
    return (f"redis:// get of one segment, {nbytes / (1 << 20):.0f} MiB in {len(keys)} "
            f"pages, against raw pipelined GETs of the same pages; {rounds} interleaved "
            "rounds (target on the median; CPU: the least this process used for one)", [
                row("raw GETs, pipelined, into a touched buffer", "raw", None),
                row("redis-py GETs of the same pages, pipelined", "redis-py", None),
                row("RedisChunks.get (one pass, recycled buffer)", "get", 0.8),
                row("RedisChunks.get_verified (hashed as it lands)", "get_verified", 0.8)])


if __name__ == "__main__":
    main()
