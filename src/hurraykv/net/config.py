"""What a ``hurraykv serve`` is configured with (``KVServer(config)``, the options of
``hurraykv serve``); below the server and its connections, which both read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
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
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    zero_unused: bool = True
    frame_bytes: int = 4 << 20
    recycle_bytes: int = 1 << 30  # idle received memory kept for the next PUTs
    store: str | None = None  # redis://HOST:PORT or redis+cluster://...: the backing tier
    metrics_listen: str | None = None  # HOST:PORT of the HTTP /metrics and /healthz
