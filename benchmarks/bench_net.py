"""Pushing and pulling a KV snapshot over loopback against a raw socket.

One run, one table: ``KVClient.push`` and ``KVClient.pull`` of a 1 GiB snapshot to a
``hurraykv serve`` process, against a raw socket ``sendall`` / ``recv_into`` of the same
number of bytes between the same two processes' worth of Python (target >= 0.8x each),
and the time to the first layer of ``iter_pull`` against the whole transfer.  Pulls are
measured run by run against a raw receive of the same size run just before: into a
fresh process (its first pull, into new memory), in the steady state (the client's
recycled memory against a reused buffer) and into the caller's memory (``into=``).

Then the ``hurray://`` chunk store as the vLLM connector uses it: ``ServerChunks.
get_checked`` of a 64 MiB segment (16 layers x key/value, full pages, with checksums:
every page verified, hashed as it lands) against a raw ``recv_into`` of the same byte
count into a reused buffer, run by run (target >= 0.8x, judged on the median ratio), with
the compiled hasher warmed as a connector's worker warms it; the unverified ``get`` and
the hashing time show where the rest goes.  Run with ``make bench`` (or ``--small`` for
128 MiB; ``--segment`` for the segment rows alone).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

import hurraykv as hk
from bench_paged import best, print_table
from bench_snapshot import DIM, HEADS, PAGE, make
from hurraykv.chunks.server import ServerChunks
from hurraykv.io import checksums
from hurraykv.net.client import KVClient
from hurraykv.testing import keys

RAW_PEER = r"""
import socket, sys, numpy as np
n = int(sys.argv[1])
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
buf = np.ones(n, np.uint8)
while True:
    conn, _ = srv.accept()
    op = conn.recv(1)
    if op in (b"r", b"f"):  # receive n bytes (into fresh memory for f), answer one byte
        view, got = memoryview(buf if op == b"r" else np.empty(n, np.uint8)), 0
        while got < n:
            got += conn.recv_into(view[got:])
        conn.sendall(b"k")
    elif op == b"s":  # send n bytes
        conn.sendall(memoryview(buf))
    else:
        break
    conn.close()
"""


def raw_send(port: int, n: int, data: np.ndarray, op: bytes = b"r") -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(op)
        s.sendall(memoryview(data))
        s.recv(1)


def raw_recv(port: int, n: int, out: np.ndarray | None = None) -> None:
    """Receive ``n`` bytes from the peer into ``out`` (reused) or into new memory."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"s")
        view, got = memoryview(out if out is not None else np.empty(n, np.uint8)), 0
        while got < n:
            got += s.recv_into(view[got:])


# A fresh process: its first receive, timed from inside (interpreter start excluded).
FIRST_RAW = r"""
import socket, sys, time, numpy as np
port, n = int(sys.argv[1]), int(sys.argv[2])
t0 = time.perf_counter()
with socket.create_connection(("127.0.0.1", port)) as s:
    s.sendall(b"s")
    view, got = memoryview(np.empty(n, np.uint8)), 0
    while got < n:
        got += s.recv_into(view[got:])
print(time.perf_counter() - t0)
"""
FIRST_PULL = r"""
import sys, time
from hurraykv.net.client import KVClient
with KVClient(sys.argv[1]) as c:
    c.ping()
    t0 = time.perf_counter()
    c.pull("bench")
print(time.perf_counter() - t0)
"""


def first(code: str, *args: object) -> float:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def paired(a, b, runs: int) -> tuple[list[float], list[float]]:
    """Alternate ``a()`` and ``b()`` runs (each returning seconds), so drift hits both."""
    ta, tb = [], []
    for _ in range(runs):
        ta.append(a())
        tb.append(b())
    return ta, tb


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def spread(nbytes: int, times: list[float]) -> str:
    """Throughput of the slowest and the fastest run."""
    gib = 1 << 30
    return f"{nbytes / max(times) / gib:.2f}-{nbytes / min(times) / gib:.2f} GiB/s"


