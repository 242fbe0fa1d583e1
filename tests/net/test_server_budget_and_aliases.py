"""Regression tests for issue 19 (outside reliability campaign) against a real
``hurraykv serve`` on loopback: refused pushes, buffered payloads and the memory budget,
per-tenant STAT, server aliases; and issue 10's: a PUT the server cannot build, refused
pushes and broken groups, claimed sizes, PUTs in flight against the budget.  Each test
failed on the code before its fix."""

from __future__ import annotations

import logging
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.net import messages as m
from hurraykv.net.client import KVClient
from hurraykv.net.messages import ErrorCode as E
from hurraykv.net.messages import MessageType as T
from hurraykv.net.server import KVServer
from hurraykv.snapshot import group_head
from tests.io.test_file_safety import absurd_members
from tests.net.test_net import Raw
from tests.support.snapshots import fused, make_snapshot, zeroed

MIB = 1 << 20


# ------------------------------------------------------------------- 8 refused pushes
def test_a_refused_push_evicts_nobody(tmp_path):
    other, big = fused(1, 2, seed=1), fused(5, 2, seed=2)  # 2 MiB; 10 MiB in 5 members
    with KVServer(listen="127.0.0.1:0", memory_budget=8 * MIB).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.push("other", other)
        with pytest.raises(hk.RemoteError) as exc:
            c.push("big", big)
        assert exc.value.code == E.STORE_FULL and f"needs {big.nbytes} bytes" in str(exc.value)
        assert [k for k, _ in c.list_keys()] == ["other"]  # before: [] (evicted for member 4)
        assert c.pull("other").equal(other)
        fits = fused(3, 2, seed=3)  # 6 MiB: fits only by evicting "other", which it may
        c.push("fits", fits)
        assert [k for k, _ in c.list_keys()] == ["fits"] and c.pull("fits").equal(fits)
        store = st.server.store
        assert store.memory_bytes + store.reserved_bytes <= 8 * MIB


def test_a_group_keeps_objects_on_disk_out_of_memory_as_it_arrives(tmp_path):
    other, big = fused(1, 2, seed=1), fused(5, 2, seed=2)
    with KVServer(listen="127.0.0.1:0", memory_budget=8 * MIB,
                  persist=str(tmp_path)).run_in_thread() as st, KVClient(st.address) as c:
        c.push("other", other)
        with pytest.raises(hk.RemoteError):
            c.push("big", big)
        # a persisted object may leave memory for a group still arriving: it stays on disk
        assert "other" not in st.server.store._objects
        assert [k for k, _ in c.list_keys()] == ["other"] and c.pull("other").equal(other)


# ------------------------------------------------------------------- 7 payload memory
def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


class Received:
    """What a ``hurraykv serve`` has read from other connections: STAT's
    ``bytes_received`` (framing included) less what this client's own STAT requests
    added.  Open it before the traffic it is to count."""

    def __init__(self, address: str) -> None:
        self.client = KVClient(address)  # its handshake is answered: the loop serves
        self.first = self.client.stat()["bytes_received"]
        self.per = self.client.stat()["bytes_received"] - self.first  # one STAT request
        self.asked = 1

    def others(self) -> int:
        total = self.client.stat()["bytes_received"]
        self.asked += 1
        return total - self.first - self.asked * self.per

    def wait(self, total: int, timeout: float = 60.0) -> None:
        """Until the server has read ``total`` bytes from the other connections."""
        deadline = time.monotonic() + timeout
        while (got := self.others()) < total:
            assert time.monotonic() < deadline, f"the server read {got} of {total} bytes"
            time.sleep(0.01)

    def close(self) -> None:
        self.client.close()


HELLO = len(m.message(T.CLIENT_HELLO, 1, m.Hello().encode()))


