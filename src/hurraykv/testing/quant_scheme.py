"""The contract every quantization scheme keeps (a ``QuantScheme`` class registered with
``hurraykv.wire.quant_registry``: the package's five, or one a distribution declares in
the entry point group ``hurraykv.quant_schemes``), as one pytest test class that each
scheme's test class inherits.  A scheme gets every test below by subclassing
``QuantSchemeTests`` and giving, as class attributes,

* ``SCHEME``: the scheme class, registered when the tests run (its distribution
  installed, or a fixture of the test class registering it and unregistering after),
* ``GOLDEN``: sections of the scheme and their exact bytes, the 4-byte header included,
  as hex (spaces ignored): each flag the scheme defines set in one of them and clear in
  another, and
* ``MALFORMED`` (optional): section bytes (hex) the scheme's own rules refuse, each
  with the field its refusal names (``"q.block_size"``)::

    from hurraykv.testing import QuantSchemeTests
    from hurraykv.wire.quant_schemes import PerTensor

    class TestPerTensor(QuantSchemeTests):
        SCHEME = PerTensor  # registered: the package's, or an installed plugin's
        GOLDEN = ((PerTensor(0.125, -3), "01010000 0000003e fdffffff 00000000"),)
        MALFORMED = (("01010000 00000000 00000000 00000000", "q.scale"),)

Sections are decoded as a descriptor's are (``decode_quantization``, behind a ``u32
quantization_length``).  The golden bytes round-trip both ways, padding kept; a
truncated section, an unknown flag, another ``scheme_version``, a short
``quantization_length`` and every ``MALFORMED`` entry are refused with a ``HurrayError``
whose message names the field, its byte, the value and the rule (never another
exception); a byte string the scheme accepts is the one it writes back (a reserved byte
is refused, not dropped); another class taking its tag or name is refused.  An affine
scheme (``AFFINE``: ``hurraykv.quant`` computes it) quantizes real data, and what
hurraykv decodes is ``scale * (q - zero_point)`` computed here from the stored codes and
parameter bytes by the spec (``expected_values``, which a scheme documenting another
formula overrides), within half a scale of the data; hurraykv computes no values for
any other scheme."""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.errors import HurrayError
from hurraykv.wire.cursor import Cursor
from hurraykv.wire.descriptor import decode_descriptor
from hurraykv.wire.dtypes import BY_NAME, unpack
from hurraykv.wire.quant_registry import (
    INT_STORAGE,
    SCALE_TYPE_NAMES,
    QuantScheme,
    register,
    scheme_by_name,
    scheme_class,
    unregister,
)
from hurraykv.wire.quantization import decode_quantization

# "field at byte N: found V; rule" (HurrayError.at): what every refusal says
HOUSE_FORM = re.compile(r"(?P<field>\S+) at byte (?P<offset>-?\d+): found (?P<value>.+?); "
                        r"(?P<rule>.+)", re.S)


def section_bytes(hex_text: str) -> bytes:
    return bytes.fromhex(hex_text.replace(" ", ""))


def decode_section(data: bytes, length: int | None = None) -> QuantScheme:
    """``data`` decoded as a descriptor's quantization section: after its ``u32
    quantization_length`` (``length``, by default ``len(data)``), so the section starts at
    byte 4 and the length field is byte 0."""
    n = len(data) if length is None else length
    raw = struct.pack("<I", n) + data
    return decode_quantization(Cursor(memoryview(raw), 4, len(raw)), n)


def refusal(data: bytes, length: int | None = None) -> HurrayError:
    """The ``HurrayError`` refusing ``data``, checked to say the field, its byte, the
    value found and the rule; a test failure when it decodes or raises anything else."""
    try:
        q = decode_section(data, length)
    except HurrayError as e:
        said = HOUSE_FORM.fullmatch(str(e))
        assert said is not None and e.field and e.rule and e.offset is not None, (
            f"{data.hex()}: refused as {type(e).__name__}({str(e)!r}), which does not say "
            "'FIELD at byte N: found VALUE; RULE'")
        assert said["field"] == e.field and int(said["offset"]) == e.offset, str(e)
        assert 0 <= e.offset <= 4 + len(data), f"{e}: byte {e.offset} is outside the section"
        return e
    except Exception as e:  # a struct.error, an IndexError...: a decoder that trusted its input
        pytest.fail(f"{data.hex()} (quantization_length {length}): {type(e).__name__}: {e}; "
                    "a refusal is a HurrayError naming the field")
    pytest.fail(f"{data.hex()} (quantization_length {length}) decoded to {q!r}: it should "
                "be refused")


