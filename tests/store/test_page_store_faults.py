"""Regression tests for issue 19 (outside reliability campaign) against a real
redis-server (and a real 3-master cluster): concurrent puts and deletes from several
processes, clients killed in the middle of a put or a delete, a redis-server killed and
restarted from its append-only file, and ``fsck`` after all of them.  The invariant: every
page's references are exactly the manifests naming it, every remaining snapshot reads back
bit for bit.  Each test failed on the code before its fix."""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hurraykv.cli import main
from hurraykv.paged import BlockPagedTensor
from hurraykv.snapshot import KVCacheSnapshot
from hurraykv.store import PageStore
from hurraykv.store.pages import StoreError
from tests.support import store_checks
from tests.support.paths import ROOT
from tests.support.redis_fixtures import emptied_url
from tests.support.redis_servers import free_port, redis_server_binary, start_redis

SHARED = np.random.default_rng(0).standard_normal((32, 4, 2, 8)).astype(np.float16)


def snap(seed: int) -> KVCacheSnapshot:
    """Two layers; every member holds 6 pages every snapshot shares (a system prompt) and
    4 of its own; two sequences, the second sharing the first's first 3 pages."""
    rng = np.random.default_rng(seed)
    tensors = []
    for layer in range(2):
        for r, role in enumerate(("key", "value")):
            start = (2 * layer + r) * 6
            pool = np.concatenate([SHARED[start:start + 6],
                                   rng.standard_normal((4, 4, 2, 8)).astype(np.float16)])
            tensors.append(BlockPagedTensor(pool, [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 8, 9],
                                            [0, 8, 13], [32, 20], kv_role=role,
                                            layer_index=layer))
    return KVCacheSnapshot.from_tensors(tensors, metadata={"seed": seed})


def check_consistent(store: PageStore) -> int:
    return store_checks.check_consistent(store, snap)


@pytest.fixture(params=["single", "cluster"])
def url(request):
    return emptied_url(request)


# ------------------------------------------------------------------- 2 concurrency
def _worker(url: str, wid: int, seconds: float) -> None:
    store = PageStore.from_url(url)
    rng = random.Random(wid)
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += 1
        seed, r = wid * 1_000_000 + n, rng.random()
        sid = "X" if r < 0.35 else "Y" if r < 0.5 else f"own-{wid}"
        if rng.random() < 0.6:
            store.put(sid, snap(seed))
        else:
            with contextlib.suppress(StoreError):
                store.delete(sid)  # "no snapshot": another process deleted it first


@pytest.mark.slow  # ~11 s (single), ~7 s (cluster) alone on 2 cores
def test_concurrent_puts_and_deletes_keep_every_reference_right(url):
    store = PageStore.from_url(url)
    store.put("S", snap(7))  # stored once, never touched again
    seconds = 10 if "cluster" not in url else 6
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(url, w, seconds)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(seconds + 120)
    assert [p.exitcode for p in procs] == [0] * 4
    # before: "snapshot 'S': layer 0 key page 3 ... is missing from the store", or counts
    # off by the releases done twice ('pages': -300)
    assert store.get("S").equal(snap(7))
    assert check_consistent(store) >= 1
    for sid in ("X", "Y", *(f"own-{w}" for w in range(4))):
        with contextlib.suppress(StoreError):
            store.delete(sid)
    store.delete("S")
    assert store.stats() == {"snapshots": 0, "pages": 0, "stored_bytes": 0,
                             "logical_bytes": 0}
    assert check_consistent(store) == 0
    store.client.close()


# ------------------------------------------------------------------- 3 crashes, fsck
CHILD = """
import os, signal, sys
import redis.connection as rc
from hurraykv.store import PageStore
from tests.store.test_page_store_faults import snap

url, op, seed, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = PageStore.from_url(url)  # scripts loaded: their replies are not counted
replies = [0]
read = rc.AbstractConnection.read_response


def read_response(self, *args, **kwargs):  # killed for real right after reply kill_at
    out = read(self, *args, **kwargs)
    replies[0] += 1
    if replies[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return out


rc.AbstractConnection.read_response = read_response
s = snap(seed)
store.put("A", s) if op == "put" else store.delete("A")
print("finished", flush=True)
"""


