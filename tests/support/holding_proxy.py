"""A loopback TCP proxy in front of a real ``hurraykv serve`` that can hold one kind of
request: the store then answers everything else and hangs on that one, as a server does
whose disk stalls on reads, or a network that drops one direction of one flow.

The client's side of each connection is forwarded frame by frame (the Hurray protocol's
12-byte header ``<III``: type, stream, payload length); a frame whose type is held waits,
with everything after it on its connection, until it is released.  The server's side is
forwarded as bytes.  Used by the connector's deadline and backlog tests (a lookup that
hangs, a fetch that hangs after the lookup answered, writes that wait)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections import Counter

HEADER = struct.Struct("<III")


class HoldingProxy:
    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("hurray://").rsplit(":", 1)
        self.target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._cond = threading.Condition()
        self._held_types: set[int] = set()
        self.held = Counter()  # frames that waited, by message type
        self.forwarded = Counter()  # frames forwarded to the server, by message type
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def hold(self, *types: int) -> None:
        """From now on, frames of these message types wait (and their connections with
        them) until ``release``."""
        with self._cond:
            self._held_types.update(int(t) for t in types)

    def release(self) -> None:
        with self._cond:
            self._held_types.clear()
            self._cond.notify_all()

    def wait_held(self, mtype: int, count: int = 1, timeout: float = 30.0) -> bool:
        """Until ``count`` frames of ``mtype`` have been held (a client asked, and waits)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.held[int(mtype)] >= count, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._held_types.clear()
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.close()
        for s in list(self._sockets):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> HoldingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ forwarding
    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            for fn, args in ((self._frames, (client, server)), (self._bytes, (server, client))):
                t = threading.Thread(target=fn, args=args, daemon=True)
                t.start()
                self._threads.append(t)

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                header = _exact(src, HEADER.size)
                if header is None:
                    break
                mtype, _, length = HEADER.unpack(header)
                with self._cond:
                    if mtype in self._held_types:
                        self.held[mtype] += 1
                        self._cond.notify_all()
                        self._cond.wait_for(lambda m=mtype: m not in self._held_types
                                            or self._closed)
                    if self._closed:
                        break
                    self.forwarded[mtype] += 1
                dst.sendall(header)
                while length:
                    data = src.recv(min(length, 1 << 20))
                    if not data:
                        return
                    dst.sendall(data)
                    length -= len(data)
        except OSError:
            pass
        finally:
            _close_both(src, dst)

    @staticmethod
    def _bytes(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close_both(src, dst)


def _exact(sock: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        data = sock.recv(n - len(out))
        if not data:
            return None
        out += data
    return out


def _close_both(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()
