"""A pull's data frames go from the stored memory to the socket (``Connection.send_data``)
while the client reads slowly: whatever else the server answers on the same connection
meanwhile arrives whole, between frames, never inside one."""

from __future__ import annotations

import socket
import time

import numpy as np

import hurraykv as hk
from hurraykv.net.client import KVClient
from hurraykv.net.messages import HEADER, Hello, MessageType, Request, message
from hurraykv.net.server import KVServer


def test_a_reply_sent_while_a_frame_waits_for_room_follows_the_frame():
    rng = np.random.default_rng(3)
    pages = 1024  # two 8 MiB pools: more than the server's socket buffer takes (4 MiB)
    pools = [rng.integers(0, 255, (pages, 16, 8, 64), dtype=np.uint8).view(np.float16)
             for _ in range(2)]
    snap = hk.KVCacheSnapshot.from_arrays(pools[:1], pools[1:], np.arange(pages),
                                          [0, pages], [pages * 16])
    with KVServer(listen="127.0.0.1:0", zero_unused=False).run_in_thread() as st:
        with KVClient(st.address) as c:
            c.push("big", snap, zero_unused=False)
        host, port = st.address.rsplit(":", 1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # fills soon
        sock.connect((host, int(port)))
        sock.sendall(message(MessageType.CLIENT_HELLO, 1, Hello().encode()))
        sock.sendall(message(MessageType.TENSOR_REQUEST, 3, Request("big").encode()))
        time.sleep(0.5)  # the first data frame fills the socket and waits for room
        sock.sendall(message(MessageType.PING, 5, b"between frames"))
        time.sleep(0.2)
        sock.settimeout(10)
        got = _messages(sock, until=lambda seen: MessageType.PONG in seen and
                        seen.count(MessageType.TENSOR_DATA_END) == 1 + snap.member_count())
        sock.close()
    kinds = [t for t, _, _ in got]
    assert kinds[0] == MessageType.SERVER_HELLO
    pong = next(p for t, s, p in got if t == MessageType.PONG)
    assert pong == b"between frames"
    # the frames of stream 3 joined hold both pools' bytes whole
    data = b"".join(p[8:] for t, s, p in got if t == MessageType.TENSOR_DATA and s == 3)
    assert pools[0].tobytes() in data and pools[1].tobytes() in data

def _messages(sock: socket.socket, until) -> list[tuple[int, int, bytes]]:
    """Whole messages ``(type, stream, payload)`` read until ``until(types seen)``; a
    header that is not one (bytes of another message inside a frame) fails the test."""
    out: list[tuple[int, int, bytes]] = []
    while not until([t for t, _, _ in out]):
        mtype, stream, length = HEADER.unpack(_exact(sock, HEADER.size))
        assert mtype in {int(t) for t in MessageType}, f"no message type 0x{mtype:x}"
        assert length <= 16 << 20, f"a message of {length} bytes"
        out.append((mtype, stream, _exact(sock, length)))
    return out


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        assert k, "the server closed the connection"
        got += k
    return bytes(buf)
