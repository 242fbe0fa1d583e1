"""``file:///DIR``: segments as ``DIR/NAME.hrry`` files that every engine on the host
shares.  ``store`` is the store (``FileChunks``); the parts it is built from, each a
module: ``index`` (the chunk aliases, lines of ``DIR/aliases.log``), ``capacity`` (the
byte budget and admission), ``reservations`` (room held by writes in progress),
``eviction`` (taking a segment out so that no reader sees part of one), ``locking`` (the
directory's ``flock``), ``tenants`` (per-tenant quotas) and ``layouts`` (the structures
learned, for loads in one pass)."""

from .store import FileChunks

__all__ = ["FileChunks"]
