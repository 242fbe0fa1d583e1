"""Block-paged tensors: layouts, quantized pages, kernels, key/value of different sizes.

Fixtures only these tests use go here; shared ones stay in tests/conftest.py, helpers that
are not fixtures in tests/support."""
