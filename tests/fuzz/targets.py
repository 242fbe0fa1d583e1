"""Fuzz targets: every input must end in success or a HurrayError, in bounded time and
memory.  Shared by the suite (``tests/fuzz/test_fuzz.py``: a fixed, seeded set of mutations)
and by ``make fuzz`` (``tests/fuzz/run.py``: coverage-guided with atheris, for longer).

Targets:

* ``descriptor`` - strict and permissive decoding; what decodes re-encodes to itself.
* ``hrry``       - a .hrry file read at random (``HrryFile.from_bytes``) and sequentially
                   (from a non-seekable source): both readers give the same verdict, and
                   what they accept builds every member and reads every token.
* ``stream``     - the streaming format from a non-seekable source, as a snapshot and as
                   plain tensors.
* ``protocol``   - every codec's decoder (``codecs.CODECS``) on the first payload, each
                   frame's payload through its own type's decoder, and a live server on
                   loopback fed the bytes as one connection; it must stay up and answer
                   a PING afterwards.  The seeds hold every message type.
* ``tenant``     - a client certificate's tenant identity (``net/tenants.py``): an id or
                   None, never another exception.  The seeds are the corpus of
                   ``tests/data/tenant_ids.json``.

Each check runs under tracemalloc: the peak traced allocation of one input may be at
most ``2 x len(input)`` plus ``SLACK`` (decoded Python objects of a small input), so no
claimed size is ever allocated before the bytes behind it arrived.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import socket
import struct
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

import hurraykv as hk
from hurraykv import kernels
from hurraykv.io.hrry import HrryFile, read_hrry_sequential
from hurraykv.io.snapshots import snapshot_from_file
from hurraykv.io.stream import TensorStreamReader
from hurraykv.net import messages as m
from hurraykv.net import private
from hurraykv.net.codecs import CODECS, frame
from hurraykv.net.messages import MessageType as T

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
SLACK = 1 << 20  # allowance for the Python objects one input decodes into
TIME_LIMIT = 10  # seconds one input may take before it counts as a hang


class Finding(AssertionError):
    """An input that broke a rule: a foreign exception, a hang or too much memory."""

    def __init__(self, target: str, data: bytes, why: str) -> None:
        super().__init__(f"{target}: {why} (input of {len(data)} bytes, hex prefix "
                         f"{data[:96].hex()})")
        self.target, self.data, self.why = target, data, why


class Pipe(io.RawIOBase):
    """Bytes behind a non-seekable reader, delivered in small pieces like a pipe's."""

    def __init__(self, data: bytes, piece: int = 4093) -> None:
        self._src = memoryview(data)
        self._pos = 0
        self._piece = piece

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self._piece, len(self._src) - self._pos)
        b[:n] = self._src[self._pos:self._pos + n]
        self._pos += n
        return n


# --------------------------------------------------------------------------- targets
def _touch(snap: hk.KVCacheSnapshot, budget: int) -> None:
    """Build every member and read its tokens - all of them while the dense result stays
    within ``budget`` bytes (aliased pages legitimately expand), else the first and last."""
    for t in snap.tensors():
        if t.seq_lens is None or t.num_heads * t.head_dim == 0:
            continue
        if t.total_tokens * t.num_heads * t.head_dim * 4 <= budget:
            t.to_dense(dequantize=True)
        else:
            for s in range(t.num_seqs):
                if t.seq_lens[s]:
                    t.element(s, 0, 0, 0)
                    t.element(s, int(t.seq_lens[s]) - 1, t.num_heads - 1, t.head_dim - 1)
                    break


def descriptor(data: bytes) -> None:
    for strict in (True, False):
        try:
            d = hk.decode_descriptor(data, strict=strict)
        except hk.HurrayError:
            continue
        if strict and d.encode() != bytes(data[: len(d.encode())]):
            raise AssertionError("a strictly decoded descriptor does not re-encode to itself")


