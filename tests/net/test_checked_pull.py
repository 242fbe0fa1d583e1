"""Verified pulls (``KVClient.pull(verify=True)``, the ``hurray://`` store's ``get_checked``):
each page hashed as it lands, the snapshot's checksums checked against those digests, over
a real ``KVServer`` on loopback; damage on the server or in transit is a ``ChecksumError``."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.chunks.server import ServerChunks
from hurraykv.io import checksums
from hurraykv.io.checksums import ChecksumError
from hurraykv.net.client import KVClient, receive_pool
from hurraykv.net.server import KVServer
from hurraykv.testing import keys
from hurraykv.wire.layouts import BlockPaged

PAGES, TOKENS, HEADS, DIM = 64, 16, 8, 64  # a 1 MiB float16 pool per member: pooled memory
PAGE_BYTES = TOKENS * HEADS * DIM * 2


def summed(layers: int = 2, seed: int = 0, sums: bool = True) -> hk.KVCacheSnapshot:
    """Full pages (nothing for the server to zero), with checksums unless ``sums`` is
    False."""
    rng = np.random.default_rng(seed)
    pools = [rng.standard_normal((PAGES, TOKENS, HEADS, DIM)).astype(np.float16)
             for _ in range(2 * layers)]
    snap = hk.KVCacheSnapshot.from_arrays(pools[0::2], pools[1::2], np.arange(PAGES),
                                          [0, PAGES], [PAGES * TOKENS])
    return checksums.with_checksums(snap) if sums else snap


@pytest.fixture
def server():
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
        yield st


def damage_stored(st, key: str, layer: int, role: str, page: int) -> None:
    """Flip one byte of ``page`` of the stored member's pool, inside the server."""
    obj = st.server.store.get(key)
    for desc, buffers in obj.items:
        layout = desc.layout
        if isinstance(layout, BlockPaged) and (layout.layer_index, layout.kv_role_name) == (
                layer, role):
            pool = np.frombuffer(memoryview(buffers[0]).cast("B"), np.uint8)
            pool[page * PAGE_BYTES + 100] ^= 0x40
            return
    raise AssertionError(f"no member layer {layer} {role} under {key}")


def test_verified_pull_equals_what_was_pushed_and_hashed_every_page_as_it_landed(server):
    snap = summed()
    with KVClient(server.address) as c:
        c.push("s", snap)
        back = c.pull("s", verify=True)
        assert back.equal(snap)
        # every page of the 4 pools was hashed while it was received, none after
        assert c.last_pull_hashed == 4 * PAGES
        c.pull("s")
        assert c.last_pull_hashed == 0  # an unverified pull hashes nothing


def test_verified_pull_of_a_page_damaged_on_the_server_names_the_page(server):
    with KVClient(server.address) as c:
        c.push("s", summed())
        damage_stored(server, "s", 1, "value", 5)
        with pytest.raises(ChecksumError, match=r"page 5 of buffer 0 of member "
                                                r"layers\.1\.value .*\(1 damaged piece"):
            c.pull("s", verify=True)
        c.ping()  # the stream was read to its end: the connection still serves
        assert not c.pull("s").equal(summed())  # unverified, the damage comes through


def test_verified_pull_of_a_snapshot_without_checksums_is_refused(server):
    with KVClient(server.address) as c:
        c.push("plain", summed(sums=False))
        with pytest.raises(ChecksumError, match=rf"carries no {checksums.KEY}"):
            c.pull("plain", verify=True)


def test_verified_pull_into_a_held_snapshot_checks_it_too(server):
    with KVClient(server.address) as c:
        c.push("s", summed())
        held = c.pull("s", verify=True)
        again = c.pull("s", verify=True, into=held)
        assert again.equal(summed()) and c.last_pull_hashed == 4 * PAGES
        damage_stored(server, "s", 0, "key", PAGES - 1)
        with pytest.raises(ChecksumError, match=rf"page {PAGES - 1} of buffer 0 of member "
                                                r"layers\.0\.key"):
            c.pull("s", verify=True, into=held)


class FlippingProxy:
    """Loopback TCP in front of a server: the server's bytes reach the client with the
    byte at ``at`` (counted from the start of each connection's server side) flipped."""

    def __init__(self, target: str, at: int) -> None:
        host, port = target.rsplit(":", 1)
        self.target, self.at = (host, int(port)), at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target)
                self.sockets += [client, upstream]
                threading.Thread(target=self._pipe, args=(client, upstream, None),
                                 daemon=True).start()
                threading.Thread(target=self._pipe, args=(upstream, client, self.at),
                                 daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, flip: int | None) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                if flip is not None and seen <= flip < seen + len(data):
                    data = bytearray(data)
                    data[flip - seen] ^= 0x01
                seen += len(data)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for s in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                s.close()


def test_a_page_damaged_in_transit_is_a_checksum_error_of_the_hurray_store(server):
    store = ServerChunks(server.address)
    ks = keys(1)
    store.put(ks, 0, summed(), {})
    name = store.locate(ks)[0]
    # before the pools: the handshake, the head, seq_lens and info (a few KiB); then the
    # four 1 MiB pools, so byte 3.5 MiB of the server's side lies in layer 1's value pool
    proxy = FlippingProxy(server.address, (3 << 20) + (1 << 19))
    try:
        through = ServerChunks(proxy.address)
        with pytest.raises(ChecksumError, match=r"page \d+ of buffer 0 of member "
                                                r"layers\.1\.value"):
            through.get_checked(name)
        through.close()
    finally:
        proxy.close()
    snap, pending = store.get_checked(name)  # straight from the server: intact
    assert pending is None and snap.equal(summed().with_info(metadata=snap.metadata))
    store.close()


def test_successive_gets_reuse_the_receive_buffer_once_the_snapshot_is_gone(server):
    store = ServerChunks(server.address)
    ks = keys(1)
    store.put(ks, 0, summed(), {})
    name = store.locate(ks)[0]

    def pools(snap: hk.KVCacheSnapshot) -> set[int]:
        return {np.asarray(snap.tensor(*k).page_pool).ctypes.data
                for k in snap.member_keys()}

    first, _ = store.get_checked(name)
    held, _ = store.get_checked(name)  # the first still alive: other memory
    seen = pools(first) | pools(held)
    assert len(seen) == 8
    del first, held
    gc.collect()
    recycled = receive_pool().recycled
    again, _ = store.get_checked(name)
    assert receive_pool().recycled == recycled + 4  # every member's pool, no fresh mapping
    assert pools(again) <= seen
    assert again.equal(summed().with_info(metadata=again.metadata))
    store.close()


def test_verified_pull_without_the_compiled_hasher_catches_damage_too():
    """The pure-Python path (``HURRAYKV_KERNELS=numpy``: no numba), in its own process."""
    code = """
from hurraykv.io import page_hash
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from hurraykv.io.checksums import ChecksumError
from tests.net.test_checked_pull import summed, damage_stored, PAGES
assert page_hash.hasher() is None
with KVServer(listen="127.0.0.1:0").run_in_thread() as st, KVClient(st.address) as c:
    c.push("s", summed())
    assert c.pull("s", verify=True).equal(summed()) and c.last_pull_hashed == 4 * PAGES
    damage_stored(st, "s", 1, "key", 7)
    try:
        c.pull("s", verify=True)
    except ChecksumError as e:
        assert "page 7 of buffer 0 of member layers.1.key" in str(e), e
        print("caught")
"""
    env = {**os.environ, "HURRAYKV_KERNELS": "numpy"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["caught"]
