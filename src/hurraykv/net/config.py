"""What a ``hurraykv serve`` is configured with (``KVServer(config)``, the options of
``hurraykv serve``); below the server and its connections, which both read it."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass
class ServerConfig:
    """The settings of a server, one per option of ``hurraykv serve``.  The connection
    limits are checked when the config is made: ``max_connections`` and
    ``max_connections_per_tenant`` are integers of at least 1, a tenant's share at most
    ``max_connections`` (``ConfigError`` naming the option otherwise).  The share applies
    under mutual TLS (``tls_ca``) only; left None it is a quarter of ``max_connections``
    (at least 1), so that one tenant's idle connections never take every slot."""

    listen: str = "127.0.0.1:0"  # HOST:PORT, or a Unix socket path
    memory_budget: int | None = None
    persist: str | None = None
    persist_budget: int | None = None  # bytes of .hrry files under persist, LRU beyond
    max_pinned_bytes: int | None = None  # pinned (RETAIN); default a quarter of a budget
    max_bytes_per_tenant: int | None = None  # memory per mutual-TLS tenant, LRU within
    max_message_size: int = 16 << 20
    read_timeout: float = 30.0  # a message started must keep arriving
    idle_timeout: float = 600.0  # between messages
    max_connections: int = 256
    max_connections_per_tenant: int | None = None  # None: tenant_share()'s default
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    zero_unused: bool = True
    frame_bytes: int = 4 << 20
    recycle_bytes: int = 1 << 30  # idle received memory kept for the next PUTs
    store: str | None = None  # redis://HOST:PORT or redis+cluster://...: the backing tier
    metrics_listen: str | None = None  # HOST:PORT of the HTTP /metrics and /healthz

    def __post_init__(self) -> None:
        _count("max_connections", self.max_connections)
        share = self.max_connections_per_tenant
        if share is not None:
            _count("max_connections_per_tenant", share)
            if share > self.max_connections:
                raise _refusal("max_connections_per_tenant", share,
                               f"at most --max-connections ({self.max_connections})")

    def tenant_share(self) -> int:
        """How many connections one tenant may hold at once: the setting, or a quarter
        of ``max_connections`` (at least 1)."""
        if self.max_connections_per_tenant is not None:
            return self.max_connections_per_tenant
        return max(1, self.max_connections // 4)


def _count(option: str, value: object) -> None:
    """``value`` is a count of connections: an int (not a bool) of at least 1."""
    if type(value) is not int:
        raise _refusal(option, value, "an integer of at least 1")
    if value < 1:
        raise _refusal(option, value, "at least 1")


def _refusal(option: str, value: object, rule: str) -> ConfigError:
    flag = "--" + option.replace("_", "-")
    return ConfigError(f"{flag} {value!r}: a count of connections is {rule}", field=option,
                       value=value, rule=rule)
