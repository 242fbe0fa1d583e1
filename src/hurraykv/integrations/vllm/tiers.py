"""``kv_connector_extra_config['tiers']``: the connector's stores, fastest first, each a
store URL with that store's own options (``{"url": "mem://", "max_bytes": "8G"}``), read
once into ``Tier``s.  ``url`` with its options at the top level stays the one-tier form;
the two are never mixed, so no option is read for the wrong store.

A tier entry may also carry ``store_threshold`` (``TIER_KEYS``: the connector's own keys a
tier takes), the computations of a chunk after which that tier stores it
(``save_plans.py``); without it the tier takes the connector's ``store_threshold``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ... import chunks
from ...errors import ConfigError

TIER_KEYS = ("store_threshold",)  # the connector's keys a tier entry may carry


@dataclass(frozen=True)
class Tier:
    url: str
    options: dict[str, Any]
    store_threshold: int | None = None  # None: the connector's


def parse_tiers(value: Any, parse: Callable[[str, Any, Any], Any],
                kinds: Mapping[str, str]) -> tuple[Tier, ...]:
    """``value`` read as tiers; ``parse(key, kind, value)`` reads one option of a kind
    (``kinds``: an ``Option.kind`` to the config's type of it)."""
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"kv_connector_extra_config['tiers'] is {value!r:.80}; it is a "
                          "non-empty list of stores, fastest first, each {\"url\": ..., and "
                          "that store's options}", field="tiers", value=repr(value)[:80],
                          rule="a non-empty list of objects")
    out: list[Tier] = []
    for i, entry in enumerate(value):
        where = f"kv_connector_extra_config['tiers'][{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("url"), str):
            raise ConfigError(f"{where} is {entry!r:.80}; a tier is an object with a "
                              "\"url\" and that store's options", field=f"tiers[{i}]",
                              value=repr(entry)[:80], rule="{\"url\": ..., options}")
        url = entry["url"]
        given = [k for k in entry if k != "url" and k not in TIER_KEYS]
        why = chunks.url_problem(url, given)
        if why:
            raise ConfigError(f"{where}['url'] is {url!r}: {why}", field=f"tiers[{i}].url",
                              value=url, rule="a chunk store URL")
        cls = chunks.store_class(url.partition(":")[0])
        declared = {o.name: o for o in cls.OPTIONS} if cls is not None else {}
        options = {k: parse(f"tiers[{i}].{k}", kinds[declared[k].kind], entry[k])
                   for k in given}
        options = {k: v for k, v in options.items() if v is not None}
        if cls is not None:
            cls.check_options(options, lambda key, w=where: f"{w}[{key!r}]")
        if any(t.url == url for t in out):
            raise ConfigError(f"{where}['url'] {url!r} is an earlier tier's too; each tier "
                              "is a store of its own", field=f"tiers[{i}].url", value=url,
                              rule="tiers of distinct URLs")
        threshold = None
        if "store_threshold" in entry:
            threshold = parse(f"tiers[{i}].store_threshold", "int", entry["store_threshold"])
        out.append(Tier(url, options, threshold))
    return tuple(out)


__all__ = ["TIER_KEYS", "Tier", "parse_tiers"]
