"""Regression tests for what an outside campaign broke (issue 10): tenant isolation,
absurd dimensions, refused pushes, unbounded memory, temporary files, reader parity
and the command line on pipes.  Each test failed on the code before its fix."""

from __future__ import annotations

import io
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509

import hurraykv as hk
from hurraykv.io.hrry import HrryFile, read_hrry_sequential, write_hrry
from hurraykv.io.snapshots import snapshot_from_file
from hurraykv.io.stream import write_tensor
from hurraykv.net import messages as m
from hurraykv.net.client import KVClient
from hurraykv.net.messages import ErrorCode as E
from hurraykv.net.messages import MessageType as T
from hurraykv.net.server import KVServer
from hurraykv.net.tenants import client_key, scoped_key, tenant_identity
from hurraykv.snapshot import group_head, seq_lens_member
from hurraykv.wire.buffers import BufferHandle
from hurraykv.wire.layouts import BlockPaged
from tests.certs import PKI, name
from tests.snapshots import make_snapshot, saving_forever
from tests.test_net import Raw, zeroed


# --------------------------------------------------------------------------- 1 tenants
@pytest.fixture
def tls_server(tmp_path):
    pki = PKI(tmp_path)
    server, key = pki.pair("server")
    with KVServer(listen="127.0.0.1:0", tls_cert=server, tls_key=key,
                  tls_ca=pki.ca_pem).run_in_thread() as st:
        def client(label: str, subject: x509.Name, san: list | None = None) -> KVClient:
            cert, ckey = pki.client(label, subject, san)
            return KVClient(st.address, tls_cert=cert, tls_key=ckey, tls_ca=pki.ca_pem)
        yield client


def test_a_certificate_that_names_nobody_is_refused_at_the_handshake(tls_server):
    b = tls_server("tenant-b", name(("CN", "tenant-b")))
    b.push("secret", make_snapshot("float16", seed=3))
    with pytest.raises(hk.RemoteError) as exc:
        tls_server("empty", x509.Name([]))  # the old hole: tenant "" saw every key
    assert exc.value.code == E.UNAUTHORIZED and "names no tenant" in str(exc.value)
    b.close()


def test_subjects_that_flatten_to_the_same_text_are_different_tenants(tls_server):
    first = tls_server("two-rdns", name(("CN", "x"), ("O", "y")))
    second = tls_server("one-rdn", name(("CN", "x,organizationName=y")))
    s1, s2 = make_snapshot("float16", seed=1), make_snapshot("int8", seed=2)
    first.push("k", s1)
    with pytest.raises(hk.RemoteError) as exc:
        second.pull("k")
    assert exc.value.code == E.UNKNOWN_TENSOR
    second.push("k", s2)
    assert first.pull("k").equal(zeroed(s1)) and second.pull("k").equal(zeroed(s2))
    first.close()
    second.close()


def test_a_client_key_cannot_spell_another_tenants_key(tls_server):
    a = tls_server("tenant-a", name(("CN", "tenant-a")))
    for forged in ("commonName=tenant-b\x00secret", "\x00", ""):
        with pytest.raises(hk.RemoteError) as exc:
            a.push(forged, make_snapshot("float16"))
        assert exc.value.code == E.INVALID_MESSAGE and "NUL" in str(exc.value)
        with pytest.raises(hk.RemoteError):
            a.pull(forged)
    a.close()


def test_a_subject_alternative_name_alone_identifies_a_tenant(tls_server):
    spiffe = tls_server("spiffe", x509.Name([]),
                        [x509.UniformResourceIdentifier("spiffe://example/ns/a")])
    other = tls_server("spiffe-b", x509.Name([]),
                       [x509.UniformResourceIdentifier("spiffe://example/ns/b")])
    spiffe.push("k", make_snapshot("float16"))
    with pytest.raises(hk.RemoteError):
        other.pull("k")
    spiffe.close()
    other.close()


