"""``hurraykv serve --persist DIR --persist-budget SIZE`` against a real server on loopback:
the disk tier evicts least recently used files, keeps its accounts across a restart,
refuses an object larger than the whole budget, and never shows a reader half a file."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

import hurraykv as hk
from hurraykv.cli import main
from hurraykv.net.client import KVClient
from hurraykv.net.keystore import KeyStore, PersistFull, StoredObject, hrry_size
from hurraykv.net.messages import ErrorCode as E
from hurraykv.net.persisted import file_contents
from hurraykv.net.server import KVServer
from tests.support.snapshots import make_snapshot, zeroed


def _items(snap: hk.KVCacheSnapshot) -> list:
    return [(snap.head(), [])] + [(d, list(b)) for _, d, b in snap.members()]


def _object(snap: hk.KVCacheSnapshot) -> StoredObject:
    return StoredObject(_items(snap), snap.nbytes)


def _files(directory: Path) -> dict[str, int]:
    """The key each persisted file holds, with the file's size."""
    return {hk.HrryFile.open(p).kv["hurraykv.key"]: p.stat().st_size
            for p in directory.glob("*.hrry")}


def _file_size(tmp_path: Path, snap: hk.KVCacheSnapshot, key: str = "k0") -> int:
    """The size of the file the server writes for ``snap`` under a key of ``key``'s length."""
    store = KeyStore(persist=tmp_path / "measure")
    return store.persist_object(key, _object(snap), snap).stat().st_size


def _server(tmp_path: Path, budget: int, **kw):
    return KVServer(listen="127.0.0.1:0", persist=str(tmp_path / "store"),
                    persist_budget=budget, **kw).run_in_thread()


@pytest.mark.parametrize("kind", ["float16", "int8", "fp8", "tensor"])
def test_the_expected_file_size_is_the_written_one(tmp_path, kind):
    store = KeyStore(persist=tmp_path)
    if kind == "tensor":  # a single tensor: no snapshot KV, one member
        t = make_snapshot("float16").tensor(1, "value")
        bufs = list(t.buffers())
        obj = StoredObject([(t.descriptor(), bufs)], sum(memoryview(b).nbytes for b in bufs))
        snap = None
    else:
        snap = make_snapshot(kind, layers=4).with_info("some-model", {"engine": "x" * 5000})
        obj = _object(snap)
    expected = hrry_size(*file_contents("key-é", obj, snap))
    path = store.persist_object("key-é", obj, snap)
    assert path.stat().st_size == expected == store.persisted_bytes
    assert store.persist_reserved == 0 and store.stats()["persisted_objects"] == 1


