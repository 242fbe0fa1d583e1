"""Pulls on a ``hurraykv serve`` connection (floor 5): a TENSOR_REQUEST answered with the
stored object's descriptors and data frames, written from the stored buffers (read from
the file a frame at a time for objects served from disk) under transport flow control.

A pull whose persisted file turns out damaged (cut short underneath the server) is
answered with ERROR INTERNAL naming the key, before the frame it could not read; it is
logged once, as a failure.  A pull stops writing as soon as its transport closes.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .. import units
from .codecs import frame
from .dataplane import DataPlan
from .messages import (
    DescriptorMessage,
    ErrorCode,
    MessageType,
    ProtocolError,
    Request,
    encode_data_header,
)
from .stored import FileBytes, UnreadableObject

if TYPE_CHECKING:
    from .keystore import StoredObject
    from .session import Session

log = logging.getLogger("hurraykv.server")


def on_request(s: Session, stream: int, req: Request) -> None:
    try:
        obj = s.server.store.get(s.key(req.key))
    except UnreadableObject as e:
        fail_pull(s, stream, req.key, e)
        return
    if obj is None:
        raise ProtocolError(f"no tensor under key {req.key!r}", ErrorCode.UNKNOWN_TENSOR)
    if req.preferred_device not in (0,) and 0 not in s.hello.devices:  # type: ignore[union-attr]
        raise ProtocolError(f"device 0x{req.preferred_device:02x} is unavailable and "
                            "the client does not take CPU", ErrorCode.DEVICE_UNAVAILABLE)
    s.spawn(send_object(s, stream, req.key, obj))


def fail_pull(s: Session, stream: int, key: str, e: UnreadableObject, sent: int = 0) -> None:
    """Answer a pull of ``key`` whose persisted file cannot be served: one log line
    (the file named), one ERROR (the key and what is wrong, not where)."""
    log.warning("get key=%r failed%s: %s", key,
                f" after {units.size(sent)} sent" if sent else "", e)
    s.fail(stream, ErrorCode.INTERNAL,
           f"key {key!r}: its persisted file cannot be served: {e.why}")


async def send_object(s: Session, stream: int, key: str, obj: StoredObject) -> None:
    started = time.perf_counter()
    cfg = s.server.config
    max_frame = min(cfg.frame_bytes, (s.hello.max_message_size if s.hello
                                      else cfg.max_message_size) - 8)
    sent = 0
    try:
        for desc, buffers in obj.items:
            total = sum(h.byte_size for h in desc.buffers)
            # a tensor's messages go out together: its descriptor with its first frame,
            # its end with its last (one write each, fewer system calls)
            out = [frame(MessageType.TENSOR_DESCRIPTOR, stream,
                         DescriptorMessage(desc, total))]
            plan = DataPlan([b if isinstance(b, FileBytes) else memoryview(b).cast("B")
                             for b in buffers])
            frames = list(plan.frames(max_frame))
            for k, (offset, parts) in enumerate(frames):
                if s.closing():
                    break
                # read before the frame's header goes out: a short read can still be
                # answered with ERROR on a stream whose framing is intact
                data = [p.read() if isinstance(p, FileBytes) else p for p in parts]
                size = sum(len(d) if isinstance(d, bytes) else d.nbytes for d in data)
                out += [encode_data_header(stream, offset, size), *data]
                if k == len(frames) - 1:
                    out.append(frame(MessageType.TENSOR_DATA_END, stream))
                await s.send_data(out)
                out = []
                sent += size
            if s.closing():
                break
            if not frames:
                s.send(*out, frame(MessageType.TENSOR_DATA_END, stream))
    except UnreadableObject as e:
        s.server.store.drop_opened(obj)
        fail_pull(s, stream, key, e, sent)
        return
    if s.closing():
        log.info("get key=%r abandoned after %s of %s: the connection closed", key,
                 units.size(sent), units.size(obj.nbytes))
        return
    counts = s.server.counts
    counts.pulls += 1
    seconds = time.perf_counter() - started
    counts.latencies.observe("pull", seconds)
    log.info("get key=%r %s in %.3f s (%s)", key, units.size(obj.nbytes), seconds,
             units.rate(obj.nbytes, seconds))
