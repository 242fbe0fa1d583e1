"""The transport under ``KVClient`` (``client.py``): a blocking connection to a
``hurraykv serve`` over TCP, a Unix socket or mutual TLS, its handshake, and the
messages on it: sent with scatter-gather ``sendmsg``, received straight into the
caller's buffers (``recv_into``; hashed in steps as they land for a checked pull),
descriptors passed with a header taken (``SCM_RIGHTS``), an ERROR answer raised as the
``RemoteError`` it names, and every socket failure a ``TransportError`` that names the
address and what to do.  One request at a time: the client's verbs are in ``client.py``.
"""

from __future__ import annotations

import array
import socket
import ssl
from typing import Any

from ..errors import TransportError
from ..io.gather import send_gathered
from ..paged import byte_view
from . import tls
from .codecs import decode, frame
from .messages import (
    HEADER,
    ErrorCode,
    Hello,
    MessageType,
    ProtocolError,
    decode_error,
    decode_header,
    decode_hello,
    message,
    remote_error,
)
from .page_digests import STEP, PoolHashes
from .server import parse_address

# how a web server's answer starts: a status line, or (to a request line without an HTTP
# version, which the bytes of CLIENT_HELLO read as) an HTML error page alone
HTTP_ANSWERS = (b"HTTP/", b"<!DOCTYPE", b"<HTML")
MAX_FDS = 4  # descriptors taken with one message (hurraykv.share passes one)
FD = array.array("i")