def test_control_payloads_are_reserved_against_the_budget():
    p = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                          "127.0.0.1:0", "--memory-budget", "16M", "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        host, port = p.stdout.readline().split()[-1].rsplit(":", 1)
        received = Received(f"{host}:{port}")
        before = _rss(p.pid)
        size = (16 << 20) - 1  # one TENSOR_PUT payload just under --max-message-size
        body = bytes(size)
        codes: list[int] = []
        sent = threading.Barrier(33)

        def send() -> None:
            with socket.create_connection((host, int(port)), timeout=60) as s:
                s.sendall(m.message(T.CLIENT_HELLO, 1, m.Hello().encode()))
                s.recv(4096)
                s.sendall(struct.pack("<III", T.TENSOR_PUT, 3, size))
                s.sendall(body[:-1])  # all but the last byte: the server holds the rest
                sent.wait()
                sent.wait()
                s.sendall(body[-1:])
                f = s.makefile("rb")
                _, _, n = struct.unpack("<III", f.read(12))
                codes.append(m.decode_error(f.read(n)).code)

        threads = [threading.Thread(target=send) for _ in range(32)]
        for t in threads:
            t.start()
        sent.wait(120)
        received.wait(32 * (HELLO + 12 + size - 1))  # whatever the server buffers, it holds now
        received.close()
        grown = _rss(p.pid) - before
        sent.wait()
        for t in threads:
            t.join()
        # before: 530 MiB; now at most the budget, plus allocator slack
        assert grown < 40 << 20, f"the server grew by {grown >> 20} MiB under a 16 MiB budget"
        assert len(codes) == 32 and E.STORE_FULL in codes
        with KVClient(f"{host}:{port}") as c:  # still serving; nothing left reserved
            assert c.stat()["reserved_bytes"] == 0
            many = [f"key-{i:06d}-" + "x" * 100 for i in range(4000)]  # a 460 KiB payload
            assert c.has(many) == [False] * len(many)
            c.push("k", fused(1, 2))
            assert c.pull("k").equal(fused(1, 2))
    finally:
        p.terminate()
        p.wait(10)


# ------------------------------------------------------------------- 6 aliases
def test_a_line_cut_by_a_crash_never_swallows_the_next_link(tmp_path):
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.push("target", make_snapshot())
        c.link([("first", "target")])
    with open(tmp_path / "aliases.jsonl", "ab") as f:
        f.write(b'["cut-by-a-cr')  # the server died in the middle of an append
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.link([("second", "target")])  # acknowledged
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address) as c:
        assert c.locate(["first", "second", "cut-by-a-cr"]) == ["target", "target", None]
        assert (tmp_path / "aliases.jsonl").read_bytes().endswith(b"\n")


def test_hostile_alias_lines_do_not_stop_a_server(tmp_path):
    lines = [b"[" * 100_000, b'["ok", "target"]', b'{"not": "a pair"}', b'["a", ["b"]]',
             b'["x" ' + b" " * 200_000 + b']', b"\xff\xfe", b'["y", 1]', b'["also", "target"]']
    (tmp_path / "aliases.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address) as c:  # before: RecursionError, the server did not start
        assert c.aliases() == [("also", "target"), ("ok", "target")]
    assert (tmp_path / "aliases.jsonl").stat().st_size < 100  # compacted to what is live


def test_aliases_are_listed_removed_and_dropped_with_their_target(tmp_path, capsys):
    from hurraykv.cli import main

    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.push("seg-1", make_snapshot(seed=1))
        c.push("seg-2", make_snapshot(seed=2))
        c.link([("a1", "seg-1"), ("a2", "seg-1"), ("b1", "seg-2")])
        assert main(["ls", "--aliases", st.address]) == 0
        out = capsys.readouterr().out
        assert "a1  -> seg-1" in out and "b1  -> seg-2" in out and "3 aliases" in out
        assert main(["rm", st.address, "b1"]) == 0  # an alias: its target stays
        assert c.aliases() == [("a1", "seg-1"), ("a2", "seg-1")]
        assert [k for k, _ in c.list_keys()] == ["seg-1", "seg-2"]
        c.delete("seg-1")  # a target: its aliases go too
        assert c.aliases() == [] and c.locate(["a1"]) == [None]
        with pytest.raises(hk.RemoteError) as exc:
            c.delete("a1")
        assert exc.value.code == E.UNKNOWN_TENSOR
        assert c.stat()["aliases"] == 0
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address) as c:
        assert c.aliases() == [] and c.locate(["a1", "b1"]) == [None, None]