def hrry(data: bytes) -> None:
    verdicts = []
    for read in (lambda: HrryFile.from_bytes(data), lambda: read_hrry_sequential(Pipe(data))):
        try:
            f = read()
            snap = snapshot_from_file(f)
            _touch(snap, len(data))
            verdicts.append(snap)
        except hk.HurrayError as e:
            verdicts.append(type(e))
    a, b = verdicts
    if isinstance(a, type) != isinstance(b, type) or (
            not isinstance(a, type) and not a.equal(b)):
        raise AssertionError(f"the readers disagree: random access {a!r}, sequential {b!r}")


def stream(data: bytes) -> None:
    with contextlib.suppress(hk.HurrayError):
        _touch(hk.read_snapshot_stream(Pipe(data)), len(data))
    with contextlib.suppress(hk.HurrayError):
        for _ in TensorStreamReader(Pipe(data)):
            pass


_DECODERS: list[Callable[[memoryview], object]] = [c.decode for c in CODECS.values()]


def frames(data: bytes | memoryview, most: int = 256) -> Iterator[tuple[int, memoryview]]:
    """(message_type, payload) of the whole frames at the start of ``data``."""
    view, pos = memoryview(data), 0
    while most and pos + 12 <= len(view):
        mtype, _, length = struct.unpack_from("<III", view, pos)
        if pos + 12 + length > len(view):
            return
        yield mtype, view[pos + 12:pos + 12 + length]
        pos, most = pos + 12 + length, most - 1


class _LiveServer:
    """One server on loopback for the whole fuzz run (started on first use)."""

    thread = None

    @classmethod
    def address(cls) -> tuple[str, int]:
        if cls.thread is None:
            from hurraykv.net.server import KVServer

            cls.thread = KVServer(listen="127.0.0.1:0", read_timeout=1.0, idle_timeout=2.0,
                                  memory_budget=64 << 20).run_in_thread()
        host, port = cls.thread.address.rsplit(":", 1)
        return host, int(port)

    @classmethod
    def stop(cls) -> None:
        if cls.thread is not None:
            cls.thread.stop()
            cls.thread = None


def protocol(data: bytes) -> None:
    view = memoryview(data)
    if len(view) >= 12:  # the payload of the first message through every decoder
        payload = view[12:12 + struct.unpack_from("<I", view, 8)[0]]
        for decode in _DECODERS:
            with contextlib.suppress(hk.HurrayError):
                decode(payload)
    for mtype, payload in frames(view):  # each payload through its own decoder
        if mtype in CODECS:
            with contextlib.suppress(hk.HurrayError):
                CODECS[mtype].decode(payload)
    with socket.create_connection(_LiveServer.address(), timeout=5) as s, \
            contextlib.suppress(OSError):
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        while s.recv(1 << 16):
            pass
    with socket.create_connection(_LiveServer.address(), timeout=5) as s:
        s.sendall(m.message(T.CLIENT_HELLO, 1, m.Hello().encode()) + m.message(T.PING, 2, b"?"))
        got = b""
        while len(got) < 12 or len(got) < 12 + struct.unpack_from("<I", got, 8)[0] + 13:
            chunk = s.recv(1 << 16)
            if not chunk:
                raise AssertionError("the server stopped answering after this input")
            got += chunk
        if not got.endswith(m.message(T.PONG, 2, b"?")):
            raise AssertionError("the server did not answer PING after this input")


def tenant(data: bytes) -> None:
    from hurraykv.net import tenants

    # cryptography warns about what it parses in a mutated certificate (a serial <= 0, a
    # country of 3 letters): expected of these inputs, and only those are let through
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        got = tenants.tenant_identity(data)
    for w in warned:
        if not (issubclass(w.category, UserWarning) and w.filename == tenants.__file__):
            raise AssertionError(f"a warning not about the certificate: {w.message!r} "
                                 f"({w.category.__name__}, {w.filename}:{w.lineno})")
    if got is not None and not (len(got[0]) == 32 and isinstance(got[1], str)):
        raise AssertionError(f"a tenant identity of an unexpected form: {got!r}")


