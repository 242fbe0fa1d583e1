"""Write loops that always finish (issue 29, item 1): an empty rewrite, a write that makes
no progress, and the server's alias log compacted off its event loop.  Each of these hung
for ever on the code before the fix: ``writev`` of nothing returns 0, and the loop retried."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.io.atomic import write_all, write_pieces
from hurraykv.net.aliases import AliasTable
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from tests.support.snapshots import make_snapshot


def _bounded(fn, seconds: float = 20.0):
    """Run ``fn`` on a thread and fail (rather than hang the suite) if it does not return."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised on the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return within {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("pieces", [[b""], [b"", b""], [b"", b"ab", b"", b"c", b""]])
def test_an_empty_or_partly_empty_rewrite_returns(tmp_path, pieces):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    size = sum(map(len, pieces))
    _bounded(lambda: write_pieces(path, pieces, size, fsync=True))  # before: never returned
    assert path.read_bytes() == b"".join(pieces)
    assert os.listdir(tmp_path) == ["f"]  # no temporary left


def test_a_write_that_makes_no_progress_is_an_error_not_a_spin(tmp_path):
    class Stuck:  # a file object whose write takes nothing, as a non-blocking one may
        def write(self, mv):
            return 0

    from hurraykv.io.hrry_writer import HrryWriter

    w = HrryWriter.__new__(HrryWriter)
    w._f = Stuck()
    with pytest.raises(hk.HurrayError) as exc:
        _bounded(lambda: w._write_out(memoryview(b"abc")))
    assert exc.value.field == "output" and "took 0 of 3 bytes" in str(exc.value)


def test_write_all_writes_more_pieces_than_one_gathered_write_takes(tmp_path):
    pieces = [bytes([i % 251]) * (i % 7) for i in range(5000)]  # > IOV_MAX, many empty
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        write_all(fd, pieces, "f")
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)


# ------------------------------------------------------------------------- alias log
def _pairs(n: int, prefix: str = "a", target: str = "t") -> list[tuple[str, str]]:
    return [(f"{prefix}{i:05d}-" + "x" * 990, target) for i in range(n)]


def test_removing_every_alias_compacts_the_log_to_nothing(tmp_path):
    table = AliasTable(tmp_path / "aliases.jsonl")
    table.link(_pairs(1200))  # 1.2 MB of lines
    _bounded(lambda: table.drop_target("t"))  # before: the empty rewrite never returned
    _bounded(table.wait_compacted)
    assert (tmp_path / "aliases.jsonl").read_bytes() == b""
    assert len(AliasTable(tmp_path / "aliases.jsonl")) == 0


def test_a_compaction_runs_beside_the_caller_and_keeps_links_made_meanwhile(tmp_path):
    copying, proceed = threading.Event(), threading.Event()
    caller = threading.get_ident()
    ran_on: list[int] = []

    class Slow(AliasTable):
        def _serialize(self, items):
            ran_on.append(threading.get_ident())
            if ran_on[-1] == caller:  # on the caller's thread it would block the caller
                return super()._serialize(items)
            copying.set()
            assert proceed.wait(20)
            return super()._serialize(items)

    table = Slow(tmp_path / "aliases.jsonl")
    table.link(_pairs(1200))
    table.remove([a for a, _ in _pairs(1100)])  # the file now holds far more than is live
    assert caller not in ran_on, "the compaction ran on the thread that changes the table"
    assert copying.wait(20)
    # the compaction is under way on its own thread: the table still changes, durably
    table.link(_pairs(3, prefix="late", target="u"))
    table.remove(["a01150-" + "x" * 990])
    proceed.set()
    table.wait_compacted(20)
    assert ran_on and ran_on[0] != caller
    size = (tmp_path / "aliases.jsonl").stat().st_size
    assert size < 200 * 1024  # compacted
    again = AliasTable(tmp_path / "aliases.jsonl")
    assert again.items() == table.items()
    assert len(again) == 100 - 1 + 3


def test_a_server_keeps_answering_while_an_rm_drops_a_megabyte_of_aliases(tmp_path):
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address, timeout=10) as a, KVClient(st.address, timeout=10) as b:
        a.push("target", make_snapshot())
        a.push("other", make_snapshot(seed=2))
        for chunk in range(4):
            a.link(_pairs(300, prefix=f"c{chunk}-", target="target"))
        a.delete("target")  # before: the server never answered again
        assert b.has(["target", "other"]) == [False, True]
        b.link([("kept", "other")])
        st.server.store.aliases.wait_compacted(20)
        assert (tmp_path / "aliases.jsonl").stat().st_size < 1024
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address, timeout=10) as c:
        assert c.aliases() == [("kept", "other")]


