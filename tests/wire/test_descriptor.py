"""Descriptor codec: property round trips, fuzzing, strict vs permissive, framing rules."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hurraykv as hk
from hurraykv.paged import BlockPagedTensor
from hurraykv.wire.buffers import BufferHandle
from hurraykv.wire.descriptor import TensorDescriptor, decode_descriptor, peek_length
from hurraykv.wire.dtypes import ELEMENT_TYPES
from hurraykv.wire.layouts import (
    BlockPaged,
    ColMajor,
    Composite,
    Coo,
    Csc,
    Csf,
    Csr,
    Hilbert,
    Morton,
    PrivateLayout,
    RowMajor,
    Strided,
    Tiled,
)
from hurraykv.wire.quantization import PerBlockAffine, PerChannel, PerTensor, RawQuantization
from hurraykv.wire.sections import CompositeMember, ExtensionType, Shard, Statistics
from tests.support.wire import split_stream
from tests.vectors.make_vectors import INVALID, VALID, WORKED, WORKED_BUFFERS

u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, (1 << 64) - 1)
WHOLE_BYTE = [t for t, e in ELEMENT_TYPES.items() if e.bits % 8 == 0 and e.numpy is not None]


@st.composite
def block_paged(draw) -> TensorDescriptor:
    tag = draw(st.sampled_from([*WHOLE_BYTE, 72, 73]))
    et = ELEMENT_TYPES[tag]
    ps = draw(st.integers(1, 64))
    heads, dim = draw(st.integers(1, 16)), draw(st.integers(1, 256))
    if et.sub_byte and (ps * heads * dim) % 2:
        dim += 1
    pages = draw(st.integers(0, 1 << 20))
    seqs = draw(st.integers(0, 300))
    index_type = draw(st.sampled_from([0, 1]))
    w = 8 if index_type else 4
    logical = draw(st.integers(0, 4 * (seqs + 1))) if seqs else 0
    total = draw(st.integers(0, logical * ps))
    align = draw(st.sampled_from([64, 128, 4096]))
    device, mc = draw(st.sampled_from([(0, 0), (0, 1), (1, 0), (1, 3), (2, 2), (0xF0, 0xF1)]))
    sync = 0 if device == 0 else draw(st.integers(0, 2))
    hs = [BufferHandle(et.nbytes(pages * ps * heads * dim), align, device, sync, mc),
          BufferHandle(logical * w, align, device, sync, mc),
          BufferHandle((seqs + 1) * w, align, device, sync, mc)]
    layer = draw(st.none() | st.integers(0, 0xFFFFFFFE))
    layout = BlockPaged(ps, pages, seqs, draw(st.integers(0, 2)), layer, index_type)
    quant = None
    if tag in (0x10, 0x11, 0x48, 0x49) and draw(st.booleans()):
        kind = draw(st.sampled_from(["tensor", "channel", "block"] if ps in (
            2, 4, 8, 16, 32, 64) else ["tensor", "channel"]))
        if kind == "tensor":
            quant = PerTensor(draw(st.floats(0.001, 100.0)), 0)
        elif kind == "channel":
            axis = draw(st.sampled_from([1, 2]))
            sym = draw(st.booleans())
            quant = PerChannel(axis, 3, None if sym else 4)
            hs += [hs[0]._replace(byte_size=4 * (heads, dim)[axis - 1])] * (1 if sym else 2)
        else:
            sym = draw(st.booleans())
            stype = draw(st.sampled_from([1, 2, 3]))
            quant = PerBlockAffine(0, ps, 3, None if sym else 4, stype)
            slots = pages * ps
            hs.append(hs[0]._replace(byte_size=slots * (4 if stype == 3 else 2)))
            if not sym:
                hs.append(hs[0]._replace(byte_size=slots * 4))
    stats = Statistics(0x3F, total, 0.0, -1.0, 1.0, 1.0, 0.0, 0.5) if draw(st.booleans()) \
        else None
    return TensorDescriptor(tag, (total, heads, dim), layout, tuple(hs), quantization=quant,
                            statistics=stats)


def _handles(draw, n: int) -> tuple[BufferHandle, ...]:
    return tuple(BufferHandle(draw(st.integers(0, 1 << 40)), 64) for _ in range(n))


@st.composite
def other_layout(draw) -> TensorDescriptor:
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 1 << 20) | st.just((1 << 64) - 1),
                                min_size=rank, max_size=rank)))
    kind = draw(st.sampled_from(["row", "col", "strided", "tiled", "morton", "coo", "csr",
                                 "csc", "csf", "hilbert", "group", "partition"]))
    tag = draw(st.sampled_from(sorted(ELEMENT_TYPES)))
    ext = None
    if draw(st.integers(0, 9)) == 0:
        tag = draw(st.integers(0xF0, 0xFE))
        ext = ExtensionType(draw(st.sampled_from([1, 2, 4, 8, 16, 12])), 1, 1, 1, 1, 4, 3, 7)
        ext = replace(ext, packing=8 // ext.bit_width if ext.bit_width < 8 else 1)
    layout = {
        "row": RowMajor(), "col": ColMajor(),
        "strided": Strided(tuple(draw(st.lists(st.integers(-(1 << 40), 1 << 40),
                                               min_size=rank, max_size=rank)))),
        "morton": Morton(tuple(draw(st.lists(st.integers(1, 32), min_size=rank,
                                             max_size=rank)))),
        "coo": Coo(draw(u64), draw(st.booleans())), "csr": Csr(draw(u64)), "csc": Csc(draw(u64)),
        "csf": Csf(draw(u64), tuple(draw(st.permutations(range(rank))))),
        "hilbert": Hilbert(draw(st.integers(1, 30)), rank),
        "group": Composite(3, draw(st.integers(0, 0xFFFFFFFE))),
        "partition": Composite(1, draw(st.integers(0, 0xFFFFFFFE))),
        "tiled": Tiled(tuple([2] * rank), 3, 4, outer_strides=tuple(range(rank)),
                       inner_tiled=Tiled(tuple([1] * rank), 1, 3, inner_strides=tuple([1] * rank))),
    }[kind]
    if kind == "hilbert" and rank < 2:
        layout, shape = Hilbert(3, 2), shape + (4,) * (2 - rank)
    if isinstance(layout, Composite):
        return TensorDescriptor(tag, shape, layout, (), extension_type=ext)
    buffers = _handles(draw, draw(st.integers(1, 5)))
    shard = None
    if draw(st.booleans()) and (1 << 64) - 1 not in shape:
        off = tuple(draw(st.integers(0, 100)) for _ in shape)
        shard = Shard(tuple(s + o + draw(st.integers(0, 5)) for s, o in zip(shape, off,
                                                                              strict=True)), off)
    stats = None
    if draw(st.booleans()):
        f = st.floats(allow_nan=True, allow_infinity=True)
        stats = Statistics(draw(st.integers(0, 0x3F)), draw(u64), *(draw(f) for _ in range(6)),
                           *(draw(st.integers(0, 255)) for _ in range(4)))
    minor = draw(st.sampled_from([0, 0, 1, 7]))
    trailing = draw(st.binary(max_size=9)) if minor else b""
    return TensorDescriptor(tag, shape, layout, buffers, byte_offset=draw(
        st.integers(0, buffers[0].byte_size)), shard=shard, statistics=stats,
        extension_type=ext, version_minor=minor, trailing=trailing)


any_descriptor = block_paged() | other_layout()


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(any_descriptor)
def test_round_trip_descriptor_bytes_descriptor(desc):
    data = desc.encode()
    back = decode_descriptor(data)
    assert back == desc
    assert back.encode() == data
    assert peek_length(data) == len(data)
    assert decode_descriptor(data + b"\xff" * 7) == desc  # never reads past descriptor_length


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(any_descriptor, st.data())
def test_fuzzed_descriptors_raise_only_hurray_errors(desc, data):
    raw = bytearray(desc.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "insert", "set_len"]))
        if op == "flip" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            del raw[data.draw(st.integers(0, len(raw))):]
        elif op == "insert":
            i = data.draw(st.integers(0, len(raw)))
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "set_len" and len(raw) >= 10:
            raw[6:10] = data.draw(u32).to_bytes(4, "little")
    for strict in (True, False):
        try:
            back = decode_descriptor(bytes(raw), strict=strict)
        except hk.HurrayError as e:
            assert str(e)
            continue
        assert len(back.encode()) <= len(raw)


def test_decoder_never_allocates_what_a_huge_rank_claims():
    raw = bytearray(WORKED.encode())
    raw[16:20] = (64).to_bytes(4, "little")  # 64 dims of u64 = 512 bytes, only ~100 present
    with pytest.raises(hk.DescriptorError, match=r"shape at byte 20.*truncated"):
        decode_descriptor(bytes(raw))


def test_descriptor_length_larger_than_the_input_is_truncation():
    data = WORKED.encode()
    with pytest.raises(hk.DescriptorError, match=r"descriptor_length at byte 6.*132 bytes"):
        decode_descriptor(data[:-1])


def test_minor_zero_requires_exact_length_and_newer_minor_keeps_trailing_bytes():
    data = bytearray(WORKED.encode() + b"\x00\x00")
    data[6:10] = (len(data)).to_bytes(4, "little")
    with pytest.raises(hk.DescriptorError, match="MUST fill descriptor_length exactly"):
        decode_descriptor(bytes(data))
    data[5] = 1  # version 1.1: a newer minor may append fields we must not interpret
    desc = decode_descriptor(bytes(data))
    assert desc.trailing == b"\x00\x00" and desc.encode() == bytes(data)


def test_version_major_zero_is_rejected():
    raw = bytearray(WORKED.encode())
    raw[4] = 0
    with pytest.raises(hk.DescriptorError, match="version_major at byte 4: found 0"):
        decode_descriptor(bytes(raw))


def test_extension_flag_must_match_the_type_tag():
    raw = bytearray(VALID["worked_example_f16_key_layer3"][1].encode())
    raw[10] = 0x04
    with pytest.raises(hk.DescriptorError, match="HAS_EXTENSION_TYPE"):
        decode_descriptor(bytes(raw))


def test_composite_head_rules():
    head = TensorDescriptor(0x11, (5,), Composite(3, 5))
    assert decode_descriptor(head.encode()) == head
    with pytest.raises(hk.LayoutError, match="member_count"):
        decode_descriptor(replace(head, layout=Composite(3, 0xFFFFFFFF)).encode())
    with pytest.raises(hk.LayoutError, match="combine_op"):
        decode_descriptor(replace(head, layout=Composite(3, 2, combine_op=1)).encode())
    with pytest.raises(hk.BufferError, match="composite head MUST have buffer_count 0"):
        decode_descriptor(replace(head, buffers=(BufferHandle(4),)).encode())
    with pytest.raises(hk.DescriptorError, match="composite head carries no"):
        decode_descriptor(replace(head, composite_member=CompositeMember(1)).encode())


def test_private_layout_is_strict_reject_permissive_accept():
    desc = TensorDescriptor(0x03, (4,), PrivateLayout(0xF3, 0xABCDEF, b"xyz"), (BufferHandle(16),))
    data = desc.encode()
    with pytest.raises(hk.LayoutError, match="extension_layout_id"):
        decode_descriptor(data)
    back = decode_descriptor(data, strict=False)
    assert back == desc and back.relaxed and back.encode() == data


def test_reserved_layout_tags_are_rejected_even_when_permissive():
    raw = bytearray(WORKED.encode())
    for tag in (0x00, 0x0C, 0x3F, 0x41, 0xEF, 0xFF):
        raw[15] = tag
        for strict in (True, False):
            with pytest.raises(hk.LayoutError, match="layout_tag at byte 15"):
                decode_descriptor(bytes(raw), strict=strict)


def test_unknown_type_tag_is_relaxed_only_permissively():
    raw = bytearray(WORKED.encode())
    raw[14] = 0x30  # unassigned Tier 1 tag
    with pytest.raises(hk.ElementTypeError):
        decode_descriptor(bytes(raw))
    desc = decode_descriptor(bytes(raw), strict=False)
    assert desc.relaxed and desc.element_type_name == "unknown_0x30"
    with pytest.raises(hk.PermissiveAccessError, match="data must not be touched"):
        BlockPagedTensor.from_descriptor(desc, WORKED_BUFFERS)


@pytest.mark.parametrize("name", [n for n, v in INVALID.items() if v.permissive_ok])
def test_permissive_mode_relaxes_exactly_what_the_spec_allows(name):
    v = INVALID[name]
    desc = decode_descriptor(v.data, strict=False)
    assert desc.relaxed, "a relaxed rule is recorded"
    assert v.field in desc.relaxed[0]
    with pytest.raises(hk.PermissiveAccessError):
        BlockPagedTensor.from_descriptor(desc, [bytes(h.byte_size) for h in desc.buffers])


@pytest.mark.parametrize("name", [n for n, v in INVALID.items()
                                  if not v.permissive_ok and not v.with_buffers])
def test_permissive_mode_still_rejects_everything_else(name):
    with pytest.raises(INVALID[name].error):
        decode_descriptor(INVALID[name].data, strict=False)


def test_permissive_decode_of_a_valid_descriptor_relaxes_nothing():
    desc = decode_descriptor(WORKED.encode(), strict=False)
    assert desc.relaxed == ()
    BlockPagedTensor.from_descriptor(desc, WORKED_BUFFERS)


def test_unknown_quantization_scheme_is_carried_raw_when_permissive():
    data = INVALID["r24_scheme_unknown"].data
    desc = decode_descriptor(data, strict=False)
    assert isinstance(desc.quantization, RawQuantization)
    assert desc.encode() == data


def test_every_rejection_names_field_offset_value_and_rule():
    for name, v in INVALID.items():
        try:
            if v.with_buffers:
                desc, bufs = split_stream(v.data)
                BlockPagedTensor.from_descriptor(desc, bufs)
            else:
                decode_descriptor(v.data)
        except hk.HurrayError as e:
            assert e.field and e.field.startswith(v.field.split("[")[0]), name
            assert e.offset is not None and e.rule, name
            assert " at " in str(e) and "found" in str(e), name
        else:
            pytest.fail(f"{name} was accepted")


def test_non_bytes_input_is_a_hurray_error():
    with pytest.raises(hk.DescriptorError, match="bytes-like"):
        decode_descriptor(12345)  # type: ignore[arg-type]


def test_encode_reports_out_of_range_fields_as_hurray_errors():
    with pytest.raises(hk.HurrayError):
        replace(WORKED, layout=replace(WORKED.layout, page_size=1 << 32)).encode()
    with pytest.raises(hk.HurrayError):
        replace(WORKED, shape=(-1, 2, 8)).encode()
