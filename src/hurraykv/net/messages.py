"""Hurray interchange protocol messages (interchange.md; docs/spec/wire-notes.md §5.2, D10).

Every message is a 12-byte header ``message_type u32 | stream_id u32 (0 reserved) |
payload_length u32`` and its payload.  Encoders and decoders are plain functions over
bytes (``codecs.CODECS`` maps each message type to its pair); a decoder reads through
``wire.cursor.Cursor`` and rejects a malformed payload with :class:`ProtocolError`, whose
``code`` is the ERROR code to answer with.

====  ==================  ====================================================================
type  name                payload
====  ==================  ====================================================================
0x01  CLIENT_HELLO        u32 protocol_version, u32 max_message_size, u64 capability_flags,
0x02  SERVER_HELLO        u16 n + layout_entry[n], u16 n + u8 device_tag[n],
                          u16 n + u8 memory_class[n] (may be absent: {STANDARD})
0x03  TENSOR_REQUEST      u32 n + utf8 key, u16 n + layout_entry[n], u8 preferred_device,
                          u32 min_alignment (power of two), u32 request_flags (bits 0-1)
0x04  TENSOR_DESCRIPTOR   descriptor bytes, u64 total_data_bytes, u32 shard_index,
                          u32 total_shards
0x05  TENSOR_DATA         u64 byte_offset_in_buffer, data
0x06  TENSOR_DATA_END     empty
0x07  TENSOR_PUT          u32 n + utf8 key, u32 n + descriptor bytes, u64 total_data_bytes
0x08  TENSOR_PUT_ACK      empty
0x09  ERROR               u32 error_code, u32 n + utf8 message
0x0A  PING / 0x0B PONG    opaque bytes (PONG echoes PING's)
0xF0  DELETE (private)    u32 n + utf8 key; answered by 0xF1 DELETE_ACK (empty) or ERROR
0xF2  LIST (private)      u32 n + utf8 key prefix; answered by 0xF3 LIST_REPLY: u32 count,
                          then per key u32 n + utf8 key, u64 bytes
0xF4  STAT (private)      empty; answered by 0xF5 STAT_REPLY: u32 n + utf8 JSON object
0xF6  HAS (private)       u32 count, then per key u32 n + utf8 key; answered by 0xF7
                          HAS_REPLY: u32 count, one byte (0 or 1) per key
0xF8  LINK (private)      u32 count, then per alias u32 n + utf8 alias, u32 n + utf8 target;
                          answered by 0xF9 LINK_ACK (empty): each alias now names the target
0xFA  LOCATE (private)    u32 count, then per key u32 n + utf8 key; answered by 0xFB
                          LOCATE_REPLY: u32 count, then per key the stored object it names
                          (itself, or an alias's target) as u32 n + utf8, empty if none
0xFC  ALIASES (private)   u32 n + utf8 alias prefix; answered by 0xFD ALIASES_REPLY: u32
                          count, then per alias u32 n + utf8 alias, u32 n + utf8 target
0xFE  RETAIN (private)    u32 n + utf8 JSON object: ``{"keys": [...], "pin": bool or null,
                          "ttl_s": seconds or null, "extend": bool}`` pins and gives a
                          lifetime to stored keys (set, or extended: H93), or
                          ``{"prefix": "..."}`` lists the keys retained; answered by 0xF5
                          (STAT_REPLY's form, the last private type being this one): a
                          JSON object ``{"retained": [keys]}`` or ``{"kept": {key:
                          [pinned, expiry, bytes]}}``; a pin past the server's
                          ``--max-pinned-bytes`` is ERROR STORE_FULL
0xFE  EXTENSION           the private envelope (H95), told from RETAIN by its first u32:
      (private envelope)  u32 0xFFFFFFFF (``EXTENSION_MARK``, never a RETAIN text's
                          length), u32 n + utf8 operation (1 to 128 ASCII letters, digits,
                          ``.``, ``_``, ``-``; ``vendor.name`` by convention), then the
                          operation's own payload (the rest of the message); answered by
                          0xFE in the same form, naming the same operation, with the reply's
                          payload, or by ERROR (UNKNOWN_OPERATION 0xF5 naming an operation
                          the server does not have).  Every private operation after RETAIN
                          is one of these: an operation name, never a type number
====  ==================  ====================================================================

A layout entry is one byte, or for a private tag (0xF0-0xFE) the byte, ``u16 ext_len`` and
the extension bytes; unknown entries are skipped, never a reason to reject the list.
The data of one tensor is its buffers concatenated in table order without padding (D10):
``total_data_bytes`` is their sum and ``byte_offset_in_buffer`` indexes that concatenation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from ..errors import HurrayError, RemoteError, TransportError
from ..wire.cursor import Cursor
from ..wire.descriptor import TensorDescriptor, decode_descriptor

HEADER = struct.Struct("<III")
PROTOCOL_VERSION = 1
MIN_MESSAGE_SIZE = 4096


class MessageType(IntEnum):
    CLIENT_HELLO = 0x01
    SERVER_HELLO = 0x02
    TENSOR_REQUEST = 0x03
    TENSOR_DESCRIPTOR = 0x04
    TENSOR_DATA = 0x05
    TENSOR_DATA_END = 0x06
    TENSOR_PUT = 0x07
    TENSOR_PUT_ACK = 0x08
    ERROR = 0x09
    PING = 0x0A
    PONG = 0x0B
    RDMA_REGISTER = 0x0C
    RDMA_READY = 0x0D
    DELETE = 0xF0
    DELETE_ACK = 0xF1
    LIST = 0xF2
    LIST_REPLY = 0xF3
    STAT = 0xF4
    STAT_REPLY = 0xF5
    HAS = 0xF6
    HAS_REPLY = 0xF7
    LINK = 0xF8
    LINK_ACK = 0xF9
    LOCATE = 0xFA
    LOCATE_REPLY = 0xFB
    ALIASES = 0xFC
    ALIASES_REPLY = 0xFD
    RETAIN = 0xFE
    EXTENSION = 0xFE  # the same number: the envelope is told apart by EXTENSION_MARK (H95)


class ErrorCode(IntEnum):
    PROTOCOL_VERSION_MISMATCH = 1
    UNKNOWN_TENSOR = 2
    LAYOUT_UNAVAILABLE = 3
    TRANSCODE_LIMIT_EXCEEDED = 4
    DEVICE_UNAVAILABLE = 5
    INVALID_MESSAGE = 6
    MESSAGE_TOO_LARGE = 7
    SHARD_MISMATCH = 8
    # implementation-defined (0xF0-0xFE)
    SERVER_BUSY = 0xF0
    STORE_FULL = 0xF1
    TIMEOUT = 0xF2
    INTERNAL = 0xF3
    UNAUTHORIZED = 0xF4
    UNKNOWN_OPERATION = 0xF5  # an EXTENSION envelope naming an operation not served (H95)


CAP_TRANSCODING, CAP_PARALLEL_STREAMS, CAP_RDMA, CAP_RDMA_GPUDIRECT = 1, 2, 4, 8
KNOWN_CAPS = 0xF
REQ_ALLOW_TRANSCODE, REQ_PARALLEL_OK = 1, 2


class ProtocolError(HurrayError):
    """A message that breaks the protocol; ``code`` is the ERROR code that answers it."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_MESSAGE,
                 **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.code = code


