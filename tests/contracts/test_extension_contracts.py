"""The contracts of ``hurraykv.testing`` run as a third party runs them (issue 48 item 4):
``QuantSchemeTests`` on the scheme from outside the package
(``tests/support/plugins/quant_scheme``, loaded through its entry point) and on each of
the spec's five; ``ServerOperationTests`` on the operation from outside the package
(``tests/support/plugins/server_ops``: ``acme.shout``) and on the package's own
``hurraykv.share`` (a server on a Unix socket).  Then the proof that each suite can fail:
deliberately broken schemes and operations, each suite run on them by pytest in a new
interpreter, fail exactly the tests that catch their fault and pass the others.
"""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar
from xml.etree import ElementTree

import pytest

import hurraykv as hk
from hurraykv.errors import QuantizationError
from hurraykv.net import extensions, handover
from hurraykv.net.extensions import Operation
from hurraykv.net.messages import ProtocolError, payload_reader
from hurraykv.testing import QuantSchemeTests, ServerOperationTests, segment
from hurraykv.testing.server_operation import Check
from hurraykv.wire.quant_registry import ENTRY_POINTS, register, unregister
from hurraykv.wire.quant_schemes import MXFP, NF4, PerBlockAffine, PerChannel, PerTensor
from tests.support.paths import ROOT, TESTS

PLUGINS = TESTS / "support" / "plugins"


# ------------------------------------------------------------------ the spec's schemes
class TestPerTensor(QuantSchemeTests):
    SCHEME = PerTensor
    GOLDEN = ((PerTensor(0.125, -3), "01010000 0000003e fdffffff 00000000"),
              (PerTensor(1.0), "01010000 0000803f 00000000 00000000"))
    MALFORMED = (("01010000 00000000 00000000 00000000", "q.scale"),  # zero
                 ("01010000 0000c07f 00000000 00000000", "q.scale"),  # NaN
                 ("01010000 0000803f 00000000 00000100", "q._reserved[2]"))


class TestPerChannel(QuantSchemeTests):
    SCHEME = PerChannel
    GOLDEN = ((PerChannel(2, 3, 4), "02010000 02000000 03000000 04000000 03000000"),
              (PerChannel(1, 3), "02010100 01000000 03000000 ffffffff 03000000"))
    MALFORMED = (("02010000 02000000 03000000 ffffffff 03000000",  # SYMMETRIC clear
                  "q.zero_point_buffer_index"),
                 ("02010100 02000000 03000000 04000000 03000000",  # SYMMETRIC set
                  "q.zero_point_buffer_index"),
                 ("02010100 02000000 ffffffff ffffffff 03000000", "q.scale_buffer_index"),
                 ("02010100 02000000 03000000 ffffffff 01000000", "q.scale_type"),
                 ("02010100 02000000 03000000 ffffffff 03000100", "q._reserved[1]"))


class TestPerBlockAffine(QuantSchemeTests):
    SCHEME = PerBlockAffine
    GOLDEN = ((PerBlockAffine(0, 16, 3, 4, 1),
               "03010000 00000000 10000000 03000000 04000000 01000000"),
              (PerBlockAffine(0, 4, 3, None, 3),
               "03010100 00000000 04000000 03000000 ffffffff 03000000"),
              (PerBlockAffine(0, 8, 3, 3, 2),
               "03010000 00000000 08000000 03000000 03000000 02000000"))
    MALFORMED = (("03010100 00000000 03000000 03000000 ffffffff 03000000", "q.block_size"),
                 ("03010100 00000000 01000000 03000000 ffffffff 03000000", "q.block_size"),
                 ("03010100 00000000 04000000 03000000 ffffffff 04000000", "q.scale_type"),
                 ("03010100 00000000 04000000 03000000 04000000 03000000",
                  "q.zero_point_buffer_index"),
                 ("03010100 00000000 04000000 03000000 ffffffff 03000001", "q._reserved[2]"))