def worst(base: list[float], times: list[float]) -> str:
    """The lowest ratio of a run to its paired baseline run, and the median."""
    ratios = sorted(b / t for b, t in zip(base, times, strict=True))
    return f"{ratios[0]:.2f}x worst, {ratios[len(ratios) // 2]:.2f}x median"


def segment(layers: int = 16, pages: int = 64) -> hk.KVCacheSnapshot:
    """A connector's segment: full pages (nothing for the server to zero), checksums."""
    raw = np.random.default_rng(1).integers(0, 1 << 16, (pages, PAGE, HEADS, DIM),
                                            dtype=np.uint16)
    pools = [(raw + i).view(ml_dtypes.bfloat16) for i in range(2 * layers)]
    snap = hk.KVCacheSnapshot.from_arrays(pools[0::2], pools[1::2], np.arange(pages),
                                          [0, pages], [pages * PAGE])
    return checksums.with_checksums(snap)


def ratios(base: list[float], times: list[float]) -> tuple[float, float]:
    """The ratio of the best runs, and the median ratio of a run to its paired baseline
    run (on a shared host one pair can be far apart either way: no best pair)."""
    r = [b / t for b, t in zip(base, times, strict=True)]
    return min(base) / min(times), statistics.median(r)


def ms(times: list[float]) -> str:
    return f"{min(times) * 1e3:.1f} / {statistics.median(times) * 1e3:.1f} ms"


def segment_rows(address: str, port: int, runs: int) -> list[tuple[str, str, str, str]]:
    """``ServerChunks.get_checked`` of a 64 MiB segment against a raw receive of as
    many bytes, paired run by run; the unverified get and the hashing beside them."""
    checksums.warm()  # as the connector's worker does at start
    snap = segment()
    n = snap.nbytes
    data = np.ones(n, np.uint8)
    store = ServerChunks(address)
    ks = keys(1)
    store.put(ks, 0, snap, {})
    name = store.locate(ks)[0]
    for _ in range(3):  # the receive pool holds a segment's memory from now on
        store.get_checked(name)
    raw, checked, plain, hashing = [], [], [], []
    for _ in range(runs):
        raw.append(timed(lambda: raw_recv(port, n, data)))
        before = store.verify_seconds
        checked.append(timed(lambda: store.get_checked(name)))
        hashing.append(store.verify_seconds - before)
        plain.append(timed(lambda: store.get(name)))
    store.close()
    hi, mid = ratios(raw, checked)
    plain_hi, plain_mid = ratios(raw, plain)
    return [
        (f"raw recv_into {n / (1 << 20):.0f} MiB, memory reused", ms(raw),
         "1.00x", "best / median"),
        ("hurray:// get_checked (verified on arrival)", ms(checked),
         f"{hi:.2f}x best, {mid:.2f}x median",
         ">= 0.8x: " + ("met" if mid >= 0.8 else "MISSED")),
        ("hurray:// get (no checksums checked)", ms(plain),
         f"{plain_hi:.2f}x best, {plain_mid:.2f}x median", ""),
        ("get_checked: hashing and checking", ms(hashing),
         f"{statistics.median(hashing) / statistics.median(checked):.2f} of it", ""),
    ]


