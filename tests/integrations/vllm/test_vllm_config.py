"""``kv_connector_extra_config`` parsed once: unknown keys, loose booleans and bad numbers
are refused by name (the connector module itself needs vLLM; its config does not)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hurraykv as hk
from hurraykv.chunks.urls import open_store
from hurraykv.integrations.vllm.config import KEYS, ConnectorConfig


def test_defaults_and_typed_values():
    c = ConnectorConfig.from_extra({"url": "file:///kv", "save_decode": "false",
                                    "async_save": True, "chunk_size": 64,
                                    "lookup_timeout_ms": "20"})
    assert (c.save_decode, c.async_save, c.chunk_size, c.lookup_timeout_ms) == (
        False, True, 64, 20.0)
    assert ConnectorConfig.from_extra({"url": "hurray://h:1"}).load_timeout_ms == 2000.0


def test_a_stores_own_keys_come_from_its_class_parsed_by_their_kind():
    """``max_bytes`` and the TLS files are options their store classes declare
    (``ChunkStore.OPTIONS``), handed to ``open_store`` as ``store_options``; the config
    has no field of a store's own."""
    from hurraykv import chunks

    c = ConnectorConfig.from_extra({"url": "file:///kv", "max_bytes": "64G",
                                    "max_pinned_bytes": None, "chunk_size": 32})
    assert c.store_options == {"max_bytes": 64 << 30} and c.chunk_size == 32
    assert ConnectorConfig.from_extra({"url": "hurray://h:1"}).store_options == {}
    builtin = {o.name for cls in chunks.store_classes(plugins=False) for o in cls.OPTIONS}
    assert builtin == {"max_bytes", "max_pinned_bytes", "max_bytes_per_tenant", "tls_cert",
                       "tls_key", "tls_ca", "server_hostname", "endpoint", "region"} \
        and builtin <= set(KEYS)
    with pytest.raises(hk.HurrayError, match=r"unknown key\(s\) \['store_options'\]"):
        ConnectorConfig.from_extra({"url": "file:///kv", "store_options": {}})


@pytest.mark.parametrize(("extra", "why"), [
    ({"url": "file:///kv", "max_byte": "1G"},
     r"unknown key\(s\) \['max_byte'\]; did you mean 'max_bytes'\?; known: url, "),
    ({"url": "file:///kv", "zzz": 1}, r"unknown key\(s\) \['zzz'\]; known: url, "),
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
    ({"url": "fle:///kv"}, r"scheme 'fle' is not one of file, hurray"),  # the built-ins first
    ({"url": "file://tmp/kv"}, r"names a local directory"),
    ({"url": "redis://h:1", "tls_cert": "c.pem"},
     r"'tls_cert' is not one a redis:// store takes.*hurray://HOST:PORT takes it"),
    ({"url": "hurray://"}, r"names HOST:PORT"),
])
def test_mistakes_are_refused_by_name(extra, why):
    with pytest.raises(hk.HurrayError, match=why):
        ConnectorConfig.from_extra(extra)