class TestNF4(QuantSchemeTests):
    SCHEME = NF4
    GOLDEN = ((NF4(1, 64, 3), "04010000 01000000 40000000 03000000"),)
    MALFORMED = (("04010000 01000000 30000000 03000000", "q.block_size"),
                 ("04010000 01000000 00000000 03000000", "q.block_size"))


class TestMXFP(QuantSchemeTests):
    SCHEME = MXFP
    GOLDEN = ((MXFP(2, 32, 3), "05010000 02000000 20000000 03000000"),)
    MALFORMED = (("05010000 02000000 08000000 03000000", "q.block_size"),
                 ("05010000 02000000 00100000 03000000", "q.block_size"))


# ------------------------------------------------------------------ from outside the package
def from_entry_point(directory: Path, group: str, name: str) -> Any:
    """What the entry point ``name`` of ``group`` names, in the distribution under
    ``directory`` (a ``.dist-info`` found on ``sys.path``, as an installed one is); the
    directory is on the path only while it loads, so the registries of the other tests
    never find it."""
    sys.path.insert(0, str(directory))
    try:
        (ep,) = [e for e in metadata.entry_points(group=group) if e.name == name]
        return ep.load()
    finally:
        sys.path.remove(str(directory))


class Registered:
    """Registers ``SCHEME`` for the suite's tests and unregisters it after, so no other
    test sees it."""

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def registered(cls) -> Iterator[None]:
        register(cls.SCHEME)
        yield
        unregister(cls.SCHEME)


ToySlotScheme = from_entry_point(PLUGINS / "quant_scheme", ENTRY_POINTS, "toy_per_slot")


class TestToySlotScheme(Registered, QuantSchemeTests):
    """The contract, as the toy scheme's distribution runs it (registered as the registry
    registers an installed plugin, on its first lookup)."""

    SCHEME = ToySlotScheme
    GOLDEN = ((ToySlotScheme(0, 4, 3, None, 3),
               "f3010100 00000000 04000000 03000000 ffffffff 03000000"),
              (ToySlotScheme(0, 16, 3, 4, 2),
               "f3010000 00000000 10000000 03000000 04000000 02000000"))
    MALFORMED = (("f3010100 00000000 06000000 03000000 ffffffff 03000000", "q.block_size"),
                 ("f3010100 00000000 04000000 03000000 ffffffff 00000000", "q.scale_type"))



# ------------------------------------------------------------------ broken schemes
# Each is a scheme with one fault a third party could make, and its suite (not collected
# here: no "Test" prefix), run by broken_outcomes; FAILING names the tests that must fail.
@dataclass(frozen=True)
class DropsZeroPoint(PerBlockAffine):
    """Reads the zero-point buffer index and forgets it: every section reads symmetric."""

    TAG: ClassVar[int] = 0xF5
    NAME: ClassVar[str] = "broken_drops_zero_point"

    @classmethod
    def decode_body(cls, cur, start, flags):
        return replace(super().decode_body(cur, start, flags), zero_point_buffer=None)


@dataclass(frozen=True)
class IgnoresReserved(PerTensor):
    """Skips its 4 reserved bytes unread, so a section with them set is accepted."""

    TAG: ClassVar[int] = 0xF6
    NAME: ClassVar[str] = "broken_ignores_reserved"

    @classmethod
    def decode_body(cls, cur, start, flags):
        scale = float(cur.scalar("f32", "q.scale"))
        zp = cur.i32("q.zero_point")
        cur.take(4, "q._reserved")
        if scale == 0.0 or scale != scale or abs(scale) == float("inf"):
            raise QuantizationError.at("q.scale", start + 4, scale,
                                       "scale MUST be finite and non-zero")
        return cls(scale, zp)


@dataclass(frozen=True)
class TrustsItsInput(NF4):
    """Unpacks its fields with struct, past the end of a truncated section."""

    TAG: ClassVar[int] = 0xF7
    NAME: ClassVar[str] = "broken_trusts_its_input"

    @classmethod
    def decode_body(cls, cur, start, flags):
        axis, block, sbuf = struct.unpack_from("<III", cur.data, cur.pos)
        cur.pos += 12
        if block & (block - 1) or not block:
            raise QuantizationError.at("q.block_size", start + 8, block, cls.BLOCK_RULE)
        return cls(axis, block, sbuf)