def segment_only(runs: int) -> None:
    """The segment rows alone: a server and a raw peer of a segment's size."""
    n = segment().nbytes
    server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                               "127.0.0.1:0", "--log-level", "warning"],
                              stdout=subprocess.PIPE, text=True)
    peer = subprocess.Popen([sys.executable, "-c", RAW_PEER, str(n)],
                            stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().split()[-1]
        port = int(peer.stdout.readline())
        rows = segment_rows(address, port, runs)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"q")
    finally:
        server.terminate()
        peer.terminate()
        server.wait(10)
        peer.wait(10)
    print_table(f"hurray:// segment {n / (1 << 20):.0f} MiB bfloat16 (16 layers x key/value), "
                f"loopback, server in its own process; {runs} paired runs, ms best / median",
                rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="128 MiB instead of 1 GiB")
    ap.add_argument("--segment", action="store_true",
                    help="only the hurray:// segment rows (get_checked of 64 MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.segment:
        segment_only(max(args.repeat, 9))
        return
    layers, pages = 32, 512 if not args.small else 32  # 64 members x 16 MiB = 1 GiB
    snap = make(layers, pages)
    total = snap.nbytes
    r = args.repeat
    server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                               "127.0.0.1:0", "--log-level", "warning"],
                              stdout=subprocess.PIPE, text=True)
    peer = subprocess.Popen([sys.executable, "-c", RAW_PEER, str(total)],
                            stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().split()[-1]
        port = int(peer.stdout.readline())
        data = np.ones(total, np.uint8)
        t_raw_send = best(lambda: raw_send(port, total, data), r)
        t_raw_fresh = best(lambda: raw_send(port, total, data, b"f"), r)
        t_raw_recv = best(lambda: raw_recv(port, total, data), r)
        with KVClient(address) as c:
            t_push = best(lambda: c.push("bench", snap), r)
            runs = max(r, 4)
            # pulls into fresh memory: a new process each time, against the same for raw
            raw_first, pull_first = paired(lambda: first(FIRST_RAW, port, total),
                                           lambda: first(FIRST_PULL, address), runs)
            # steady state: this process, memory recycled (pull) or reused (raw)
            c.pull("bench")
            raw_steady, pull_steady = paired(lambda: timed(lambda: raw_recv(port, total, data)),
                                             lambda: timed(lambda: c.pull("bench")), runs)
            held = c.pull("bench")
            pull_into = [timed(lambda: c.pull("bench", into=held)) for _ in range(runs)]
            firsts, wholes = [], []
            for _ in range(r):
                t0 = time.perf_counter()
                first_layer = None
                for i, _layer in c.iter_pull("bench"):
                    if i == 0:
                        first_layer = time.perf_counter() - t0
                wholes.append(time.perf_counter() - t0)
                firsts.append(first_layer)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"q")
    finally:
        server.terminate()
        peer.terminate()
        server.wait(10)
        peer.wait(10)
    gib = 1 << 30
    rows = [
        ("raw socket sendall (client -> peer)", f"{total / t_raw_send / gib:.2f} GiB/s",
         "1.00x", ""),
        ("raw sendall, peer stores in new memory", f"{total / t_raw_fresh / gib:.2f} GiB/s",
         f"{t_raw_send / t_raw_fresh:.2f}x", ""),
        ("push (until the server's ACK)", f"{total / t_push / gib:.2f} GiB/s",
         f"{t_raw_send / t_push:.2f}x", ">= 0.8x"),
        ("raw socket recv_into (peer -> client)", f"{total / t_raw_recv / gib:.2f} GiB/s",
         "1.00x", ""),
        ("raw recv_into, fresh process + memory", spread(total, raw_first), "1.00x", ""),
        ("pull, fresh process (first pull)", spread(total, pull_first),
         worst(raw_first, pull_first), ">= 0.8x every run"),
        ("raw recv_into, memory reused", spread(total, raw_steady), "1.00x", ""),
        ("pull, steady state (recycled memory)", spread(total, pull_steady),
         worst(raw_steady, pull_steady), ">= 0.8x every run"),
        ("pull(into=previous snapshot)", spread(total, pull_into),
         worst(raw_steady, pull_into), ">= 0.8x every run"),
        ("iter_pull: first layer", f"{min(firsts) * 1e3:.1f} ms",
         f"{min(firsts) / min(wholes):.3f} of whole", ""),
        ("iter_pull: whole snapshot", f"{min(wholes) * 1e3:.1f} ms", "1.000", ""),
    ]
    print_table(f"snapshot {total / gib:.2f} GiB {snap.dtype} ({layers} layers x key/value), "
                f"loopback, server in its own process; best of {r}", rows)
    print()
    segment_only(max(r, 9))


if __name__ == "__main__":
    main()
