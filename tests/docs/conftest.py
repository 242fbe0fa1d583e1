"""The documentation's claims: README and docs/ examples run, API reference and names.

Fixtures only these tests use go here; shared ones stay in tests/conftest.py, helpers that
are not fixtures in tests/support."""