@dataclass(frozen=True)
class ClaimsEveryFlag(PerChannel):
    """Declares all 16 flag bits its own, though it defines only SYMMETRIC."""

    TAG: ClassVar[int] = 0xF8
    NAME: ClassVar[str] = "broken_claims_every_flag"
    FLAGS: ClassVar[int] = 0xFFFF


@dataclass(frozen=True)
class MisreadsBfloat16(PerBlockAffine):
    """Says its bfloat16 scales are float16 (the same width): decoded values are wrong."""

    TAG: ClassVar[int] = 0xF9
    NAME: ClassVar[str] = "broken_misreads_bfloat16"

    @property
    def scale_dtype(self) -> str:
        return "float16" if self.scale_type == 0x02 else super().scale_dtype


class BrokenDropsZeroPoint(Registered, QuantSchemeTests):
    SCHEME = DropsZeroPoint
    GOLDEN = ((DropsZeroPoint(0, 4, 3, None, 3),
               "f5010100 00000000 04000000 03000000 ffffffff 03000000"),
              (DropsZeroPoint(0, 16, 3, 4, 1),
               "f5010000 00000000 10000000 03000000 04000000 01000000"))


class BrokenIgnoresReserved(Registered, QuantSchemeTests):
    SCHEME = IgnoresReserved
    GOLDEN = ((IgnoresReserved(0.125, -3), "f6010000 0000003e fdffffff 00000000"),)
    MALFORMED = (("f6010000 0000003e fdffffff 00010000", "q._reserved[1]"),)


class BrokenTrustsItsInput(Registered, QuantSchemeTests):
    SCHEME = TrustsItsInput
    GOLDEN = ((TrustsItsInput(1, 64, 3), "f7010000 01000000 40000000 03000000"),)
    MALFORMED = (("f7010000 01000000 30000000 03000000", "q.block_size"),)


class BrokenClaimsEveryFlag(Registered, QuantSchemeTests):
    SCHEME = ClaimsEveryFlag
    GOLDEN = ((ClaimsEveryFlag(2, 3, 4), "f8010000 02000000 03000000 04000000 03000000"),
              (ClaimsEveryFlag(1, 3), "f8010100 01000000 03000000 ffffffff 03000000"))


class BrokenMisreadsBfloat16(Registered, QuantSchemeTests):
    SCHEME = MisreadsBfloat16
    GOLDEN = ((MisreadsBfloat16(0, 4, 3, None, 2),
               "f9010100 00000000 04000000 03000000 ffffffff 02000000"),
              (MisreadsBfloat16(0, 4, 3, 4, 2),
               "f9010000 00000000 04000000 03000000 04000000 02000000"))


# The repository's plugin that defines a scheme and forgets @register (noreg_scheme): its
# class, never registered
Forgotten = from_entry_point(PLUGINS / "noreg_scheme", ENTRY_POINTS, "forgotten").Forgotten


class BrokenForgotten(QuantSchemeTests):
    SCHEME = Forgotten
    GOLDEN = ((Forgotten(0, 4, 3, None, 3),
               "f4010100 00000000 04000000 03000000 ffffffff 03000000"),)


# ------------------------------------------------------------------ server operations
shout = from_entry_point(PLUGINS / "server_ops", extensions.GROUP, "acme.shout")


def text(s: str) -> bytes:
    """acme.shout's payload: u32 n + UTF-8."""
    raw = s.encode()
    return struct.pack("<I", len(raw)) + raw


class ShoutCases:
    """Valid and malformed payloads of an operation that reads acme.shout's payload
    through ``payload_reader(payload, OPERATION)``."""

    @pytest.fixture
    def cases(self, client) -> list[tuple[bytes, bytes]]:
        return [(text("hello"), b"HELLO"), (text(""), b""), (text("straße"), b"STRASSE")]

    @property
    def MALFORMED(self) -> list[tuple[bytes, str]]:
        name = self.OPERATION
        return [(struct.pack("<I", 9) + b"hi", f"{name}.text"),  # runs past the payload
                (struct.pack("<I", 2) + b"\xc3(", f"{name}.text"),  # not UTF-8
                (text("hi") + b"!", f"{name}.trailing")]


