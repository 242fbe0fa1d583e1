"""``hurraykv.share``: a stored object handed to a client on the same host as a sealed
memory file, both sides (issue 47 item 3).

A client connected over the server's Unix socket, without TLS, asks with the object's
key; the server answers with the size of the object's ``.hrry`` file, the same bytes a
``file://`` segment or a ``--persist`` file holds, and passes alongside the answer
(``SCM_RIGHTS``) a descriptor of a memory file (``memfd_create``) holding that file,
sealed against shrinking, growing and writing, then against new seals.  The client reads
it as it reads a segment file: every page hashed and placed straight into the engine's
blocks (``file_layouts.Layouts.pages``), so no byte goes through the socket.  A sealed
file cannot be cut underneath a reader: nobody, the server included, can shrink it, so a
mapping of it never faults with SIGBUS and a read never comes up short; the client
refuses a descriptor that does not carry those seals.

A server listening on a Unix socket without TLS writes each object it stores into its
memory file as soon as the push is acknowledged (``prepare``: a worker thread, one
copy, off the push's and the load's paths: a decode engine loads what a prefill engine
stored a moment before, and its first hand-over should not wait for that copy); an
object not sealed yet when a hand-over asks is sealed then, once, whoever asks.  The
object then lives in that file: its buffers become views of a read-only mapping of it
(pulls send from it as before), the memory they held going back to the receive pool, so
it is held once, never twice (twice only while the copy runs); every hand-over costs one
message.  The file is closed when the object goes (replaced, deleted, evicted); a
client still holding a descriptor keeps reading what it was given, and the kernel frees
the memory when the last one closes.  An object served from its persisted file is
copied into a memory file for each hand-over (not kept: the memory budget does not
count it), which that hand-over's client alone holds.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import socket
import ssl
import struct
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import HurrayError
from ..io.hrry import HrryFile
from ..io.hrry_writer import write_hrry
from ..snapshot import KVCacheSnapshot
from ..wire.layouts import Composite
from . import extensions
from .messages import ErrorCode, ProtocolError, payload_reader
from .persisted import file_contents
from .stored import FileBytes, StoredObject

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("hurraykv.server")
OPERATION = "hurraykv.share"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
RULE = "a client on the server's Unix socket, without TLS"
SIZE = struct.Struct("<Q")


class Sealed:
    """A sealed memory file of ``size`` bytes holding one object's ``.hrry`` file; its
    descriptor closes when this is dropped."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.close = weakref.finalize(self, os.close, fd)


# -- the server's side ---------------------------------------------------------------
async def share(s: Session, payload: bytes) -> extensions.Handover:
    r = payload_reader(payload, OPERATION)
    key = r.text("key", "u16")
    r.end()
    if not s.can_pass_fds():
        raise ProtocolError(f"{OPERATION} passes a descriptor, which only a Unix socket "
                            "without TLS carries: pull the object instead",
                            ErrorCode.INVALID_MESSAGE, field="extension.operation",
                            value=OPERATION, rule=RULE)
    obj = s.server.store.get(s.key(key))
    if obj is None:
        raise ProtocolError(f"no tensor under key {key!r}", ErrorCode.UNKNOWN_TENSOR,
                            field="key", value=key, rule="a stored key")
    sealed = await _sealed(s.key(key), obj)
    return extensions.Handover(SIZE.pack(sealed.size), [sealed.fd], keep=sealed)


def prepare(key: str, obj: StoredObject) -> None:
    """Start sealing ``obj`` (just stored under ``key``) into its memory file on a
    worker thread, so that its first hand-over does not wait for the copy (a decode
    engine loads what a prefill engine stored a moment before)."""
    if obj.sealed is None:
        _making(key, obj)


async def _sealed(key: str, obj: StoredObject) -> Sealed:
    """``obj``'s sealed file: the one it lives in, or made now (once, whoever asks)."""
    held = obj.sealed
    if isinstance(held, Sealed):
        return held
    if held is None:
        held = _making(key, obj)
    sealed, _ = await asyncio.shield(held)
    return sealed