def _run_killed(url: str, op: str, seed: int, kill_at: int) -> bool:
    """Run ``op`` on snapshot A in a process SIGKILLed after its ``kill_at``-th Redis
    reply; True if it finished first."""
    out = subprocess.run([sys.executable, "-c", CHILD, url, op, str(seed), str(kill_at)],
                         capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    if out.returncode == 0:
        assert "finished" in out.stdout
        return True
    assert out.returncode == -signal.SIGKILL, out.stderr
    return False


@pytest.mark.parametrize("op", ["delete", pytest.param("put", marks=pytest.mark.slow)])  # ~8 s
def test_a_client_killed_at_every_step_never_costs_another_snapshot(redis_url, op):
    url = redis_url  # one sweep, on the single server: the cluster runs the same scripts
    store = PageStore.from_url(url)
    store.client.flushall()
    store.put("B", snap(2))  # shares 6 pages of each member with A; never deleted
    changed = 0
    for kill_at in range(1, 60):
        store.put("A", snap(100 + kill_at))
        if _run_killed(url, op, 200 + kill_at, kill_at):
            break
        if op == "delete":  # the retry succeeds, or finds the delete was complete
            with contextlib.suppress(StoreError):
                store.delete("A")
            assert "A" not in store
        else:  # the retry stores the snapshot; the killed put's references are dropped
            store.put("A", snap(300 + kill_at))
            assert store.get("A").equal(snap(300 + kill_at))
        # before: "snapshot 'B': layer 0 key page 0 ... is missing from the store" after
        # the retry of a delete killed right after its DECREF pipeline
        assert store.get("B").equal(snap(2)), kill_at
        report = store.fsck(grace=0)
        changed += sum(report[k] for k in ("releases_completed", "references_dropped",
                                           "pages_freed", "orphan_pages_freed"))
        check_consistent(store)
        again = store.fsck(grace=0)  # nothing left to do
        assert again["stats_before"] == again["stats_after"] == report["stats_after"]
        assert not any(again[k] for k in ("releases_completed", "references_dropped",
                                          "references_added", "pages_freed",
                                          "orphan_pages_freed")), again
    else:
        raise AssertionError(f"{op} never finished")
    assert kill_at > 3  # it was killed at every step before it finished
    # a retried delete completes what the killed one began (fsck finds nothing); a killed
    # put leaves references nobody holds, which only fsck drops
    assert (changed > 0) == (op == "put"), changed
    store.client.close()


def test_fsck_repairs_after_redis_server_is_killed_and_restarted(tmp_path, capsys):
    binary, port = redis_server_binary(), free_port()
    aof = ("--appendonly", "yes", "--appendfsync", "always")
    server = start_redis(binary, tmp_path, port, *aof)
    url = f"redis://127.0.0.1:{port}"
    worker = None
    try:
        store = PageStore.from_url(url)
        store.put("S", snap(7))  # stored before the crash, never touched
        code = ("import sys, random\nfrom hurraykv.store import PageStore\n"
                "from tests.store.test_page_store_faults import snap\n"
                "store, rng, n = PageStore.from_url(sys.argv[1]), random.Random(1), 0\n"
                "print('ready', flush=True)\n"
                "while True:\n"
                "    n += 1\n"
                "    sid = rng.choice(['X', 'Y', 'Z'])\n"
                "    try:\n"
                "        store.put(sid, snap(1000 + n)) if rng.random() < 0.6 "
                "else store.delete(sid)\n"
                "    except Exception as e:\n"
                "        if 'no snapshot' not in str(e): raise\n")
        worker = subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL,
                                  cwd=ROOT)
        worker.stdout.readline()
        time.sleep(1.5)
        server.kill()  # SIGKILL: whatever the worker was doing stops half-way
        server.wait(10)
        worker.kill()
        worker.wait(10)
        server = start_redis(binary, tmp_path, port, *aof)  # replays the append-only file
        store = PageStore.from_url(url)
        assert store.get("S").equal(snap(7))
        assert main(["store", "fsck", url]) == 0
        out = capsys.readouterr().out
        assert "pending releases completed" in out and "stats snapshots" in out
        report = store.fsck(grace=0)  # the killed put's references, however young
        print("fsck after the server crash:", report)
        assert check_consistent(store) >= 1
        store.client.close()
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        server.kill()
        server.wait(10)


def test_fsck_upgrades_a_store_of_counted_references(redis_url):
    """A store written before generations: version 1 manifests, ``hkv:r:`` counters."""
    import struct

    store = PageStore.from_url(redis_url)
    c = store.client
    c.flushall()
    store.put("old", snap(5))
    raw = c.get("hkv:m:{old}")
    v1 = b"HKVM" + struct.pack("<I", 1) + raw[24:]  # no generation
    c.set("hkv:m:{old}", v1)
    for key in store_checks.keys(c, "o"):
        c.delete(key)
        c.set(key.replace(b"hkv:o:", b"hkv:r:"), 1)
    assert store.get("old").equal(snap(5))  # read as ever
    for change in (lambda: store.put("old", snap(6)), lambda: store.delete("old")):
        with pytest.raises(StoreError, match="store fsck URL"):
            change()
    report = store.fsck()
    assert report["manifests_upgraded"] == 1 and report["legacy_counters_removed"] == 40
    assert report["references_added"] == 40 and not report["missing_pages"]
    assert check_consistent(store) == 1
    store.put("old", snap(6))
    store.delete("old")
    assert check_consistent(store) == 0
    store.client.close()