def _show(where: tuple[str, int]) -> str:
    host, port = where
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _show(where: tuple[str, int]) -> str:
    host, port = where
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ClientConnection:
    """A connection to a ``hurraykv serve``, handshaken; one request at a time."""

    def __init__(self, address: str, *, timeout: float = 60.0, tls_cert: str | None = None,
                 tls_key: str | None = None, tls_ca: str | None = None,
                 server_hostname: str | None = None, max_message_size: int = 16 << 20,
                 frame_bytes: int = 4 << 20) -> None:
        where = parse_address(address)
        self.address = where if isinstance(where, str) else _show(where)
        self.timeout = timeout
        ctx = tls.client_context(tls_cert, tls_key, tls_ca)  # the files checked first
        try:
            if isinstance(where, str):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                sock.connect(where)
            else:
                sock = socket.create_connection(where, timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ctx is not None:
                host = server_hostname or (where[0] if not isinstance(where, str)
                                           else "localhost")
                sock = ctx.wrap_socket(sock, server_hostname=host)
        except OSError as e:
            raise self._transport(e, "connecting to") from None
        self.sock = sock
        self.max_message_size = max_message_size
        self.frame_bytes = frame_bytes
        self._stream = 1
        self._hdr = bytearray(HEADER.size)
        self._off = bytearray(8)
        self.server_hello = self._handshake()

    def _transport(self, e: OSError, doing: str = "talking to") -> TransportError:
        """A socket failure as a HurrayError that names the address and what to do."""
        if isinstance(e, TimeoutError | socket.timeout):
            why = f"no answer within {self.timeout:g} s (timeout=)"
        elif isinstance(e, FileNotFoundError):
            why = "no such socket: is `hurraykv serve --listen PATH` running?"
        elif isinstance(e, ConnectionRefusedError):
            why = "connection refused: is `hurraykv serve` running there?"
        elif isinstance(e, ssl.SSLError):
            why = f"TLS failed: {e.reason or e}"
        else:
            why = e.strerror or str(e) or type(e).__name__
        return TransportError(f"{doing} {self.address}: {why}", field="address",
                              value=self.address, rule="a reachable hurraykv server")

    def _cut_short(self, got: int, size: int) -> TransportError:
        """The server closed the connection ``got`` of ``size`` bytes into a message."""
        return TransportError(f"{self.address} closed the connection ({got} of {size} "
                              "bytes of a message received)", field="address",
                              value=self.address)

    def _next_stream(self) -> int:
        self._stream = self._stream % 0xFFFFFFFF + 1
        return self._stream

    def _send(self, *parts: Any) -> None:
        try:
            send_gathered(self.sock, [byte_view(p) for p in parts])
        except OSError as e:
            raise self._transport(e) from None

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except OSError as e:
                raise self._transport(e) from None
            if not n:
                raise self._cut_short(got, len(view))
            got += n

    def _recv_hashing(self, view: memoryview, hashes: PoolHashes) -> None:
        """``_recv_into`` in steps of at most ``STEP`` bytes, the pages each completes
        hashed right after it lands (in cache)."""
        got, size = 0, len(view)
        while got < size:
            want = min(size - got, STEP)
            try:
                n = self.sock.recv_into(view[got:got + want], want)
            except OSError as e:
                raise self._transport(e) from None
            if not n:
                raise self._cut_short(got, size)
            got += n
            hashes.advance(n)

    def _recv(self, fds: list[int] | None = None) -> tuple[int, int, int]:
        if fds is None:
            self._recv_into(memoryview(self._hdr))
        else:
            self._recv_header_fds(fds)
        if bytes(self._hdr).upper().startswith(HTTP_ANSWERS):  # no Hurray peer says so
            raise TransportError(
                f"{self.address} answered in HTTP, not the Hurray protocol: is it the "
                "metrics port (--metrics-listen)? give the address `hurraykv serve` "
                "prints as 'listening on'", field="address", value=self.address,
                rule="the address of a hurraykv server's protocol port")
        return decode_header(self._hdr, max(self.max_message_size,
                                            self.server_hello.max_message_size
                                            if hasattr(self, "server_hello") else 0))

    def _recv_header_fds(self, fds: list[int]) -> None:
        """The header into ``_hdr`` with ``recvmsg``: descriptors passed with it
        (``SCM_RIGHTS``, a Unix socket) appended to ``fds``, which the caller owns (a
        socket read without room for them would close them unseen)."""
        view, got = memoryview(self._hdr), 0
        while got < len(view):
            try:
                n, ancillary, flags, _ = self.sock.recvmsg_into(
                    [view[got:]], socket.CMSG_SPACE(MAX_FDS * FD.itemsize))
            except OSError as e:
                raise self._transport(e) from None
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", data[:len(data) - len(data) % FD.itemsize]))
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError(f"{self.address} passed more than {MAX_FDS} descriptors "
                                    "with one message", field="descriptors",
                                    rule=f"at most {MAX_FDS} descriptors a message")
            if not n:
                raise self._cut_short(got, len(view))
            got += n

    def _payload(self, length: int) -> memoryview:
        buf = memoryview(bytearray(length))
        self._recv_into(buf)
        return buf

    def _expect(self, stream: int, *types: int, fds: list[int] | None = None
                ) -> tuple[int, memoryview]:
        mtype, sid, length = self._recv(fds)
        if mtype == MessageType.ERROR:
            err = decode_error(self._payload(length))
            raise remote_error(err.code, err.message)
        if sid != stream or mtype not in types:
            self._payload(length)
            raise ProtocolError(f"expected {[MessageType(t).name for t in types]} on stream "
                                f"{stream}, got message 0x{mtype:x} on stream {sid}")
        if mtype == MessageType.TENSOR_DATA:
            return mtype, memoryview(b"")
        return mtype, self._payload(length)

    def _handshake(self) -> Hello:
        stream = self._next_stream()
        self._send(message(MessageType.CLIENT_HELLO, stream,
                           Hello(max_message_size=self.max_message_size).encode()))
        mtype, _sid, length = self._recv()
        payload = self._payload(length)
        if mtype == MessageType.ERROR:
            err = decode_error(payload)
            raise remote_error(err.code, err.message)
        if mtype != MessageType.SERVER_HELLO:
            raise ProtocolError(f"expected SERVER_HELLO, got message 0x{mtype:x}")
        hello = decode_hello(payload, "server_hello")
        if hello.protocol_version > 1:
            raise ProtocolError(f"server speaks protocol {hello.protocol_version}, above ours",
                                ErrorCode.PROTOCOL_VERSION_MISMATCH)
        return hello

    def _frame_limit(self) -> int:
        return min(self.frame_bytes, self.server_hello.max_message_size - 8)

    def _ask(self, mtype: int, value: Any, reply: int, fds: list[int] | None = None) -> Any:
        """One round trip of a private message; the reply's decoded value (descriptors
        passed with it appended to ``fds``, when given)."""
        stream = self._next_stream()
        self._send(frame(mtype, stream, value))
        _, payload = self._expect(stream, reply, fds=fds)
        return decode(reply, payload)


__all__ = ["ClientConnection"]
