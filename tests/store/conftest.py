"""Stores: Redis page stores, chunk stores (file://, server, Redis), capacity, the guard.

Fixtures only these tests use go here; shared ones stay in tests/conftest.py, helpers that
are not fixtures in tests/support."""
