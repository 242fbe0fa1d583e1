"""``kv_connector_extra_config`` parsed once into a typed, frozen object.

Every key is declared here with its type, default and meaning, except a store's own
settings, which its class declares (``ChunkStore.OPTIONS``: ``max_bytes``, the TLS files,
a plugin store's ``bucket``), so that a new store edits only its own module; they are
parsed by their kind into ``store_options`` (``docs/vllm.md``'s table is tested against
``KEYS``).  An unknown key is refused with the list of known ones, a
boolean is ``true``/``false`` (JSON or the strings) and nothing else, numbers must be
positive (as text: ASCII digits; ``int()`` reads any script's), strings non-empty,
sizes bytes or binary multiples ("64G", "64GB" and "64GiB" are all 64 GiB): a typo
never silently becomes a default.  Every refusal is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from ... import chunks, units
from ...chunks.stack import POLICIES
from ...errors import ConfigError, did_you_mean
from . import store_format
from .tiers import Tier, parse_tiers

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
    store_dtype: str = "auto"
    """What segments hold: ``"auto"`` (the cache dtype), ``"int8"``, ``"int4"`` or
    ``"fp8"`` (e4m3); part of the cache identity (``store_format.py``)."""
    quantization: str | None = None
    """For int8 and int4: ``"per_block_affine"`` (default; a scale per token of a page)
    or ``"per_channel"`` (a scale per head_dim channel of each layer's pool)."""
    store_threshold: int = 1
    """Store a chunk the Nth time a request of this engine computes it (as vLLM's
    offloading connector's ``store_threshold``): 2 keeps one-off prompts out of the
    store, so they do not evict what comes back.  1: every chunk, at once.  With
    ``tiers``, the default of each tier's own ``store_threshold`` (``thresholds``)."""
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
    tiers: tuple[Tier, ...] | None = None
    """Stores, fastest first, instead of ``url``: a list of objects, each a store URL and
    that store's own options (``[{"url": "mem://", "max_bytes": "8G"}, {"url":
    "file:///nvme/kv", "max_bytes": "500G"}]``), and optionally the tier's own
    ``store_threshold``.  A lookup takes the longest prefix any tier holds; a lower
    tier's hit is promoted into the tiers above, off the request's path
    (``chunks/stack.py``)."""
    write_policy: str = "write_through"
    """With ``tiers``: ``"write_through"`` (the first tier before the save is done, the
    others behind a bounded queue that drops under pressure) or ``"write_back"`` (a
    segment goes down when a ``mem://`` first tier drops it)."""
    store_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The settings of the URL's store given, parsed: the keys its class declares
    (``ChunkStore.OPTIONS``; ``file://``'s ``max_bytes``, ``max_pinned_bytes``,
    ``max_bytes_per_tenant``, ``hurray://``'s TLS files, a plugin store's own), handed to
    ``open_store``.  Not a key of ``kv_connector_extra_config`` itself."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config is a {type(extra).__name__} "
                              f"({_shown(extra)}); it is an object of keys and values",
                              field="kv_connector_extra_config",
                              value=type(extra).__name__, rule="a JSON object (a dict)")
        extra = dict(extra or {})
        own = {f.name: f for f in dataclasses.fields(cls) if f.name != "store_options"}
        stores = chunks.options()  # every registered store's (a plugin's too)
        known = [*own, *(k for k in stores if k not in own)]
        unknown = sorted(set(extra) - set(known), key=repr)  # keys need not be strings
        if unknown:
            raise ConfigError(f"kv_connector_extra_config has unknown key(s) {unknown}"
                              f"{did_you_mean(unknown[0], known)}; known: "
                              f"{', '.join(known)}", field="kv_connector_extra_config",
                              value=unknown, rule="a key the connector reads")
        tiers = None
        if extra.get("tiers") is not None:
            mixed = sorted(k for k in extra if k == "url" or k not in own)
            if mixed:
                raise ConfigError(f"kv_connector_extra_config has 'tiers' and {mixed}: a "
                                  "store's URL and options go in its tier's entry",
                                  field="tiers", value=mixed, rule="tiers or url, not both")
            tiers = parse_tiers(extra.pop("tiers"), _parse, KIND_TYPES)
            extra["url"] = tiers[0].url
        extra.pop("tiers", None)
        if not extra.get("url"):
            raise ConfigError("HurrayConnector needs kv_connector_extra_config {'url': ...}: "
                              f"{chunks.url_forms()}", field="url",
                              rule="kv_connector_extra_config.url")
        # a store option is read as the URL's store declares it (else as the first
        # class that does: the URL check then says whose it is)
        declared = {o.name: o for o in getattr(chunks.store_class(_scheme(extra["url"])),
                                               "OPTIONS", ())}
        parsed = {k: _parse(k, own[k].type if k in own else KIND_TYPES[
            declared.get(k, stores[k]).kind], v) for k, v in extra.items()}
        config = cls(**{k: v for k, v in parsed.items() if k in own},
                     store_options=dict(tiers[0].options) if tiers else {
                         k: v for k, v in parsed.items() if k not in own and v is not None},
                     tiers=tiers)
        if config.load_mode not in LOAD_MODES:
            raise ConfigError(f"kv_connector_extra_config['load_mode'] is "
                              f"{config.load_mode!r}; it is one of {', '.join(LOAD_MODES)}",
                              field="load_mode", value=config.load_mode,
                              rule=f"one of {', '.join(LOAD_MODES)}")
        if config.write_policy not in POLICIES:
            raise ConfigError(f"kv_connector_extra_config['write_policy'] is "
                              f"{config.write_policy!r}; it is one of {', '.join(POLICIES)}",
                              field="write_policy", value=config.write_policy,
                              rule=f"one of {', '.join(POLICIES)}")
        config._check_tier_thresholds()
        config._check_url()
        config._check_store_options()
        config.accepted_formats()  # every store format now, not at the first request
        return config

    def store_format(self) -> store_format.StoreFormat:
        schemes = store_format.scheme_names()
        if self.quantization is not None and self.quantization not in schemes:
            known = ", ".join(schemes)
            raise ConfigError(f"kv_connector_extra_config['quantization'] is "
                              f"{self.quantization!r}; it is one of {known}",
                              field="quantization", value=self.quantization,
                              rule=f"one of {known}")
        if self.quantization is not None and self.store_dtype not in ("int8", "int4"):
            raise ConfigError(f"kv_connector_extra_config['quantization'] is "
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

    def thresholds(self) -> tuple[int, ...]:
        """Each tier's ``store_threshold`` (its own, else the connector's), fastest first;
        under ``write_back`` the first tier's for every tier; one store: the
        connector's alone."""
        if not self.tiers:
            return (self.store_threshold,)
        own = tuple(self.store_threshold if t.store_threshold is None else t.store_threshold
                    for t in self.tiers)
        if self.write_policy == "write_back":  # the stack writes the first tier alone:
            return (own[0],) * len(own)  # what it admits is what every tier is given
        return own

    def _check_tier_thresholds(self) -> None:
        """``write_back`` writes the first tier only, and a lower tier receives what the
        first drops: that is no new computation to count, so a lower tier's threshold
        would mean nothing; refused rather than ignored."""
        if self.write_policy != "write_back":
            return
        for i, tier in enumerate(self.tiers or ()):
            if i and tier.store_threshold is not None:
                raise ConfigError(
                    f"kv_connector_extra_config['tiers'][{i}]['store_threshold'] is "
                    f"{tier.store_threshold} with write_policy 'write_back': a lower tier "
                    "receives only what the first tier drops, so only the first tier (or "
                    "the connector's store_threshold) admits; use write_through for a "
                    "threshold per tier", field=f"tiers[{i}].store_threshold",
                    value=tier.store_threshold,
                    rule="store_threshold on the first tier only under write_back")

    def _check_url(self) -> None:
        """The URL's scheme and form now, not when the store first opens (after three
        failed requests); the schemes and what each takes come from the store registry."""
        why = chunks.url_problem(self.url, list(self.store_options))
        if why:
            raise ConfigError(f"kv_connector_extra_config['url'] is {self.url!r}: {why}",
                              field="url", value=self.url, rule="a chunk store URL")

    def _check_store_options(self) -> None:
        """What the store's class checks of its options now (a TLS file readable, PEM of
        its kind), not as an outage at the first request that reaches the store."""
        store = chunks.store_class(_scheme(self.url))
        if store is not None:
            store.check_options(self.store_options,
                                lambda key: f"kv_connector_extra_config[{key!r}]")


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
            raise ConfigError(f"kv_connector_extra_config[{key!r}] is {_shown(value)}; a size "
                              "is a positive byte count or a string like \"64G\", \"512M\" "
                              "in ASCII digits, up to 8 EiB", field=key, value=value,
                              rule="a positive size up to 2**63 - 1 bytes, in ASCII digits")
        return out
    if kind.startswith("tuple"):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(x, str) for x in items):
            raise ConfigError(f"kv_connector_extra_config[{key!r}] is {value!r}; it is a "
                              "list of strings (or one comma-separated string)", field=key,
                              value=value, rule="a list of strings")
        return tuple(x.strip() for x in items if x.strip())
    if kind.startswith("bool"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"kv_connector_extra_config[{key!r}] is {value!r}; a boolean is "
                          "true or false", field=key, value=value, rule="true or false")
    if kind.startswith(("int", "float")):
        number = int if kind.startswith("int") else float
        try:
            if isinstance(value, bool) or (number is int and isinstance(value, float)):
                raise ValueError
            if isinstance(value, str):  # int() and float() read any script's digits
                out = (units.parse_int if number is int else units.parse_float)(value)
            else:
                out = number(value)
        except (TypeError, ValueError, OverflowError):  # float(10**400) overflows
            out = None
        least = "0 or more" if key in ZERO_OFF else "positive"
        if out is None or not (out >= 0 if key in ZERO_OFF else out > 0) or out > LIMIT:
            raise ConfigError(f"kv_connector_extra_config[{key!r}] is {_shown(value)}; it is "
                              f"a {least} {number.__name__} up to {LIMIT:g} (as text: in "
                              "ASCII digits)", field=key, value=value,
                              rule=f"a {least} {number.__name__}, as text in ASCII digits")
        return out
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"kv_connector_extra_config[{key!r}] is {value!r}; it is a "
                          "non-empty string (leave the key out for its default)", field=key,
                          value=value, rule="a non-empty string")
    return value


def _scheme(url: Any) -> str:
    """The scheme of ``url`` ("" when it does not parse: the URL check says why)."""
    try:
        return urlparse(str(url)).scheme
    except ValueError:
        return ""


def _shown(value: Any) -> str:
    """``repr(value)``, cut short when long (``10**400`` has 401 digits)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


LOAD_MODES = ("auto", "sync", "async")
ZERO_OFF = ("removal_check_s",)  # numbers whose 0 turns their feature off
LIMIT = 1e9  # finite, and no deadline or count this large is meant
MAX_SIZE = (1 << 63) - 1  # what a byte count on disk or the wire holds

# how the connector parses a store's option of each kind (``chunks.Option.kind``)
KIND_TYPES = {"str": "str | None", "size": "Size | None", "int": "int | None",
              "float": "float | None", "bool": "bool | None"}
# the keys docs/vllm.md's table documents: the connector's and the built-in stores'
KEYS = tuple(f.name for f in dataclasses.fields(ConnectorConfig) if f.name != "store_options"
             ) + tuple(o.name for c in chunks.store_classes(plugins=False) for o in c.OPTIONS)
