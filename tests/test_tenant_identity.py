"""Tenant identity under mutual TLS (``net/tenants.py``), issue 33 item 11: the reader is
cryptography's, and the ids stay the ones the hand-written DER reader gave.

``tests/data/tenant_ids.json`` (built by ``tests/tenant_certs.py``) holds certificates and
the id that reader gave each; every one must keep it."""

from __future__ import annotations

import pytest

from hurraykv.net.tenants import UnreadableIdentity, tenant_identity
from tests.tenant_certs import load

CORPUS = load()


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_a_certificate_keeps_the_tenant_id_it_had(name):
    case = CORPUS[name]
    if "refused" in case:
        with pytest.raises(UnreadableIdentity):
            tenant_identity(case["der"])
    else:
        got = tenant_identity(case["der"])
        assert (got[0] if got else None) == case["id"], case["what"]


def test_the_corpus_shows_what_makes_a_tenant():
    ids = {name: case.get("id") for name, case in CORPUS.items()}
    same = {"cn-reissued": "cn", "v1": "cn", "cn-empty-general-names": "cn",
            "dns-two-swapped": "dns-two", "dns-repeated": "dns-two",
            "spiffe-critical": "spiffe", "cn-dns-spiffe": "cn-spiffe-dns"}
    for name, twin in same.items():
        assert ids[name] == ids[twin], (name, twin)
    assert ids["nobody"] is ids["nobody-empty-general-names"] is None
    # every other certificate the reader gives an id to is a tenant of its own
    others = [ids[n] for n in ids if ids[n] and n not in same and ids[n] != ids["cn"]]
    assert len(others) == len(set(others)) >= 45
