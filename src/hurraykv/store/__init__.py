"""Floor 4: snapshots in Redis / Valkey (single server or cluster), pages stored once."""

from .capacity import MissingPagesError, StoreFullError
from .pages import PageStore

__all__ = ["MissingPagesError", "PageStore", "StoreFullError"]
