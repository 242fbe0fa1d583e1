"""``kv_connector_extra_config`` parsed once into a typed, frozen object.

Every key is declared here with its type, default and meaning (``docs/vllm.md``'s table is
tested against ``KEYS``).  An unknown key is refused with the list of known ones, a
boolean is ``true``/``false`` (JSON or the strings) and nothing else, numbers must be
positive, strings non-empty, sizes bytes or binary multiples ("64G", "64GB" and "64GiB"
are all 64 GiB): a typo never silently becomes a default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ... import units
from ...errors import HurrayError, did_you_mean
from ..chunks import url_problem
from . import store_format

Size = int  # a byte count; in the config also "64G"-style text (units.parse_size)


@dataclass(frozen=True)
class ConnectorConfig:
    url: str
    """``file:///DIR``, ``hurray://HOST:PORT``, ``redis://HOST:PORT`` or
    ``redis+cluster://HOST:PORT``: where chunks are stored (a part of the URL its store
    does not read, such as ``?max_bytes=``, is refused: settings are keys of their own)."""
    chunk_size: int | None = None
    """Tokens per stored chunk, a multiple of the block size (default: the block size)."""
    save_decode: bool = True
    """Also store chunks of generated tokens."""
    model_id: str | None = None
    """The model name in the cache identity (default: vLLM's ``model``)."""
    async_save: bool = True
    """Write segments from a background thread."""
    tls_cert: str | None = None
    """Client certificate for a ``hurray://`` server with mutual TLS."""
    tls_key: str | None = None
    """Its private key."""
    tls_ca: str | None = None
    """The CA that signed the server's certificate."""
    server_hostname: str | None = None
    """The name the server's certificate must carry."""
    lookup_timeout_ms: float = 2000.0
    """Deadline of a lookup (off vLLM's scheduler thread: only the request looked up waits
    for it): a slower one is a miss, and counts towards the store being down."""
    load_timeout_ms: float = 2000.0
    """Deadline of fetching one segment: a slower one is recomputed."""
    load_mode: str = "auto"
    """``"async"``: a hit waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` while its segments
    are fetched, verified and written beside the forward passes of running requests;
    ``"sync"``: loaded before the forward pass of the step that schedules it (every
    running request waits for it); ``"auto"``: sync for a hit of at most
    ``sync_load_max_tokens`` from a ``file://`` store, async otherwise."""
    sync_load_max_tokens: int = 512
    """With ``load_mode`` auto: the largest ``file://`` hit loaded synchronously."""
    save_timeout_ms: float = 10000.0
    """Deadline of storing one segment (off the forward pass): a slower one is dropped."""
    failures_before_down: int = 3
    """Failed or late calls in a row after which the store counts as down (no calls
    until a backoff passes)."""
    max_backoff_s: float = 30.0
    """Longest wait between probes of a store that is down (from 1 s, doubling)."""
    max_pending_saves: int | None = None
    """Segments waiting for the writer; more are dropped (counted) instead of queued
    (default: bounded by ``max_pending_save_bytes`` only)."""
    max_pending_save_bytes: Size = 1 << 30
    """Bytes of segments waiting for the writer (``"1G"``): a segment that would pass
    it is dropped (counted) instead of queued, so a burst is absorbed by memory, not by
    a count of segments of any size."""
    max_bytes: Size | None = None
    """Capacity of a ``file://`` directory (``"64G"``, ``"512M"`` or bytes): past it the
    least recently used segments are evicted.  Default: unbounded (a warning at start)."""
    max_bytes_per_tenant: Size | None = None
    """Of a ``file://`` directory, the most that one tenant's segments may hold (a tenant:
    the requests of one ``cache_salt``; those without one are a tenant too): past it the
    tenant's own least recently used segments are evicted, never another's.  Default:
    no quota."""
    max_pinned_bytes: Size | None = None
    """Of a ``file://`` directory's ``max_bytes``, the most that pinned segments may hold
    (requests ask pins with ``kv_transfer_params``): a pin past it is refused and the
    segment stored unpinned.  Default: a quarter of ``max_bytes``."""
    store_dtype: str = "auto"
    """What segments hold: ``"auto"`` (the cache dtype), ``"int8"``, ``"int4"`` or
    ``"fp8"`` (e4m3); part of the cache identity (``store_format.py``)."""
    quantization: str | None = None
    """For int8 and int4: ``"per_block_affine"`` (default; a scale per token of a page)
    or ``"per_channel"`` (a scale per head_dim channel of each layer's pool)."""
    store_threshold: int = 1
    """Store a chunk the Nth time a request of this engine computes it (as vLLM's
    offloading connector's ``store_threshold``): 2 keeps one-off prompts out of the
    store, so they do not evict what comes back.  1: every chunk, at once."""
    max_tracker_size: int = 64000
    """With ``store_threshold`` >= 2: chunk keys whose computations are counted (the
    least recently counted leaves the table)."""
    removal_check_s: float = 1.0
    """With KV events on: seconds between checks that the segments announced to routers
    are still stored.  One found gone (evicted by this engine or another, by a server's
    budget or Redis's ``maxmemory``, cleared by an operator) is announced removed
    (``BlockRemoved``); this is how long a router may see a prefix that is gone.
    0: never checked."""
    accept_store_dtypes: tuple[str, ...] | None = None
    """Other store formats this engine also looks up and loads (``"int4"``,
    ``"int8:per_channel"``, ``"auto"``, ...).  Default: its own only."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        if extra is not None and not isinstance(extra, Mapping):
            raise HurrayError(f"kv_connector_extra_config is a {type(extra).__name__} "
                              f"({_shown(extra)}); it is an object of keys and values",
                              field="kv_connector_extra_config",
                              value=type(extra).__name__, rule="a JSON object (a dict)")
        extra = dict(extra or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(known), key=repr)  # keys need not be strings
        if unknown:
            raise HurrayError(f"kv_connector_extra_config has unknown key(s) {unknown}"
                              f"{did_you_mean(unknown[0], known)}; known: "
                              f"{', '.join(known)}", field="kv_connector_extra_config",
                              value=unknown, rule="a key the connector reads")
        if not extra.get("url"):
            raise HurrayError("HurrayConnector needs kv_connector_extra_config {'url': ...}: "
                              "file:///DIR, hurray://HOST:PORT or redis://HOST:PORT",
                              field="url", rule="kv_connector_extra_config.url")
        config = cls(**{k: _parse(k, known[k].type, v) for k, v in extra.items()})
        if config.load_mode not in LOAD_MODES:
            raise HurrayError(f"kv_connector_extra_config['load_mode'] is "
                              f"{config.load_mode!r}; it is one of {', '.join(LOAD_MODES)}",
                              field="load_mode", value=config.load_mode,
                              rule=f"one of {', '.join(LOAD_MODES)}")
        config._check_url()
        config._check_tls()
        config.accepted_formats()  # every store format now, not at the first request
        return config

    def store_format(self) -> store_format.StoreFormat:
        known = ", ".join(store_format.scheme_names())
        if self.quantization is not None and \
                self.quantization not in store_format.scheme_names():
            raise HurrayError(f"kv_connector_extra_config['quantization'] is "
                              f"{self.quantization!r}; it is one of {known}",
                              field="quantization", value=self.quantization,
                              rule=f"one of {known}")
        if self.quantization is not None and self.store_dtype not in ("int8", "int4"):
            raise HurrayError(f"kv_connector_extra_config['quantization'] is "
                              f"{self.quantization!r} with store_dtype {self.store_dtype!r}; "
                              "a quantization scheme applies to store_dtype int8 and int4",
                              field="quantization", value=self.quantization,
                              rule="quantization with store_dtype int8 or int4 only")
        return store_format.parse(self.store_dtype, "store_dtype", self.quantization)

    def accepted_formats(self) -> list[store_format.StoreFormat]:
        """This engine's store format first, then those ``accept_store_dtypes`` adds (a
        bare int8 or int4 with this engine's ``quantization`` scheme)."""
        own = self.store_format()
        out = [own]
        for text in self.accept_store_dtypes or ():
            fmt = store_format.parse(text, "accept_store_dtypes", self.quantization)
            if fmt not in out:
                out.append(fmt)
        return out

    def _check_url(self) -> None:
        """The URL's scheme and form now, not when the store first opens (after three
        failed requests); the schemes and what each takes come from the store registry."""
        options = [k for k in ("tls_cert", "tls_key", "tls_ca", "server_hostname",
                               "max_bytes", "max_pinned_bytes", "max_bytes_per_tenant")
                   if getattr(self, k) is not None]
        why = url_problem(self.url, options)
        if why:
            raise HurrayError(f"kv_connector_extra_config['url'] is {self.url!r}: {why}",
                              field="url", value=self.url, rule="a chunk store URL")


    def _check_tls(self) -> None:
        """The TLS files now (readable, PEM of their kind, the key the certificate's),
        not as an outage at the first request that reaches the store."""
        from ...net.tls import client_context

        client_context(self.tls_cert, self.tls_key, self.tls_ca,
                       names={kind: f"kv_connector_extra_config['tls_{kind}']"
                              for kind in ("cert", "key", "ca")})

def _parse(key: str, kind: Any, value: Any) -> Any:
    kind = str(kind)
    if value is None and "None" in kind:
        return None
    if kind.startswith("Size"):
        try:
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise ValueError
            out = value if isinstance(value, int) else units.parse_size(value)
        except ValueError:
            out = None
        if out is None or not 0 < out <= MAX_SIZE:
            raise HurrayError(f"kv_connector_extra_config[{key!r}] is {_shown(value)}; a size "
                              "is a positive byte count or a string like \"64G\", \"512M\", "
                              "up to 8 EiB", field=key, value=value,
                              rule="a positive size up to 2**63 - 1 bytes")
        return out
    if kind.startswith("tuple"):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(x, str) for x in items):
            raise HurrayError(f"kv_connector_extra_config[{key!r}] is {value!r}; it is a "
                              "list of strings (or one comma-separated string)", field=key,
                              value=value, rule="a list of strings")
        return tuple(x.strip() for x in items if x.strip())
    if kind.startswith("bool"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise HurrayError(f"kv_connector_extra_config[{key!r}] is {value!r}; a boolean is "
                          "true or false", field=key, value=value, rule="true or false")
    if kind.startswith(("int", "float")):
        number = int if kind.startswith("int") else float
        try:
            if isinstance(value, bool) or (number is int and isinstance(value, float)):
                raise ValueError
            out = number(value)
        except (TypeError, ValueError, OverflowError):  # float(10**400) overflows
            out = None
        least = "0 or more" if key in ZERO_OFF else "positive"
        if out is None or not (out >= 0 if key in ZERO_OFF else out > 0) or out > LIMIT:
            raise HurrayError(f"kv_connector_extra_config[{key!r}] is {_shown(value)}; it is "
                              f"a {least} {number.__name__} up to {LIMIT:g}", field=key,
                              value=value, rule=f"a {least} {number.__name__}")
        return out
    if not isinstance(value, str) or not value.strip():
        raise HurrayError(f"kv_connector_extra_config[{key!r}] is {value!r}; it is a "
                          "non-empty string (leave the key out for its default)", field=key,
                          value=value, rule="a non-empty string")
    return value


def _shown(value: Any) -> str:
    """``repr(value)``, cut short when long (``10**400`` has 401 digits)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


LOAD_MODES = ("auto", "sync", "async")
ZERO_OFF = ("removal_check_s",)  # numbers whose 0 turns their feature off
LIMIT = 1e9  # finite, and no deadline or count this large is meant
MAX_SIZE = (1 << 63) - 1  # what a byte count on disk or the wire holds

KEYS = tuple(f.name for f in dataclasses.fields(ConnectorConfig))
