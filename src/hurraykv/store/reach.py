"""A Redis or Valkey that cannot be reached, or is there but not serving, as a
``TransportError`` naming the server (a store that will be back: a miss, not a bug), and
any other reply that refuses a command as a ``StoreError`` naming it: around one call
(``unreachable_as_transport``) or every method of a store object (``reaching``: the
PageStore, the ``redis://`` chunk store).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..errors import StoreError, TransportError, require


def server_name(client: Any) -> str:
    """The server a redis-py client talks to, for a message."""
    try:
        kw = client.connection_pool.connection_kwargs
        return kw.get("path") or f"{kw.get('host')}:{kw.get('port')}"
    except AttributeError:  # a cluster, or a stand-in
        pass
    try:
        return f"cluster {client.get_default_node().name}"
    except Exception:  # a stand-in, or a cluster that lost its nodes
        return type(client).__name__


# Replies of a Redis that is there but not serving: loading its data after a restart
# (LOADING, raised by redis-py as a ConnectionError), a cluster without a quorum or with a
# slot's master down (CLUSTERDOWN, MASTERDOWN), a slot moving (TRYAGAIN), a primary
# demoted by a failover (READONLY).  They pass once Redis is back, as a refused connection
# does, so they are TransportError too.
_NOT_SERVING = ("ClusterDownError", "TryAgainError", "ReadOnlyError", "NoScriptError")


@contextlib.contextmanager
def unreachable_as_transport(where: str | Callable[[], str]) -> Iterator[None]:
    """redis-py's errors for a store it cannot reach (refused, timed out, unknown host, a
    cluster with no reachable node) or that is not serving (loading its data after a
    restart, a cluster down, a script cache lost again and again while it restarts)
    raised as ``TransportError`` naming ``where`` (or what ``where()`` says, asked only
    then).  Any other redis-py error (a reply refusing a command, such as WRONGTYPE on a
    key that is not the store's) is ``StoreError`` naming the reply."""
    redis = require("redis", "redis", "the Redis page store")
    from redis.exceptions import RedisClusterException

    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError, RedisClusterException) as e:
        name = where() if callable(where) else where
        said = "it is loading its data" if isinstance(e, redis.BusyLoadingError) else \
            "cannot reach it"
        raise TransportError(f"redis store {name}: {said}: {e}", field="url", value=name,
                             rule="a reachable Redis or Valkey server") from None
    except redis.RedisError as e:
        name = where() if callable(where) else where
        if any(c.__name__ in _NOT_SERVING for c in type(e).__mro__):
            raise TransportError(f"redis store {name}: it is not serving: {e}", field="url",
                                 value=name, rule="a Redis or Valkey server serving "
                                 "commands") from None
        raise StoreError(f"redis store {name}: Redis refused a command: {e}", field="reply",
                         value=str(e)[:200], rule="a store holding only hurraykv's keys, "
                         "each of its type") from None


T = TypeVar("T")


def reaching(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` of an object with a redis-py ``client`` (the PageStore, the ``redis://``
    chunk store), with a store that goes away midway raised as ``TransportError`` (as one
    that cannot be reached at all), never as redis-py's own exceptions."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> T:
        with unreachable_as_transport(lambda: server_name(self.client)):
            return method(self, *args, **kwargs)
    return call


__all__ = ["reaching", "server_name", "unreachable_as_transport"]