def test_a_server_starts_on_an_alias_log_holding_only_a_cut_line(tmp_path):
    (tmp_path / "aliases.jsonl").write_bytes(b'["cut-by-a-cr')
    server = _bounded(lambda: KVServer(listen="127.0.0.1:0", persist=str(tmp_path))
                      .run_in_thread())  # before: never listened
    with server as st, KVClient(st.address, timeout=10) as c:
        assert c.aliases() == []
    assert (tmp_path / "aliases.jsonl").read_bytes() == b""


def test_a_file_store_whose_alias_log_compacts_to_nothing_releases_its_lock(tmp_path,
                                                                               monkeypatch):
    from hurraykv.chunks.file.capacity import Capacity
    from hurraykv.chunks.file.store import FileChunks
    from hurraykv.chunks.keys import ChunkKeys, identity_digest
    from hurraykv.io import checksums

    monkeypatch.setattr(FileChunks, "COMPACT_SLACK", 2)
    monkeypatch.setattr(Capacity, "RESCAN_SECONDS", 0.0)

    def seg(seed: int) -> hk.KVCacheSnapshot:
        pool = np.random.default_rng(seed).standard_normal((8, 4, 2, 8)).astype(np.float16)
        return checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
            [pool], [pool], np.arange(8), [0, 8], [32]))

    def put(store: FileChunks, seed: int) -> None:
        store.put(ChunkKeys(identity_digest(f"t{seed}"), 4).upto(list(range(32)), 8), 0,
                  seg(seed), {})

    probe = FileChunks(tmp_path / "probe")
    put(probe, 0)
    size = next((tmp_path / "probe").glob("*.hrry")).stat().st_size
    store = FileChunks(tmp_path / "kv", max_bytes=size)  # room for one: each put evicts all
    for seed in range(6):
        _bounded(lambda seed=seed: put(store, seed))  # before: hung holding DIR/.lock
    other = FileChunks(tmp_path / "kv", max_bytes=size)
    _bounded(lambda: put(other, 99))
    assert len(list((tmp_path / "kv").glob("*.hrry"))) == 1


# ------------------------------------------------- the alias log on a full disk
def test_a_link_the_disk_cannot_hold_is_an_error_and_links_nothing(tmp_path):
    from tests.support.disk_fixtures import fill, tmpfs

    with tmpfs(tmp_path / "small", "4m") as disk:
        with KVServer(listen="127.0.0.1:0", persist=str(disk)).run_in_thread() as st, \
                KVClient(st.address, timeout=10) as c:
            c.push("target", make_snapshot())
            c.link([("kept", "target")])
            filler = fill(disk)
            with pytest.raises(hk.RemoteError) as exc:  # before: the connection dropped
                c.link(_pairs(100, target="target"))
            assert exc.value.code == hk.net.messages.ErrorCode.INTERNAL
            assert "nothing was linked" in str(exc.value) and "space" in str(exc.value)
            assert str(disk) not in str(exc.value)  # a tenant is not told where
            assert c.aliases() == [("kept", "target")]  # the same connection answers
            filler.unlink()
            c.link([("after", "target")])
        with KVServer(listen="127.0.0.1:0", persist=str(disk)).run_in_thread() as st, \
                KVClient(st.address, timeout=10) as c:  # before: a part of it came back
            assert c.aliases() == [("after", "target"), ("kept", "target")]


def test_an_rm_whose_aliases_the_disk_cannot_drop_says_so_and_can_be_retried(tmp_path):
    from tests.support.disk_fixtures import fill, tmpfs

    with tmpfs(tmp_path / "small", "8m") as disk:
        with KVServer(listen="127.0.0.1:0", persist=str(disk)).run_in_thread() as st, \
                KVClient(st.address, timeout=10) as c:
            c.push("target", make_snapshot())
            c.push("other", make_snapshot(seed=2))
            c.link(_pairs(1000, target="target"))
            filler = fill(disk)
            with pytest.raises(hk.RemoteError) as exc:
                c.delete("target")
            assert exc.value.code == hk.net.messages.ErrorCode.INTERNAL
            assert "rm it again" in str(exc.value)
            assert c.has(["target", "other"]) == [False, True]
            filler.unlink()
            c.delete("target")  # the retry removes the aliases left
            assert c.aliases() == []
        with KVServer(listen="127.0.0.1:0", persist=str(disk)).run_in_thread() as st, \
                KVClient(st.address, timeout=10) as c:
            assert c.aliases() == [] and c.has(["other"]) == [True]


