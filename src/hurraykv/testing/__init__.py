"""Test suites a third-party extension of hurraykv runs to prove it keeps hurraykv's
contracts (as ``zarr.testing.StoreTests`` does for zarr stores).

``ChunkStoreTests`` (``chunk_store.py``): the contract every chunk store keeps, one pytest
test class to inherit, giving two fixtures (``make``, ``capped``).  This package imports
pytest (a test dependency, ``hurraykv[test]``); nothing else in hurraykv imports it.
"""

from __future__ import annotations

import pytest

# a failed assert of the suites says its values, as in a test module (before their import)
pytest.register_assert_rewrite("hurraykv.testing.chunk_store")

from .chunk_store import CHUNK, ChunkStoreTests, keys, segment  # noqa: E402

__all__ = ["CHUNK", "ChunkStoreTests", "keys", "segment"]
