"""Where the suite's files are, whatever folder a test module sits in."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent  # the repository
VECTORS = TESTS / "vectors"
# The reference project's golden vectors, vendored so a clone anywhere tests against them;
# SHARED_REFERENCE is the workspace copy they came from (checked equal when present).
REFERENCE = VECTORS / "reference"
SHARED_REFERENCE = ROOT.parent / "shared" / "conformance" / "reference"
DATA = TESTS / "data"