def code_of(e: HurrayError) -> ErrorCode:
    """The ERROR code that answers ``e``: a ProtocolError's own; SERVER_BUSY for a
    TransportError (the backing --store away: the request was fine, try again, H36);
    INVALID_MESSAGE for any other refusal."""
    if isinstance(e, ProtocolError):
        return e.code
    return ErrorCode.SERVER_BUSY if isinstance(e, TransportError) else ErrorCode.INVALID_MESSAGE


def remote_error(code: int, message: str) -> RemoteError:
    """The error a client raises for an ERROR message, the code named where known."""
    try:
        name: str | None = ErrorCode(code).name
    except ValueError:
        name = None
    return RemoteError(code, message, name)


def protocol_error(msg: str, code: ErrorCode = ErrorCode.INVALID_MESSAGE,
                   field_: str = "payload", offset: int | None = None,
                   value: object = None) -> ProtocolError:
    """The :class:`ProtocolError` that answers a bad message with ERROR ``code``."""
    return ProtocolError(msg, code, field=field_, offset=offset, value=value)


def payload_reader(payload: bytes | memoryview, what: str) -> Cursor:
    """A bounded reader over one message's payload: short, long or malformed payloads are
    a :class:`ProtocolError` (INVALID_MESSAGE) naming ``what.field`` and its payload byte."""
    return Cursor(payload, error=ProtocolError, noun=f"{what} payload", prefix=f"{what}.",
                  where="payload byte", bound="the payload")