def _making(key: str, obj: StoredObject) -> asyncio.Future:
    """``seal`` on a worker thread; once done, ``obj`` lives in its file (or, served from
    disk or failed, is left as it was, to be tried again by the next hand-over)."""
    making = asyncio.get_running_loop().run_in_executor(None, seal, key, obj)
    obj.sealed = making

    def done(f: asyncio.Future) -> None:
        if obj.sealed is not f:
            return
        failed = f.cancelled() or f.exception() is not None
        if failed or f.result()[1] is None:
            obj.sealed = None
            if failed and not f.cancelled():
                log.warning("%s of %r failed: %s", OPERATION, key, f.exception())
            return
        sealed, items = f.result()
        obj.items, obj.sealed = items, sealed

    making.add_done_callback(done)
    return making


def seal(key: str, obj: StoredObject) -> tuple[Sealed, list | None]:
    """``obj``'s ``.hrry`` file written into a new memory file, sealed; and the object's
    items over a read-only mapping of it (None for an object served from its persisted
    file: it stays there)."""
    on_disk = any(isinstance(b, FileBytes) for _, bufs in obj.items for b in bufs)
    items = [(d, [b.read() if isinstance(b, FileBytes) else b for b in bufs])
             for d, bufs in obj.items]
    snap = (KVCacheSnapshot.from_members([(None, d, b) for d, b in items[1:]])
            if isinstance(items[0][0].layout, Composite) else None)
    tensors, kv = file_contents(key, StoredObject(items, obj.nbytes), snap)
    label = f"{OPERATION} of {key!r}"
    fd = os.memfd_create(f"hurraykv:{key[:200]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        write_hrry(label, tensors, kv, into=fd)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
        sealed = Sealed(fd, os.fstat(fd).st_size)
    except BaseException:
        os.close(fd)
        raise
    if on_disk:
        return sealed, None
    f = HrryFile.index(fd, label)
    mapped = memoryview(mmap.mmap(fd, sealed.size, prot=mmap.PROT_READ))
    return sealed, [(d, [mapped[off:off + n] for off, n in f.spans(name)])
                    for (name, _, _), (d, _) in zip(tensors, obj.items, strict=True)]


extensions.register(OPERATION, share, replace=True)


# -- the client's side ---------------------------------------------------------------
def can_receive(client: Any) -> bool:
    """Whether ``client`` can be handed a file: a Unix socket without TLS."""
    sock = client.sock
    return not isinstance(sock, ssl.SSLSocket) and sock.family == socket.AF_UNIX


def receive(client: Any, key: str) -> Sealed:
    """The sealed memory file holding the ``.hrry`` file of ``key``, from ``client`` (a
    ``KVClient``: not imported, the client imports the server) (the caller's to
    close, ``Sealed.close``).  ``HurrayError`` naming what is wrong with what the server
    passed: no descriptor or several, one that is not a memory file sealed against
    shrinking, growing and writing, a size that is not the one announced."""
    fds: list[int] = []
    sealed = None
    try:
        answer = client.extension(OPERATION, _key_payload(key), fds=fds)
        if len(fds) != 1:
            raise _refused("descriptors", len(fds), "one descriptor with the answer", key)
        fd = fds.pop()
        sealed = Sealed(fd, 0)
        if len(answer) != SIZE.size:
            raise _refused("size", len(answer), f"an answer of {SIZE.size} bytes", key)
        (sealed.size,) = SIZE.unpack(answer)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise _refused("seals", "none", "a sealed memory file", key) from None
        if seals & SEALS != SEALS:
            raise _refused("seals", f"0x{seals:x}", f"F_SEAL_SHRINK, F_SEAL_GROW and "
                           f"F_SEAL_WRITE (0x{SEALS:x}) set", key)
        found = os.fstat(fd).st_size
        if found != sealed.size:
            raise _refused("size", found, f"the {sealed.size} bytes announced", key)
        return sealed
    except BaseException:
        if sealed is not None:
            sealed.close()  # now: a traceback holding it would keep it open
        raise
    finally:
        for fd in fds:
            os.close(fd)


def _key_payload(key: str) -> bytes:
    raw = key.encode()
    if len(raw) > 0xFFFF:
        raise HurrayError(f"key of {len(raw)} bytes: at most 65535", field="key",
                          value=len(raw), rule="a key of at most 65535 UTF-8 bytes")
    return struct.pack("<H", len(raw)) + raw


def _refused(field: str, value: Any, rule: str, key: str) -> HurrayError:
    return HurrayError(f"{OPERATION} of {key!r}: the server passed {field} {value}; the "
                       f"rule is {rule}", field=f"{OPERATION}.{field}", value=value,
                       rule=rule)


__all__ = ["OPERATION", "SEALS", "Sealed", "can_receive", "receive", "seal", "share"]
