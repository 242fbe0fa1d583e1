"""Element types: the tag table, tag classes, buffer sizes and sub-byte packing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hurraykv as hk
from hurraykv.wire.dtypes import (
    BY_NAME,
    ELEMENT_TYPES,
    check_type_tag,
    element_type,
    pack,
    tag_class,
    unpack,
)

SPEC_TABLE = {  # wire-notes Part B §2
    0x01: ("float16", 16), 0x02: ("bfloat16", 16), 0x03: ("float32", 32),
    0x04: ("float64", 64), 0x10: ("int8", 8), 0x11: ("uint8", 8), 0x12: ("int16", 16),
    0x13: ("uint16", 16), 0x14: ("int32", 32), 0x15: ("uint32", 32), 0x16: ("int64", 64),
    0x17: ("uint64", 64), 0x20: ("bool", 1), 0x40: ("float8_e4m3", 8),
    0x41: ("float8_e5m2", 8), 0x42: ("float8_e8m0", 8), 0x43: ("float4_e2m1", 4),
    0x44: ("float6_e2m3", 6), 0x45: ("float6_e3m2", 6), 0x46: ("float128", 128),
    0x48: ("int4", 4), 0x49: ("uint4", 4), 0x4A: ("int2", 2), 0x4B: ("uint2", 2),
    0x50: ("complex64", 64), 0x51: ("complex128", 128),
}


def test_table_is_the_spec_table():
    assert {t: (e.name, e.bits) for t, e in ELEMENT_TYPES.items()} == SPEC_TABLE


def test_numpy_types_for_fp8_and_bf16_are_the_ocp_ones():
    assert BY_NAME["float8_e4m3"].numpy == np.dtype(ml_dtypes.float8_e4m3fn)
    assert BY_NAME["float8_e5m2"].numpy == np.dtype(ml_dtypes.float8_e5m2)
    assert BY_NAME["bfloat16"].numpy == np.dtype(ml_dtypes.bfloat16)
    assert element_type(np.float16).tag == 0x01
    assert element_type(ml_dtypes.float8_e4m3fn).tag == 0x40


@pytest.mark.parametrize("tag", range(256))
def test_every_tag_is_classified_and_rejected_as_the_spec_says(tag):
    cls = tag_class(tag)
    if tag in SPEC_TABLE:
        assert cls == "known"
    elif tag in (0x00, 0xFF):
        assert cls == "invalid"
    elif tag == 0x47 or 0x80 <= tag <= 0xEF:
        assert cls == "reserved"
    elif 0xF0 <= tag <= 0xFE:
        assert cls == "extension"
    else:
        assert cls == "unknown"
    if cls in ("invalid", "reserved", "unknown"):
        with pytest.raises(hk.ElementTypeError, match="type_tag at byte 14"):
            check_type_tag(tag, 14)
    if cls == "unknown":
        check_type_tag(tag, 14, strict=False)  # a permissive reader may carry it
    if cls in ("invalid", "reserved"):
        with pytest.raises(hk.ElementTypeError):
            check_type_tag(tag, 14, strict=False)


@pytest.mark.parametrize(("name", "count", "nbytes"), [
    ("float16", 320, 640), ("int8", 5, 5), ("bool", 10, 2), ("int4", 3, 2), ("uint4", 4, 2),
    ("int2", 5, 2), ("float6_e2m3", 5, 6), ("float6_e3m2", 4, 3), ("float128", 2, 32),
    ("complex64", 3, 24), ("int4", 0, 0),
])
def test_buffer_size_formula(name, count, nbytes):
    assert BY_NAME[name].nbytes(count) == nbytes


def test_bit_order_examples_from_the_spec():
    assert pack(np.array([5, 12, 3]), "uint4") == bytes([0xC5, 0x03])
    # element 4k+j sits in bits [2j+1:2j]
    assert pack(np.array([1, 2, 3, 0, 2]), "uint2") == bytes([0b00111001, 0b10])
    assert pack(np.array([1, 0, 0, 0, 0, 0, 0, 0, 1, 1], bool), "bool") == bytes([0x01, 0x03])
    assert pack(np.array([-1, -8]), "int4") == bytes([0x8F])


@pytest.mark.parametrize("name", ["int4", "uint4", "int2", "uint2", "bool", "float4_e2m1",
                                  "float6_e2m3", "float6_e3m2"])
@given(data=st.data())
def test_pack_unpack_round_trip(name, data):
    et = BY_NAME[name]
    n = data.draw(st.integers(0, 67))
    codes = np.array(data.draw(st.lists(st.integers(0, (1 << et.bits) - 1), min_size=n,
                                        max_size=n)), dtype=np.uint8)
    if name == "bool":
        values = codes.astype(bool)
    elif et.is_float:
        values = codes.view(et.numpy)
    elif et.is_signed:
        values = (codes.astype(np.int16) - ((codes >= (1 << (et.bits - 1))) << et.bits)).astype(
            np.int8)
    else:
        values = codes
    raw = pack(values, et)
    assert len(raw) == et.nbytes(n)
    back = unpack(raw, et, n)
    assert back.view(np.uint8).tobytes() == values.view(np.uint8).tobytes()
    if n and et.bits in (1, 2, 4) and (n * et.bits) % 8:
        used = (n * et.bits) % 8
        assert raw[-1] >> used == 0  # unused high bits are zero


def test_pack_rejects_values_outside_the_storage_range():
    with pytest.raises(hk.ElementTypeError, match=r"int4 value at index 2: found 8"):
        pack(np.array([0, 7, 8]), "int4")
    with pytest.raises(hk.ElementTypeError, match=r"uint2 value at index 0: found -1"):
        pack(np.array([-1]), "uint2")


def test_unpack_refuses_short_data():
    with pytest.raises(hk.ElementTypeError, match="need 2 bytes"):
        unpack(b"\x00", "int4", 3)


def test_unknown_names_say_what_exists():
    with pytest.raises(hk.ElementTypeError, match="known names"):
        element_type("float7")
