"""Fixtures and settings every area uses.  A fixture that only one area's tests use lives
in that area's ``conftest.py`` (tests/wire, tests/net, ...); helpers that are not fixtures
live in ``tests/support``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support.paths import REFERENCE
from tests.support.redis_fixtures import redis_cluster_url, redis_url  # noqa: F401 - fixtures
from tests.support.s3_fixtures import own_server, s3_server, s3_url  # noqa: F401 - fixtures

# CI (CI=true) replays a fixed set of examples so a run is reproducible; local runs keep
# exploring new ones.  No deadlines: a loaded 2-core machine is slow, not wrong.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not (REFERENCE / "manifest.json").exists():
        pytest.fail(f"reference conformance vectors not found at {REFERENCE}")
    return REFERENCE


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked slow first (in their order), the others after: with ``make
    test``'s two pytest-xdist workers a long test taken last kept one worker busy alone
    while the other had finished."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
