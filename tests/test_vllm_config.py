"""``kv_connector_extra_config`` parsed once: unknown keys, loose booleans and bad numbers
are refused by name (the connector module itself needs vLLM; its config does not)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hurraykv as hk
from hurraykv.integrations.vllm.config import KEYS, ConnectorConfig


def test_defaults_and_typed_values():
    c = ConnectorConfig.from_extra({"url": "file:///kv", "save_decode": "false",
                                    "async_save": True, "chunk_size": 64,
                                    "lookup_timeout_ms": "20"})
    assert (c.save_decode, c.async_save, c.chunk_size, c.lookup_timeout_ms) == (
        False, True, 64, 20.0)
    assert ConnectorConfig.from_extra({"url": "hurray://h:1"}).load_timeout_ms == 2000.0


@pytest.mark.parametrize(("extra", "why"), [
    ({"url": "file:///kv", "max_byte": "1G"}, r"unknown key\(s\) \['max_byte'\]; known: url, "),
    ({}, r"needs kv_connector_extra_config \{'url'"),
    ({"url": "file:///kv", "save_decode": "no"}, r"'save_decode'\] is 'no'; a boolean is true"),
    ({"url": "file:///kv", "save_decode": 1}, r"a boolean is true or false"),
    ({"url": "file:///kv", "chunk_size": 0}, r"'chunk_size'\] is 0; it is a positive int"),
    ({"url": "file:///kv", "chunk_size": 1.5}, r"positive int"),
    ({"url": "file:///kv", "lookup_timeout_ms": "soon"}, r"positive float"),
    ({"url": "file:///kv", "tls_ca": 3}, r"'tls_ca'\] is 3; it is a non-empty string"),
    ({"url": "file:///kv", "model_id": ""}, r"'model_id'\] is ''; it is a non-empty string"),
    ({"url": "file:///kv", "max_bytes": "infG"}, r"'max_bytes'\] is 'infG'; a size"),
    ({"url": "file://"}, r"absolute directory"),
    ({"url": "hurray://h:notaport"}, r"HOST:PORT"),
    ({"url": "file:///kv", "lookup_timeout_ms": "inf"}, r"positive float up to 1e\+09"),
    ({"url": "fle:///kv"}, r"scheme 'fle' is not one of file, hurray"),
    ({"url": "file://tmp/kv"}, r"names a local directory"),
    ({"url": "redis://h:1", "tls_cert": "c.pem"}, r"\['tls_cert'\] apply to hurray://"),
    ({"url": "hurray://"}, r"names HOST:PORT"),
])
def test_mistakes_are_refused_by_name(extra, why):
    with pytest.raises(hk.HurrayError, match=why):
        ConnectorConfig.from_extra(extra)


def test_the_docs_table_lists_exactly_the_known_keys():
    text = (Path(__file__).parents[1] / "docs" / "vllm.md").read_text()
    table = text[text.index("| key |"):]
    table = table[:table.index("\n\n")]
    documented = {k for row in table.splitlines()[2:]
                  for k in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert documented == set(KEYS)
