"""The page store's bulk data path: RESP written and read by hand (floor 4).

redis-py packs every command into one new bytes object (hiredis copies each page into
it) and returns every reply as a new bytes object: two copies of every page and a
Python call per page, which cost PageStore more time than the network did.  Here page
bytes go from the caller's arrays to the socket with ``sendmsg`` (gathered, no copy),
pages travel many to an ``MSET``, and ``GET`` replies are received by scatter reads
(``recvmsg_into``, ``Wire.bulks_into``) straight into the rows of the pools being
rebuilt: the replies' headers into one small buffer, checked against those expected,
each value into its row, hundreds of replies a system call, nothing joined or copied.

Only for a plain TCP or Unix-socket connection to one server; ``open_wire`` answers
None for anything else (TLS, a cluster, a redis-py without the attributes relied on)
and the store uses redis-py pipelines instead.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate, pairwise
from typing import Any

from ..errors import StoreError, TransportError
from ..io.gather import IOV_MAX, send_gathered

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

    def bulks_into(self, views: Sequence[memoryview],
                   landed: Callable[[int, int], None] | None = None) -> list[int]:
        """The replies to GETs of ``len(views)`` keys, each value received into its view;
        the indices of the nil replies (no such key).  ``landed(a, b)`` is called, in
        order, once views ``a`` to ``b - 1`` hold their values (while they are still in
        the core's cache).

        Where every reply is the one expected (a value of its view's size), replies are
        received by scatter reads (``recvmsg_into``): headers into one small buffer,
        values straight into their views, up to 512 replies a system call.  The reply that
        is not (nil, another size, an error) is found from the first byte it differs by,
        so nothing waits for bytes the server never sends; it and those after it are read
        one at a time (``bulk_into``), from the bytes already scattered first."""
        if self._start != self._end or not views:
            return self._one_by_one(views, 0, landed)
        sizes = [v.nbytes for v in views]
        # before value k: the CRLF ending value k - 1 (none before the first), its header
        if min(sizes) == max(sizes):  # pages of one size: built by repetition
            head = b"$%d\r\n" % sizes[0]
            expected = head + (b"\r\n" + head) * (len(sizes) - 1) + b"\r\n"
            at = [0, *range(len(head), len(expected), len(head) + 2), len(expected)]
        else:
            seps = [b"$%d\r\n" % sizes[0], *(b"\r\n$%d\r\n" % n for n in sizes[1:]),
                    b"\r\n"]
            expected = b"".join(seps)
            at = [0, *accumulate(map(len, seps))]  # each separator's offset in got
        got = bytearray(len(expected))
        with memoryview(got) as g:
            iov: list[memoryview] = [g] * (2 * len(views) + 1)
            iov[::2] = [g[a:b] for a, b in pairwise(at)]
            iov[1::2] = views
            lengths = [0] * len(iov)
            lengths[::2] = [b - a for a, b in pairwise(at)]
            lengths[1::2] = sizes
            ends = list(accumulate(lengths))
            pos = done = checked = 0
            while pos < ends[-1]:
                i = bisect_right(ends, pos)  # the first entry not filled yet
                lo = ends[i - 1] if i else 0
                n = self.sock.recvmsg_into([iov[i][pos - lo:], *iov[i + 1:i + IOV_MAX]])[0]
                if not n:
                    raise closed(self.where)
                pos += n
                i = bisect_right(ends, pos)
                # the separator bytes received: inside separator i // 2 (i even), those
                # before it and its part received; inside a value (i odd), all up to it
                filled = at[i // 2] + pos - (ends[i - 1] if i else 0) if i % 2 == 0 \
                    else at[i // 2 + 1]
                if got[checked:filled] != expected[checked:filled]:
                    return self._diverged(views, iov, ends, got, expected, at, pos, done,
                                          landed)
                checked = filled
                if landed is not None and i // 2 > done:
                    landed(done, i // 2)
                done = i // 2  # the values received whole
        return []

    def _diverged(self, views: Sequence[memoryview], iov: list[memoryview], ends: list[int],
                  got: bytearray, expected: bytes, at: list[int], pos: int, done: int,
                  landed: Callable[[int, int], None] | None) -> list[int]:
        """A reply that is not the expected value: every stream byte from its start on
        (``pos`` received so far) is gathered back into the buffer from where it was
        scattered, and the rest is read one reply at a time."""
        bad = next(b for b in range(len(got)) if got[b] != expected[b])
        k = bisect_right(at, bad) - 1  # the separator holding it, before value k
        if k and bad < at[k] + 2:  # the CRLF after a value of the size announced
            raise StoreError(f"Redis's reply {k - 1} to GET does not end where its header "
                             "says", field="reply", value=k - 1)
        if landed is not None and k > done:
            landed(done, k)
        first = ends[2 * k - 1] + 2 if k else 0  # where reply k starts
        tail = bytearray()
        for e in range(2 * k, len(iov)):
            lo, hi = (ends[e - 1] if e else 0), ends[e]
            if lo >= pos:
                break
            take_from, take_to = max(lo, first), min(hi, pos)
            if take_from < take_to:
                tail += iov[e][take_from - lo:take_to - lo]
        self._buf[:0] = tail
        self._start, self._end = 0, len(tail)
        return self._one_by_one(views, k, landed)

    def _one_by_one(self, views: Sequence[memoryview], first: int,
                    landed: Callable[[int, int], None] | None) -> list[int]:
        missing = []
        for k in range(first, len(views)):
            try:
                found = self.bulk_into(views[k])
            except StoreError as e:
                if e.field != "page":
                    raise
                raise StoreError(f"reply {k}: {e}", field="page", offset=k, value=e.value,
                                 rule="a page of the size its manifest says") from None
            if found:
                if landed is not None:
                    landed(k, k + 1)
            else:
                missing.append(k)
        return missing


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
