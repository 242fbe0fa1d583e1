"""The EXTENSION envelope (0xFE marked by EXTENSION_MARK, decision H95): a private
operation is a name registered in ``hurraykv.net.extensions``, never a new message type.
The toy operations here are registered at run time from outside the package, served by a
real server over a socket, and unregistered after."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hurraykv.errors import HurrayError, RemoteError
from hurraykv.net import extensions, private
from hurraykv.net import messages as m
from hurraykv.net.client import KVClient
from hurraykv.net.codecs import decode, encode, frame
from hurraykv.net.messages import ErrorCode as E
from hurraykv.net.messages import MessageType as T
from hurraykv.net.private import Extension
from hurraykv.net.server import KVServer
from hurraykv.net.session import Session
from tests.support.snapshots import make_snapshot

# ---------------------------------------------------------------------- golden bytes
GOLDEN = [  # (value, payload as hex)
    (Extension("acme.echo", b"\x01\x02"), "ffffffff 09000000 61636d652e6563686f 0102"),
    (Extension("x"), "ffffffff 01000000 78"),
    (Extension("hurraykv.retain-2_b", b"{}"),
     "ffffffff 13000000 6875727261796b762e72657461696e2d325f62 7b7d"),
]


@pytest.mark.parametrize(("value", "payload"), GOLDEN, ids=[v.operation for v, _ in GOLDEN])
def test_the_envelope_bytes(value, payload):
    raw = bytes.fromhex(payload)
    assert T.EXTENSION == T.RETAIN == 0xFE  # one number: told apart by the mark
    assert encode(T.EXTENSION, value) == raw
    assert frame(T.EXTENSION, 5, value) == struct.pack("<III", 0xFE, 5, len(raw)) + raw
    assert decode(T.EXTENSION, raw) == value
    assert private.EXTENSION_MARK == 0xFFFFFFFF


def test_retain_text_and_the_envelope_never_read_as_each_other():
    text = json.dumps({"prefix": ""})
    assert decode(T.RETAIN, encode(T.RETAIN, text)) == text
    assert isinstance(decode(T.RETAIN, encode(T.RETAIN, text)), str)
    # a RETAIN text's u32 length would have to be 0xFFFFFFFF: more than any payload holds
    assert not private.is_extension(encode(T.RETAIN, "x" * 1000))


_I = E.INVALID_MESSAGE
MALFORMED = [  # (payload hex, field named, offset)
    ("ffffff", "retain.text_length", 0),  # shorter than the mark: RETAIN's, cut short
    ("ffffffff", "extension.operation_length", 4),  # no name
    ("ffffffff 02000000 61", "extension.operation", 8),  # the name runs past the payload
    ("ffffffff 00000000", "extension.operation", 8),  # empty name
    ("ffffffff 03000000 612062", "extension.operation", 8),  # a space
    ("ffffffff 02000000 c3a9", "extension.operation", 8),  # not ASCII
    ("ffffffff 02000000 ff61", "extension.operation", 8),  # not UTF-8
    ("ffffffff 81000000" + "61" * 129, "extension.operation", 8),  # over 128 bytes
]


@pytest.mark.parametrize(("payload", "field", "offset"), MALFORMED)
def test_malformed_envelopes_are_protocol_errors_naming_the_field(payload, field, offset):
    with pytest.raises(m.ProtocolError) as exc:
        decode(T.EXTENSION, bytes.fromhex(payload))
    e = exc.value
    assert e.code == _I and e.field == field and e.offset == offset, str(e)
    assert e.rule and field in str(e)


def test_every_truncation_of_an_envelope_is_a_value_or_a_protocol_error():
    raw = Extension("acme.echo", b"payload").encode()
    for cut in range(len(raw)):
        with contextlib.suppress(m.ProtocolError):
            decode(T.EXTENSION, raw[:cut])


# ---------------------------------------------------------------------- registry
def test_register_refuses_bad_names_and_second_registrations():
    with pytest.raises(HurrayError, match="1 to 128 ASCII"):
        extensions.register("no spaces", lambda s, p: b"")
    op = extensions.register("test.once", lambda s, p: b"")
    try:
        with pytest.raises(HurrayError, match="already registered"):
            extensions.register("test.once", lambda s, p: b"other")
        extensions.register("test.once", op)  # the same function again: fine
        extensions.register("test.once", lambda s, p: b"new", replace=True)
        assert extensions.OPERATIONS["test.once"](None, b"") == b"new"
    finally:
        extensions.unregister("test.once")
    assert "test.once" not in extensions.OPERATIONS


# ---------------------------------------------------------------------- served
@pytest.fixture
def toy_operations() -> Iterator[list[str]]:
    """Private operations registered from outside the package, as a plugin would."""
    seen: list[str] = []

    @extensions.register("test.reverse")
    def reverse(s: Session, payload: bytes) -> bytes:
        seen.append(f"reverse {s.tenant!r}")
        return payload[::-1]

    @extensions.register("test.size")
    def size(s: Session, payload: bytes) -> bytes:
        """The bytes stored under a key, through the session's tenant-scoped key."""
        key = s.key(payload.decode())
        found = dict(s.server.store.listing()).get(key)
        if found is None:
            raise m.ProtocolError(f"no tensor under key {payload.decode()!r}",
                                  E.UNKNOWN_TENSOR)
        return struct.pack("<Q", found)

    @extensions.register("test.later")
    async def later(s: Session, payload: bytes) -> bytes:
        await asyncio.sleep(0.01)
        if payload == b"fail":
            raise m.ProtocolError("asked to fail", E.STORE_FULL)
        return b"later:" + payload

    @extensions.register("test.bug")
    def bug(s: Session, payload: bytes) -> bytes:
        return {}[payload]

    @extensions.register("test.huge")
    def huge(s: Session, payload: bytes) -> bytes:
        return bytes(s.hello.max_message_size)  # with the envelope: past the limit

    names = ["test.reverse", "test.size", "test.later", "test.bug", "test.huge"]
    try:
        yield seen
    finally:
        for name in names:
            extensions.unregister(name)