def cuts(n: int) -> list[int]:
    """Lengths to truncate an ``n``-byte section to: all of them."""
    return list(range(n))


def pool(pages: int = 5, size: int = 4, heads: int = 2, dim: int = 16) -> hk.BlockPagedTensor:
    """A float32 pool of real-looking data: an outlier channel, a zero slot, a page no
    sequence reads, a page shared by two sequences and a partly filled last page."""
    rng = np.random.default_rng(7)
    values = (rng.standard_normal((pages, size, heads, dim)) * 4).astype(np.float32)
    values[..., 3] *= 25
    values[1, 2] = 0
    table = [2, 0, 2, 4, 1]  # page 3 unread, page 2 shared
    return hk.BlockPagedTensor(values, table, [0, 2, 5], [7, 10])


class QuantSchemeTests:
    """Every test a quantization scheme passes; inherit it and give ``SCHEME``, ``GOLDEN``
    and, where the scheme refuses values of its own fields, ``MALFORMED`` (the module
    docstring says how)."""

    SCHEME: ClassVar[type[QuantScheme]]
    GOLDEN: ClassVar[Sequence[tuple[QuantScheme, str]]] = ()
    MALFORMED: ClassVar[Sequence[tuple[str, str]]] = ()

    def golden(self) -> list[tuple[QuantScheme, bytes]]:
        """``GOLDEN``'s sections and their bytes (at least one)."""
        assert self.GOLDEN, f"{type(self).__name__}.GOLDEN names no section of the scheme"
        return [(q, section_bytes(h)) for q, h in self.GOLDEN]

    # ------------------------------------------------------------------ the registry
    def test_it_is_registered_under_its_tag_and_name(self):
        cls = self.SCHEME
        assert scheme_class(cls.TAG) is cls, (
            f"tag 0x{cls.TAG:02x} is {scheme_class(cls.TAG)!r} in the registry, not {cls!r}")
        assert scheme_by_name(cls.NAME) is cls
        assert 0x01 <= cls.TAG <= 0x5F or 0xF0 <= cls.TAG <= 0xFE

    def _refused_registration(self, clash: type[QuantScheme]) -> HurrayError:
        try:
            register(clash)
        except HurrayError as e:
            return e
        except Exception as e:
            pytest.fail(f"registering {clash.__qualname__} raised {type(e).__name__}: {e}; "
                        "a refusal is a HurrayError naming the field")
        finally:
            unregister(clash)  # only if it got in: the registry stays as it was
        pytest.fail(f"{clash.__qualname__} (0x{clash.TAG:02x}, {clash.NAME!r}) was "
                    f"registered beside {self.SCHEME.__qualname__}")

    def test_another_scheme_taking_its_tag_is_refused_naming_the_tag(self):
        cls = self.SCHEME
        clash = type("TagClash", (cls,), {"NAME": f"{cls.NAME}_tag_clash"})
        e = self._refused_registration(clash)
        assert (e.field, e.value) == ("TAG", cls.TAG), str(e)
        assert f"0x{cls.TAG:02x}" in str(e) and cls.__qualname__ in str(e), str(e)
        assert scheme_class(cls.TAG) is cls and scheme_by_name(clash.NAME) is None

    def test_another_scheme_taking_its_name_is_refused_naming_the_name(self):
        cls = self.SCHEME
        free = next(t for t in range(0xFE, 0xEF, -1) if scheme_class(t) is None)
        clash = type("NameClash", (cls,), {"TAG": free})
        e = self._refused_registration(clash)
        assert (e.field, e.value) == ("NAME", cls.NAME), str(e)
        assert repr(cls.NAME) in str(e) and cls.__qualname__ in str(e), str(e)
        assert scheme_by_name(cls.NAME) is cls and scheme_class(free) is None

    # ------------------------------------------------------------------ golden bytes
    def test_golden_sections_round_trip_byte_for_byte(self):
        cls = self.SCHEME
        flags = set()
        for q, data in self.golden():
            assert type(q) is cls
            assert q.encode() == data, f"{q!r} writes {q.encode().hex()}, not {data.hex()}"
            assert len(data) == cls.LENGTH
            tag, version, flag_bits = struct.unpack_from("<BBH", data)
            assert (tag, version, flag_bits) == (cls.TAG, 1, q.flags)
            back = decode_section(data)
            assert type(back) is cls and back == q, f"{data.hex()} reads as {back!r}, not {q!r}"
            assert back.encode() == data  # the bytes are stable: encode(decode(b)) == b
            flags.add(flag_bits)
        for bit in range(16):  # each flag the scheme defines, both ways
            if cls.FLAGS & 1 << bit:
                assert {f & 1 << bit for f in flags} == {0, 1 << bit}, (
                    f"GOLDEN holds no section with flag bit {bit} both set and clear")

    def test_padding_after_the_section_comes_back_verbatim(self):
        for q, data in self.golden():
            for pad in (b"\x00", b"\x07\x00\xff"):
                back = decode_section(data + pad)
                assert back == replace(q, padding=pad), f"{(data + pad).hex()}: {back!r}"
                assert back.encode() == data + pad

    # ------------------------------------------------------------------ refusals
    def test_a_truncated_section_is_refused_naming_the_field(self):
        for _, data in self.golden():
            for n in cuts(len(data)):
                # the length field says it: shorter than the scheme's fixed part
                e = refusal(data[:n], n)
                assert n >= 4 or e.field == "quantization_length", str(e)
                # the length field says all of it, the bytes run out: read field by field
                refusal(data[:n], len(data))

    def test_a_short_quantization_length_is_refused_naming_it(self):
        for _, data in self.golden():
            e = refusal(data[:self.SCHEME.LENGTH - 1])
            assert (e.field, e.offset, e.value) == (
                "quantization_length", 0, self.SCHEME.LENGTH - 1), str(e)
            assert str(self.SCHEME.LENGTH) in e.rule

    def test_an_unknown_flag_is_refused_naming_q_flags(self):
        unknown = [1 << b for b in range(16) if not self.SCHEME.FLAGS & 1 << b]
        for _, data in self.golden():
            for bit in unknown:
                (flags,) = struct.unpack_from("<H", data, 2)
                e = refusal(data[:2] + struct.pack("<H", flags | bit) + data[4:])
                assert (e.field, e.offset, e.value) == ("q.flags", 6, flags | bit), str(e)

    def test_another_scheme_version_is_refused_naming_it(self):
        for _, data in self.golden():
            for version in (0, 2, 0xFF):
                e = refusal(data[:1] + bytes([version]) + data[2:])
                assert (e.field, e.offset, e.value) == ("q.scheme_version", 5, version), str(e)

    def test_the_malformed_sections_are_refused_naming_their_field(self):
        if not self.MALFORMED:
            pytest.skip(f"{type(self).__name__}.MALFORMED lists no section")
        for hex_text, field in self.MALFORMED:
            e = refusal(section_bytes(hex_text))
            assert e.field == field, f"{hex_text}: {e} (the field named is not {field!r})"

    def test_a_section_it_accepts_is_the_one_it_writes(self):
        """Every byte of each golden section changed: the scheme refuses it (a
        ``HurrayError`` saying why) or reads what it writes back, byte for byte, so a
        reserved byte or a field the decoder drops cannot pass unseen."""
        for _, data in self.golden():
            for i in range(len(data)):
                for bits in (0x01, 0x80, 0xFF):
                    changed = bytearray(data)
                    changed[i] ^= bits
                    try:
                        back = decode_section(bytes(changed))
                    except HurrayError:
                        refusal(bytes(changed))  # and the refusal says the house form
                        continue
                    except Exception as e:
                        pytest.fail(f"{changed.hex()} (byte {i} ^ 0x{bits:02x}): "
                                    f"{type(e).__name__}: {e}; a refusal is a HurrayError")
                    assert back.encode() == bytes(changed), (
                        f"byte {i} ^ 0x{bits:02x}: {changed.hex()} is read as {back!r}, which "
                        f"writes {back.encode().hex()}")

    # ------------------------------------------------------------------ values
    def quantize_arguments(self) -> list[dict[str, Any]]:
        """``BlockPagedTensor.quantize`` keywords to try: each integer storage type the
        scheme takes, symmetric (signed types) and not, each scale type, each axis."""
        cls = self.SCHEME
        axes = {"channel": (1, 2)}.get(cls.GRANULARITY, (None,))
        out = []
        for dtype in (s for s in INT_STORAGE if s in cls.STORAGE):
            signed = BY_NAME[dtype].is_signed
            for symmetric in ((True, False) if signed else (False,)):
                for scale_type in cls.SCALE_TYPES:
                    for axis in axes:
                        out.append({"dtype": dtype, "symmetric": symmetric, "axis": axis,
                                    "scale_dtype": SCALE_TYPE_NAMES[scale_type]})
        return out

    def expected_values(self, t: hk.BlockPagedTensor) -> tuple[np.ndarray, np.ndarray]:
        """The spec's values of a quantized pool, ``[num_pages, page_size, H, D]``
        float32, and the scale of each (broadcast): ``x = scale * (q - zero_point)``, with
        one scale per tensor (in the section), per channel along ``axis`` or per page slot
        (D4), of the section's ``scale_type``, read from the stored bytes (nothing of
        hurraykv's dequantizing involved)."""
        q, et = t.quantization, t.element_type
        n = t.num_pages * t.page_size * t.num_heads * t.head_dim
        codes = (unpack(t.pool_rows, et, n) if et.sub_byte else t.pool_rows).reshape(
            t.num_pages * t.page_size, t.num_heads, t.head_dim).astype(np.float64)
        if q.GRANULARITY == "tensor":
            scale, zero = np.float64(np.float32(q.scale)), np.float64(q.zero_point)
            scales = np.full(codes.shape, scale)
        else:
            count = t.num_pages * t.page_size if q.GRANULARITY == "slot" else \
                q.param_count(t.shape)
            stype = BY_NAME[SCALE_TYPE_NAMES[getattr(q, "scale_type", 0x03)]]
            raw = t.quant_params[q.scale_buffer - 3]
            scale = np.frombuffer(raw, stype.numpy, count).astype(np.float64)
            if q.zero_point_buffer is None:
                zero = np.zeros(count)
            else:
                skip = count * stype.itemsize if q.zero_point_buffer == q.scale_buffer else 0
                zero = np.frombuffer(t.quant_params[q.zero_point_buffer - 3], "<i4", count,
                                     skip).astype(np.float64)
            shape = [-1, 1, 1] if q.GRANULARITY == "slot" else [1, 1, 1]
            if q.GRANULARITY == "channel":
                shape[q.axis] = -1
            scale, zero = scale.reshape(shape), zero.reshape(shape)
            scales = np.broadcast_to(scale, codes.shape)
        values = ((codes - zero) * scale).astype(np.float32)
        return values.reshape(t.page_pool.shape), scales.reshape(t.page_pool.shape)

    def test_decoded_values_are_the_spec_formula_of_the_stored_bytes(self):
        """Real data quantized with the scheme, its descriptor encoded and decoded again:
        the values hurraykv decodes are the spec's, within half a scale of the data; a
        scheme hurraykv has no formula for gets no values at all."""
        cls = self.SCHEME
        source = pool()
        if not cls.AFFINE:
            with pytest.raises(HurrayError) as e:
                source.quantize(cls.NAME, cls.STORAGE[0])
            assert e.value.field == "scheme", str(e.value)
            return
        used = source.used_slots().reshape(source.page_pool.shape[:2])
        for kw in self.quantize_arguments():
            t = source.quantize(cls.NAME, **kw)
            assert type(t.quantization) is cls, kw
            desc = decode_descriptor(t.descriptor().encode())
            assert desc.quantization == t.quantization, kw
            back = hk.BlockPagedTensor.from_descriptor(
                desc, [bytes(b) for b in t.buffers()], seq_lens=t.seq_lens)
            want, scales = self.expected_values(back)
            got = back.decode_pages(0, back.num_pages)
            assert np.array_equal(got.reshape(want.shape), want), (
                f"{kw}: decoded values differ from the formula at "
                f"{np.argwhere(got.reshape(want.shape) != want)[:3].tolist()}")
            assert np.array_equal(back.dequantize().page_pool, want), kw
            err = np.abs(want - source.page_pool)[used]
            bound = (scales[used] / 2) * (1 + 1e-6) + 1e-30
            assert (err <= bound).all(), (
                f"{kw}: decoded values are up to {(err / bound).max():.3g} half-scales from "
                "the data they quantize")


__all__ = ["QuantSchemeTests", "decode_section", "refusal", "section_bytes"]
