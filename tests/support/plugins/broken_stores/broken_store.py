"""A store plugin whose import fails (a dependency that is not installed): hurraykv skips
it with a warning, and its built-in stores still work."""

import hurraykv_missing_dependency  # noqa: F401  (no such module)