def test_aliases_count_against_the_budget_and_the_file_is_compacted(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                          "127.0.0.1:0", "--memory-budget", "16M", "--persist", str(tmp_path),
                          "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = p.stdout.readline().split()[-1]
        with KVClient(address) as c:
            c.ping()  # serving: the baseline is a running server's
        before = _rss(p.pid)
        refused = linked = 0
        with KVClient(address) as c:
            c.push("target", make_snapshot())
            for batch in range(120):  # 12,000 aliases of 2 KB names: 48 MB of keys
                pairs = [(f"{batch:03d}-{i:03d}-" + "a" * 2000, "target") for i in range(100)]
                try:
                    c.link(pairs)
                    linked += len(pairs)
                except hk.RemoteError as e:
                    assert e.code == E.STORE_FULL and "aliases" in str(e)
                    refused += 1
            s = c.stat()
            grown = _rss(p.pid) - before
            assert refused and 6000 < linked < 7500, (refused, linked)  # before: none refused
            assert s["aliases"] == linked and s["alias_bytes"] <= 16 * MIB
            assert grown < 40 * MIB, f"the server grew by {grown >> 20} MiB"  # before: 100+
            assert (tmp_path / "aliases.jsonl").stat().st_size < s["alias_bytes"]
            for alias, _ in c.aliases()[:linked - 10]:
                c.delete(alias)
            assert len(c.aliases()) == 10
            assert (tmp_path / "aliases.jsonl").stat().st_size < 2 * MIB  # compacted
            c.link([("fits-again", "target")])
    finally:
        p.terminate()
        p.wait(10)


def test_an_alias_goes_when_its_target_is_evicted_for_good():
    with KVServer(listen="127.0.0.1:0", memory_budget=5 * MIB).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.push("t1", fused(1, 2, seed=1))
        c.link([("a", "t1")])
        c.push("t2", fused(1, 3, seed=2))  # evicts t1: no disk, no backing store
        assert [k for k, _ in c.list_keys()] == ["t2"]
        assert c.aliases() == [] and st.server.store.aliases.nbytes == 0


# ------------------------------------------------------ issue 10: absurd dims
def test_the_server_answers_a_put_it_cannot_build(caplog):
    caplog.set_level(logging.INFO, logger="hurraykv.server")
    members = absurd_members()
    frames = [m.message(T.TENSOR_PUT, 5, m.Put("absurd", group_head(len(members)), 0).encode()),
              m.message(T.TENSOR_DATA_END, 5)]
    for _, desc, bufs in members:
        data = b"".join(bytes(b) for b in bufs)
        frames.append(m.message(T.TENSOR_PUT, 5, m.Put("absurd", desc, len(data)).encode()))
        if data:
            frames.append(m.message(T.TENSOR_DATA, 5, struct.pack("<Q", 0) + data))
        frames.append(m.message(T.TENSOR_DATA_END, 5))
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
        raw = Raw(st.address)
        raw.sock.settimeout(5)  # before the fix: no answer at all
        raw.sock.sendall(b"".join(frames))
        assert raw.error_code() == E.INVALID_MESSAGE
        raw.send(T.PING, 9, b"up")
        assert raw.recv() == (T.PONG, 9, b"up")
        raw.close()


# ------------------------------------------------------ issue 10: refused push
def test_a_refused_push_keeps_the_stored_snapshot_whole(caplog):
    caplog.set_level(logging.INFO, logger="hurraykv.server")
    small, big = make_snapshot("float16", layers=1), make_snapshot("float16", layers=8, seed=4)
    budget = small.nbytes * 3
    with KVServer(listen="127.0.0.1:0", memory_budget=budget).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.push("k", small)
        with pytest.raises(hk.RemoteError) as exc:
            c.push("k", big)
        assert exc.value.code == E.STORE_FULL
        assert f"needs {big.nbytes} bytes" in str(exc.value)
        assert f"memory budget is {budget} bytes" in str(exc.value)
        back = c.pull("k")
        assert back.equal(zeroed(small))  # before: "holds a single tensor, not a snapshot"
        assert st.server.store.reserved_bytes == 0
        c.push("k2", small)  # the connection and the server are still in step
    assert not any("tensor_data without" in r.message for r in caplog.records)


def test_a_group_broken_midway_stores_nothing_of_it():
    s, other = make_snapshot("float16", layers=2), make_snapshot("int8", layers=2, seed=5)
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
        with KVClient(st.address) as c:
            c.push("k", s)
        frames = [m.message(T.TENSOR_PUT, 5, m.Put("k", other.head(), 0).encode()),
                  m.message(T.TENSOR_DATA_END, 5)]
        for i, (_, desc, bufs) in enumerate(other.members()):
            data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
            put = m.Put("k", desc, len(data)).encode()
            if i == 1:
                put = put[:-9] + b"\xff" + put[-8:]  # a corrupt member descriptor
            frames += [m.message(T.TENSOR_PUT, 5, put),
                       m.message(T.TENSOR_DATA, 5, struct.pack("<Q", 0) + data),
                       m.message(T.TENSOR_DATA_END, 5)]
        raw = Raw(st.address)
        raw.sock.sendall(b"".join(frames))
        assert raw.error_code() == E.INVALID_MESSAGE
        raw.send(T.PING, 7, b"x")
        assert raw.recv() == (T.PONG, 7, b"x")  # nothing else was answered on stream 5
        raw.close()
        with KVClient(st.address) as c:
            assert c.pull("k").equal(zeroed(s))


# ------------------------------------------------------------ issue 10: memory
def test_messages_before_the_handshake_are_small():
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
        raw = Raw(st.address, hello=False)
        raw.sock.sendall(struct.pack("<III", T.CLIENT_HELLO, 1, 16 << 20) + b"\x01")
        assert raw.error_code() == E.MESSAGE_TOO_LARGE
        with pytest.raises(ConnectionError):
            raw.recv()  # closed: nothing of the claim was read, let alone allocated


def test_claimed_sizes_do_not_grow_a_server_process():
    p = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                          "127.0.0.1:0", "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = p.stdout.readline().split()[-1]
        host, port = address.rsplit(":", 1)
        received = Received(address)
        before = _rss(p.pid)
        socks = []
        for i in range(64):  # 13 bytes each, claiming 16 MiB: before the fix ~1 GiB
            s = socket.create_connection((host, int(port)))
            if i % 2:  # after a handshake, a 16 MiB PING claim
                s.sendall(m.message(T.CLIENT_HELLO, 1, m.Hello().encode()))
                s.sendall(struct.pack("<III", T.PING, 3, 16 << 20) + b"\x01")
            else:
                s.sendall(struct.pack("<III", T.CLIENT_HELLO, 1, 16 << 20) + b"\x01")
            socks.append(s)
        # every claim read (a refused handshake's byte after its header may stay unread)
        received.wait(32 * (HELLO + 13) + 32 * 12)
        received.close()
        grown = _rss(p.pid) - before
        assert grown < 32 << 20, f"the server grew by {grown >> 20} MiB"
        for s in socks:
            s.close()
    finally:
        p.terminate()
        p.wait(10)


def test_pushes_in_flight_count_against_the_budget():
    shape = (96, 16, 16, 128)  # a 6 MiB float16 pool
    snap = hk.KVCacheSnapshot.from_arrays([np.ones(shape, np.float16)], None,
                                          np.arange(96), [0, 96], [1536])
    (_, desc, bufs), = [x for x in snap.members() if x[0].startswith("layers")]
    data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    with KVServer(listen="127.0.0.1:0", memory_budget=8 << 20).run_in_thread() as st:
        stalled = Raw(st.address)  # announces 6 MiB, sends 1 MiB, then waits
        stalled.send(T.TENSOR_PUT, 3, m.Put("first", desc, len(data)).encode())
        stalled.sock.sendall(m.message(T.TENSOR_DATA, 3, struct.pack("<Q", 0)
                                       + data[:1 << 20]))
        deadline = time.monotonic() + 5
        while st.server.store.reserved_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.server.store.reserved_bytes == len(data)
        with KVClient(st.address) as c:
            with pytest.raises(hk.RemoteError) as exc:
                c.push_tensor("second", snap.tensor(0, "fused"))
            assert exc.value.code == E.STORE_FULL and "reserved by other PUTs in flight" in str(
                exc.value)
            stalled.close()
            deadline = time.monotonic() + 5
            while st.server.store.reserved_bytes and time.monotonic() < deadline:
                time.sleep(0.01)
            assert st.server.store.reserved_bytes == 0  # released with the connection
            c.push_tensor("second", snap.tensor(0, "fused"))
            with pytest.raises(hk.RemoteError) as exc:  # both values would be held at once
                c.push_tensor("second", snap.tensor(0, "fused"))
            assert "hold the key's current value" in str(exc.value)
            store, pool = st.server.store, st.server.pool
            for i in range(4):  # each new key evicts the last; memory is recycled
                c.push_tensor(f"next-{i}", snap.tensor(0, "fused"))
                assert store.memory_bytes + store.reserved_bytes + pool.idle_bytes <= 8 << 20, i
            assert pool.recycled >= 1
