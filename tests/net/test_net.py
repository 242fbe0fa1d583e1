"""The KV server and client over real loopback sockets (servers started by the tests)."""

from __future__ import annotations

import logging
import re
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.net import messages as m
from hurraykv.net.client import KVClient
from hurraykv.net.messages import ErrorCode as E
from hurraykv.net.messages import MessageType as T
from hurraykv.net.server import KVServer
from tests.support.certs import PKI, name
from tests.support.snapshots import make_snapshot, zeroed

KINDS = ["float16", "bfloat16", "int8", "fp8"]


@pytest.fixture
def server():
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
        yield st



@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_byte_exact(server, kind):
    s = make_snapshot(kind)
    with KVClient(server.address) as c:
        c.push(f"batch-{kind}", s)
        back = c.pull(f"batch-{kind}")
    assert back.equal(zeroed(s))
    if kind == "fp8":
        np.testing.assert_array_equal(back.kv_scales, s.kv_scales)


def test_without_zeroing_the_bytes_are_the_original_ones():
    s = make_snapshot("float16")
    with KVServer(listen="127.0.0.1:0", zero_unused=False).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.push("raw", s, zero_unused=False)
        assert c.pull("raw").equal(s)
    assert not s.equal(zeroed(s))  # the fixture really has data in unused slots


def test_unix_socket_and_single_tensors(tmp_path):
    path = str(tmp_path / "kv.sock")
    s = make_snapshot("int4")
    with KVServer(listen=path).run_in_thread() as st, KVClient(st.address) as c:
        t = s.tensor(1, "value")
        c.push_tensor("one", t)
        back = c.pull_tensor("one", seq_lens=t.seq_lens)
        np.testing.assert_array_equal(back.to_dense(dequantize=True),
                                      t.to_dense(dequantize=True))
        with pytest.raises(hk.HurrayError, match="single tensor"):
            c.pull("one")
        assert c.ping(b"hello") < 5


def test_iter_pull_yields_layer_zero_before_the_transfer_ends(server):
    s = make_snapshot("float16", layers=6)
    progress: list[int] = []
    with KVClient(server.address) as c:
        c.push("layers", s)
        first_at = None
        for i, (key, _value) in c.iter_pull("layers", progress=lambda d, t: progress.append(d)):
            if i == 0:
                first_at = progress[-1]
            np.testing.assert_array_equal(key.to_dense(), zeroed(s).layer(i)[0].to_dense())
        assert first_at is not None and first_at < progress[-1] / 3


def test_thirty_two_concurrent_clients(server):
    snaps = {f"client-{i}": make_snapshot("int8" if i % 2 else "float16", seed=i)
             for i in range(32)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(32)

    def work(key: str) -> None:
        try:
            with KVClient(server.address) as c:
                barrier.wait(10)
                c.push(key, snaps[key])
                for _ in range(2):
                    assert c.pull(key).equal(zeroed(snaps[key]))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in snaps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]


class Raw:
    """A hand-driven protocol connection for fault injection."""

    def __init__(self, address: str, hello: bool = True) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        if hello:
            self.send(T.CLIENT_HELLO, 1, m.Hello().encode())
            assert self.recv()[0] == T.SERVER_HELLO

    def send(self, mtype: int, stream: int, payload: bytes = b"") -> None:
        self.sock.sendall(m.message(mtype, stream, payload))

    def recv(self) -> tuple[int, int, bytes]:
        hdr = self._exact(12)
        mtype, stream, n = struct.unpack("<III", hdr)
        return mtype, stream, self._exact(n)

    def _exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    def error_code(self) -> int:
        mtype, _, payload = self.recv()
        assert mtype == T.ERROR, mtype
        return m.decode_error(payload).code

    def close(self) -> None:
        self.sock.close()


def _put_frames(key: str, s: hk.KVCacheSnapshot, stream: int = 5) -> list[bytes]:
    """The exact frames a client sends to push ``s``."""
    frames = [m.message(T.TENSOR_PUT, stream, m.Put(key, s.head(), 0).encode()),
              m.message(T.TENSOR_DATA_END, stream)]
    for _, desc, bufs in s.members():
        data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
        frames.append(m.message(T.TENSOR_PUT, stream, m.Put(key, desc, len(data)).encode()))
        if data:
            frames.append(m.message(T.TENSOR_DATA, stream, struct.pack("<Q", 0) + data))
        frames.append(m.message(T.TENSOR_DATA_END, stream))
    return frames