def test_tenant_identity_is_unambiguous_and_keys_never_cross(tmp_path):
    from cryptography.hazmat.primitives import serialization

    pki = PKI(tmp_path)

    def der(label: str, subject: x509.Name) -> bytes:
        pem = Path(pki.client(label, subject)[0]).read_bytes()
        return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)

    a = tenant_identity(der("a", name(("CN", "x"), ("O", "y"))))
    b = tenant_identity(der("b", name(("CN", "x,organizationName=y"))))
    c = tenant_identity(der("c", x509.Name([x509.RelativeDistinguishedName([
        x509.NameAttribute(x509.NameOID.COMMON_NAME, "x"),
        x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, "y")])])))
    assert a and b and c and len({a[0], b[0], c[0]}) == 3
    assert tenant_identity(der("nobody", x509.Name([]))) is None
    internal = scoped_key(a[0], "k")
    assert client_key(a[0], internal) == "k" and client_key(b[0], internal) is None
    assert client_key("", internal) is None and client_key("", "plain") == "plain"
    with pytest.raises(hk.HurrayError, match="without NUL"):
        scoped_key(a[0], b[0] + "\x00k")


# --------------------------------------------------------------------------- 2 absurd dims
ABSURD = 18446181123756130312


def absurd_member(role: int) -> tuple[hk.TensorDescriptor, list[bytes]]:
    layout = BlockPaged(page_size=4, num_pages=0, num_seqs=0, kv_role=role, layer_index=0,
                        index_type=0)
    desc = hk.TensorDescriptor(0x01, (0, 2, ABSURD), layout,
                               (BufferHandle(0, 64), BufferHandle(0, 64), BufferHandle(4, 64)))
    return desc, [b"", b"", bytes(4)]


def absurd_members() -> list[tuple[str, hk.TensorDescriptor, list]]:
    return [("seq_lens", *seq_lens_member(np.zeros(0, np.uint64))),
            ("layers.0.key", *absurd_member(0)), ("layers.0.value", *absurd_member(1))]