# ---------------------------------------------------------------------------- header
def decode_header(raw: bytes | memoryview, max_message_size: int) -> tuple[int, int, int]:
    """(message_type, stream_id, payload_length); raises for stream 0, type 0xFF and
    payloads above ``max_message_size`` (MESSAGE_TOO_LARGE: the payload still follows)."""
    if len(raw) != HEADER.size:
        raise protocol_error(f"a message header is {HEADER.size} bytes, got {len(raw)}",
                             field_="header", value=len(raw))
    mtype, stream_id, length = HEADER.unpack(raw)
    if mtype == 0xFF or mtype == 0:
        raise protocol_error(f"message_type 0x{mtype:x} is invalid", field_="message_type",
                             offset=0, value=mtype)
    if stream_id == 0:
        raise protocol_error("stream_id 0 is reserved", field_="stream_id", offset=4, value=0)
    if length > max_message_size:
        raise protocol_error(f"payload_length {length} exceeds max_message_size {max_message_size}",
                             ErrorCode.MESSAGE_TOO_LARGE, "payload_length", 8, length)
    return mtype, stream_id, length


def message(mtype: int, stream_id: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(mtype, stream_id, len(payload)) + payload


# ---------------------------------------------------------------------------- hello
@dataclass(frozen=True)
class LayoutEntry:
    tag: int
    ext: bytes = b""

    def encode(self) -> bytes:
        if 0xF0 <= self.tag <= 0xFE:
            return struct.pack("<BH", self.tag, len(self.ext)) + self.ext
        return bytes([self.tag])


def _encode_layouts(entries: tuple[LayoutEntry, ...]) -> bytes:
    return struct.pack("<H", len(entries)) + b"".join(e.encode() for e in entries)


def _decode_layouts(r: Cursor) -> tuple[LayoutEntry, ...]:
    n = r.u16("layout_count")
    out = []
    for _ in range(n):
        tag = r.u8("layout_entry")
        if 0xF0 <= tag <= 0xFE:
            ext = bytes(r.take(r.u16("ext_len"), "ext"))
            out.append(LayoutEntry(tag, ext))
        else:
            out.append(LayoutEntry(tag))
    return tuple(out)


@dataclass(frozen=True)
class Hello:
    protocol_version: int = PROTOCOL_VERSION
    max_message_size: int = 16 << 20
    capabilities: int = 0
    layouts: tuple[LayoutEntry, ...] = (LayoutEntry(0x0A), LayoutEntry(0x0B), LayoutEntry(0x01))
    devices: tuple[int, ...] = (0,)
    memory_classes: tuple[int, ...] = (0,)

    def encode(self) -> bytes:
        return (struct.pack("<IIQ", self.protocol_version, self.max_message_size,
                            self.capabilities) + _encode_layouts(self.layouts)
                + struct.pack("<H", len(self.devices)) + bytes(self.devices)
                + struct.pack("<H", len(self.memory_classes)) + bytes(self.memory_classes))


def decode_hello(payload: bytes | memoryview, what: str = "hello") -> Hello:
    r = payload_reader(payload, what)
    version = r.u32("protocol_version")
    size = r.u32("max_message_size")
    caps = r.u64("capability_flags")
    if caps & ~KNOWN_CAPS:
        raise protocol_error(f"{what}.capability_flags 0x{caps:x}: bits 4-63 MUST be 0",
                             field_="capability_flags", offset=8, value=caps)
    if caps & CAP_RDMA_GPUDIRECT and not caps & CAP_RDMA:
        raise protocol_error(f"{what}.capability_flags: RDMA_GPUDIRECT needs RDMA_DATA_PLANE",
                             field_="capability_flags", offset=8, value=caps)
    if size < MIN_MESSAGE_SIZE:
        raise protocol_error(f"{what}.max_message_size {size} is below {MIN_MESSAGE_SIZE}",
                             field_="max_message_size", offset=4, value=size)
    layouts = _decode_layouts(r)
    devices = tuple(bytes(r.take(r.u16("device_count"), "devices")))
    classes: tuple[int, ...] = (0,)
    if r.left:
        classes = tuple(bytes(r.take(r.u16("memory_class_count"), "memory_classes")))
        classes = classes or (0,)
    r.end()
    return Hello(version, size, caps, layouts, devices, classes)


# ---------------------------------------------------------------------------- request
@dataclass(frozen=True)
class Request:
    key: str
    layouts: tuple[LayoutEntry, ...] = ()
    preferred_device: int = 0
    min_alignment: int = 64
    flags: int = 0

    def encode(self) -> bytes:
        raw = self.key.encode("utf-8")
        return (struct.pack("<I", len(raw)) + raw + _encode_layouts(self.layouts)
                + struct.pack("<BII", self.preferred_device, self.min_alignment, self.flags))


def decode_request(payload: bytes | memoryview) -> Request:
    r = payload_reader(payload, "tensor_request")
    key = r.text("key")
    layouts = _decode_layouts(r)
    device = r.u8("preferred_device")
    align = r.u32("min_alignment")
    flags = r.u32("request_flags")
    r.end()
    if align == 0 or align & (align - 1):
        raise protocol_error(f"tensor_request.min_alignment {align} is not a power of two",
                             field_="min_alignment", value=align)
    if flags & ~3:
        raise protocol_error(f"tensor_request.request_flags 0x{flags:x}: bits 2-31 MUST be 0",
                             field_="request_flags", value=flags)
    return Request(key, layouts, device, align, flags)


# ---------------------------------------------------------------------------- tensors
def total_data_bytes(desc: TensorDescriptor) -> int:
    """D10: a tensor's data region is its buffers back to back, no padding."""
    return sum(h.byte_size for h in desc.buffers)


def _descriptor(raw: memoryview, what: str) -> TensorDescriptor:
    try:
        desc = decode_descriptor(raw)
    except HurrayError as e:
        raise protocol_error(f"{what}: {e}", field_=f"{what}.descriptor", offset=e.offset,
                             value=e.value) from None
    for i, h in enumerate(desc.buffers):
        if h.sync_mode != 0:
            raise protocol_error(f"{what}: buffers[{i}].sync_mode is {h.sync_mode}; over the "
                                 "network every buffer MUST be PRODUCER_SYNCED (0)",
                                 field_="sync_mode", value=h.sync_mode)
    return desc


@dataclass(frozen=True)
class DescriptorMessage:
    descriptor: TensorDescriptor
    total_data_bytes: int
    shard_index: int = 0
    total_shards: int = 1

    def encode(self) -> bytes:
        return self.descriptor.encode() + struct.pack("<QII", self.total_data_bytes,
                                                      self.shard_index, self.total_shards)


def _check_total(desc: TensorDescriptor, total: int, what: str) -> None:
    want = total_data_bytes(desc)
    if total != want:
        raise protocol_error(f"{what}.total_data_bytes {total} MUST equal the sum of the "
                             f"buffer sizes {want} (D10)", field_="total_data_bytes",
                             value=total)


def decode_descriptor_message(payload: bytes | memoryview) -> DescriptorMessage:
    mv = memoryview(payload).cast("B")
    if len(mv) < 10:
        raise protocol_error("tensor_descriptor: the payload is shorter than a descriptor",
                             field_="tensor_descriptor", value=len(mv))
    length = int.from_bytes(mv[6:10], "little")
    desc = _descriptor(mv[:length] if length <= len(mv) else mv, "tensor_descriptor")
    r = payload_reader(mv[length:], "tensor_descriptor")
    total = r.u64("total_data_bytes")
    index = r.u32("shard_index")
    shards = r.u32("total_shards")
    r.end()
    _check_total(desc, total, "tensor_descriptor")
    if shards == 0 or index >= shards or (desc.shard is None and (index, shards) != (0, 1)):
        raise protocol_error(f"tensor_descriptor: shard {index} of {shards} for a tensor without a "
                             "shard section", ErrorCode.SHARD_MISMATCH, "shard_index", value=index)
    return DescriptorMessage(desc, total, index, shards)


@dataclass(frozen=True)
class Put:
    key: str
    descriptor: TensorDescriptor
    total_data_bytes: int

    def encode(self) -> bytes:
        raw, desc = self.key.encode("utf-8"), self.descriptor.encode()
        return (struct.pack("<I", len(raw)) + raw + struct.pack("<I", len(desc)) + desc
                + struct.pack("<Q", self.total_data_bytes))


def decode_put(payload: bytes | memoryview) -> Put:
    r = payload_reader(payload, "tensor_put")
    key = r.text("key")
    n = r.u32("descriptor_length")
    raw = r.take(n, "descriptor")
    desc = _descriptor(raw, "tensor_put")
    if len(desc.encode()) != n:
        raise protocol_error(f"tensor_put: the descriptor is {len(desc.encode())} bytes, its "
                             f"length prefix says {n}", field_="descriptor_length", value=n)
    total = r.u64("total_data_bytes")
    r.end()
    _check_total(desc, total, "tensor_put")
    return Put(key, desc, total)


def encode_data_header(stream_id: int, offset: int, length: int) -> bytes:
    """The 12-byte header and the u64 offset of a TENSOR_DATA frame of ``length`` bytes."""
    return HEADER.pack(MessageType.TENSOR_DATA, stream_id, 8 + length) + struct.pack("<Q",
                                                                                      offset)


def decode_data(payload: bytes | memoryview) -> tuple[int, memoryview]:
    mv = memoryview(payload).cast("B")
    if len(mv) < 8:
        raise protocol_error(f"tensor_data: {len(mv)} bytes cannot hold the u64 byte_offset",
                             field_="byte_offset_in_buffer", value=len(mv))
    return int.from_bytes(mv[:8], "little"), mv[8:]


def decode_empty(payload: bytes | memoryview, what: str) -> None:
    if len(payload):
        raise protocol_error(f"{what} carries no payload, got {len(payload)} bytes", field_=what,
                             value=len(payload))


# ---------------------------------------------------------------------------- errors
@dataclass(frozen=True)
class ErrorMessage:
    code: int
    message: str = ""

    def encode(self) -> bytes:
        raw = self.message.encode("utf-8")[:65536]
        return struct.pack("<II", self.code, len(raw)) + raw


def decode_error(payload: bytes | memoryview) -> ErrorMessage:
    r = payload_reader(payload, "error")
    code = r.u32("error_code")
    text = r.text("message")
    r.end()
    return ErrorMessage(code, text)


@dataclass(frozen=True)
class Delete:
    key: str

    def encode(self) -> bytes:
        raw = self.key.encode("utf-8")
        return struct.pack("<I", len(raw)) + raw


def decode_delete(payload: bytes | memoryview) -> Delete:
    r = payload_reader(payload, "delete")
    key = r.text("key")
    r.end()
    return Delete(key)


def encode_text(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def decode_text(payload: bytes | memoryview, what: str) -> str:
    """A payload that is one ``u32 n + utf8`` string (LIST's prefix, STAT_REPLY's JSON)."""
    r = payload_reader(payload, what)
    text = r.text("text")
    r.end()
    return text