class TestAcmeShout(ShoutCases, ServerOperationTests):
    """The contract, as the acme distribution runs it on its operation."""

    OPERATION = "acme.shout"

    @pytest.fixture
    def operation(self):
        return shout


class TestShare(ServerOperationTests):
    """``hurraykv.share``, the package's own operation: only a client on the server's Unix
    socket (without TLS) is handed a file, so the server listens on one."""

    OPERATION = handover.OPERATION
    MALFORMED = ((b"\x05\x00ab", "hurraykv.share.key"),  # runs past the payload
                 (b"\x02\x00\xff\xfe", "hurraykv.share.key"),  # not UTF-8
                 (b"\x01\x00ab", "hurraykv.share.trailing"))

    @pytest.fixture
    def listen(self, tmp_path) -> str:
        return str(tmp_path / "kv.sock")

    @pytest.fixture
    def operation(self):
        return handover.share  # registered by the package: served as it is

    @pytest.fixture
    def cases(self, client) -> list[tuple[bytes, Check]]:
        out = []
        for i, key in enumerate(("contract/a", "contract/é")):
            snap = segment(2 + i, i)
            client.push(key, snap)

            def check(reply: bytes, fds: list[int], snap=snap) -> None:
                (size,) = struct.unpack("<Q", reply)
                assert len(fds) == 1
                assert fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & handover.SEALS == handover.SEALS
                assert os.fstat(fds[0]).st_size == size
                assert hk.load_snapshot(f"/proc/self/fd/{fds[0]}", mmap=False).equal(snap)

            raw = key.encode()
            out.append((struct.pack("<H", len(raw)) + raw, check))
        return out


# ------------------------------------------------------------------ broken operations
def shout_like(name: str, *, short: bool = True, end: bool = True, upper: bool = True,
               vague: bool = False) -> Operation:
    """acme.shout with one fault: ``short`` False unpacks the length with struct first
    (a payload under 4 bytes raises struct.error: INTERNAL); ``end`` False leaves bytes
    after the text unread; ``upper`` False answers in lower case; ``vague`` refuses with
    a message that names no field."""

    def operation(session, payload: bytes) -> bytes:
        if not short:
            struct.unpack_from("<I", payload)
        r = payload_reader(payload, name)
        try:
            s = r.text("text")
            if end:
                r.end()
        except ProtocolError:
            if vague:
                raise ProtocolError("bad payload") from None
            raise
        return (s.upper() if upper else s.lower()).encode()

    return operation


class BrokenOperation(ShoutCases, ServerOperationTests):
    FAULT: ClassVar[dict[str, bool]]

    @pytest.fixture
    def operation(self):
        return shout_like(self.OPERATION, **self.FAULT)


class BrokenCrashesWhenShort(BrokenOperation):
    OPERATION, FAULT = "broken.crashes-when-short", {"short": False}


class BrokenIgnoresTrailing(BrokenOperation):
    OPERATION, FAULT = "broken.ignores-trailing", {"end": False}


class BrokenAnswersWrongly(BrokenOperation):
    OPERATION, FAULT = "broken.answers-wrongly", {"upper": False}


class BrokenRefusesVaguely(BrokenOperation):
    OPERATION, FAULT = "broken.refuses-vaguely", {"vague": True}


