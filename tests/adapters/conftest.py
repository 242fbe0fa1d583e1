"""Framework adapters: vLLM tables, FlashInfer, SGLang, transformers caches.

Fixtures only these tests use go here; shared ones stay in tests/conftest.py, helpers that
are not fixtures in tests/support."""
