"""One class per quantization scheme (issue 21): golden bytes of every assigned scheme,
the tables as views of the registry, and a toy scheme defined here that the codec, the
validation, the block-paged rules, the store and the report pick up with no other edit
(the recipe in docs/architecture.md ("Extending hurraykv"))."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from hurraykv import quant
from hurraykv.cli.report import member_row
from hurraykv.errors import QuantizationError
from hurraykv.paged import BlockPagedTensor
from hurraykv.store.members import Member
from hurraykv.wire import block_paged
from hurraykv.wire.annotate import quantization_fields
from hurraykv.wire.cursor import Cursor
from hurraykv.wire.descriptor import decode_descriptor
from hurraykv.wire.dtypes import BY_NAME
from hurraykv.wire.quant_registry import BUILTIN, SchemeRegistrationError
from hurraykv.wire.quantization import (
    MXFP,
    NF4,
    SCALE_TYPES,
    SCHEME_NAMES,
    VALID_STORAGE,
    VALID_STORAGE_TAGS,
    PerBlockAffine,
    PerChannel,
    PerTensor,
    QuantScheme,
    RawQuantization,
    check_param_sizes,
    decode_quantization,
    register,
    scheme_by_name,
    scheme_class,
    scheme_name,
    schemes,
    unregister,
)
from tests.vectors.make_vectors import QUANT, handles

# Exact section bytes (header included), as the encoder wrote them before the schemes
# became registered classes; each must decode back to the same object.
GOLDEN = [
    (PerTensor(0.125, -3), "010100000000003efdffffff00000000"),
    (PerTensor(1.0), "010100000000803f0000000000000000"),
    (PerChannel(2, 3, 4), "0201000002000000030000000400000003000000"),
    (PerChannel(1, 3), "020101000100000003000000ffffffff03000000"),
    (PerBlockAffine(0, 16, 3, 4, 1), "030100000000000010000000030000000400000001000000"),
    (PerBlockAffine(0, 4, 3, None, 3), "03010100000000000400000003000000ffffffff03000000"),
    (PerBlockAffine(0, 8, 3, 3, 2), "030100000000000008000000030000000300000002000000"),
    (NF4(1, 64, 3), "04010000010000004000000003000000"),
    (MXFP(2, 32, 3), "05010000020000002000000003000000"),
]


def _decode(data: bytes, *, strict: bool = True) -> QuantScheme:
    cur = Cursor(memoryview(data), 0, len(data), strict=strict)
    return decode_quantization(cur, len(data))


@pytest.mark.parametrize(("q", "hex_bytes"), GOLDEN, ids=lambda v: getattr(v, "NAME", None))
def test_each_scheme_encodes_to_its_golden_bytes(q, hex_bytes):
    data = bytes.fromhex(hex_bytes)
    assert q.encode() == data
    assert len(data) == q.LENGTH
    assert _decode(data) == q
    padded = type(q)(**{**q.__dict__, "padding": b"\x00\x07"})
    assert padded.encode() == data + b"\x00\x07"
    assert _decode(data + b"\x00\x07") == padded


def test_every_table_is_a_view_of_the_registry():
    classes = schemes()  # the spec's five, and any a plugin installed here registers
    spec = [c for c in classes if c.__module__ == BUILTIN]
    assert [c.TAG for c in spec] == [1, 2, 3, 4, 5]
    assert dict(SCHEME_NAMES) == {c.TAG: c.NAME for c in classes}
    assert dict(VALID_STORAGE) == {c.TAG: c.STORAGE for c in classes}
    assert dict(VALID_STORAGE_TAGS) == {
        c.TAG: frozenset(BY_NAME[n].tag for n in c.STORAGE) for c in classes}
    assert dict(quant.SCHEMES) == {c.NAME: c.TAG for c in classes if c.AFFINE}
    assert {c.NAME: c.TAG for c in spec if c.AFFINE} == {
        "per_tensor": 1, "per_channel": 2, "per_block_affine": 3}
    assert dict(block_paged.SCALE_WIDTH) == {t: BY_NAME[n].itemsize
                                             for t, n in SCALE_TYPES.items()}
    assert all(scheme_class(c.TAG) is c and scheme_by_name(c.NAME) is c for c in classes)
    # the properties that replaced the isinstance checks
    assert [PerTensor(1.0).per_slot, PerChannel(1, 3).per_slot,
            PerBlockAffine(0, 4, 3).per_slot, NF4(1, 64, 3).per_slot] == [
        False, False, True, False]
    assert [PerBlockAffine(0, 4, 3, None, t).scale_width for t in (1, 2, 3)] == [2, 2, 4]
    assert (PerChannel(1, 3).scale_width, NF4(1, 64, 3).scale_width,
            MXFP(1, 64, 3).scale_width) == (4, 4, 1)
    assert not RawQuantization(0x20, b"\x20\x01\x00\x00").per_slot


def test_a_scheme_tag_must_be_assignable_and_free():
    for tag in (0x00, 0x60, 0xEF, 0xFF, 0x03):
        cls = type("Bad", (Toy,), {"TAG": tag, "NAME": f"bad_{tag}"})
        with pytest.raises(ValueError):
            register(cls)
    with pytest.raises(ValueError, match=r"takes the name 'per_tensor' of .*PerTensor") as e:
        register(type("Bad", (Toy,), {"NAME": "per_tensor"}))
    # a HurrayError naming the field (and still the ValueError it was)
    assert isinstance(e.value, SchemeRegistrationError)
    assert isinstance(e.value, QuantizationError)
    assert (e.value.field, e.value.value) == ("NAME", "per_tensor")
    with pytest.raises(SchemeRegistrationError, match=r"takes the tag 0x03 of .*PerBlock") as e:
        register(type("Bad", (Toy,), {"TAG": 0x03}))
    assert (e.value.field, e.value.value) == ("TAG", 0x03)
    with pytest.raises(ValueError, match=r"0x60 is invalid or reserved; a scheme takes "
                                         r"0x01-0x5F .* or 0xF0-0xFE") as e:
        register(type("Bad", (Toy,), {"TAG": 0x60, "NAME": "bad_0x60"}))
    assert (e.value.field, e.value.value) == ("TAG", 0x60)
    with pytest.raises(TypeError, match="defines no decode_body or encode_body"):
        register(type("NoCodec", (QuantScheme,), {"TAG": 0x5D, "NAME": "no_codec"}))


# --------------------------------------------------------------------- the toy scheme
@dataclass(frozen=True)
class Toy(QuantScheme):
    """A per-slot float32 scale on int8 storage, at tag 0x5E (unassigned): the whole of
    what a new scheme needs, in one class."""

    scale_buffer: int
    reserved_zero: int = 0
    padding: bytes = b""
    TAG: ClassVar[int] = 0x5E
    NAME: ClassVar[str] = "toy_slot_scale"
    LENGTH: ClassVar[int] = 12
    STORAGE: ClassVar[tuple[str, ...]] = ("int8",)
    GRANULARITY: ClassVar[str | None] = "slot"
    BLOCK_PAGED: ClassVar[bool] = True

    @classmethod
    def decode_body(cls, cur, start, flags):
        sbuf = cur.u32("q.scale_buffer_index")
        cur.zeros(4, "q._reserved", QuantizationError)
        if sbuf == 0xFFFFFFFF:
            raise QuantizationError.at("q.scale_buffer_index", start + 4, sbuf,
                                       "a scale buffer index is required")
        return cls(sbuf)

    def encode_body(self):
        return struct.pack("<I4x", self.scale_buffer)

    @property
    def buffers(self):
        return (self.scale_buffer,)

    def check_in_context(self, desc, cur, *, paged):
        super().check_in_context(desc, cur, paged=paged)  # STORAGE
        if not paged:
            check_param_sizes(self, desc.buffers, int(np.prod(desc.shape)), 4, cur)


TOY_BYTES = bytes.fromhex("5e010000" "03000000" "00000000")
# QUANT's pool (5 pages of 4 slots, int8) with the toy's 80-byte scale buffer at 3
TOY_DESC = QUANT.__class__(**{**QUANT.__dict__, "quantization": Toy(3)})


@pytest.fixture
def toy():
    register(Toy)
    yield Toy
    unregister(Toy)
    assert scheme_class(0x5E) is None


def test_unregistered_the_toy_tag_is_an_unknown_scheme():
    with pytest.raises(QuantizationError, match="unknown quantization scheme"):
        _decode(TOY_BYTES)
    assert _decode(TOY_BYTES, strict=False) == RawQuantization(0x5E, TOY_BYTES)
    assert scheme_name(0x5E) == "0x5e"


def test_registered_the_toy_is_in_every_table_and_the_codec(toy):
    assert SCHEME_NAMES[0x5E] == "toy_slot_scale" == scheme_name(0x5E)
    assert VALID_STORAGE[0x5E] == ("int8",)
    assert VALID_STORAGE_TAGS[0x5E] == {BY_NAME["int8"].tag}
    assert "toy_slot_scale" not in quant.SCHEMES  # not AFFINE: quant.py does not compute it
    assert Toy(3).encode() == TOY_BYTES and _decode(TOY_BYTES) == Toy(3)
    assert _decode(TOY_BYTES + b"\x01") == Toy(3, padding=b"\x01")
    with pytest.raises(QuantizationError, match="reserved toy_slot_scale flag bits"):
        _decode(b"\x5e\x01\x01\x00" + TOY_BYTES[4:])
    with pytest.raises(QuantizationError, match="toy_slot_scale needs 12 bytes"):
        _decode(TOY_BYTES[:8])
    with pytest.raises(QuantizationError, match="scale buffer index is required"):
        _decode(TOY_BYTES[:4] + b"\xff" * 4 + bytes(4))
    data = TOY_DESC.encode()
    assert data.find(TOY_BYTES) > 0
    assert decode_descriptor(data) == TOY_DESC


def test_registered_the_toy_is_validated_on_block_paged(toy):
    # per-slot: 5 pages * 4 slots * 4-byte scales, checked by the block-paged rules
    short = TOY_DESC.__class__(**{**TOY_DESC.__dict__, "buffers": handles(320, 12, 12, 40)})
    with pytest.raises(QuantizationError, match="toy_slot_scale scales take exactly 80 bytes"):
        decode_descriptor(short.encode())
    wrong = TOY_DESC.__class__(**{**TOY_DESC.__dict__, "type_tag": BY_NAME["uint8"].tag})
    with pytest.raises(QuantizationError, match="toy_slot_scale storage MUST be one of int8"):
        decode_descriptor(wrong.encode())
    no_paged = type("ToyUnpaged", (Toy,), {"BLOCK_PAGED": False})
    unregister(Toy)
    register(no_paged)
    try:
        with pytest.raises(QuantizationError, match="no composition rule with block-paged"):
            decode_descriptor(TOY_DESC.encode())
    finally:
        unregister(no_paged)
        register(Toy)


def test_registered_the_toy_reaches_the_pool_the_store_and_the_report(toy):
    bufs = [np.zeros(320, np.int8), np.array([0, 1, 0], "<u4"), np.array([0, 2, 3], "<u4"),
            np.full(20, 2.0, "<f4")]
    t = BlockPagedTensor.from_descriptor(decode_descriptor(TOY_DESC.encode()), bufs,
                                         seq_lens=[5, 4])
    assert t.quantization == Toy(3)
    # per-slot parameters travel with their page: 64 pool bytes + 4 scales of 4 bytes
    assert Member(t, zero_unused=False).per_slot
    assert Member(t, zero_unused=False).rows.shape == (5, 80)
    row = member_row("layer3.key", t.descriptor(), t)
    assert row["quantization"] == quantization_fields(t.descriptor())
    assert row["quantization"]["scheme"] == "toy_slot_scale"
    assert row["quantization"]["scheme_tag"] == 0x5E
    assert row["compact_saves"] == 3 * 80  # 3 unreferenced pages, scales included
    kept = t.compact()
    assert kept.num_pages == 2 and len(kept.quant_params[0]) == 2 * 4 * 4
    # zeroing unused slots resets their per-slot scales to 1.0, as for per-block-affine
    c = t.copy()
    assert c.zero_unused_slots() == 15
    assert c.quant_params[0].view("<f4").tolist() == [2] * 5 + [1] * 15
    with pytest.raises(QuantizationError, match="hurraykv dequantizes per-tensor"):
        t.dequantize()  # not AFFINE: hurraykv.quant has no formula for it