TARGETS: dict[str, Callable[[bytes], None]] = {
    "descriptor": descriptor, "hrry": hrry, "stream": stream, "protocol": protocol,
    "tenant": tenant}


# --------------------------------------------------------------------------- seeds
def _snapshots() -> list[hk.KVCacheSnapshot]:
    from tests.support.snapshots import make_fused, make_snapshot

    return [make_snapshot("float16", layers=2), make_snapshot("int8", layers=1, seed=2),
            make_snapshot("fp8", layers=1, seed=3), make_snapshot("int4", layers=1, seed=4),
            make_fused(1)]


def seeds(target: str) -> list[bytes]:
    if target == "descriptor":
        files = sorted(VECTORS.glob("*.bin")) + sorted(
            (VECTORS / "reference" / "descriptors").glob("*.bin"))
        return [p.read_bytes() for p in files]
    if target == "hrry":
        out = [(VECTORS / "reference" / "files" / "basic.hrry").read_bytes()]
        for snap in _snapshots():
            out.append(_hrry_bytes(snap))
        return out
    if target == "tenant":
        from tests.support.tenant_certs import load

        return [case["der"] for case in load().values() if case["der"]]
    if target == "stream":
        out = []
        for snap in _snapshots():
            buf = io.BytesIO()
            hk.write_snapshot_stream(snap, buf)
            out.append(buf.getvalue())
        return out
    out = []
    for i, snap in enumerate(_snapshots()[:3]):
        key = f"fuzz-{i}"
        parts = [m.message(T.CLIENT_HELLO, 1, m.Hello().encode()),
                 m.message(T.TENSOR_PUT, 3, m.Put(key, snap.head(), 0).encode()),
                 m.message(T.TENSOR_DATA_END, 3)]
        for _, desc, bufs in snap.members():
            raw = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
            parts.append(m.message(T.TENSOR_PUT, 3, m.Put(key, desc, len(raw)).encode()))
            if raw:
                parts.append(m.message(T.TENSOR_DATA, 3, struct.pack("<Q", 0) + raw))
            parts.append(m.message(T.TENSOR_DATA_END, 3))
        parts += [frame(T.TENSOR_REQUEST, 5, m.Request(key)),
                   frame(T.HAS, 11, [key, "nothing"]),
                   frame(T.LINK, 13, [(f"{key}-alias", key)]),
                   frame(T.LOCATE, 15, [f"{key}-alias", "nothing"]),
                   frame(T.LIST, 17, "fuzz-"),
                   frame(T.ALIASES, 19, ""),
                   frame(T.STAT, 21),
                   frame(T.RETAIN, 25, json.dumps({"keys": [key], "pin": True,
                                                   "ttl_s": 60})),
                   frame(T.RETAIN, 27, json.dumps({"prefix": "fuzz-"})),
                   frame(T.EXTENSION, 29, private.Extension("fuzz.unknown", b"x")),  # H95
                   frame(T.ERROR, 23, m.ErrorMessage(int(m.ErrorCode.TIMEOUT), "gave up")),
                   frame(T.DELETE, 7, m.Delete(key)),
                   frame(T.PING, 9, b"ping")]
        out.append(b"".join(parts))
    # what only a server sends, sent to one (each answered with ERROR on its stream)
    snap = _snapshots()[0]
    head = snap.head()
    replies = [(T.SERVER_HELLO, m.Hello()), (T.TENSOR_DESCRIPTOR, m.DescriptorMessage(head, 0)),
               (T.TENSOR_DATA, (0, b"data")), (T.TENSOR_PUT_ACK, None), (T.PONG, b"ping"),
               (T.DELETE_ACK, None), (T.LIST_REPLY, [("fuzz-0", 4096)]),
               (T.STAT_REPLY, '{"objects_in_memory": 0}'), (T.HAS_REPLY, [True, False]),
               (T.LINK_ACK, None), (T.LOCATE_REPLY, ["fuzz-0", ""]),
               (T.ALIASES_REPLY, [("fuzz-a", "fuzz-0")])]
    out.append(frame(T.CLIENT_HELLO, 1, m.Hello()) + b"".join(
        frame(t, 3 + 2 * i, value) for i, (t, value) in enumerate(replies)))
    return out


