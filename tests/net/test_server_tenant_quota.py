"""``hurraykv serve --max-bytes-per-tenant`` under mutual TLS: a noisy tenant's pushes
evict its own least recently used objects from memory, never another tenant's."""

from __future__ import annotations

import pytest

from hurraykv.errors import RemoteError
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from hurraykv.testing import segment
from tests.net.test_server_retention import client_of
from tests.support.certs import PKI, name


def test_a_noisy_tenant_evicts_only_its_own_objects(tmp_path):
    pki = PKI(tmp_path)
    server, key = pki.pair("server")
    with client_of() as c:  # an object's bytes
        c.push("probe", segment(16, 0))
        size = c.stat()["memory_bytes"]
    with KVServer(listen="127.0.0.1:0", tls_cert=server, tls_key=key, tls_ca=pki.ca_pem,
                  max_bytes_per_tenant=3 * size).run_in_thread() as st:
        def connect(label: str) -> KVClient:
            cert, ckey = pki.client(label, name(("CN", label)), None)
            return KVClient(st.address, tls_cert=cert, tls_key=ckey, tls_ca=pki.ca_pem)

        quiet, noisy = connect("quiet"), connect("noisy")
        for i in range(3):
            quiet.push(f"q{i}", segment(16, i))
        for i in range(10):
            noisy.push(f"n{i}", segment(16, 10 + i))
        assert quiet.has(["q0", "q1", "q2"]) == [True] * 3  # untouched
        assert noisy.has([f"n{i}" for i in range(10)]) == [False] * 7 + [True] * 3
        assert noisy.stat()["memory_bytes"] <= 3 * size
        # its pinned objects fill its quota: the next push is refused, naming the quota
        assert noisy.retain(["n7", "n8", "n9"], pin=True, ttl_s=None) == ["n7", "n8", "n9"]
        with pytest.raises(RemoteError, match="max-bytes-per-tenant") as e:
            noisy.push("n10", segment(16, 30))
        assert e.value.code == 0xF1  # STORE_FULL
        assert quiet.has(["q0"]) == [True] and noisy.has(["n9"]) == [True]
        quiet.close()
        noisy.close()
