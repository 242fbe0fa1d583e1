from __future__ import annotations

from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "conformance" / "reference"
VECTORS = Path(__file__).parent / "vectors"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not (REFERENCE / "manifest.json").exists():
        pytest.fail(f"reference conformance vectors not found at {REFERENCE} (../shared)")
    return REFERENCE


def split_stream(data: bytes):
    """Descriptor bytes followed by each buffer's bytes (the streaming form, D8)."""
    from hurraykv.wire.descriptor import decode_descriptor

    desc = decode_descriptor(data)
    pos = len(desc.encode())
    buffers = []
    for h in desc.buffers:
        buffers.append(data[pos:pos + h.byte_size])
        pos += h.byte_size
    return desc, buffers