def test_the_least_recently_used_files_leave_first(tmp_path):
    snaps = {f"k{i}": make_snapshot("float16", seed=i) for i in range(5)}
    size = _file_size(tmp_path, snaps["k0"])
    budget = 3 * size + size // 2
    objects = snaps["k0"].nbytes
    # memory holds one object: every other pull is served from its file
    with _server(tmp_path, budget, memory_budget=objects + objects // 2) as st, \
            KVClient(st.address) as c:
        for key in ("k0", "k1", "k2"):
            c.push(key, snaps[key])
        assert c.pull("k0").equal(zeroed(snaps["k0"]))  # k0 is now the most recent
        c.push("k3", snaps["k3"])  # 4 files pass the budget: k1 goes, not k0
        on_disk = _files(tmp_path / "store")
        assert sorted(on_disk) == ["k0", "k2", "k3"]
        assert sum(on_disk.values()) <= budget
        c.push("k4", snaps["k4"])
        on_disk = _files(tmp_path / "store")
        assert sorted(on_disk) == ["k0", "k3", "k4"] and sum(on_disk.values()) <= budget
        s = c.stat()
        assert s["disk_evictions"] == 2 and s["persisted_objects"] == 3
        assert s["persisted_bytes"] == sum(on_disk.values())
        assert s["persist_budget"] == budget and s["persist_reserved_bytes"] == 0
        assert s["memory_evictions"] >= 4  # each push pushed the previous object out
        # evicted from both tiers: gone, and said so; the others served whole
        assert c.has(["k1", "k2", "k0"]) == [False, False, True]
        with pytest.raises(hk.RemoteError) as exc:
            c.pull("k1")
        assert exc.value.code == E.UNKNOWN_TENSOR
        for key in ("k0", "k3", "k4"):
            assert c.pull(key).equal(zeroed(snaps[key]))


def test_disk_evicts_the_least_recently_used_in_exact_order_across_a_restart(tmp_path):
    """Issue 35 item 7: the order itself, write by write.  A pull is a use whether it is
    served from memory (the newest push) or from the file; a restart orders the files by
    the mtimes the server gave them, so it evicts in the same order."""
    snaps = {f"k{i}": make_snapshot("float16", seed=i) for i in range(8)}
    size = _file_size(tmp_path, snaps["k0"])
    budget = 3 * size + size // 2  # three files; a fourth evicts exactly one
    objects = snaps["k0"].nbytes

    def run(c: KVClient, st, steps: list[str]) -> None:
        """``push KEY [EVICTED]``, ``pull KEY`` (from its file), ``pull-memory KEY``."""
        for step in steps:
            op, key, *evicted = step.split()
            if op.startswith("pull"):
                assert (key in st.server.store._objects) == (op == "pull-memory"), step
                assert c.pull(key).equal(zeroed(snaps[key]))
                continue
            before = set(_files(tmp_path / "store"))
            c.push(key, snaps[key])
            after = _files(tmp_path / "store")
            assert sorted(before - set(after)) == evicted, (step, sorted(after))
            assert key in after and sum(after.values()) <= budget
            assert sorted(st.server.store._files) == sorted(after)

    # memory holds one object: the newest push is pulled from memory, the rest from files
    with _server(tmp_path, budget, memory_budget=objects + objects // 2) as st, \
            KVClient(st.address) as c:
        run(c, st, ["push k0", "push k1", "push k2",
                    "pull k0",  # used: k1, k2, k0
                    "pull-memory k2",  # used: k1, k0, k2
                    "push k3 k1",  # by name, or without the pulls, k0 would go
                    "pull k0",  # used: k2, k3, k0
                    "push k4 k2",
                    "push k5 k3",
                    "pull k4"])  # used: k0, k5, k4
        assert c.stat()["disk_evictions"] == 3
    with _server(tmp_path, budget) as st, KVClient(st.address) as c:
        run(c, st, ["push k6 k0",  # the oldest use, though the first of them pushed
                    "push k7 k5"])  # not k4, pulled after it
        assert c.has(["k0", "k5", "k4"]) == [False, False, True]
        assert c.stat()["disk_evictions"] == 2


def test_an_object_evicted_from_disk_stays_served_from_memory(tmp_path):
    snaps = {f"k{i}": make_snapshot("float16", seed=i) for i in range(3)}
    size = _file_size(tmp_path, snaps["k0"])
    with _server(tmp_path, 2 * size) as st, KVClient(st.address) as c:
        for key, snap in snaps.items():
            c.push(key, snap)
        assert sorted(_files(tmp_path / "store")) == ["k1", "k2"]
        assert c.pull("k0").equal(zeroed(snaps["k0"]))  # no memory budget: still held
        assert st.server.store._objects["k0"].path is None  # but no longer durable


def test_a_restart_rescans_the_directory_and_keeps_the_budget(tmp_path):
    snaps = {k: make_snapshot("float16", seed=i) for i, k in enumerate("abcd")}
    size = _file_size(tmp_path, snaps["a"], key="a")
    budget = 3 * size + size // 2
    with _server(tmp_path, budget) as st, KVClient(st.address) as c:
        for key in "abc":
            c.push(key, snaps[key])
        c.pull("a")  # least recently used now: b, c, a
    with _server(tmp_path, budget) as st, KVClient(st.address) as c:
        s = c.stat()
        assert (s["persisted_objects"], s["persisted_bytes"]) == (3, 3 * size)
        assert s["disk_evictions"] == 0 and s["objects_in_memory"] == 0
        assert c.pull("b").equal(zeroed(snaps["b"]))  # a read counts: c, a, b
        c.push("d", snaps["d"])
        assert sorted(_files(tmp_path / "store")) == ["a", "b", "d"]
        assert c.has(["c"]) == [False] and c.stat()["disk_evictions"] == 1
    # a smaller budget on the next start: the least recently used go at once
    with _server(tmp_path, 2 * size + size // 2) as st, KVClient(st.address) as c:
        assert sorted(_files(tmp_path / "store")) == ["b", "d"]
        s = c.stat()
        assert s["disk_evictions"] == 1 and s["persisted_bytes"] == 2 * size
        assert c.pull("d").equal(zeroed(snaps["d"]))


def test_an_object_larger_than_the_whole_budget_is_refused(tmp_path):
    small, big = make_snapshot("float16"), make_snapshot("float16", layers=12, seed=1)
    size = _file_size(tmp_path, small, key="small")
    budget = 2 * size
    with _server(tmp_path, budget) as st, KVClient(st.address) as c:
        c.push("small", small)
        with pytest.raises(hk.RemoteError) as exc:
            c.push("big", big)
        text = str(exc.value)
        assert exc.value.code == E.STORE_FULL and "'big'" in text
        assert "file_bytes" in text and f"--persist-budget is {budget} bytes" in text
        # decided before anything was written or evicted
        assert sorted(_files(tmp_path / "store")) == ["small"]
        assert not [p for p in (tmp_path / "store").iterdir() if p.name.endswith(".tmp")]
        s = c.stat()
        assert s["disk_evictions"] == 0 and s["persist_reserved_bytes"] == 0
        assert s["reserved_bytes"] == 0 and c.has(["big"]) == [False]
        assert c.pull("small").equal(zeroed(small))


def test_persist_full_names_field_value_and_rule(tmp_path):
    store = KeyStore(persist=tmp_path, persist_budget=4096)
    snap = make_snapshot("float16")
    with pytest.raises(PersistFull) as exc:
        store.persist_object("k", _object(snap), snap)
    e = exc.value
    assert isinstance(e, hk.HurrayError) and e.code == E.STORE_FULL
    assert (e.field, e.rule) == ("file_bytes", "--persist-budget") and e.value > 4096
    assert list(tmp_path.iterdir()) == [] and store.persist_reserved == 0


def test_a_reader_holding_an_evicted_file_keeps_valid_bytes(tmp_path):
    snaps = [make_snapshot("fp8", seed=i) for i in range(3)]
    size = _file_size(tmp_path, snaps[0])
    store = KeyStore(persist=tmp_path / "store", persist_budget=2 * size)
    store.persist_object("k0", _object(snaps[0]), snaps[0])
    held = store.get("k0")  # mapped from its file, as a pull in progress holds it
    assert held is not None and held.path is not None
    path = held.path
    for i in (1, 2):
        store.persist_object(f"k{i}", _object(snaps[i]), snaps[i])
    assert not path.exists() and store.get("k0") is None  # gone as a whole
    want = _items(snaps[0])
    for (desc, bufs), (want_desc, want_bufs) in zip(held.items, want, strict=True):
        assert desc == want_desc
        assert [bytes(b) for b in bufs] == [bytes(memoryview(b).cast("B")) for b in want_bufs]


def test_concurrent_pushes_and_pulls_stay_within_the_budget(tmp_path):
    snaps = {f"k{i}": make_snapshot("float16", seed=i) for i in range(8)}
    size = _file_size(tmp_path, snaps["k0"])
    budget = 3 * size
    failures: list[str] = []
    done = {"push": 0, "pull": 0}
    # memory for three objects: most pulls map a file that another push may evict
    with _server(tmp_path, budget, memory_budget=snaps["k0"].nbytes * 3) as st:

        def work(seed: int) -> None:
            rng = random.Random(seed)
            try:
                with KVClient(st.address) as c:
                    for _ in range(12):
                        key = rng.choice(sorted(snaps))
                        op = "push" if rng.random() < 0.5 else "pull"
                        try:
                            if op == "push":
                                c.push(key, snaps[key])
                            elif not c.pull(key).equal(zeroed(snaps[key])):
                                failures.append(f"{key}: other bytes")
                                continue
                        except hk.RemoteError as e:  # a budget taken by others in flight
                            if e.code not in (E.UNKNOWN_TENSOR, E.STORE_FULL):
                                failures.append(f"{op} {key}: {e}")
                            continue
                        done[op] += 1
            except Exception as e:
                failures.append(repr(e))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        on_disk = _files(tmp_path / "store")
        store = st.server.store
        assert not failures and done["push"] and done["pull"]
        assert sum(on_disk.values()) <= budget
        assert store.persisted_bytes == sum(on_disk.values())
        assert sorted(store._files) == sorted(on_disk) and store.persist_reserved == 0


def test_cli_persist_budget_needs_persist(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--persist-budget", "1G"])
    assert exc.value.code == 2 and "--persist-budget" in capsys.readouterr().err
    with pytest.raises(hk.HurrayError, match="persist_budget"):
        KVServer(listen="127.0.0.1:0", persist_budget=1 << 30)