def test_an_absurd_dimension_is_a_hurray_error_on_every_path(tmp_path):
    desc, bufs = absurd_member(0)
    decoded = hk.decode_descriptor(desc.encode())  # strictly valid on the wire
    with pytest.raises(hk.UnsupportedError, match=r"shape.*2\^63-1"):
        hk.BlockPagedTensor.from_descriptor(decoded, bufs)
    members = absurd_members()
    stream = io.BytesIO()
    write_tensor(stream, group_head(len(members)), [])
    for _, d, b in members:
        write_tensor(stream, d, b)
    with pytest.raises(hk.HurrayError):
        hk.read_snapshot_stream(io.BytesIO(stream.getvalue()))
    path = tmp_path / "absurd.hrry"
    write_hrry(path, [("snapshot", group_head(len(members)), []), *members])
    with pytest.raises(hk.HurrayError):
        hk.load_snapshot(path).layer(0)
    p = subprocess.run([sys.executable, "-m", "hurraykv.cli", "validate", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "UnsupportedError" in p.stderr


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


# --------------------------------------------------------------------------- 3 refused push
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


# --------------------------------------------------------------------------- 4 memory
def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


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
        time.sleep(0.3)
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
        time.sleep(1.0)
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


# --------------------------------------------------------------------------- 5 temp files
def _temps(directory: Path) -> list[Path]:
    return sorted(directory.glob(".*.tmp"))


def test_the_server_removes_its_stale_temporary_files(tmp_path):
    stale = tmp_path / ".0123abcd.hrry.deadbeef.tmp"
    stale.write_bytes(bytes(1 << 16))
    mine = tmp_path / "notes.txt"
    mine.write_text("not the server's")
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread():
        assert _temps(tmp_path) == [] and mine.exists()


@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
def test_a_failed_save_leaves_no_temporary_file_and_the_old_file(tmp_path, monkeypatch, error):
    path = tmp_path / "s.hrry"
    hk.save_snapshot(make_snapshot("float16"), path)
    before = path.read_bytes()
    from hurraykv.io import hrry

    calls = {"n": 0}
    real = hrry.HrryWriter._write

    def failing(self, data):
        calls["n"] += 1
        if calls["n"] == 5:
            raise error("disk on fire")
        real(self, data)

    monkeypatch.setattr(hrry.HrryWriter, "_write", failing)
    with pytest.raises(error):
        hk.save_snapshot(make_snapshot("int8", seed=3), path)
    assert _temps(tmp_path) == [] and path.read_bytes() == before


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_are_created_with_the_process_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        hk.save_snapshot(make_snapshot("float16"), tmp_path / "s.hrry")
    finally:
        os.umask(old)
    assert (tmp_path / "s.hrry").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_missing_directory_is_named_without_temporary_names(tmp_path):
    with pytest.raises(hk.ContainerError) as exc:
        hk.save_snapshot(make_snapshot("float16"), tmp_path / "nope" / "s.hrry")
    assert "nope" in str(exc.value) and "does not exist" in str(exc.value)
    assert ".tmp" not in str(exc.value)


def test_sigkill_during_save_keeps_the_old_file_and_a_restart_cleans_up(tmp_path):
    persist = tmp_path / "store"
    persist.mkdir()
    target = persist / "s.hrry"
    hk.save_snapshot(make_snapshot("float16"), target)
    before = target.read_bytes()
    p = saving_forever(target, 4096, pools=4)
    deadline = time.monotonic() + 30
    while not _temps(persist) and time.monotonic() < deadline:
        time.sleep(0.005)
    p.kill()
    p.wait(10)
    survivor = target.read_bytes()
    assert survivor == before or hk.load_snapshot(target).num_layers == 4  # old or new, whole
    with KVServer(listen="127.0.0.1:0", persist=str(persist)).run_in_thread():
        assert _temps(persist) == []


# --------------------------------------------------------------------------- 6 parity
def _both(raw: bytes):
    """(random-access verdict, sequential verdict): a snapshot or the error class."""
    out = []
    for read in (lambda: snapshot_from_file(HrryFile.from_bytes(raw)),
                 lambda: hk.read_snapshot_sequential(_Pipe(raw))):
        try:
            snap = read()
            for t in snap.tensors():
                t.validate()
            out.append(snap)
        except hk.HurrayError as e:
            out.append(type(e))
    return out


class _Pipe(io.RawIOBase):
    """A non-seekable byte source, as a pipe is."""

    def __init__(self, data: bytes) -> None:
        self._src = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self._src.readinto(b)


def _patch_index(raw: bytes, name: str, field: str, delta: int) -> bytes:
    from hurraykv.io.crc32c import crc32c
    from hurraykv.io.hrry import ENTRY

    data = bytearray(raw)
    index_off, index_len = struct.unpack_from("<QQ", data, len(data) - 40)
    pos = index_off + 8
    while pos < index_off + index_len:
        (n,) = struct.unpack_from("<H", data, pos)
        entry = pos + 2 + n
        if data[pos + 2:entry].decode() == name:
            fields = list(ENTRY.unpack_from(data, entry))
            i = ("descriptor_offset", "descriptor_length", "data_offset", "data_length").index(
                field)
            fields[i] += delta
            ENTRY.pack_into(data, entry, *fields)
        pos = entry + ENTRY.size
    struct.pack_into("<I", data, len(data) - 12, crc32c(bytes(data[index_off:index_off
                                                                     + index_len])))
    return bytes(data)


def test_both_readers_give_the_same_verdict(tmp_path):
    s = make_snapshot("int8")
    hk.save_snapshot(s, tmp_path / "s.hrry")
    raw = (tmp_path / "s.hrry").read_bytes()
    f = HrryFile.from_bytes(raw)
    cases = [_patch_index(raw, "layers.0.key", "data_offset", 4096),
             _patch_index(raw, "layers.0.key", "data_length", 1),
             _patch_index(raw, "layers.1.value", "descriptor_length", 8),
             _patch_index(raw, "seq_lens", "data_offset", 8)]
    kv = bytearray(raw)  # a KV mirror that disagrees with the tensors
    kv_off = struct.unpack_from("<Q", raw, len(raw) - 24)[0]
    lens_at = bytes(kv).index(b"hurraykv.seq_lens", kv_off) + len("hurraykv.seq_lens") + 6
    kv[lens_at] ^= 1
    cases.append(bytes(kv))
    torn = bytearray(raw)  # the group head announces more members than follow
    head = f.entry("snapshot")
    struct.pack_into("<I", torn, head.descriptor_offset + 20 + 8 + 8 + 4, 263)
    cases.append(bytes(torn))
    for case in cases:
        ra, sq = _both(case)
        assert isinstance(ra, type) and ra is sq, (ra, sq)
    rng = np.random.default_rng(0)
    for _ in range(300):
        data = bytearray(raw)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        ra, sq = _both(bytes(data))
        if isinstance(ra, type):
            assert sq is ra, (ra, sq)
        else:
            assert not isinstance(sq, type) and ra.equal(sq)
    assert not isinstance(_both(raw)[1], type)
    assert read_hrry_sequential(_Pipe(raw)).names == f.names


# --------------------------------------------------------------------------- 7 pipes
def _cli_pipe(args: list[str], data: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hurraykv.cli", *args], input=data,
                          capture_output=True, timeout=60)


def test_validate_and_inspect_read_a_pipe_once(tmp_path):
    s = make_snapshot("fp8")
    hk.save_snapshot(s, tmp_path / "s.hrry")
    raw = (tmp_path / "s.hrry").read_bytes()
    with open(tmp_path / "s.stream", "wb") as fh:
        hk.write_snapshot_stream(s, fh)
    for arg in ("-", "/dev/stdin"):
        ok = _cli_pipe(["validate", arg], raw)
        assert ok.returncode == 0 and b"valid hrry, KVCacheSnapshot(3 layers" in ok.stdout
        stream = _cli_pipe(["validate", arg], (tmp_path / "s.stream").read_bytes())
        assert stream.returncode == 0 and b"valid stream, KVCacheSnapshot" in stream.stdout
        cut = _cli_pipe(["validate", arg], raw[: len(raw) // 2])
        assert cut.returncode == 1 and b"valid" not in cut.stdout
        tail = bytearray(raw)
        tail[-30] ^= 0xFF  # a corrupt trailer
        bad = _cli_pipe(["validate", arg], bytes(tail))
        assert bad.returncode == 1 and b"ContainerError" in bad.stderr
    piped = _cli_pipe(["inspect", "-"], raw)
    direct = subprocess.run([sys.executable, "-m", "hurraykv.cli", "inspect",
                             str(tmp_path / "s.hrry")], capture_output=True, timeout=60)
    assert piped.returncode == 0
    assert piped.stdout.replace(b"<stdin>", str(tmp_path / "s.hrry").encode()) == direct.stdout


def test_the_sequential_reader_takes_a_reference_file_in_small_pieces():
    r_fd, w_fd = os.pipe()
    data = (Path(__file__).parent / "vectors" / "reference" / "files" / "basic.hrry").read_bytes()

    def feed() -> None:
        with os.fdopen(w_fd, "wb") as w:
            for i in range(0, len(data), 7):
                w.write(data[i:i + 7])

    t = threading.Thread(target=feed)
    t.start()
    with os.fdopen(r_fd, "rb") as r:
        f = read_hrry_sequential(r)
    t.join()
    assert f.names == HrryFile.from_bytes(data).names
