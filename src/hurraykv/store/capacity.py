"""The page store at Redis's memory limit (floor 4): the errors and the best-effort writes.

The store's capacity is Redis's own: ``maxmemory`` with an eviction policy (``pages.py``,
"Capacity").  Two things can happen at the limit:

* Redis evicts (``allkeys-lru`` and the other ``allkeys-*`` policies): any key may go,
  one at a time - a page, a manifest, a page's owners, a pending release, a prefix-index
  entry.  Every read copes (a snapshot missing anything is a miss or ``MissingPagesError``,
  never other bytes); ``fsck`` removes what is left of damaged snapshots.
* Redis refuses writes (``noeviction``, or a ``volatile-*`` policy: hurraykv sets no TTLs,
  so Redis finds nothing it may evict): every write command that could grow memory is
  answered ``OOM``.  A put refused there raises ``StoreFullError`` and takes back what it
  had written; deletes still work (they only shrink memory), so they make room.

The statistics and the prefix index are an account and an accelerator, not data: a write
to them that Redis refuses for memory is skipped (``fsck`` recomputes the statistics; a
missing index entry is a lookup miss), so a put that stored its manifest, or a delete that
removed one, is not reported failed because of them.  So is a statistics write Redis
refuses because the hash is damaged (a key of another type, a field not a number).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .. import units
from ..errors import StoreError

# What Redis and Valkey answer to a write past maxmemory: "OOM command not allowed when used
# memory > 'maxmemory'." (redis-py raises OutOfMemoryError with the "OOM " cut off).
_OOM = "used memory > 'maxmemory'"


class StoreFullError(StoreError):
    """Redis refused a write: it is at its ``maxmemory`` and may evict nothing."""


class MissingPagesError(StoreError):
    """A snapshot names pages the store no longer holds (evicted or deleted): it cannot be
    read whole, and a caller that can recompute treats it as a miss."""


def is_full(error: BaseException) -> bool:
    """Whether ``error`` is Redis refusing a write for memory (any client path)."""
    return isinstance(error, StoreFullError) or _OOM in str(error)


def memory(client: Any) -> dict[str, Any]:
    """``used_memory``, ``maxmemory`` and ``maxmemory_policy`` as the server reports them
    (one node's, for a cluster), or {} where INFO is refused (some managed services)."""
    try:
        info = client.info("memory")
    except Exception:  # the numbers only decorate an error message
        return {}
    if isinstance(info, dict) and "used_memory" not in info:  # a cluster: node -> info
        info = next(iter(info.values()), {})
    return {k: info[k] for k in ("used_memory", "maxmemory", "maxmemory_policy") if k in info}


def full_error(client: Any, what: str, outcome: str) -> StoreFullError:
    """The error for a write Redis refused for memory: what was refused, Redis's limit and
    policy, what became of the write, and what the operator can do."""
    mem = memory(client)
    limit = mem.get("maxmemory")
    at = (f": {units.size(mem['used_memory'])} used of maxmemory {units.size(limit)}, "
          f"maxmemory-policy {mem.get('maxmemory_policy', '?')}" if limit else "")
    return StoreFullError(
        f"{what}: Redis refused a write at its memory limit (OOM{at}); {outcome}. For a "
        "cache set `maxmemory-policy allkeys-lru` (Redis then evicts old snapshots and "
        "hurraykv reads them as misses); otherwise raise `maxmemory` or delete snapshots",
        field="maxmemory", value=limit,
        rule="a write must fit under Redis's maxmemory when its policy evicts nothing")


@contextlib.contextmanager
def refusing_full(client: Any, what: str,
                  outcome: str = "nothing stored before was touched") -> Iterator[None]:
    """Redis's OOM reply, from whichever path met it, raised as ``StoreFullError``."""
    try:
        yield
    except StoreFullError:
        raise
    except Exception as e:
        if not is_full(e):
            raise
        raise full_error(client, what, outcome) from None


# What Redis answers to HINCRBY on a statistics hash that is damaged: a key of another
# type, a field that is not a number.
_DAMAGED_ACCOUNT = ("WRONGTYPE", "hash value is not an integer")


def best_effort(pipe: Any) -> list[Any]:
    """Run ``pipe`` (statistics, prefix index); replies Redis refused for memory, or for a
    statistics hash that is damaged (``fsck`` rewrites it), come back as None; any other
    error is raised."""
    out = []
    for reply in pipe.execute(raise_on_error=False):
        if isinstance(reply, Exception):
            if not is_full(reply) and not any(s in str(reply) for s in _DAMAGED_ACCOUNT):
                raise reply
            reply = None
        out.append(reply)
    return out