@contextlib.contextmanager
def served(**kw) -> Iterator[tuple[object, KVClient]]:
    with KVServer(listen="127.0.0.1:0", **kw).run_in_thread() as st, \
            KVClient(st.address) as c:
        yield st, c


def test_a_toy_operation_round_trips_over_a_real_server(toy_operations):
    with served() as (st, c):
        assert c.extension("test.reverse", b"abc") == b"cba"
        assert c.extension("test.reverse") == b""
        assert toy_operations == ["reverse ''", "reverse ''"]
        c.push("k", make_snapshot("float16"))
        (stored,) = struct.unpack("<Q", c.extension("test.size", b"k"))
        assert stored == dict(c.list_keys())["k"]
        assert c.extension("test.later", b"x") == b"later:x"
        assert st.server.counts.latencies.read("extension")[0] != [0] * 17
        assert c.retain(["k"], pin=True, ttl_s=None) == ["k"]  # RETAIN as before


def test_errors_of_operations_close_only_their_stream(toy_operations):
    with served() as (_, c):
        with pytest.raises(RemoteError) as e:
            c.extension("test.nothing-here", b"x")
        assert e.value.code == E.UNKNOWN_OPERATION and "UNKNOWN_OPERATION" in str(e.value)
        assert "'test.nothing-here'" in str(e.value)
        assert "test.reverse" not in str(e.value)  # a client learns no other operation
        assert c.ping() >= 0  # the connection carries on
        with pytest.raises(RemoteError, match="no tensor under key 'gone'") as e:
            c.extension("test.size", b"gone")
        assert e.value.code == E.UNKNOWN_TENSOR
        with pytest.raises(RemoteError, match="asked to fail") as e:
            c.extension("test.later", b"fail")
        assert e.value.code == E.STORE_FULL
        with pytest.raises(RemoteError, match=r"'test\.bug' failed: KeyError") as e:
            c.extension("test.bug", b"x")
        assert e.value.code == E.INTERNAL
        with pytest.raises(RemoteError, match="exceeds the client's max_message_size") as e:
            c.extension("test.huge")
        assert e.value.code == E.MESSAGE_TOO_LARGE
        assert c.extension("test.reverse", b"ok") == b"ko"


def test_the_client_checks_the_name_before_sending(toy_operations):
    with served() as (_, c), pytest.raises(HurrayError, match="1 to 128 ASCII"):
        c.extension("not a name")


def _read(sock: socket.socket) -> tuple[int, int, bytes]:
    def exactly(n: int) -> bytes:
        got = b""
        while len(got) < n:
            chunk = sock.recv(n - len(got))
            assert chunk, "the server closed the connection"
            got += chunk
        return got

    mtype, stream, length = struct.unpack("<III", exactly(12))
    return mtype, stream, exactly(length)


def test_the_wire_bytes_of_a_request_and_its_reply(toy_operations):
    """What another implementation sends and gets back, byte for byte."""
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
        host, port = st.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(m.message(T.CLIENT_HELLO, 1, m.Hello().encode()))
            assert _read(s)[0] == T.SERVER_HELLO
            s.sendall(bytes.fromhex("fe000000 07000000 17000000"
                                    "ffffffff 0c000000 746573742e72657665727365 616263"))
            assert _read(s) == (0xFE, 7, bytes.fromhex(
                "ffffffff 0c000000 746573742e72657665727365 636261"))
            s.sendall(bytes.fromhex("fe000000 09000000 0c000000"
                                    "ffffffff 04000000 6e6f7065"))  # "nope"
            mtype, stream, payload = _read(s)
            err = m.decode_error(payload)
            assert (mtype, stream, err.code) == (T.ERROR, 9, 0xF5) and "'nope'" in err.message
            s.sendall(m.message(T.PING, 11, b"still"))
            assert _read(s) == (T.PONG, 11, b"still")


PLUGINS = Path(__file__).resolve().parents[1] / "support" / "plugins"


