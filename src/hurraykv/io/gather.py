"""Gathered sends: many buffers to a socket without joining them (below both the page
store and the server, which send so)."""

from __future__ import annotations

import errno
import socket
import ssl
from collections.abc import Sequence
from typing import Any

IOV_MAX = 1024  # buffers per sendmsg (Linux's UIO_MAXIOV)


def send_gathered(sock: socket.socket, parts: Sequence[Any]) -> None:
    """Send every byte of ``parts`` (bytes-like) in order: ``sendmsg`` of up to ``IOV_MAX``
    buffers per call (no copy into one buffer), ``sendall`` each on a TLS socket or a
    socket without ``sendmsg``."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        for v in views:
            sock.sendall(v)
        return
    start = 0
    while start < len(views):
        sent = sock.sendmsg(views[start:start + IOV_MAX])
        if sent <= 0:  # never retried: a send that moves nothing would spin forever
            raise BrokenPipeError(errno.EPIPE, "the socket took 0 bytes of a send")
        while sent:
            if sent >= views[start].nbytes:
                sent -= views[start].nbytes
                start += 1
            else:
                views[start] = views[start][sent:]
                sent = 0
