"""Reference vectors (tests/vectors/reference, from the reference project) and our own
(tests/vectors)."""

from __future__ import annotations

import json

import pytest

import hurraykv as hk
from hurraykv.cli import main as cli_main
from hurraykv.paged import BlockPagedTensor
from hurraykv.wire.annotate import to_json
from hurraykv.wire.descriptor import decode_descriptor
from tests.support.paths import VECTORS
from tests.support.wire import split_stream
from tests.vectors import make_vectors

EXPECT_KEYS = ("version_major", "version_minor", "element_type_tag", "element_type", "shape",
               "byte_offset", "layout_tag", "buffer_byte_sizes", "has_quantization", "has_shard")


def _reference_cases():
    from tests.support.paths import REFERENCE

    manifest = json.loads((REFERENCE / "manifest.json").read_text())
    return [pytest.param(v, id=v["file"]) for v in manifest["descriptors"]]


@pytest.mark.parametrize("vector", _reference_cases())
def test_reference_vector_matches_manifest(reference_dir, vector):
    data = (reference_dir / vector["file"]).read_bytes()
    desc = decode_descriptor(data)
    got = to_json(desc)
    assert {k: got[k] for k in EXPECT_KEYS} == vector["expect"]
    assert desc.encode() == data  # byte-exact re-encoding


@pytest.mark.parametrize("vector", _reference_cases())
def test_cli_inspect_json_on_reference_vector(reference_dir, vector, capsys):
    assert cli_main(["inspect", "--json", str(reference_dir / vector["file"])]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {k: out[k] for k in EXPECT_KEYS} == vector["expect"]
    assert [b["byte_size"] for b in out["buffers"]] == vector["expect"]["buffer_byte_sizes"]


def test_reference_per_block_quantization_is_parsed(reference_dir):
    desc = decode_descriptor(
        (reference_dir / "descriptors/quant_per_block_int4_128x128.bin").read_bytes())
    q = to_json(desc)["quantization"]
    assert q["scheme"] == "per_block_affine"
    assert (q["axis"], q["block_size"], q["scale_buffer"], q["scale_type"]) == (
        1, 128, 1, "float16")
    assert q["symmetric"] is True


def test_committed_vectors_are_what_the_generator_builds():
    for rel, data in make_vectors.files().items():
        path = VECTORS / rel
        assert path.exists(), f"{rel} missing: run python tests/vectors/make_vectors.py"
        assert path.read_bytes() == data, f"{rel} differs from make_vectors.py"


def _own_manifest():
    return json.loads((VECTORS / "manifest.json").read_text())


@pytest.mark.parametrize("vector", _own_manifest()["descriptors"], ids=lambda v: v["file"])
def test_own_valid_vector(vector, capsys):
    data = (VECTORS / vector["file"]).read_bytes()
    desc = decode_descriptor(data)
    assert to_json(desc) == vector["expect"]
    assert desc.encode() == data
    assert cli_main(["validate", str(VECTORS / vector["file"])]) == 0
    assert cli_main(["inspect", "--json", str(VECTORS / vector["file"])]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1]) == vector["expect"]


@pytest.mark.parametrize("vector", _own_manifest()["invalid"], ids=lambda v: v["file"])
def test_own_invalid_vector(vector, capsys):
    data = (VECTORS / "invalid" / vector["file"]).read_bytes()
    error = getattr(hk, vector["error"])
    with pytest.raises(error) as exc:
        if vector["with_buffers"]:
            desc, buffers = split_stream(data)
            BlockPagedTensor.from_descriptor(desc, buffers)
        else:
            decode_descriptor(data)
    assert vector["field"] in str(exc.value)
    if not vector["with_buffers"]:
        assert cli_main(["validate", str(VECTORS / "invalid" / vector["file"])]) == 1
        assert error.__name__ in capsys.readouterr().err


def test_worked_example_bytes_match_the_wire_notes_hex_dump():
    # wire-notes §1.9, typed in from the document: 133 bytes.
    dump = """
    48 52 52 59 01 00 85 00 00 00 00 00 00 00 01 0a 03 00 00 00 09 00 00 00 00 00 00 00
    02 00 00 00 00 00 00 00 08 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 04 00 00 00
    05 00 00 00 00 00 00 00 00 00 00 00 02 00 00 00 00 03 00 00 00 00 00 00 00 00 00 00
    03 80 02 00 00 00 00 00 00 40 00 00 00 00 00 00 00 0c 00 00 00 00 00 00 00 40 00 00
    00 00 00 00 00 0c 00 00 00 00 00 00 00 40 00 00 00 00 00 00 00"""
    assert make_vectors.WORKED.encode() == bytes.fromhex(dump)


def test_vendored_reference_vectors_match_the_workspace_copy(reference_dir):
    """tests/vectors/reference is a copy of ../shared/conformance/reference: where the
    workspace copy exists (a developer checkout), the two hold the same files and bytes."""
    from tests.support.paths import SHARED_REFERENCE

    if not SHARED_REFERENCE.is_dir():
        pytest.skip(f"no workspace copy at {SHARED_REFERENCE} (a standalone clone)")

    def files(root):
        return {p.relative_to(root).as_posix(): p.read_bytes()
                for p in sorted(root.rglob("*")) if p.is_file() and p.name != "PROVENANCE.md"}

    assert files(reference_dir) == files(SHARED_REFERENCE)
