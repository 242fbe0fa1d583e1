"""The page store's bulk data path: RESP written and read by hand (floor 4).

redis-py packs every command into one new bytes object (hiredis copies each page into
it) and returns every reply as a new bytes object: two copies of every page and a
Python call per page, which cost PageStore more time than the network did.  Here page
bytes go from the caller's arrays to the socket with ``sendmsg`` (gathered, no copy),
pages travel many to an ``MSET``, and ``GET`` replies are received with ``recv_into``
straight into the rows of the pool being rebuilt.

Only for a plain TCP or Unix-socket connection to one server; ``open_wire`` answers
None for anything else (TLS, a cluster, a redis-py without the attributes relied on)
and the store uses redis-py pipelines instead.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import StoreError, TransportError
from ..net.gather import send_gathered

_READ = 1 << 16
HEADER_READ = 64


class Wire:
    """One redis-py connection's socket, used for raw RESP while it is borrowed."""

    def __init__(self, sock: socket.socket, where: str = "") -> None:
        self.sock = sock
        self.where = where
        self._buf = bytearray(_READ)
        self._start = self._end = 0

    def send(self, parts: Sequence[Any]) -> None:
        """Send ``parts`` (bytes or memoryviews) gathered, without copying them."""
        send_gathered(self.sock, parts)

    # -- receiving -----------------------------------------------------------------------
    def _fill(self, limit: int = _READ) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end + limit > len(self._buf):
            del self._buf[:self._start]
            self._end -= self._start
            self._start = 0
            if self._end + limit > len(self._buf):
                self._buf.extend(bytes(limit))
        with memoryview(self._buf) as mv:
            n = self.sock.recv_into(mv[self._end:self._end + limit])
        if not n:
            raise closed(self.where)
        self._end += n

    def line(self, limit: int = _READ) -> bytes:
        """One reply header line, without its CRLF (read ``limit`` bytes at a time)."""
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                out = bytes(self._buf[self._start:i])
                self._start = i + 2
                return out
            self._fill(limit)

    def _into(self, view: memoryview) -> None:
        """Exactly ``len(view)`` bytes: what is buffered, then straight from the socket."""
        have = min(self._end - self._start, view.nbytes)
        if have:
            with memoryview(self._buf) as mv:
                view[:have] = mv[self._start:self._start + have]
            self._start += have
        got = have
        while got < view.nbytes:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise closed(self.where)
            got += n

    def simple(self) -> bytes:
        """A status or integer reply; an error reply raises ``StoreError``."""
        head = self.line()
        if head[:1] == b"-":
            raise reply_error(head)
        return head[1:]

    def bulk_into(self, view: memoryview) -> bool:
        """A bulk-string reply received into ``view``; False for a nil reply (no such key).
        A reply of another size is consumed and raised as ``StoreError``."""
        # a short read for the header: the value itself then lands in ``view`` directly
        head = self.line(HEADER_READ)
        if head[:1] == b"-":
            raise reply_error(head)
        if head == b"_":  # RESP3's null
            return False
        if head[:1] != b"$":
            raise StoreError(f"Redis answered {head[:40]!r} to GET", field="reply")
        n = int(head[1:])
        if n < 0:
            return False
        if n != view.nbytes:
            self._into(memoryview(bytearray(n + 2)))
            raise StoreError(f"a page holds {n} bytes, expected {view.nbytes}", field="page",
                             value=n)
        self._into(view)
        self._into(memoryview(bytearray(2)))  # CRLF
        return True


def closed(where: str) -> TransportError:
    return TransportError(f"redis store {where}: the server closed the connection",
                          field="connection", value=where,
                          rule="a connection open until its replies are read")


# Error replies of a server that is there but not serving yet (restarted, loading; a
# replica a failover has not promoted): it will be again, as a refused connection.
_NOT_SERVING = (b"LOADING", b"MASTERDOWN", b"READONLY")


def reply_error(head: bytes) -> StoreError | TransportError:
    """An error reply (``head``: its line) as ``TransportError`` where Redis is not
    serving, else ``StoreError``."""
    text = head[1:].decode(errors="replace")
    if head[1:].split(b" ", 1)[0] in _NOT_SERVING:
        return TransportError(f"Redis is not serving: {text}", field="reply", value=text,
                              rule="a Redis server serving commands")
    return StoreError(f"Redis: {text}", field="reply", value=text)


def mset(keys: Sequence[str], values: Sequence[Any]) -> list[Any]:
    """``MSET k v ...`` as gathered parts: the values are not copied."""
    parts: list[Any] = []
    head = b"*%d\r\n$4\r\nMSET\r\n" % (2 * len(keys) + 1)
    for k, v in zip(keys, values, strict=True):
        kb = k.encode()
        parts.append(head + b"$%d\r\n%s\r\n$%d\r\n" % (len(kb), kb, memoryview(v).nbytes))
        parts.append(v)
        head = b"\r\n"
    parts.append(head)
    return parts


def get(key: str) -> bytes:
    kb = key.encode()
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(kb), kb)


@contextlib.contextmanager
def open_wire(client: Any) -> Iterator[Wire | None]:
    """A raw view of one of ``client``'s pooled connections, or None where the raw path
    does not apply.  A connection that failed mid-way is dropped, never reused."""
    pool = getattr(client, "connection_pool", None)
    if pool is None or hasattr(client, "get_primaries"):
        yield None
        return
    conn = pool.get_connection()
    try:
        conn.connect()
        sock = getattr(conn, "_sock", None)
        ok = isinstance(sock, socket.socket) and not isinstance(sock, ssl.SSLSocket) \
            and hasattr(sock, "sendmsg")
    except BaseException:
        pool.release(conn)
        raise
    where = getattr(conn, "path", None) or f"{conn.host}:{conn.port}"
    try:
        yield Wire(sock, where) if ok else None
    except OSError as e:  # reset, broken pipe, timed out: the server went away midway
        conn.disconnect()
        raise TransportError(f"redis store {where}: the connection broke: {e}",
                             field="connection", value=where,
                             rule="a connection open until its replies are read") from None
    except BaseException:
        conn.disconnect()  # replies may be left unread: the connection is out of step
        raise
    finally:
        pool.release(conn)
