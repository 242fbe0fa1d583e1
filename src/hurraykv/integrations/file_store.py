"""Moved to ``hurraykv.chunks.file.store`` (issue 48): this path keeps working for one release
(``CHANGELOG.md``).  Import from ``hurraykv.chunks.file`` instead."""

from ..chunks.file.store import TENANT_KEY, FileChunks

__all__ = ["TENANT_KEY", "FileChunks"]
