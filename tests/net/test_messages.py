"""Protocol messages byte by byte, and their decoders' rejections with the spec's codes."""

from __future__ import annotations

import contextlib
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


# ------------------------------------------------------------------ every message type
# One row per message type in codecs.CODECS: a known value, its payload as literal bytes
# (hex, spaces between fields), and malformed variants (truncated, oversized, a wrong
# field), each answered with a ProtocolError carrying the given ERROR code.
_D = WORKED.encode().hex()
_I = E.INVALID_MESSAGE
_T = m.MessageType
_HELLO = "01000000 00000001 0000000000000000 0300 0a 0b 01 0100 00 0100 00"
_CASES = [
    (_T.CLIENT_HELLO, m.Hello(), _HELLO, [
        ("02000000 00000001 1000000000000000 0000 0000", _I),  # capability bit 4
        ("01000000 00010000 0000000000000000 0000 0000", _I)]),  # max_message_size 256
    (_T.SERVER_HELLO, m.Hello(1, 4096, 0, (m.LayoutEntry(0xF3, b"x"),), (0,), (0,)),
     "01000000 00100000 0000000000000000 0100 f3 0100 78 0100 00 0100 00", [
         ("01000000 00100000 0000000000000000 0100 f3 0900 78 0100 00 0100 00", _I)]),
    (_T.TENSOR_REQUEST, m.Request("k", (), 0, 64, 0), "01000000 6b 0000 00 40000000 00000000",
     [("01000000 6b 0000 00 30000000 00000000", _I),  # min_alignment 48
      ("01000000 6b 0000 00 40000000 04000000", _I),  # request_flags bit 2
      ("01000000 ff 0000 00 40000000 00000000", _I)]),  # the key is not UTF-8
    (_T.TENSOR_DESCRIPTOR, m.DescriptorMessage(WORKED, 664),
     _D + " 9802000000000000 00000000 01000000",
     [(_D + " 9702000000000000 00000000 01000000", _I),  # total_data_bytes 663
      (_D + " 9802000000000000 01000000 02000000", E.SHARD_MISMATCH)]),
    (_T.TENSOR_DATA, (4096, b"xyz"), "0010000000000000 78797a", []),
    (_T.TENSOR_DATA_END, None, "", []),
    (_T.TENSOR_PUT, m.Put("k", WORKED, 664),
     f"01000000 6b {len(WORKED.encode()):02x}000000 {_D} 9802000000000000",
     [(f"01000000 6b {len(WORKED.encode()) + 1:02x}000000 {_D} 00 9802000000000000", _I),
      (f"01000000 6b {len(WORKED.encode()):02x}000000 {_D} 9902000000000000", _I)]),
    (_T.TENSOR_PUT_ACK, None, "", []),
    (_T.ERROR, m.ErrorMessage(7, "big"), "07000000 03000000 626967",
     [("07000000 03000000 62ff67", _I)]),
    (_T.PING, b"hi", "6869", []),  # opaque: every payload is a PING
    (_T.PONG, b"hi", "6869", []),
    (_T.DELETE, m.Delete("k"), "01000000 6b", [("01000000 ff", _I)]),
    (_T.DELETE_ACK, None, "", []),
    (_T.LIST, "k/", "02000000 6b2f", [("02000000 6bff", _I)]),
    (_T.LIST_REPLY, [("a", 5)], "01000000 01000000 61 0500000000000000",
     [("02000000 01000000 61 0500000000000000", _I)]),  # count 2 in 13 bytes
    (_T.STAT, None, "", []),
    (_T.STAT_REPLY, "{}", "02000000 7b7d", [("02000000 7bff", _I)]),
    (_T.HAS, ["a", "bc"], "02000000 01000000 61 02000000 6263",
     [("01000100 01000000 61", _I)]),  # 65537 keys: above MAX_KEYS
    (_T.HAS_REPLY, [True, False], "02000000 0100", [("02000000 0102", _I)]),  # flag 2
    (_T.LINK, [("a", "b")], "01000000 01000000 61 01000000 62",
     [("02000000 01000000 61 01000000 62", _I)]),  # count 2: a pair short
    (_T.LINK_ACK, None, "", []),
    (_T.LOCATE, ["a"], "01000000 01000000 61", [("01000000 01000000 ff", _I)]),
    (_T.LOCATE_REPLY, ["b", ""], "02000000 01000000 62 00000000",
     [("03000000 01000000 62 00000000", _I)]),
    (_T.ALIASES, "", "00000000", [("01000000", _I)]),
    (_T.ALIASES_REPLY, [("a", "b")], "01000000 01000000 61 01000000 62",
     [("01000000 01000000 61 05000000 62", _I)]),
    (_T.RETAIN, '{"prefix":""}', "0d000000 7b22707265666978223a22227d",
     [("0e000000 7b22707265666978223a22227d", _I)]),  # one byte short
]


def test_every_message_type_has_a_codec_and_a_case():
    from hurraykv.net.codecs import CODECS

    assert sorted(CODECS) == sorted(t for t, *_ in _CASES)
    assert set(CODECS) == set(_T) - {_T.RDMA_REGISTER, _T.RDMA_READY}  # RDMA: not offered


@pytest.mark.parametrize(("mtype", "value", "payload", "bad"), _CASES,
                         ids=[t.name for t, *_ in _CASES])
def test_message_bytes_and_malformed_variants(mtype, value, payload, bad):
    from hurraykv.net.codecs import decode, encode, frame

    raw = bytes.fromhex(payload)
    assert encode(mtype, value) == raw
    assert frame(mtype, 3, value) == struct.pack("<III", mtype, 3, len(raw)) + raw
    back = decode(mtype, raw)
    if mtype == _T.TENSOR_DATA:
        back = (back[0], bytes(back[1]))
    assert back == value
    variants = [(bytes.fromhex(h), code) for h, code in bad]
    if mtype not in (_T.PING, _T.PONG, _T.TENSOR_DATA):
        variants.append((raw + b"\0", _I))  # oversized: a byte after the fields
        if raw:
            variants.append((raw[:-1], _I))  # truncated
    elif mtype == _T.TENSOR_DATA:
        variants.append((raw[:7], _I))  # shorter than the u64 offset
    for data in variants:
        with pytest.raises(m.ProtocolError) as exc:
            decode(mtype, data[0])
        assert exc.value.code == data[1], (mtype.name, data[0].hex())
        assert exc.value.field, (mtype.name, data[0].hex())


def test_every_truncation_of_every_message_is_a_protocol_error():
    """No prefix of a well-formed payload decodes to anything but a value or a
    ProtocolError (never struct.error, IndexError or UnicodeDecodeError)."""
    from hurraykv.net.codecs import decode

    for mtype, _, payload, _ in _CASES:
        raw = bytes.fromhex(payload)
        for cut in range(len(raw)):
            with contextlib.suppress(m.ProtocolError):
                decode(mtype, raw[:cut])