def test_hurraykv_serve_serves_an_operation_from_an_entry_point():
    """``hurraykv serve`` loads the entry point group ``hurraykv.server_operations`` at
    start: an operation from another distribution (tests/support/plugins/server_ops, no
    edit of the package) is served; a plugin that cannot be imported is named in a
    warning at start and the server serves the others; trailing bytes after what the
    operation reads are a malformed payload."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PLUGINS / "server_ops"), str(PLUGINS / "broken_ops"),
         os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                          "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        line = p.stdout.readline()
        assert "listening on" in line, p.stderr.read()
        with KVClient(line.split()[-1]) as c:
            assert c.extension("acme.shout", struct.pack("<I", 5) + b"hello") == b"HELLO"
            with pytest.raises(RemoteError, match=r"trailing|end") as e:
                c.extension("acme.shout", struct.pack("<I", 2) + b"hi!")
            assert e.value.code == E.INVALID_MESSAGE
            with pytest.raises(RemoteError, match=r"'acme\.broken'.*does not serve it"):
                c.extension("acme.broken")
    finally:
        p.terminate()
        _, err = p.communicate(timeout=20)
    assert "hurraykv.server_operations entry point 'acme.broken'" in err, err
    assert "broken-ops 0.1" in err and "no_such_ops_module" in err, err


def test_register_refuses_what_cannot_be_called():
    with pytest.raises(HurrayError, match="42 is not callable"):
        extensions.register("acme.not-a-function", 42)
    assert "acme.not-a-function" not in extensions.OPERATIONS


# ------------------------------------------- issue 46 item 9: what an operation may do
def _raising(exc: BaseException, later: bool):
    if later:
        async def operation(s: Session, payload: bytes) -> bytes:
            await asyncio.sleep(0)
            raise exc
    else:
        def operation(s: Session, payload: bytes) -> bytes:
            raise exc
    return operation


BASE_EXCEPTIONS = [SystemExit(3), KeyboardInterrupt(), GeneratorExit(),
                   asyncio.CancelledError(), BaseException("odd")]


@pytest.mark.parametrize("later", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("exc", BASE_EXCEPTIONS, ids=lambda e: type(e).__name__)
def test_whatever_an_operation_raises_is_internal_and_the_server_serves_on(exc, later):
    """Before: SystemExit and KeyboardInterrupt stopped the server, a CancelledError from
    a synchronous operation dropped the connection unanswered, and an asynchronous one
    raising any of these left its request unanswered."""
    extensions.register("test.raise", _raising(exc, later))
    try:
        with KVServer(listen="127.0.0.1:0").run_in_thread() as st, \
                KVClient(st.address, timeout=5) as c:
            with pytest.raises(RemoteError) as e:
                c.extension("test.raise")
            assert e.value.code == E.INTERNAL, str(e.value)
            assert f"'test.raise' failed: {type(exc).__name__}" in str(e.value)
            assert c.ping() >= 0  # the connection carries on
            assert st.server.serving()
            with KVClient(st.address, timeout=5) as d:  # and so does the server
                assert d.ping() >= 0
    finally:
        extensions.unregister("test.raise")


def test_operations_in_flight_on_a_connection_are_bounded():
    """An envelope arriving while MAX_IN_FLIGHT operations of its connection are still
    running is answered ERROR SERVER_BUSY naming the limit, without running; the others
    are answered when they complete, and the connection carries on.  Before: no bound
    (60,000 pending on one connection)."""
    import threading

    released = threading.Event()
    started: list[bytes] = []

    @extensions.register("test.wait")
    async def wait(s: Session, payload: bytes) -> bytes:
        started.append(payload)
        while not released.is_set():
            await asyncio.sleep(0.005)
        return payload

    most, extra = extensions.MAX_IN_FLIGHT, 5
    try:
        with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
            host, port = st.address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(m.message(T.CLIENT_HELLO, 1, m.Hello().encode()))
                assert _read(s)[0] == T.SERVER_HELLO
                s.sendall(b"".join(
                    frame(T.EXTENSION, 2 * i + 3, Extension("test.wait", b"%d" % i))
                    for i in range(most + extra)))
                for i in range(most, most + extra):
                    mtype, stream, payload = _read(s)
                    assert (mtype, stream) == (T.ERROR, 2 * i + 3)
                    err = m.decode_error(payload)
                    assert err.code == E.SERVER_BUSY, err.message
                    assert f"{most} private operations" in err.message, err.message
                    assert "'test.wait'" in err.message, err.message
                deadline = time.monotonic() + 5
                while len(started) < most and time.monotonic() < deadline:
                    time.sleep(0.01)
                # the first MAX_IN_FLIGHT run; the refused ones never did
                assert sorted(started) == sorted(b"%d" % i for i in range(most))
                released.set()
                replies = {_read(s) for _ in range(most)}
                assert replies == {(0xFE, 2 * i + 3, Extension("test.wait", b"%d" % i)
                                    .encode()) for i in range(most)}
                s.sendall(m.message(T.PING, 1, b"on"))
                assert _read(s) == (T.PONG, 1, b"on")
                s.sendall(frame(T.EXTENSION, 5, Extension("test.wait", b"again")))
                assert _read(s)[:2] == (0xFE, 5)  # room again once they completed
    finally:
        extensions.unregister("test.wait")
