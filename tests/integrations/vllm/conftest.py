"""The vLLM connector without an engine (engine_tests/ runs real engines).

Fixtures only these tests use go here; shared ones stay in tests/conftest.py, helpers that
are not fixtures in tests/support."""
