from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from tests.redis_fixtures import redis_cluster_url, redis_url  # noqa: F401 - fixtures

# CI (CI=true) replays a fixed set of examples so a run is reproducible; local runs keep
# exploring new ones.  No deadlines: a loaded 2-core machine is slow, not wrong.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

VECTORS = Path(__file__).parent / "vectors"
# The reference project's golden vectors, vendored so a clone anywhere tests against them;
# SHARED_REFERENCE is the workspace copy they came from (checked equal when present).
REFERENCE = VECTORS / "reference"
SHARED_REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "conformance" / "reference"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not (REFERENCE / "manifest.json").exists():
        pytest.fail(f"reference conformance vectors not found at {REFERENCE}")
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
