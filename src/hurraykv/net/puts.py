"""PUTs on a ``hurraykv serve`` connection (floor 5): a tensor, or a group head and its
members, reserved against the memory budget member by member, assembled, validated and
committed (decisions H39, H42, H52; issue 19 item 8 for groups and eviction)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import units
from ..errors import HurrayError
from ..wire.layouts import Composite
from . import handover
from .dataplane import DataAssembler
from .keystore import PersistFull, StoreFull, object_from_items
from .messages import ErrorCode, MessageType, ProtocolError, code_of, message
from .messages import Put as PutMessage

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("hurraykv.server")


@dataclass
class Put:
    """One PUT (a tensor, or a group head and its members) while it arrives."""

    key: str  # the internal (tenant-scoped) key
    shown: str  # the key as the client named it
    expected: int  # tensors this PUT carries: 1, or a group head and its members
    items: list = field(default_factory=list)
    assembler: DataAssembler | None = None
    open: bool = False  # a member's TENSOR_PUT arrived, its TENSOR_DATA_END not yet
    closed: int = 0  # members whose TENSOR_DATA_END arrived
    nbytes: int = 0  # bytes announced so far
    reserved: int = 0  # of those, reserved against the memory budget
    refused: StoreFull | None = None  # read to the end, discarded, then answered
    started: float = field(default_factory=time.perf_counter)


def on_put(s: Session, stream: int, put_msg: PutMessage) -> None:
    desc = put_msg.descriptor
    put = s.puts.get(stream)
    if put is None:
        expected = 1 + (desc.layout.member_count if isinstance(desc.layout, Composite)
                        else 0)
        put = Put(s.key(put_msg.key), put_msg.key, expected)
        s.puts[stream] = put
    elif put.open:
        raise ProtocolError("TENSOR_PUT while the previous tensor's data is still open")
    elif put_msg.key != put.shown:
        raise ProtocolError(f"member pushed under key {put_msg.key!r} inside the group of "
                            f"{put.shown!r}")
    elif isinstance(desc.layout, Composite):
        raise ProtocolError("nested composites are not stored by this server")
    put.open = True
    put.nbytes += put_msg.total_data_bytes
    if put.refused is None:
        try:  # objects that would be lost leave only for the group's last member
            s.server.store.check_pin(put.key, put.nbytes)  # a pinned key: its new size
            s.server.store.reserve(put_msg.total_data_bytes, keep=put.key, owner=s.tenant,
                                   lossy=put.closed + 1 >= put.expected)
        except StoreFull as e:
            e.in_flight -= put.reserved  # what other PUTs hold, not this one's members
            s.server.store.release(put.reserved, s.tenant)
            put.reserved, put.refused = 0, e
        else:
            put.reserved += put_msg.total_data_bytes
    if put.refused is None:
        put.assembler = DataAssembler(desc, pool=s.server.pool)


def on_data_end(s: Session, stream: int, _: None = None) -> None:
    put = s.puts.get(stream)
    if put is None or not put.open:
        raise ProtocolError("tensor_data_end without an open TENSOR_PUT")
    if put.assembler is not None:
        buffers = put.assembler.finish()
        put.items.append((put.assembler.desc, buffers))
    put.assembler, put.open = None, False
    put.closed += 1
    if put.closed < put.expected:
        return
    del s.puts[stream]  # the group closes at its Nth member
    if put.refused is not None:
        what = "snapshot" if put.expected > 1 else "tensor"
        s.fail(stream, ErrorCode.STORE_FULL,
               f"{what} {put.shown!r} {put.refused.needs(put.nbytes)}")
        log.info("refused put key=%r: %s over %s", put.shown, units.size(put.nbytes),
                 put.refused.rule)
        return
    s.spawn(_commit(s, stream, put))


async def _commit(s: Session, stream: int, put: Put) -> None:
    store = s.server.store
    try:
        obj, snap = object_from_items(put.items, s.server.config.zero_unused)
        path = await asyncio.get_running_loop().run_in_executor(
            None, store.persist_object, put.key, obj, snap)
    except asyncio.CancelledError:
        store.release(put.reserved, s.tenant)
        raise
    except PersistFull as e:
        store.release(put.reserved, s.tenant)
        what = "snapshot" if put.expected > 1 else "tensor"
        s.fail(stream, ErrorCode.STORE_FULL, f"{what} {put.shown!r} {e}")
        log.info("refused put key=%r: %s over the persist budget", put.shown,
                 units.size(e.nbytes))
        return
    except HurrayError as e:
        store.release(put.reserved, s.tenant)
        code = code_of(e)  # SERVER_BUSY: the backing --store away, the message was fine
        s.fail(stream, code, f"{put.shown!r} not stored, try again: {e}"
               if code == ErrorCode.SERVER_BUSY else f"rejected: {e}")
        return
    except Exception as e:  # a bug must still answer the client, and be seen
        store.release(put.reserved, s.tenant)
        log.exception("put key=%r failed", put.shown)
        s.fail(stream, ErrorCode.INTERNAL,
               f"internal error storing {put.shown!r}: {type(e).__name__}: {e}")
        return
    store.commit(put.key, obj, path, put.reserved, s.tenant)
    if s.server.hands_over:
        handover.prepare(put.key, obj)
    seconds = time.perf_counter() - put.started
    log.info("put key=%r %s in %.3f s (%s)", put.shown, units.size(obj.nbytes), seconds,
             units.rate(obj.nbytes, seconds))
    s.send(message(MessageType.TENSOR_PUT_ACK, stream))
    s.server.counts.pushes += 1
    s.server.counts.latencies.observe("push", seconds)
