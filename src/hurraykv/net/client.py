"""``KVClient``: push, pull (whole or layer by layer), delete and ping over the Hurray
interchange protocol, on blocking sockets (TCP, Unix, optional mutual TLS); the private
messages, and any private operation by name (``extension``, H95).

Received TENSOR_DATA bytes go straight into the tensor's final buffer (``recv_into``);
sent data goes out with scatter-gather ``sendmsg`` from the snapshot's own memory, with
zeroed copies only of the pages that hold unused slots (``zero_unused``).  The
connection, its framing and its errors are ``ClientConnection``'s
(``client_connection.py``); here are the verbs.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .. import units
from ..errors import HurrayError, LayoutError, RemoteError
from ..paged import BlockPagedTensor, byte_view
from ..snapshot import KVCacheSnapshot, SnapshotAssembler
from ..wire.descriptor import TensorDescriptor
from ..wire.layouts import BlockPaged, Composite
from .client_connection import ClientConnection
from .dataplane import POOL_MIN, DataAssembler, DataPlan
from .memory import CLASS, ReceivePool
from .messages import (
    Delete,
    ErrorCode,
    MessageType,
    ProtocolError,
    Put,
    Request,
    decode_descriptor_message,
    decode_error,
    encode_data_header,
    message,
    remote_error,
    total_data_bytes,
)
from .page_digests import PullDigests
from .private import OPERATION_RULE, Extension, valid_operation

Progress = Callable[[int, int], None]


class KVClient(ClientConnection):
    """A connection to a ``hurraykv serve``; one request at a time."""

    last_pull_hashed = 0  # pages the last pull checked as hashed on landing
    last_verify_seconds = 0.0  # what checking it cost, hashing included

    # -- push --------------------------------------------------------------------------
    def _push_tensor(self, stream: int, key: str, desc: TensorDescriptor, views: list,
                     progress: Progress | None, done: list[int], total: int) -> None:
        plan = DataPlan([byte_view(v) for v in views])
        self._send(message(MessageType.TENSOR_PUT, stream, Put(key, desc, plan.total).encode()))
        for offset, parts in plan.frames(self._frame_limit()):
            size = sum(p.nbytes for p in parts)
            self._send(encode_data_header(stream, offset, size), *parts)
            done[0] += size
            if progress is not None:
                progress(done[0], total)
        self._send(message(MessageType.TENSOR_DATA_END, stream))

    def push(self, key: str, snapshot: KVCacheSnapshot, *, zero_unused: bool = True,
             progress: Progress | None = None) -> float:
        """Push a snapshot as one group; returns seconds until the server's ACK."""
        started = time.perf_counter()
        stream = self._next_stream()
        head = snapshot.head()
        total, done = snapshot.nbytes, [0]
        self._push_tensor(stream, key, head, [], None, done, total)
        for _, desc, bufs in snapshot.members():
            if zero_unused and isinstance(desc.layout, BlockPaged):
                layout = desc.layout
                bufs = snapshot.tensor(layout.layer_index, layout.kv_role_name).clean_buffers()
            self._push_tensor(stream, key, desc, list(bufs), progress, done, total)
        self._expect(stream, MessageType.TENSOR_PUT_ACK)
        return time.perf_counter() - started

    def check_room(self, key: str, nbytes: int) -> None:
        """Before pushing ``nbytes`` under ``key``: raise ``RemoteError`` STORE_FULL now,
        with no byte sent, when the server's stat shows a budget that cannot hold that
        many bytes even empty (``--memory-budget``; a tenant's ``--max-bytes-per-tenant``;
        ``--persist-budget``, which the object's file exceeds by more still), as the server
        would answer once the whole object had been sent (a group's total is announced
        nowhere on the wire: H52).  A push that may fit is left to the server; so is a
        server that does not say (one round trip, STAT)."""
        try:
            s = self.stat()
        except (RemoteError, ProtocolError):
            return
        for field, option in (("memory_budget", "--memory-budget"),
                              ("max_bytes_per_tenant", "--max-bytes-per-tenant"),
                              ("persist_budget", "--persist-budget")):
            cap = s.get(field)
            if type(cap) is int and nbytes > cap:
                raise RemoteError(ErrorCode.STORE_FULL, (
                    f"{key!r} needs {nbytes} bytes ({units.size(nbytes)}) but the server's "
                    f"{option} is {cap} bytes ({units.size(cap)}): refused before sending, "
                    f"from the server's stat"), "STORE_FULL")

    def push_tensor(self, key: str, tensor: BlockPagedTensor, *, zero_unused: bool = True
                    ) -> None:
        stream = self._next_stream()
        bufs = tensor.clean_buffers() if zero_unused else list(tensor.buffers())
        self._push_tensor(stream, key, tensor.descriptor(), bufs, None, [0], 0)
        self._expect(stream, MessageType.TENSOR_PUT_ACK)

    # -- pull --------------------------------------------------------------------------
    def _request(self, key: str) -> int:
        stream = self._next_stream()
        self._send(message(MessageType.TENSOR_REQUEST, stream, Request(key).encode()))
        return stream

    def _read_tensor(self, stream: int, progress: Progress | None = None,
                     done: list[int] | None = None, into: Into = None,
                     digests: PullDigests | None = None) -> tuple[TensorDescriptor, list]:
        """One tensor of a pull.  ``into(desc)`` may name the caller's buffers for it;
        ``digests``: its pool's pages are hashed there as they land."""
        _, payload = self._expect(stream, MessageType.TENSOR_DESCRIPTOR)
        msg = decode_descriptor_message(payload)
        views = into(msg.descriptor) if into is not None else None
        asm = DataAssembler(msg.descriptor, pool=receive_pool(), into=views)
        hashes = digests.start(msg.descriptor, asm.region) if digests is not None else None
        while True:
            mtype, sid, length = self._recv()
            if mtype == MessageType.TENSOR_DATA and sid == stream and length >= 8:
                self._recv_into(memoryview(self._off))
                for target in asm.targets(int.from_bytes(self._off, "little"), length - 8):
                    if hashes is None:
                        self._recv_into(target)  # straight into the tensor's buffer
                    else:
                        self._recv_hashing(target, hashes)
                if done is not None:
                    done[0] += length - 8
                    if progress is not None:
                        progress(done[0], done[1])
                continue
            payload = self._payload(length)
            if mtype == MessageType.ERROR:
                err = decode_error(payload)
                raise remote_error(err.code, err.message)
            if mtype == MessageType.TENSOR_DATA_END and sid == stream:
                return msg.descriptor, asm.finish()
            raise ProtocolError(f"unexpected message 0x{mtype:x} on stream {sid} inside a "
                                "tensor transfer")

    def iter_pull(self, key: str, progress: Progress | None = None, *,
                  into: KVCacheSnapshot | None = None
                  ) -> Iterator[tuple[int, tuple[BlockPagedTensor, ...]]]:
        """Layers ``(i, (key, value))`` as they arrive; ``self.last_snapshot`` holds the
        whole snapshot once the group has closed.  ``into``: see ``pull``."""
        return self._layers(key, progress, into, None)

    def _layers(self, key: str, progress: Progress | None, into: KVCacheSnapshot | None,
                digests: PullDigests | None
                ) -> Iterator[tuple[int, tuple[BlockPagedTensor, ...]]]:
        total = self._size_of(key) if progress is not None else 0  # before the transfer
        target = _IntoSnapshot(into) if into is not None else None
        self.last_snapshot = None  # the previous pull's memory can be recycled for this one
        stream = self._request(key)
        head, _ = self._read_tensor(stream)
        if not isinstance(head.layout, Composite):
            raise HurrayError(f"key {key!r} holds a single tensor, not a snapshot",
                              field="key", value=key, rule="pull() takes snapshots")
        assembler = SnapshotAssembler()
        done = [0, total]
        held = 0  # receive-pool bytes this snapshot holds
        for _ in range(head.layout.member_count):
            desc, buffers = self._read_tensor(stream, progress, done, target, digests)
            if target is None and total_data_bytes(desc) >= POOL_MIN:
                held += -(-total_data_bytes(desc) // CLASS) * CLASS
            layer = assembler.add(desc, buffers, f"from {self.address}")
            if layer is not None and (target is None or not target.misfits):
                yield layer
        if target is not None:
            target.raise_misfits(key)
        # keep at least one such snapshot's memory idle once it is dropped, so the next
        # pull of the same size recycles all of it (fresh memory costs page faults)
        pool = receive_pool()
        pool.max_idle_bytes = max(pool.max_idle_bytes, held)
        self.last_snapshot = assembler.finish()

    def _size_of(self, key: str) -> int:
        """The bytes ``key`` holds (a progress bar's total), or 0 if the server does not
        say (an older server, or a key gone meanwhile)."""
        try:
            return dict(self.list_keys(key)).get(key, 0)
        except RemoteError:
            return 0

    def pull(self, key: str, progress: Progress | None = None, *,
             into: KVCacheSnapshot | None = None, verify: bool = False) -> KVCacheSnapshot:
        """The snapshot under ``key``.

        Received bytes land in recycled memory (mappings of snapshots this process has
        dropped: ``RECYCLE_BYTES`` or the largest pull's worth kept idle) or in fresh
        mappings populated in bulk ahead of the socket.  ``into``: a snapshot whose memory
        to receive into, e.g. the previous pull of the same key or views of an engine's
        cache - every member the server sends must match one of ``into``'s (layer, role,
        shape, element type, layout, quantization and buffer sizes), else ``LayoutError``
        once the transfer has ended; its buffers must be writable.  The returned
        snapshot's arrays are ``into``'s memory; after a failure that memory holds an
        unspecified mix.

        ``verify``: the stored values checked against the checksums written with them
        (``io.checksums``), ``ChecksumError`` naming the first damaged page when they do
        not match or there are none.  Each page of every pool is hashed as it lands,
        while it is still in the cache, not in a pass after the transfer; the stream is
        read to its end first, so the connection still serves after a refusal."""
        digests = PullDigests() if verify else None
        self.last_pull_hashed, self.last_verify_seconds = 0, 0.0
        for _ in self._layers(key, progress, into, digests):
            pass
        if digests is not None:
            try:
                digests.check(self.last_snapshot, f"key {key!r} from {self.address}")
            finally:
                self.last_pull_hashed = digests.pages
                self.last_verify_seconds = digests.seconds
        return self.last_snapshot

    def pull_tensor(self, key: str, seq_lens: Any = None, *,
                    into: BlockPagedTensor | None = None) -> BlockPagedTensor:
        """One block-paged tensor; its token counts travel beside it (D6).  ``into``: a
        tensor of the same descriptor whose memory to receive into (see ``pull``)."""
        target = _IntoSnapshot.single(into) if into is not None else None
        stream = self._request(key)
        desc, buffers = self._read_tensor(stream, into=target)
        if target is not None:
            target.raise_misfits(key)
        return BlockPagedTensor.from_descriptor(desc, buffers, seq_lens)

    # -- others ------------------------------------------------------------------------
    def delete(self, key: str) -> None:
        self._ask(MessageType.DELETE, Delete(key), MessageType.DELETE_ACK)

    def has(self, keys: list[str]) -> list[bool]:
        """Which of ``keys`` the server holds (one round trip)."""
        flags = self._ask(MessageType.HAS, list(keys), MessageType.HAS_REPLY)
        if len(flags) != len(keys):
            raise ProtocolError(f"has_reply.count {len(flags)}: {len(keys)} keys were asked "
                                "about", field="count", offset=0, value=len(flags))
        return flags

    def link(self, pairs: list[tuple[str, str]]) -> None:
        """Make each alias name its target's object (one round trip for all)."""
        self._ask(MessageType.LINK, list(pairs), MessageType.LINK_ACK)

    def locate(self, keys: list[str]) -> list[str | None]:
        """The stored object each key names (itself or an alias's target), None if none."""
        names = self._ask(MessageType.LOCATE, list(keys), MessageType.LOCATE_REPLY)
        if len(names) != len(keys):
            raise ProtocolError(f"locate_reply names {len(names)} objects for {len(keys)} "
                                "keys")
        return [n or None for n in names]

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """``(key, bytes)`` of every key (starting with ``prefix``) this client may see."""
        return self._ask(MessageType.LIST, prefix, MessageType.LIST_REPLY)

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        """Deprecated alias of :meth:`list_keys` (the name shadowed the builtin)."""
        warnings.warn("KVClient.list is deprecated: use KVClient.list_keys",
                      DeprecationWarning, stacklevel=2)
        return self.list_keys(prefix)

    def aliases(self, prefix: str = "") -> list[tuple[str, str]]:
        """``(alias, target)`` of every alias (starting with ``prefix``) this client may
        see; delete one with ``delete(alias)``."""
        return self._ask(MessageType.ALIASES, prefix, MessageType.ALIASES_REPLY)

    def retain(self, keys: list[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        """Pin (never evicted to make room, within the server's ``--max-pinned-bytes``)
        and give a lifetime (``ttl_s`` seconds: gone after it) to the stored ``keys``,
        set or (``extend``) merged as ``io.retention.merged`` says: ``pin=False,
        ttl_s=None`` releases them.  The keys retained."""
        text = self._ask(MessageType.RETAIN, json.dumps({
            "keys": list(keys), "pin": pin, "ttl_s": ttl_s, "extend": extend}),
            MessageType.STAT_REPLY)
        return list(_json_object(text, "retain reply").get("retained", []))

    def retention(self, prefix: str = "") -> dict[str, tuple[bool, float | None, int]]:
        """``key -> (pinned, expiry, bytes)`` of the keys retained (starting with
        ``prefix``)."""
        text = self._ask(MessageType.RETAIN, json.dumps({"prefix": prefix}),
                         MessageType.STAT_REPLY)
        return {k: tuple(v) for k, v in _json_object(text, "retain reply").get(
            "kept", {}).items()}

    def stat(self) -> dict[str, Any]:
        """The server's counters: objects, bytes, budget, connections, uptime."""
        text = self._ask(MessageType.STAT, None, MessageType.STAT_REPLY)
        try:
            out = json.loads(text)
        except ValueError as e:
            raise ProtocolError(f"stat_reply is not a JSON object: {e}") from None
        if not isinstance(out, dict):
            raise ProtocolError("stat_reply is not a JSON object")
        return out

    def extension(self, operation: str, payload: bytes = b"", *,
                  fds: list[int] | None = None) -> bytes:
        """Call the server's private ``operation`` (one round trip in the EXTENSION
        envelope, H95) with ``payload``; the bytes it answers.  ``RemoteError``
        UNKNOWN_OPERATION when the server has no such operation (INVALID_MESSAGE from a
        server older than the envelope), or the ERROR the operation answers with.
        ``fds``: a list the descriptors the server passes with its answer are appended
        to (a Unix socket; the caller closes them, whatever is raised)."""
        if not valid_operation(operation):
            raise HurrayError(f"operation {operation!r}: {OPERATION_RULE}",
                              field="operation", value=operation, rule=OPERATION_RULE)
        reply = self._ask(MessageType.EXTENSION, Extension(operation, bytes(payload)),
                          MessageType.EXTENSION, fds)
        if not isinstance(reply, Extension) or reply.operation != operation:
            got = reply.operation if isinstance(reply, Extension) else "RETAIN's form"
            raise ProtocolError(f"the reply to private operation {operation!r} names "
                                f"{got!r}", field="extension.operation", value=got,
                                rule="a reply names its request's operation")
        return reply.payload

    def ping(self, payload: bytes = b"") -> float:
        """Round-trip seconds of a PING; the PONG must echo its payload."""
        stream = self._next_stream()
        t0 = time.perf_counter()
        self._send(message(MessageType.PING, stream, payload))
        _, echo = self._expect(stream, MessageType.PONG)
        if bytes(echo) != payload:
            raise ProtocolError("PONG did not echo the PING payload")
        return time.perf_counter() - t0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


RECYCLE_BYTES = 1 << 30  # idle receive memory kept for the next pulls (or the largest pull)
_RECEIVE_POOL: ReceivePool | None = None
Into = Callable[[TensorDescriptor], list[memoryview] | None] | None


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        out = json.loads(text)
    except ValueError as e:
        raise ProtocolError(f"{what} is not JSON: {e}", field=what) from None
    if not isinstance(out, dict):
        raise ProtocolError(f"{what} is not a JSON object", field=what)
    return out


def receive_pool() -> ReceivePool:
    """The process's pool of receive mappings, shared by its clients."""
    global _RECEIVE_POOL
    if _RECEIVE_POOL is None:
        _RECEIVE_POOL = ReceivePool(RECYCLE_BYTES)
    return _RECEIVE_POOL


def _receivable(desc: TensorDescriptor) -> tuple:
    """What must agree for a tensor to be received into another's memory."""
    return (desc.type_tag, desc.shape, desc.layout, desc.quantization,
            tuple(h.byte_size for h in desc.buffers))


class _IntoSnapshot:
    """Maps each arriving block-paged member to the buffers of the matching member of a
    caller's snapshot; records the members that match none (they land in fresh memory,
    the stream is read to its end, and then ``raise_misfits`` reports them)."""

    def __init__(self, snapshot: KVCacheSnapshot | None,
                 tensors: dict[tuple[int | None, str], BlockPagedTensor] | None = None) -> None:
        self.tensors = tensors if tensors is not None else {
            k: snapshot.tensor(*k) for k in snapshot.member_keys()}
        self.misfits: list[str] = []
        for (layer, role), t in self.tensors.items():
            for i, v in enumerate(t.buffers()):
                if v.readonly:
                    raise LayoutError.at("into", None, f"layer {layer} {role} buffer {i}",
                                         "pull(into=) writes the received bytes there: its "
                                         "buffers must be writable (not a read-only mmap)")

    @classmethod
    def single(cls, tensor: BlockPagedTensor) -> _IntoSnapshot:
        return cls(None, {(tensor.layer_index, tensor.kv_role): tensor})

    def __call__(self, desc: TensorDescriptor) -> list[memoryview] | None:
        if not isinstance(desc.layout, BlockPaged):
            return None  # seq_lens, kv_scales, info: small, received fresh
        key = (desc.layout.layer_index, desc.layout.kv_role_name)
        if len(self.tensors) == 1:
            key = next(iter(self.tensors))
        t = self.tensors.get(key)
        if t is None:
            self.misfits.append(f"layer {key[0]} {key[1]}: into has no such member")
            return None
        mine = t.descriptor()
        if _receivable(mine) != _receivable(desc):
            self.misfits.append(f"layer {key[0]} {key[1]}: into is {list(mine.shape)} "
                                f"{mine.layout}, the server sends {list(desc.shape)} "
                                f"{desc.layout}")
            return None
        return [v.cast("B") for v in t.buffers()]

    def raise_misfits(self, key: str) -> None:
        if self.misfits:
            raise LayoutError(f"pull({key!r}, into=...): {len(self.misfits)} member(s) do not "
                              f"match into: {'; '.join(self.misfits[:3])}", field="into",
                              value=key, rule="into has the layout of what is pulled")
