"""Moved to ``hurraykv.chunks.server`` (issue 48): this path keeps working for one release
(``CHANGELOG.md``).  Import from ``hurraykv.chunks.server`` instead."""

from ..chunks.server import ServerChunks

__all__ = ["ServerChunks"]
