"""Protocol messages byte by byte, and their decoders' rejections with the spec's codes."""

from __future__ import annotations

import struct

import pytest

from hurraykv.net import messages as m
from hurraykv.net.dataplane import DataAssembler, DataPlan
from hurraykv.net.messages import ErrorCode as E
from tests.vectors.make_vectors import WORKED


def test_header_layout():
    assert m.message(m.MessageType.PING, 7, b"ab") == struct.pack("<III", 0x0A, 7, 2) + b"ab"
    assert m.decode_header(struct.pack("<III", 4, 9, 100), 1000) == (4, 9, 100)
    for raw, code in ((struct.pack("<III", 4, 0, 1), E.INVALID_MESSAGE),
                      (struct.pack("<III", 0xFF, 1, 1), E.INVALID_MESSAGE),
                      (struct.pack("<III", 4, 1, 1001), E.MESSAGE_TOO_LARGE)):
        with pytest.raises(m.ProtocolError) as exc:
            m.decode_header(raw, 1000)
        assert exc.value.code == code


def test_hello_bytes():
    h = m.Hello(1, 1 << 20, m.CAP_PARALLEL_STREAMS,
                (m.LayoutEntry(0x0A), m.LayoutEntry(0xF3, b"xy")), (0, 1), (0, 1))
    raw = h.encode()
    assert raw == (struct.pack("<IIQ", 1, 1 << 20, 2) + struct.pack("<H", 2) + b"\x0a"
                   + b"\xf3" + struct.pack("<H", 2) + b"xy" + struct.pack("<H", 2) + b"\x00\x01"
                   + struct.pack("<H", 2) + b"\x00\x01")
    assert m.decode_hello(raw) == h
    # memory classes may be missing: {STANDARD}
    assert m.decode_hello(raw[:-4]).memory_classes == (0,)


@pytest.mark.parametrize(("payload", "code"), [
    (struct.pack("<IIQ", 1, 1 << 20, 1 << 4) + b"\0\0\0\0", E.INVALID_MESSAGE),  # bit 4
    (struct.pack("<IIQ", 1, 1 << 20, 8) + b"\0\0\0\0", E.INVALID_MESSAGE),  # GPUDirect alone
    (struct.pack("<IIQ", 1, 100, 0) + b"\0\0\0\0", E.INVALID_MESSAGE),  # tiny messages
    (struct.pack("<IIQ", 1, 1 << 20, 0) + b"\x05\x00\x0a", E.INVALID_MESSAGE),  # truncated
    (m.Hello().encode() + b"\x00", E.INVALID_MESSAGE),  # trailing byte
])
def test_hello_rejections(payload, code):
    with pytest.raises(m.ProtocolError) as exc:
        m.decode_hello(payload)
    assert exc.value.code == code


def test_request_bytes_and_rejections():
    r = m.Request("kv/α", (m.LayoutEntry(0x0A),), 0, 4096, m.REQ_PARALLEL_OK)
    key = "kv/α".encode()
    raw = r.encode()
    assert raw == (struct.pack("<I", len(key)) + key + b"\x01\x00\x0a"
                   + struct.pack("<BII", 0, 4096, 2))
    assert m.decode_request(raw) == r
    for bad in (raw[:-1], raw[:-4] + struct.pack("<I", 4), raw[:-8] + struct.pack("<II", 48, 0),
                struct.pack("<I", 2) + b"\xff\xfe" + raw[4 + len(key):]):
        with pytest.raises(m.ProtocolError) as exc:
            m.decode_request(bad)
        assert exc.value.code == E.INVALID_MESSAGE


def test_descriptor_message_bytes_and_rules():
    msg = m.DescriptorMessage(WORKED, 664)
    raw = msg.encode()
    assert raw == WORKED.encode() + struct.pack("<QII", 664, 0, 1)
    assert m.decode_descriptor_message(raw) == msg
    with pytest.raises(m.ProtocolError, match="sum of the buffer sizes"):
        m.decode_descriptor_message(WORKED.encode() + struct.pack("<QII", 663, 0, 1))
    with pytest.raises(m.ProtocolError) as exc:
        m.decode_descriptor_message(WORKED.encode() + struct.pack("<QII", 664, 1, 2))
    assert exc.value.code == E.SHARD_MISMATCH
    bad = bytearray(WORKED.encode())
    bad[52 + 26] = 1  # reserved byte of the block-paged payload
    with pytest.raises(m.ProtocolError, match=r"layout\._reserved"):
        m.decode_descriptor_message(bytes(bad) + struct.pack("<QII", 664, 0, 1))
    from dataclasses import replace

    from hurraykv.wire.buffers import BufferHandle
    cuda = replace(WORKED, buffers=tuple(BufferHandle(h.byte_size, 64, 1, 1) for h in
                                          WORKED.buffers))
    with pytest.raises(m.ProtocolError, match="PRODUCER_SYNCED"):
        m.decode_descriptor_message(cuda.encode() + struct.pack("<QII", 664, 0, 1))


def test_put_bytes_and_rules():
    put = m.Put("k", WORKED, 664)
    d = WORKED.encode()
    raw = put.encode()
    assert raw == struct.pack("<I", 1) + b"k" + struct.pack("<I", len(d)) + d + struct.pack(
        "<Q", 664)
    assert m.decode_put(raw) == put
    for bad in (raw[:-1], raw + b"\0",
                struct.pack("<I", 1) + b"k" + struct.pack("<I", len(d) + 1) + d + b"\0"
                + struct.pack("<Q", 664)):
        with pytest.raises(m.ProtocolError):
            m.decode_put(bad)


def test_data_error_delete_and_empty_messages():
    assert m.encode_data_header(3, 4096, 10) == struct.pack("<IIIQ", 5, 3, 18, 4096)
    off, data = m.decode_data(struct.pack("<Q", 77) + b"xyz")
    assert (off, bytes(data)) == (77, b"xyz")
    with pytest.raises(m.ProtocolError):
        m.decode_data(b"1234567")
    err = m.ErrorMessage(7, "too big")
    assert err.encode() == struct.pack("<II", 7, 7) + b"too big"
    assert m.decode_error(err.encode()) == err
    with pytest.raises(m.ProtocolError):
        m.decode_error(struct.pack("<II", 7, 8) + b"too big")
    assert m.decode_delete(m.Delete("x").encode()) == m.Delete("x")
    m.decode_empty(b"", "tensor_data_end")
    with pytest.raises(m.ProtocolError):
        m.decode_empty(b"\0", "tensor_data_end")


def test_data_plane_concatenates_buffers_without_padding():
    """D10: offsets index the concatenation of the buffers in table order."""
    plan = DataPlan([memoryview(b"abcde"), memoryview(b""), memoryview(b"fgh")])
    frames = [(o, b"".join(bytes(p) for p in parts)) for o, parts in plan.frames(3)]
    assert frames == [(0, b"abc"), (3, b"def"), (6, b"gh")]  # frames span buffers
    asm = DataAssembler(WORKED)
    with pytest.raises(m.ProtocolError, match="expected 0"):
        asm.target(8, 8)
    asm.target(0, 600)[:] = bytes(600)
    with pytest.raises(m.ProtocolError, match="runs past"):
        asm.target(600, 100)
    with pytest.raises(m.ProtocolError, match="after 600 of 664"):
        asm.finish()
    asm.target(600, 64)[:] = bytes(range(64))
    pool, bt, sp = asm.finish()
    assert (len(pool), bytes(bt), len(sp)) == (640, bytes(range(40, 52)), 12)
