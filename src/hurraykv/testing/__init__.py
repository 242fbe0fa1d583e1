"""Test suites a third-party extension of hurraykv runs to prove it keeps hurraykv's
contracts (as ``zarr.testing.StoreTests`` does for zarr stores).

Each is one pytest test class to inherit:

* ``ChunkStoreTests`` (``chunk_store.py``): the contract every chunk store keeps, given two
  fixtures (``make``, ``capped``);
* ``QuantSchemeTests`` (``quant_scheme.py``): every quantization scheme's, given the
  scheme class and its golden sections (``SCHEME``, ``GOLDEN``);
* ``ServerOperationTests`` (``server_operation.py``): every private server operation's,
  served by a real server, given its name, the function and valid payloads
  (``OPERATION``, fixtures ``operation`` and ``cases``).

This package imports pytest (a test dependency, ``hurraykv[test]``); nothing else in
hurraykv imports it.
"""

from __future__ import annotations

import pytest

# a failed assert of the suites says its values, as in a test module (before their import)
pytest.register_assert_rewrite("hurraykv.testing.chunk_store",
                               "hurraykv.testing.quant_scheme",
                               "hurraykv.testing.server_operation")

from .chunk_store import CHUNK, ChunkStoreTests, keys, segment  # noqa: E402
from .quant_scheme import QuantSchemeTests  # noqa: E402
from .server_operation import ServerOperationTests  # noqa: E402

__all__ = ["CHUNK", "ChunkStoreTests", "QuantSchemeTests", "ServerOperationTests", "keys",
           "segment"]
