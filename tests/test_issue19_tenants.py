"""Regression tests for issue 19 (outside reliability campaign) under mutual TLS, with
real certificates (tests/certs.py) and a real server on loopback: what identifies a
tenant, and what a tenant sees of the server.  Each test failed on the code before its
fix."""

from __future__ import annotations

import json

import pytest
from cryptography import x509

from hurraykv.cli import main
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from tests.certs import PKI, name
from tests.snapshots import make_snapshot


@pytest.fixture
def pki(tmp_path):
    (tmp_path / "pki").mkdir()
    return PKI(tmp_path / "pki")


@pytest.fixture
def tls_server(tmp_path, pki):
    """``(server thread, connect(label, subject, san) -> KVClient, cert paths by label)``."""
    server, key = pki.pair("server")
    persist = tmp_path / "secret-persist-dir"
    made: dict[str, tuple[str, str]] = {}
    with KVServer(listen="127.0.0.1:0", tls_cert=server, tls_key=key, tls_ca=pki.ca_pem,
                  persist=str(persist)).run_in_thread() as st:
        def connect(label: str, subject: x509.Name | None = None, san: list | None = None
                    ) -> KVClient:
            if label not in made:
                made[label] = pki.client(label, subject, san)
            cert, ckey = made[label]
            return KVClient(st.address, tls_cert=cert, tls_key=ckey, tls_ca=pki.ca_pem)
        yield st, connect, made


# ------------------------------------------------------------------- 11 per-tenant stat
def test_stat_shows_a_tenant_its_own_objects_only(tls_server, pki, capsys):
    st, connect, made = tls_server
    alice, bob = connect("alice", name(("CN", "alice"))), connect("bob", name(("CN", "bob")))
    a1, a2, b1 = make_snapshot(seed=1), make_snapshot(seed=2), make_snapshot("int8", seed=3)
    alice.push("one", a1)
    alice.push("two", a2)
    bob.push("mine", b1)
    s = bob.stat()
    assert (s["objects_in_memory"], s["persisted_objects"]) == (1, 1)  # before: 3, 3
    assert s["memory_bytes"] == st.server.store.get(
        next(k for k in st.server.store._objects if k.endswith("\x00mine"))).nbytes
    assert s["connections"] == 1 and s["reserved_bytes"] == 0
    assert s["persist"] is True and "secret-persist-dir" not in json.dumps(s)
    assert "idle_receive_bytes" not in s
    assert alice.stat()["objects_in_memory"] == 2
    cert, key = made["bob"]
    assert main(["stat", st.address, "--tls-cert", cert, "--tls-key", key,
                 "--tls-ca", pki.ca_pem]) == 0
    out = capsys.readouterr().out
    assert "1 in memory, 1 persisted" in out and "secret-persist-dir" not in out
    assert "persist      : on" in out and "this tenant's" in out
    alice.close()
    bob.close()


def test_stat_without_tenants_is_server_wide(tmp_path):
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address) as c, KVClient(st.address) as d:
        c.push("a", make_snapshot(seed=1))
        d.push("b", make_snapshot(seed=2))
        s = c.stat()
        assert s["objects_in_memory"] == 2 and s["persist"] == str(tmp_path)
        assert s["connections"] == 2 and "tenant" not in s