def test_the_docs_table_lists_exactly_the_known_keys():
    text = (Path(__file__).parents[3] / "docs" / "vllm.md").read_text()
    table = text[text.index("| key |"):]
    table = table[:table.index("\n\n")]
    documented = {k for row in table.splitlines()[2:]
                  for k in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert documented == set(KEYS)


def test_the_docs_table_defaults_are_the_configs():
    """Every number the table gives as a default (the deadlines "When things go wrong"
    quotes, the failures before down, ...) is the one a config without the key gets."""
    text = (Path(__file__).parents[3] / "docs" / "vllm.md").read_text()
    table = text[text.index("| key |"):]
    table = table[:table.index("\n\n")]
    defaults = ConnectorConfig.from_extra({"url": "file:///kv"})
    checked = []
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        key, default = re.fullmatch(r"`([a-z_]+)`", cells[0]), re.fullmatch(r"`([0-9.]+)`",
                                                                            cells[-1])
        if key and default:
            assert getattr(defaults, key[1]) == float(default[1]), row
            checked.append(key[1])
    assert {"lookup_timeout_ms", "load_timeout_ms", "failures_before_down"} <= set(checked)


@pytest.mark.parametrize(("extra", "key", "why"), [
    # Issue 29 item 4: OverflowError, ValueError, a NUL at open, a query dropped
    *[({"url": "file:///kv", k: 10**400}, k, rf"'{k}'\] is 1000.*\(401 characters\); it is "
       r"a positive float up to 1e\+09") for k in ("lookup_timeout_ms", "load_timeout_ms",
                                                   "save_timeout_ms", "max_backoff_s")],
    ({"url": "file:///kv", "max_bytes": 10**400}, "max_bytes", r"up to 8 EiB"),
    ({"url": "hurray://[::1"}, "url", r"'hurray://\[::1': it does not parse as a URL"),
    (["url", "file:///kv"], "kv_connector_extra_config",
     r"kv_connector_extra_config is a list \(\['url', 'file:///kv'\]\); it is an object"),
    ("file:///kv", "kv_connector_extra_config", r"is a str"),
    ({"url": "file:///tmp/%00x"}, "url", r"its path '/tmp/%00x' holds a NUL byte \(at "
                                         r"character 5 of the decoded path\)"),
    ({"url": "file:///tmp/%ffx"}, "url", r"percent-escape that is not UTF-8"),
    ({"url": "file:///DIR?max_bytes=1"}, "url",
     r"its query 'max_bytes=1' is not read by a file:// store \(file:///DIR\): max_bytes is "
     r"a setting of its own \(the kv_connector_extra_config key 'max_bytes'"),
    ({"url": "file:///DIR?x=1"}, "url", r"its query 'x=1' is not read .*'\?' in a path is "
                                        r"written %3F"),
    ({"url": "file:///DIR#x"}, "url", r"its fragment 'x' is not read by a file:// store"),
    ({"url": "file:///DIR\t"}, "url", r"character 11 is '\\t'; a URL holds no control"),
    ({"url": "hurray://me@h:1"}, "url", r"its userinfo 'me' is not read by a hurray://"),
    ({"url": "hurray://h:1/x"}, "url", r"its path '/x' is not read by a hurray:// store"),
    ({"url": "hurray://h:1?tls_ca=x"}, "url", r"tls_ca is a setting of its own"),
    ({"url": "redis://h:1#x"}, "url", r"its fragment 'x' is not read by a redis:// store"),
    ({"url": "redis://h:1/abc"}, "url", r"its path '/abc' is not a database number"),
    ({"url": "redis+cluster://h:1/1"}, "url", r"a cluster has database 0 only"),
    ({"url": "redis://h:1?socket_timeout="}, "url", r"its query gives 'socket_timeout' no "
                                                    r"value"),
    ({"url": "file:///kv", 1: 2, "x": 3}, "kv_connector_extra_config",
     r"unknown key\(s\) \['x', 1\]"),
])
def test_every_refusal_is_a_hurray_error_naming_the_key(extra, key, why):
    with pytest.raises(hk.HurrayError, match=why) as e:
        ConnectorConfig.from_extra(extra)
    assert e.value.field == key


@pytest.mark.parametrize(("key", "value"), [
    ("chunk_size", "\uff11\uff12"),  # full-width digits: int() reads them as 12
    ("store_threshold", "\u0662"),  # an Arabic-Indic 2
    ("lookup_timeout_ms", "\uff12\uff10\uff10\uff10"),  # float() reads 2000.0
    ("max_pending_saves", "1_000"),  # int() takes Python's digit separators too
    ("max_bytes", "\uff16\uff14G"),  # a size: float() inside parse_size
    ("max_pending_save_bytes", "\u0661G"),
])
def test_numbers_as_text_are_ascii_digits_only(key, value):
    """Item 13 (issue 46): Python's int() and float() read the digits of every script,
    so '\uff11\uff12' became 12: a number or a size given as text is ASCII digits, and a
    ConfigError names the key, the value and the rule."""
    with pytest.raises(hk.ConfigError, match=rf"kv_connector_extra_config\['{key}'\] is "
                       rf"'{value}';.*ASCII digits") as e:
        ConnectorConfig.from_extra({"url": "file:///kv", key: value})
    assert (e.value.field, e.value.value) == (key, value) and "ASCII" in e.value.rule
    ConnectorConfig.from_extra({"url": "file:///kv", key: " 12 " if "bytes" not in key
                                else "12G"})  # the same in ASCII is taken


@pytest.mark.parametrize("url", ["file:///", "file:////", "file:///.", "file:///tmp/..",
                                 "file://localhost/", "file:///%2F"])
def test_a_file_store_at_the_filesystem_root_is_refused(url):
    """Item 13 (issue 46): ``file:///`` would put segments, ``aliases.log`` and the
    quarantine in ``/``, and ``hurraykv cache clear`` would sweep it."""
    with pytest.raises(hk.ConfigError, match=r"kv_connector_extra_config\['url'\] is "
                       rf"'{re.escape(url)}': its directory is the filesystem root") as e:
        ConnectorConfig.from_extra({"url": url})
    assert (e.value.field, e.value.value) == ("url", url)
    with pytest.raises(hk.ConfigError, match=r"the filesystem root"):
        open_store(url)  # the command line's stores too (hurraykv cache)


@pytest.mark.parametrize("url", ["file://localhost/kv", "file:///a%20b%3Fc", "hurray://h:1/",
                                 "hurray:///run/hk.sock", "hurray://[::1]:7878",
                                 "redis://u:pw@h:1/2?socket_timeout=3", "rediss://h:1",
                                 "redis+cluster://h:1"])
def test_every_part_a_store_reads_is_still_taken(url):
    assert ConnectorConfig.from_extra({"url": url}).url == url


def test_the_tls_files_are_checked_at_start_not_as_an_outage_later(tmp_path):
    """Issue 33 item 7: a tls_cert that did not exist was accepted and failed only as a
    store outage at the first request."""
    from tests.support.certs import PKI, name

    (tmp_path / "pki").mkdir()
    pki = PKI(tmp_path / "pki")
    cert, key = pki.client("alice", name(("CN", "alice")))
    url = "hurray://127.0.0.1:7878"
    good = ConnectorConfig.from_extra({"url": url, "tls_cert": cert, "tls_key": key,
                                       "tls_ca": pki.ca_pem})
    assert good.store_options == {"tls_cert": cert, "tls_key": key, "tls_ca": pki.ca_pem}
    (tmp_path / "empty.pem").write_text("")
    other_cert, other_key = pki.client("bob", name(("CN", "bob")))
    for extra, field, why in [
            ({"tls_cert": str(tmp_path / "missing.pem"), "tls_key": key}, "tls_cert",
             r"\['tls_cert'\] .*missing\.pem: cannot read: No such file"),
            ({"tls_cert": cert, "tls_key": str(tmp_path / "empty.pem")}, "tls_key",
             r"\['tls_key'\] .*empty\.pem: the file is empty"),
            ({"tls_ca": key}, "tls_ca", r"\['tls_ca'\] .*: not PEM CA certificates"),
            ({"tls_cert": cert, "tls_key": other_key}, "tls_cert",
             r"\['tls_cert'\] .* and kv_connector_extra_config\['tls_key'\] .*: the key "
             r"is not the certificate's")]:
        with pytest.raises(hk.HurrayError, match=why) as e:
            ConnectorConfig.from_extra({"url": url, **extra})
        assert e.value.field == f"kv_connector_extra_config[{field!r}]"
    assert other_cert  # bob's certificate is not alice's key's
