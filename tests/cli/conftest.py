"""The ``hurraykv`` command line: inspect, validate, push/pull, cache, usage errors, demo.

Fixtures only these tests use go here; shared ones stay in tests/conftest.py, helpers that
are not fixtures in tests/support."""
