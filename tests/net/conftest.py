"""``hurraykv serve`` and its client: protocol messages, budgets, persistence, tenants, metrics.

Fixtures only these tests use go here; shared ones stay in tests/conftest.py, helpers that
are not fixtures in tests/support."""