@pytest.mark.parametrize("kind", ["link", "fifo", "directory"])
def test_an_alias_log_that_is_not_a_regular_file_stops_the_start_naming_it(tmp_path, kind):
    log = tmp_path / "aliases.jsonl"
    if kind == "link":
        (tmp_path / "elsewhere").write_bytes(b'["a","t"]\n')
        log.symlink_to(tmp_path / "elsewhere")  # before: read, then every LINK failed
    elif kind == "fifo":
        os.mkfifo(log)  # before: the server never listened
    else:
        log.mkdir()
    with pytest.raises(hk.HurrayError) as exc:
        _bounded(lambda: KVServer(listen="127.0.0.1:0", persist=str(tmp_path)))
    assert str(log) in str(exc.value) and exc.value.field == "aliases"


def test_a_failed_compaction_keeps_the_log_whole_and_waits_an_interval(tmp_path, monkeypatch):
    table = AliasTable(tmp_path / "aliases.jsonl")
    table.link(_pairs(1200))

    def fail(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hurraykv.io.atomic.create_temp", fail)
    for chunk in range(4):  # each change past the threshold would try again
        table.remove([a for a, _ in _pairs(1200)[chunk * 250:(chunk + 1) * 250]])
        table.wait_compacted(20)
    assert table.compactions_failed == 1
    monkeypatch.undo()
    table.link([("after", "t")])  # the log stayed whole: appends go on
    assert AliasTable(tmp_path / "aliases.jsonl").items() == table.items()
    table._retry_at = 0.0  # the interval over
    table.remove([_pairs(1200)[1100][0]])
    table.wait_compacted(20)
    assert table.compactions_failed == 1
    assert (tmp_path / "aliases.jsonl").stat().st_size < 250_000  # 200 aliases live
    assert AliasTable(tmp_path / "aliases.jsonl").items() == table.items()


def test_a_file_store_alias_append_cut_short_is_an_error_and_never_glues(tmp_path):
    """On a full disk an append to aliases.log can be written in part: put() returned as
    if stored (its segment unnamed), and the next append glued onto the cut line, so its
    first key was lost for every engine."""
    from hurraykv.chunks.file.store import FileChunks
    from hurraykv.chunks.keys import ChunkKeys, identity_digest
    from hurraykv.io import checksums
    from tests.support.disk_fixtures import fill, tmpfs

    def seg(seed: int) -> hk.KVCacheSnapshot:
        pool = np.random.default_rng(seed).standard_normal((2, 4, 2, 8)).astype(np.float16)
        return checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
            [pool], [pool], np.arange(2), [0, 2], [8]))

    def keys(seed: int) -> list[str]:
        return ChunkKeys(identity_digest(f"t{seed}"), 4).upto(list(range(8)), 2)

    with tmpfs(tmp_path / "small", "1m") as disk:
        store = FileChunks(disk)
        store.put(keys(0), 0, seg(0), {})
        size = next(disk.glob("*.hrry")).stat().st_size
        log = disk / "aliases.log"
        with open(log, "ab") as f:  # a stray line: the next append crosses a page
            f.write(b"#" * (4096 - 30 - log.stat().st_size - 1) + b"\n")
        filler = fill(disk, leave=-(-size // 4096) * 4096)  # room for the segment alone
        with pytest.raises(hk.HurrayError) as exc:
            store.put(keys(1), 0, seg(1), {})
        assert exc.value.field == "aliases" and "not stored" in str(exc.value)
        assert log.stat().st_size == 4096  # cut short: 30 bytes of the 2 lines
        assert len(list(disk.glob("*.hrry"))) == 1  # the unnamed segment removed
        filler.unlink()
        store.put(keys(2), 0, seg(2), {})
        reader = FileChunks(disk)
        assert None not in reader.locate(keys(0)) + reader.locate(keys(2))
        assert reader.get_verified(reader.locate(keys(2))[0]).equal(seg(2))
        assert reader.locate(keys(1)) == [None, None]


def test_a_log_opened_with_dead_lines_is_compacted_before_the_table_is_used(tmp_path):
    """At start the compaction runs before the constructor returns: one left running
    behind the new owner would rename its copy over that owner's first appends."""
    table = AliasTable(tmp_path / "aliases.jsonl")
    table.link(_pairs(3000))
    table.path = None  # this one writes no more: its lines stay dead in the file
    table.remove([a for a, _ in _pairs(3000)[:2900]])
    with open(tmp_path / "aliases.jsonl", "ab") as f:
        f.write(b"".join(f'["{a}",null]\n'.encode() for a, _ in _pairs(3000)[:2900]))
    again = AliasTable(tmp_path / "aliases.jsonl")
    assert (tmp_path / "aliases.jsonl").stat().st_size < 150_000  # 100 live, nothing dead
    again.link([("first", "t")])
    again.wait_compacted(20)
    assert AliasTable(tmp_path / "aliases.jsonl").items() == again.items()
