"""A loopback TCP proxy that slows a store down: a fixed delay per direction and a
bandwidth cap per direction, for ``bench_vllm.py --only serve``.

Each direction of each connection is a link: a chunk read from one side leaves the
link once the chunks before it have (bytes go out at ``--mbps`` MB/s, one after the
other) and reaches the other side ``--delay-ms`` after that, so a request and its answer
pay the delay twice (a round trip) and a large value pays its size over the bandwidth.
The cap is per connection and direction, not shared between connections.

    python benchmarks/slow_proxy.py --target 127.0.0.1:7878 --delay-ms 5 --mbps 200

prints ``listening on HOST:PORT`` once it accepts connections (``--listen``, default
127.0.0.1 on a free port), then runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket

CHUNK = 64 << 10


async def link(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
               rate: float) -> None:
    """Forward ``reader`` to ``writer`` through a link of ``delay`` seconds and ``rate``
    bytes/s; half-closes ``writer`` at the end of ``reader``."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        free = 0.0  # when the link has sent out everything queued so far
        try:
            while data := await reader.read(CHUNK):
                free = max(loop.time(), free) + len(data) / rate
                queue.put_nowait((free + delay, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((0.0, b""))

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            if writer.can_write_eof():
                writer.write_eof()

    with contextlib.suppress(ConnectionError, OSError):
        await asyncio.gather(receive(), deliver())


async def serve(listen: tuple[str, int], target: tuple[str, int], delay: float,
                rate: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*target)
        except OSError:
            client_w.close()
            return
        for w in (client_w, server_w):  # small requests are not held back by Nagle
            sock = w.get_extra_info("socket")
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(link(client_r, server_w, delay, rate),
                                 link(server_r, client_w, delay, rate))
        finally:
            for w in (client_w, server_w):
                w.close()

    server = await asyncio.start_server(handle, *listen)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening on {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, type=address, help="HOST:PORT to forward to")
    p.add_argument("--listen", default="127.0.0.1:0", type=address,
                   help="HOST:PORT to accept on (default 127.0.0.1, a free port)")
    p.add_argument("--delay-ms", type=float, default=5.0, help="one-way delay (default 5)")
    p.add_argument("--mbps", type=float, default=200.0,
                   help="bandwidth per connection and direction, MB/s (default 200)")
    args = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.listen, args.target, args.delay_ms / 1e3, args.mbps * 1e6))


if __name__ == "__main__":
    main()
