"""The settings a store class takes besides its URL (``ChunkStore.OPTIONS``), each an
``Option`` of a kind the connector's config and the command line parse the same way."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from .. import units
from ..errors import ConfigError

KINDS = ("str", "size", "int", "float", "bool")


@dataclass(frozen=True)
class Option:
    """A setting a store class takes besides its URL (``ChunkStore.OPTIONS``): the
    ``open_store`` keyword ``name``, and the connector's ``kv_connector_extra_config`` key
    of that name.  ``kind`` says how the connector reads it: ``"str"`` (a non-empty string:
    a name, a file), ``"size"`` (bytes, or text like ``"64G"``), ``"int"`` or ``"float"``
    (positive) or ``"bool"``; a store is given only the options set (never None)."""

    name: str
    kind: str = "str"
    doc: str = ""

    def parse(self, text: str, named: str) -> Any:
        """``text`` (a command line's) read as this option's kind; a ``ConfigError``
        naming it as ``named`` (``--option bucket``) and the rule when it is not."""
        rules = {"str": "a non-empty string", "size": "a positive byte count or a size "
                 "like 64G, in ASCII digits", "int": "a positive integer in ASCII digits",
                 "float": "a positive number in ASCII digits", "bool": "true or false"}
        value: Any = None
        with contextlib.suppress(ValueError, OverflowError):
            if self.kind == "str":
                value = text if text.strip() else None
            elif self.kind == "bool":
                value = {"true": True, "false": False}.get(text.strip().lower())
            else:
                number = {"size": units.parse_size, "int": units.parse_int,
                          "float": units.parse_float}[self.kind](text)
                value = number if 0 < number < float("inf") else None
        if value is None:
            raise ConfigError(f"{named} is {text!r}; it is {rules[self.kind]}",
                              field=self.name, value=text, rule=rules[self.kind])
        return value
