"""Files and streams: .hrry, snapshots, checksums, atomic writes, pyhurray interop.

Fixtures only these tests use go here; shared ones stay in tests/conftest.py, helpers that
are not fixtures in tests/support."""
