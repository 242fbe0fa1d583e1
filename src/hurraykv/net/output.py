"""A server connection's way out (``connection.Connection.out``): whole messages written
in order through its asyncio transport, with the transport's flow control, and on a
plain socket (no TLS) the bulk written straight to the socket from its own memory.

The transport copies every byte the socket does not take at once into a buffer of its
own: most of a data frame, when a pull outpaces its client.  So on a plain socket the
transport is paused as soon as it holds any byte (a write-buffer limit of 0), and once it
holds none a pull's data frames go to a duplicate of the socket with ``sendmsg`` (many
buffers, no copy), waiting for room as the socket fills; messages sent meanwhile wait
behind the frame and follow it in order.  The same path passes descriptors with a
message (``SCM_RIGHTS``) on a Unix socket (``handover.py``).  A send that fails closes
the transport, as the transport itself would.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from ..io.gather import IOV_MAX

if TYPE_CHECKING:
    from .counts import Counts

log = logging.getLogger("hurraykv.server")


class Output:
    """Writes of one connection, counted in ``counts.bytes_sent``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, counts: Counts) -> None:
        self.loop, self.counts = loop, counts
        self.transport: asyncio.Transport | None = None
        # a duplicate of the plain socket: frames written straight (and reads that keep
        # going while bytes wait, instead of one event-loop round per kernel buffer)
        self.raw: socket.socket | None = None
        self.writable = asyncio.Event()  # the transport holds no byte (paused otherwise)
        self.writable.set()
        self._frames = asyncio.Lock()  # one frame written straight at a time
        self._behind: list[bytes | memoryview] | None = None  # sent during such a frame
        self._writer_fd: int | None = None

    def attach(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        if transport.get_extra_info("sslcontext") is None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                self.raw = socket.socket(sock.family, sock.type, sock.proto,
                                         fileno=os.dup(sock.fileno()))
                self.raw.setblocking(False)
                # paused while the transport holds any byte: drain() returns once it
                # holds none, when a data frame may go to the socket directly
                transport.set_write_buffer_limits(high=0, low=0)  # type: ignore[attr-defined]

    def detach(self) -> None:
        """The connection is lost: the duplicate closed, anyone draining woken."""
        if self._writer_fd is not None:  # before its descriptor closes (epoll keeps it)
            self.loop.remove_writer(self._writer_fd)
            self._writer_fd = None
        if self.raw is not None:
            self.raw.close()
            self.raw = None
        self.writable.set()

    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def _lost(self, e: OSError) -> None:
        log.info("connection lost while sending: %s", e)  # what the transport would do
        if self.transport is not None:
            self.transport.close()

    def send(self, *parts: bytes | memoryview) -> None:
        """Write ``parts`` (whole messages, or a frame's header and its data) in order;
        dropped once the transport is closing.  During a frame written straight to the
        socket they wait, in order, behind it."""
        if not self.closing():
            sent = 0
            for p in parts:
                if self._behind is not None:
                    self._behind.append(p)
                else:
                    self.transport.write(p)  # type: ignore[union-attr]
                sent += len(p)  # parts are bytes or 1-D byte views
            self.counts.bytes_sent += sent

    async def drain(self) -> None:
        """Return once the transport's buffer is below its high-water mark (empty, on a
        plain socket)."""
        if not self.writable.is_set():
            await self.writable.wait()

    async def send_data(self, parts: list[Any]) -> None:
        """Whole messages (a pull's data frames: their headers, their data as byte
        views), then ``drain``: straight to the socket on a plain one."""
        if self.raw is None:
            self.send(*parts)
            await self.drain()
            return
        async with self._frames:
            await self.drain()
            if self.closing():
                return
            self._behind = []
            try:
                self.counts.bytes_sent += await self._write_direct(parts)
            finally:
                self._release_behind()

    def can_pass_fds(self) -> bool:
        return self.raw is not None and self.raw.family == socket.AF_UNIX

    async def send_with_fds(self, message: bytes, fds: list[int]) -> None:
        """One whole message with ``fds`` passed alongside its first byte, in order with
        what was sent before it; only where ``can_pass_fds``."""
        if not self.can_pass_fds():
            raise RuntimeError("descriptors go over a plain Unix socket only")
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        async with self._frames:  # after every frame before it, as send_data
            await self.drain()
            self._behind = []
            try:
                while not self.closing():
                    try:
                        n = self.raw.sendmsg([message], ancillary)  # type: ignore[union-attr]
                    except (BlockingIOError, InterruptedError):
                        await self._socket_writable()
                        continue
                    except OSError as e:
                        self._lost(e)
                        break
                    self.counts.bytes_sent += n + await self._write_direct(
                        [memoryview(message)[n:]])
                    break
            finally:
                self._release_behind()

    def _release_behind(self) -> None:
        behind, self._behind = self._behind, None
        if not self.closing():
            for p in behind or ():
                self.transport.write(p)  # type: ignore[union-attr]

    async def _write_direct(self, parts: list[Any]) -> int:
        """Every byte of ``parts`` to the socket (none when it closes first): the bytes
        written."""
        views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
        sent = 0
        while views and not self.closing():
            try:
                n = self.raw.sendmsg(views[:IOV_MAX])  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:  # the client went away
                self._lost(e)
                break
            sent += n
            while n:
                if n >= views[0].nbytes:
                    n -= views.pop(0).nbytes
                else:
                    views[0], n = views[0][n:], 0
            if views:
                await self._socket_writable()
        return sent

    async def _socket_writable(self) -> None:
        fd = self.raw.fileno()  # type: ignore[union-attr]
        woken = self.loop.create_future()
        self.loop.add_writer(fd, lambda: woken.done() or woken.set_result(None))
        self._writer_fd = fd
        try:
            await woken
        finally:
            if self._writer_fd == fd:
                self.loop.remove_writer(fd)
                self._writer_fd = None


__all__ = ["Output"]