# ------------------------------------------------------------------ the proof
# Each broken suite, the tests it must fail; the others pass (or skip, where the suite
# was given nothing to try).  Every test of both suites is in at least one set, except
# test_a_name_the_server_does_not_serve_is_unknown_operation: the answer to a name no
# operation holds is the server's, which no operation can change.
SCHEME_TESTS = {n for n in dir(QuantSchemeTests) if n.startswith("test_")}
OPERATION_TESTS = {n for n in dir(ServerOperationTests) if n.startswith("test_")}
FAILING = {
    BrokenDropsZeroPoint: {"test_golden_sections_round_trip_byte_for_byte",
                           "test_padding_after_the_section_comes_back_verbatim",
                           "test_a_section_it_accepts_is_the_one_it_writes",
                           "test_decoded_values_are_the_spec_formula_of_the_stored_bytes"},
    BrokenIgnoresReserved: {"test_a_section_it_accepts_is_the_one_it_writes",
                            "test_the_malformed_sections_are_refused_naming_their_field"},
    BrokenTrustsItsInput: {"test_a_truncated_section_is_refused_naming_the_field"},
    BrokenClaimsEveryFlag: {"test_golden_sections_round_trip_byte_for_byte",
                            "test_a_section_it_accepts_is_the_one_it_writes"},
    BrokenMisreadsBfloat16: {"test_decoded_values_are_the_spec_formula_of_the_stored_bytes"},
    # unregistered, it reads as an unknown scheme: every section is refused (its MALFORMED
    # is empty: skipped)
    BrokenForgotten: SCHEME_TESTS - {"test_a_truncated_section_is_refused_naming_the_field",
                                     "test_a_section_it_accepts_is_the_one_it_writes",
                                     "test_the_malformed_sections_are_refused_naming_their_"
                                     "field"},
    BrokenCrashesWhenShort: {"test_a_payload_cut_short_is_refused_naming_a_field",
                             "test_an_empty_payload_is_refused_naming_a_field",
                             "test_no_payload_makes_it_fail_internally"},
    BrokenIgnoresTrailing: {"test_bytes_after_the_payload_are_refused_naming_a_field",
                            "test_the_malformed_payloads_are_refused_naming_their_field"},
    BrokenAnswersWrongly: {"test_each_payload_round_trips_through_a_real_server"},
    BrokenRefusesVaguely: {"test_a_payload_cut_short_is_refused_naming_a_field",
                           "test_bytes_after_the_payload_are_refused_naming_a_field",
                           "test_an_empty_payload_is_refused_naming_a_field",
                           "test_the_malformed_payloads_are_refused_naming_their_field"},
}


@pytest.fixture(scope="module")
def broken_outcomes(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Every broken suite run once by pytest in a new interpreter, as a test module that
    imports it under a ``Test`` name: each test's outcome (passed, failed, skipped), by
    suite.  A new interpreter: the suites start servers and register schemes, and the
    compiled kernels cannot be imported twice into one (pytester's in-process runs)."""
    where = tmp_path_factory.mktemp("broken")
    names = [suite.__name__ for suite in FAILING]
    (where / "test_broken.py").write_text("".join(
        f"from {__name__} import {n} as Test{n}  # noqa: F401\n" for n in names))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(where), "--junitxml", str(where / "out.xml"),
                          "test_broken.py"], cwd=where, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]  # tests failed
    out: dict[str, dict[str, str]] = {n: {} for n in names}
    for case in ElementTree.parse(where / "out.xml").iter("testcase"):
        suite = case.get("classname").rsplit(".", 1)[-1].removeprefix("Test")
        kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
        outcome = "failed" if kinds & {"failure", "error"} else (
            "skipped" if kinds else "passed")
        out[suite][case.get("name")] = outcome
    return out


@pytest.mark.parametrize("suite", list(FAILING), ids=lambda s: s.__name__)
def test_each_suite_fails_a_broken_extension_on_the_tests_that_catch_its_fault(
        broken_outcomes, suite):
    got = broken_outcomes[suite.__name__]
    every = SCHEME_TESTS if issubclass(suite, QuantSchemeTests) else OPERATION_TESTS
    assert set(got) == every, f"tests not run: {sorted(every - set(got))}"
    failed = {t for t, o in got.items() if o == "failed"}
    assert failed == FAILING[suite], (
        f"failed: {sorted(failed)}; passed or skipped: {sorted(every - failed)}")


def test_every_test_of_the_suites_fails_on_some_broken_extension():
    caught = set().union(*FAILING.values())
    assert caught >= SCHEME_TESTS
    assert OPERATION_TESTS - caught == {
        "test_a_name_the_server_does_not_serve_is_unknown_operation"}