def _hrry_bytes(snap: hk.KVCacheSnapshot) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "seed.hrry"
        hk.save_snapshot(snap, path, fsync=False)
        return path.read_bytes()


# --------------------------------------------------------------------------- mutation
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 16, 63, 64, 255, 256, 4095, 4096, 65535, 65536,
               0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32, (1 << 62) + 3, 1 << 63,
               0xFFFFFFFFFFFFFFFF, 18446181123756130312]


def mutate(data: bytes, rng: np.random.Generator, pool: list[bytes]) -> bytes:
    """One to four edits: bit flips, bytes, little-endian fields set to edge values,
    truncation, deletion, duplication, or a splice with another seed."""
    out = bytearray(data)
    for _ in range(int(rng.integers(1, 5))):
        if not out:
            out += bytes(int(rng.integers(1, 64)))
        op = int(rng.integers(0, 9))
        i = int(rng.integers(0, len(out)))
        if op == 0:
            out[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1:
            out[i] = int(rng.integers(0, 256))
        elif op in (2, 3):
            width = (2, 4, 8)[int(rng.integers(0, 3))]
            value = INTERESTING[int(rng.integers(0, len(INTERESTING)))] & ((1 << 8 * width) - 1)
            out[i:i + width] = value.to_bytes(width, "little")
        elif op == 4:
            del out[int(rng.integers(0, len(out) + 1)):]
        elif op == 5:
            del out[i:i + int(rng.integers(1, 256))]
        elif op == 6:
            out[i:i] = out[i:i + int(rng.integers(1, 256))]
        elif op == 7:
            other = pool[int(rng.integers(0, len(pool)))]
            j = int(rng.integers(0, len(other) + 1))
            out = out[:i] + bytearray(other[j:])
        else:  # an aligned 4-byte field (lengths, counts, sizes sit on such offsets)
            k = i - i % 4
            value = INTERESTING[int(rng.integers(0, len(INTERESTING)))] & 0xFFFFFFFF
            out[k:k + 4] = value.to_bytes(4, "little")
    return bytes(out)


def inputs(target: str, count: int, seed: int = 0) -> Iterator[bytes]:
    pool = seeds(target)
    rng = np.random.default_rng(seed)
    yield from pool
    for _ in range(count):
        yield mutate(pool[int(rng.integers(0, len(pool)))], rng, pool)


# --------------------------------------------------------------------------- checking
class _Alarm(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Alarm


def check(target: str, data: bytes) -> int:
    """Run one input under the rules; returns its peak traced memory in bytes."""
    fn = TARGETS[target]
    if target == "protocol":
        _LiveServer.address()  # started (threads, loop, scratch) outside the measurement
    if target == "tenant":
        import cryptography.x509  # noqa: F401 - its import is not the input's allocation
    kernels.warm()  # compiling a kernel on first use is not the input's allocation
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(TIME_LIMIT)
    try:
        fn(data)
    except hk.HurrayError:
        pass
    except _Alarm:
        raise Finding(target, data, f"no verdict within {TIME_LIMIT} s") from None
    except AssertionError as e:
        raise Finding(target, data, str(e)) from None
    except Exception as e:
        raise Finding(target, data, f"{type(e).__name__}: {e}") from e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    peak = tracemalloc.get_traced_memory()[1] - base
    if started:
        tracemalloc.stop()
    if peak > 2 * len(data) + SLACK:
        raise Finding(target, data, f"peak memory {peak} bytes for {len(data)} input bytes")
    return peak
