"""Moved to ``hurraykv.chunks.redis`` (issue 48): this path keeps working for one release
(``CHANGELOG.md``).  Import from ``hurraykv.chunks.redis`` instead."""

from ..chunks.redis import RedisChunks

__all__ = ["RedisChunks"]
