"""``hurraykv.share`` (``net/handover.py``): a segment of a ``hurraykv serve`` on the same
host handed over as a sealed memory file over its Unix socket and loaded in one pass, as
a ``file://`` segment is (issue 47 item 3); a real server, real sockets, real memfds."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

import numpy as np
import pytest

from hurraykv.chunks.server import ServerChunks
from hurraykv.errors import HurrayError
from hurraykv.io import scatter
from hurraykv.net import extensions, handover
from hurraykv.net.client import KVClient
from hurraykv.net.messages import ErrorCode, RemoteError
from hurraykv.net.server import KVServer
from tests.store.test_file_capacity import keys, segment
from tests.store.test_file_pages import MEMBERS, place

pytestmark = pytest.mark.skipif(not scatter.available(), reason="no compiled reader")


@pytest.fixture
def unix_server(tmp_path):
    with KVServer(listen=str(tmp_path / "kv.sock")).run_in_thread() as st:
        yield st


def open_memfds(name: str) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name}"):
                out.append(fd)
    return out


def stored(store: ServerChunks, seed: int) -> str:
    store.put(keys(seed), 0, segment(seed), {})
    name = store.locate(keys(seed))[0]
    assert name is not None
    return name


def test_a_segment_is_handed_over_sealed_and_placed_bit_for_bit(unix_server):
    store = ServerChunks(unix_server.address)
    name = stored(store, 1)
    blocks = [9, 2, 5, 11, 0, 3, 7, 14]
    got = store.get_pages(name, MEMBERS)
    assert got is not None  # a hand-over, not a pull
    source = got[1]
    seals = fcntl.fcntl(source.fd, fcntl.F_GET_SEALS)
    assert seals & handover.SEALS == handover.SEALS
    with pytest.raises(PermissionError):  # nobody can cut it under a reader
        os.ftruncate(source.fd, 10)
    memory, failed = place(store, name, blocks, got)
    assert failed == {}
    want = segment(1)
    for r, role in enumerate(("key", "value")):
        for page, block in enumerate(blocks):
            assert memory[r, block].tobytes() == want.tensor(0, role).page_pool[page].tobytes()
    assert (memory[:, sorted(set(range(16)) - set(blocks))] == 0xAB).all()
    assert store.verify_seconds > 0  # its structure was checked on the way
    store.close()


def test_the_object_then_lives_in_its_sealed_file_held_once(unix_server):
    store = ServerChunks(unix_server.address)
    name = stored(store, 2)
    obj = unix_server.server.store.get(store.prefix + name)
    first = store.get_pages(name, MEMBERS)[1]
    again = store.get_pages(name, MEMBERS)[1]
    # the same memory file both times: made once, no copy per hand-over
    assert os.fstat(first.fd).st_ino == os.fstat(again.fd).st_ino
    assert isinstance(obj.sealed, handover.Sealed)
    assert all(isinstance(b, memoryview) and b.readonly
               for _, bufs in obj.items[1:] for b in bufs)
    first.close()
    again.close()
    # pulls are served from it, bit for bit
    pulled = store.get_verified(name)
    assert np.array_equal(pulled.tensor(0, "value").page_pool,
                          segment(2).tensor(0, "value").page_pool)
    store.close()


def test_a_tcp_connection_is_not_handed_anything_and_the_store_pulls(tmp_path):
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
        store = ServerChunks(st.address)
        name = stored(store, 3)
        assert store.get_pages(name, MEMBERS) is None  # the caller pulls instead
        with KVClient(st.address) as c, pytest.raises(RemoteError) as e:
            c.extension(handover.OPERATION, handover._key_payload(store.prefix + name))
        assert e.value.code == ErrorCode.INVALID_MESSAGE
        assert "Unix socket without TLS" in str(e.value)
        store.close()


def test_an_unknown_segment_is_named(unix_server):
    store = ServerChunks(unix_server.address)
    with pytest.raises(RemoteError, match="no tensor under key") as e:
        store.get_pages("0" * 32 + "-0", MEMBERS)
    assert e.value.code == ErrorCode.UNKNOWN_TENSOR
    store.close()


@pytest.mark.parametrize("seals", [0, handover.SEALS & ~fcntl.F_SEAL_SHRINK])
def test_a_descriptor_without_the_seals_is_refused(unix_server, seals):
    """A server that passes a memory file it could still cut (or write) underneath: the
    client refuses it, naming the seals found and those required."""
    def unsealed(s, payload):
        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.write(fd, b"x" * 64)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        keep = handover.Sealed(fd, 64)
        return extensions.Handover(handover.SIZE.pack(64), [fd], keep=keep)

    extensions.register(handover.OPERATION, unsealed, replace=True)
    try:
        with KVClient(unix_server.address) as c:
            with pytest.raises(HurrayError, match="seals") as e:
                handover.receive(c, "k")
            assert e.value.field == "hurraykv.share.seals"
            assert e.value.value == f"0x{seals:x}"
            # the descriptor received is closed (the server's own goes once it is sent)
            deadline = time.monotonic() + 5
            while open_memfds("unsealed"):
                assert time.monotonic() < deadline, "the refused descriptor stayed open"
                time.sleep(0.01)
    finally:
        extensions.register(handover.OPERATION, handover.share, replace=True)


def test_an_object_served_from_its_persisted_file_is_handed_over_from_a_copy(tmp_path):
    sock = str(tmp_path / "kv.sock")
    with KVServer(listen=sock, persist=tmp_path / "disk").run_in_thread():
        store = ServerChunks(sock)
        name = stored(store, 4)
        store.close()
    with KVServer(listen=sock, persist=tmp_path / "disk").run_in_thread() as st:
        store = ServerChunks(sock)
        memory, failed = place(store, name, list(range(8)))
        assert failed == {}
        assert memory[1, 7].tobytes() == segment(4).tensor(0, "value").page_pool[7].tobytes()
        obj = st.server.store.get(store.prefix + name)
        assert obj.sealed is None  # not kept: the memory budget does not count it
        store.close()


def test_the_request_payload_is_the_key_and_a_malformed_one_is_refused(unix_server):
    assert handover._key_payload("ab/é") == b"\x05\x00ab/\xc3\xa9"  # u16 n + utf8
    with KVClient(unix_server.address) as c:
        for payload, field in ((b"\x05\x00ab", "hurraykv.share.key at payload byte 2"),
                               (b"\x01\x00ab", "hurraykv.share.trailing at payload byte 3")):
            with pytest.raises(RemoteError, match=field) as e:
                c.extension(handover.OPERATION, payload)
            assert e.value.code == ErrorCode.INVALID_MESSAGE
        assert c.ping() > 0  # the connection carries on


def test_a_damaged_page_handed_over_never_reaches_its_block(unix_server):
    """A server that holds a damaged page (pushed so, or damaged in its memory): the page
    read from the sealed file is hashed before it is placed and never reaches its block;
    the others do."""
    store = ServerChunks(unix_server.address)
    snap = segment(5)
    page = snap.tensor(0, "value").page_pool[5]
    page.view(np.uint8)[0, 0, 0] ^= 0x10  # after its digest was taken
    store.put(keys(5), 0, snap, {})
    name = store.locate(keys(5))[0]
    memory, failed = place(store, name, list(range(8)))
    assert failed == {"value": ("layers.0.value", 5)}
    assert (memory[1, 5] == 0xAB).all()
    assert memory[1, 4].tobytes() == segment(5).tensor(0, "value").page_pool[4].tobytes()
    store.close()


def test_a_server_on_a_unix_socket_seals_each_object_as_it_is_stored(unix_server, tmp_path):
    """Off the load's path: a decode engine loads what a prefill engine stored a moment
    before, and its first hand-over must not wait for the copy. A server on TCP (it
    cannot hand anything over) keeps objects as received."""
    store = ServerChunks(unix_server.address)
    name = stored(store, 6)
    obj = unix_server.server.store.get(store.prefix + name)
    deadline = time.monotonic() + 10
    while not isinstance(obj.sealed, handover.Sealed):
        assert time.monotonic() < deadline, f"not sealed after the push: {obj.sealed!r}"
        time.sleep(0.01)
    store.close()
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
        remote = ServerChunks(st.address)
        name = stored(remote, 6)
        time.sleep(0.2)
        assert st.server.store.get(remote.prefix + name).sealed is None
        remote.close()