def _healthy(address: str, key: str) -> None:
    with KVClient(address) as c:
        assert c.ping() < 5
        with pytest.raises(m.RemoteError) as exc:
            c.pull(key)
        assert exc.value.code == E.UNKNOWN_TENSOR


@pytest.mark.parametrize("phase", ["mid-hello", "mid-put-descriptor", "mid-data",
                                   "before-end", "before-last-member"])
def test_disconnect_at_every_phase_leaves_nothing(server, phase):
    s = make_snapshot("float16", layers=2)
    frames = _put_frames("torn", s)
    blob = b"".join(frames)
    raw = Raw(server.address, hello=phase != "mid-hello")
    if phase == "mid-hello":
        sent = m.message(T.CLIENT_HELLO, 1, m.Hello().encode())[:15]
    elif phase == "mid-put-descriptor":
        sent = blob[: len(frames[0]) + len(frames[1]) + len(frames[2]) // 2]
    elif phase == "mid-data":
        sent = blob[: len(frames[0]) + len(frames[1]) + len(frames[2]) + len(frames[3])
                    + len(frames[4]) + 40]
    elif phase == "before-end":
        sent = b"".join(frames[:-1])
    else:
        sent = b"".join(frames[:-3])
    counts = server.server.counts
    before = counts.bytes_received  # the hello, when sent, was answered: counted
    raw.sock.sendall(sent)
    # the server has read all of it (it is mid-message), then it sees the disconnect
    wait_for(lambda: counts.bytes_received == before + len(sent))
    raw.close()
    wait_for(lambda: server.server.connections == 0)
    assert server.server.store.reserved_bytes == 0
    _healthy(server.address, "torn")


def wait_for(condition, timeout: float = 10.0) -> None:
    """Poll ``condition`` (what the server's loop has done) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _hello_then(server, frames: list[bytes]) -> Raw:
    raw = Raw(server.address)
    raw.sock.sendall(b"".join(frames))
    return raw


@pytest.mark.parametrize(("build", "code"), [
    (lambda: [m.message(T.TENSOR_REQUEST, 3, b"\x05\x00")], E.INVALID_MESSAGE),
    (lambda: [m.message(T.TENSOR_REQUEST, 3, m.Request("nope").encode())], E.UNKNOWN_TENSOR),
    (lambda: [m.message(T.TENSOR_PUT, 3, m.Put("k", make_snapshot().head(), 0).encode()[:-3])],
     E.INVALID_MESSAGE),
    (lambda: [m.message(T.TENSOR_DATA, 3, struct.pack("<Q", 0) + b"xx")], E.INVALID_MESSAGE),
    (lambda: [m.message(T.TENSOR_DATA_END, 3, b"x")], E.INVALID_MESSAGE),
    (lambda: [m.message(T.TENSOR_DATA_END, 3)], E.INVALID_MESSAGE),
    (lambda: [m.message(T.TENSOR_DESCRIPTOR, 3, b"")], E.INVALID_MESSAGE),
    (lambda: [m.message(T.SERVER_HELLO, 3, m.Hello().encode())], E.INVALID_MESSAGE),
    (lambda: [m.message(T.CLIENT_HELLO, 3, m.Hello().encode())], E.INVALID_MESSAGE),
    (lambda: [m.message(T.TENSOR_PUT_ACK, 3)], E.INVALID_MESSAGE),
    (lambda: [m.message(T.PONG, 3)], E.INVALID_MESSAGE),
    (lambda: [m.message(T.RDMA_REGISTER, 3, bytes(20))], E.INVALID_MESSAGE),
    (lambda: [m.message(T.RDMA_READY, 3)], E.INVALID_MESSAGE),
    (lambda: [m.message(T.DELETE, 3, m.Delete("nope").encode())], E.UNKNOWN_TENSOR),
    (lambda: [m.message(T.DELETE, 3, b"\x09")], E.INVALID_MESSAGE),
    (lambda: [m.message(0x33, 3, b"?")], E.INVALID_MESSAGE),
    (lambda: _put_frames("gap", make_snapshot("float16", layers=1))[:3]
     + [m.message(T.TENSOR_DATA, 5, struct.pack("<Q", 8) + b"x" * 8)], E.INVALID_MESSAGE),
    (lambda: [struct.pack("<III", T.PING, 3, (16 << 20) + 1)], E.MESSAGE_TOO_LARGE),
])
def test_malformed_frames_get_error_with_the_right_code(server, build, code):
    raw = _hello_then(server, build())
    got = raw.error_code()
    assert got == code
    if code == E.MESSAGE_TOO_LARGE:  # the payload is read and discarded; the line stays up
        raw.sock.sendall(bytes((16 << 20) + 1))
    raw.send(T.PING, 9, b"still here")
    assert raw.recv() == (T.PONG, 9, b"still here")
    raw.close()
    _healthy(server.address, "nothing")


def test_handshake_rules(server):
    raw = Raw(server.address, hello=False)
    raw.send(T.PING, 1)
    assert raw.error_code() == E.INVALID_MESSAGE
    with pytest.raises(ConnectionError):
        raw.recv()
    raw = Raw(server.address, hello=False)
    raw.send(T.CLIENT_HELLO, 1, m.Hello(protocol_version=0).encode())
    assert raw.error_code() == E.PROTOCOL_VERSION_MISMATCH


def test_limits_budget_connections_and_timeouts(caplog):
    caplog.set_level(logging.INFO, logger="hurraykv.server")
    small = make_snapshot("float16", layers=1)
    with KVServer(listen="127.0.0.1:0", memory_budget=small.nbytes * 2 + 10,
                  max_connections=2, read_timeout=1.0).run_in_thread() as st:
        with KVClient(st.address) as c:
            c.push("a", small)
            c.push("b", small)
            c.push("c", small)  # evicts "a", the least recently used
            assert c.pull("c").equal(zeroed(small))
            with pytest.raises(m.RemoteError) as exc:
                c.pull("a")
            assert exc.value.code == E.UNKNOWN_TENSOR
            with pytest.raises(m.RemoteError) as exc:
                c.push("big", make_snapshot("float16", layers=3))
            assert exc.value.code == E.STORE_FULL
        with KVClient(st.address), KVClient(st.address):
            with pytest.raises(m.RemoteError) as exc:
                KVClient(st.address)
            assert exc.value.code == E.SERVER_BUSY
        raw = Raw(st.address)
        raw.sock.sendall(m.message(T.PING, 3, b"x" * 10)[:15])  # then stall
        assert raw.error_code() == E.TIMEOUT
    assert any(re.search(r"put key='a' [\d.]+ (bytes|KiB|MiB) in [\d.]+ s "
                         r"\([\d.]+ (bytes|KiB|MiB|GiB)/s\)", r.message)
               for r in caplog.records)
    assert any("get key='c'" in r.message for r in caplog.records)


def test_mutual_tls_scopes_keys_by_client_subject(tmp_path):
    pki = PKI(tmp_path)
    ca = pki.ca_pem
    certs = {n: pki.client(n, name(("CN", n))) for n in ("tenant-a", "tenant-b")}
    with KVServer(listen="127.0.0.1:0", tls_cert=pki.pair("server")[0],
                  tls_key=pki.pair("server")[1], tls_ca=ca).run_in_thread() as st:
        a_snap, b_snap = make_snapshot("float16", seed=1), make_snapshot("int8", seed=2)

        def client(name: str) -> KVClient:
            return KVClient(st.address, tls_cert=certs[name][0], tls_key=certs[name][1],
                            tls_ca=ca)

        with client("tenant-a") as a, client("tenant-b") as b:
            a.push("shared-name", a_snap)
            with pytest.raises(m.RemoteError) as exc:
                b.pull("shared-name")  # tenant b cannot see tenant a's key
            assert exc.value.code == E.UNKNOWN_TENSOR
            b.push("shared-name", b_snap)  # nor overwrite it
            assert a.pull("shared-name").equal(zeroed(a_snap))
            assert b.pull("shared-name").equal(zeroed(b_snap))
            with pytest.raises(m.RemoteError):
                b.delete("only-a-has-this")
        with pytest.raises((OSError, hk.HurrayError)):
            KVClient(st.address, tls_ca=ca)  # no client certificate: refused


def test_restart_with_persist_serves_the_same_bytes(tmp_path):
    s = make_snapshot("fp8")
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.push("kept", s)
        first = c.pull("kept")
    files = list(tmp_path.glob("*.hrry"))
    assert len(files) == 1 and hk.load_snapshot(files[0]).equal(first)
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st:
        assert st.server.store._objects == {}  # nothing in memory: served from the file
        with KVClient(st.address) as c:
            assert c.pull("kept").equal(first)
            mapped = st.server.store._mapped["kept"]
            assert c.pull("kept").equal(first) and st.server.store._mapped["kept"] is mapped
            other = make_snapshot("fp8", seed=9)
            c.push("kept", other)  # replaces the file: the old mapping must not be served
            st.server.store._objects.clear()
            st.server.store.memory_bytes = 0
            assert c.pull("kept").equal(zeroed(other)) and not c.pull("kept").equal(first)
            c.delete("kept")
            assert "kept" not in st.server.store._mapped
    assert list(tmp_path.glob("*.hrry")) == []


def test_cli_serve_push_pull_and_restart(tmp_path):
    s = make_snapshot("int8")
    hk.save_snapshot(s, tmp_path / "in.hrry")
    persist = tmp_path / "store"

    def serve():
        p = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                              "127.0.0.1:0", "--persist", str(persist)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        assert "listening on" in line, p.stderr.read()
        return p, line.split()[-1]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "hurraykv.cli", *args],
                              capture_output=True, text=True, timeout=60)

    p, address = serve()
    try:
        r = cli("push", address, "job-1", str(tmp_path / "in.hrry"))
        assert r.returncode == 0 and "pushed job-1" in r.stdout, r.stderr
        assert r.stderr == ""  # no progress bar when stderr is not a terminal
    finally:
        p.terminate()
        p.wait(10)
    p, address = serve()
    try:
        r = cli("pull", address, "job-1", str(tmp_path / "out.hrry"))
        assert r.returncode == 0, r.stderr
        assert hk.load_snapshot(tmp_path / "out.hrry").equal(zeroed(s))
        r = cli("pull", address, "missing", str(tmp_path / "x.hrry"))
        assert r.returncode == 1 and "no such key 'missing'" in r.stderr, r.stderr
    finally:
        p.terminate()
        p.wait(10)


def test_received_memory_is_recycled_without_leaking_old_bytes():
    shape = (64, 16, 8, 128)  # 2 MiB pools: large enough to come from the pool
    big = [hk.KVCacheSnapshot.from_arrays([np.full(shape, v, np.float16)],
                                          [np.full(shape, -v, np.float16)],
                                          np.arange(64), [0, 64], [1024])
           for v in (1.0, 2.0, 3.0)]
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st, KVClient(st.address) as c:
        for s in big:  # each push replaces the last; its 2 MiB buffers go back to the pool
            c.push("same", s)
            back = c.pull("same")
            assert back.equal(s)
            del back
        assert st.server.pool.recycled >= 2


def test_a_put_claiming_more_memory_than_exists_is_refused(server):
    huge = hk.TensorDescriptor(0x11, (1 << 50,), hk.wire.RowMajor(),
                               (hk.wire.BufferHandle(1 << 50),))
    raw = Raw(server.address)
    raw.send(T.TENSOR_PUT, 3, m.Put("petabyte", huge, 1 << 50).encode())
    assert raw.error_code() == E.STORE_FULL
    raw.send(T.PING, 5, b"ok")
    assert raw.recv() == (T.PONG, 5, b"ok")
    raw.close()
    _healthy(server.address, "petabyte")


def test_pulls_recycle_the_client_memory_of_dropped_snapshots():
    from hurraykv.net import client as client_mod

    shape = (64, 16, 8, 128)  # 2 MiB pools come from the client's receive pool
    s = hk.KVCacheSnapshot.from_arrays([np.full(shape, 1.5, np.float16)],
                                       [np.full(shape, -2.5, np.float16)],
                                       np.arange(64), [0, 64], [1024])
    pool = client_mod.receive_pool()
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st, KVClient(st.address) as c:
        c.push("k", s)
        first = c.pull("k")
        assert first.equal(s)
        before = pool.recycled
        del first  # its mappings go back to the pool...
        second = c.pull("k")  # ...and this pull receives into them
        assert second.equal(s)
        assert pool.recycled >= before + 2


def test_a_pull_larger_than_the_idle_cap_is_recycled_whole_next_time(monkeypatch):
    from hurraykv.net import client as client_mod
    from hurraykv.net.memory import ReceivePool

    pool = ReceivePool(0)  # nothing kept idle to begin with
    monkeypatch.setattr(client_mod, "_RECEIVE_POOL", pool)
    shape = (64, 16, 8, 128)
    s = hk.KVCacheSnapshot.from_arrays([np.full(shape, 0.5, np.float16)] * 2,
                                       [np.full(shape, -0.5, np.float16)] * 2,
                                       np.arange(64), [0, 64], [1024])
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st, KVClient(st.address) as c:
        c.push("k", s)
        c.pull("k")
        assert pool.max_idle_bytes >= 4 * (2 << 20)  # grown to the snapshot's memory
        c.pull("k")  # drops the first pull's memory into the pool, then receives
        before = pool.recycled
        assert c.pull("k").equal(s)
        assert pool.recycled == before + 4  # every member in recycled memory


def test_pull_into_memory_the_caller_holds():
    a = make_snapshot("float16")
    b = make_snapshot("float16", seed=5)
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st, KVClient(st.address) as c:
        c.push("a", a)
        dest = c.pull("a")
        pool_before = dest.tensor(0, "key").page_pool
        pool_before[...] = 0  # scribble: the next pull must overwrite every byte
        got = c.pull("a", into=dest)
        assert got.equal(zeroed(a))
        # the returned snapshot lives in dest's memory: no new pool was allocated
        assert np.shares_memory(got.tensor(0, "key").page_pool, pool_before)
        c.push("b", b)  # same layout, other values
        assert c.pull("b", into=dest).equal(zeroed(b))
        one = a.tensor(1, "value")
        c.push_tensor("one", one)
        held = c.pull_tensor("one", a.seq_lens)
        back = c.pull_tensor("one", a.seq_lens, into=held)
        assert np.shares_memory(back.page_pool, held.page_pool)
        np.testing.assert_array_equal(back.gather(0), one.gather(0))


def test_pull_into_a_snapshot_of_another_shape_says_which_member_differs():
    a = make_snapshot("float16")
    other = make_snapshot("bfloat16")
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st, KVClient(st.address) as c:
        c.push("a", a)
        dest = c.pull("a")
        c.push("other", other)
        with pytest.raises(hk.LayoutError, match=r"pull\('other', into=...\): .*layer 0 key"):
            c.pull("other", into=dest)
        assert c.pull("a").equal(zeroed(a))  # the connection is still in step


def test_pull_into_read_only_memory_is_refused_before_the_request(tmp_path):
    a = make_snapshot("float16")
    hk.save_snapshot(a, tmp_path / "a.hrry")
    mapped = hk.load_snapshot(tmp_path / "a.hrry")
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st, KVClient(st.address) as c:
        c.push("a", a)
        with pytest.raises(hk.LayoutError, match="writable"):
            c.pull("a", into=mapped)
        assert c.pull("a").equal(zeroed(a))


def test_client_timeouts_and_refused_connections_are_transport_errors():
    with socket.socket() as silent:  # accepts, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(hk.TransportError, match=f"127.0.0.1:{port}.*no answer within"):
            KVClient(f"127.0.0.1:{port}", timeout=0.5)
        assert time.monotonic() - t0 < 5
    with pytest.raises(hk.TransportError, match=f"127.0.0.1:{port}.*hurraykv serve"):
        KVClient(f"127.0.0.1:{port}")
