"""Regression tests for issue 19 (outside reliability campaign) under mutual TLS, with
real certificates (tests/support/certs.py) and a real server on loopback: what identifies a
tenant, and what a tenant sees of the server; and issue 10's: certificates that name
nobody or flatten alike, keys spelling another tenant's.  Each test failed on the code
before its fix."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

import hurraykv as hk
from hurraykv.cli import main
from hurraykv.net.client import KVClient
from hurraykv.net.messages import ErrorCode as E
from hurraykv.net.server import KVServer
from hurraykv.net.tenants import UnreadableIdentity, client_key, scoped_key, tenant_identity
from tests.support.certs import PKI, name
from tests.support.snapshots import make_snapshot, zeroed


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


# ------------------------------------------------------------------- 1 identities
def _der(*elements: bytes) -> bytes:
    """DER of a GeneralNames value holding ``elements`` (each a whole GeneralName)."""
    body = b"".join(elements)
    return b"\x30" + bytes([len(body)]) + body


def _x400(country: str) -> bytes:
    """[3] x400Address: an ORAddress whose built-in attributes hold a country name."""
    c = b"\x13\x02" + country.encode()  # PrintableString
    attrs = b"\x61" + bytes([len(c)]) + c  # [APPLICATION 1] country-name
    std = b"\x30" + bytes([len(attrs)]) + attrs  # BuiltInStandardAttributes
    return b"\xa3" + bytes([len(std)]) + std  # IMPLICIT [3] of the ORAddress SEQUENCE


def _edi(party: str) -> bytes:
    """[5] ediPartyName with partyName [1] (explicit) as a UTF8String."""
    s = b"\x0c" + bytes([len(party)]) + party.encode()
    p = b"\xa1" + bytes([len(s)]) + s
    return b"\xa5" + bytes([len(p)]) + p


def _other(value: str, oid: str = "1.3.6.1.4.1.55555.1") -> x509.OtherName:
    """An otherName of a private type (getpeercert() renders it '<unsupported>')."""
    utf8 = b"\x0c" + bytes([len(value)]) + value.encode()  # UTF8String
    return x509.OtherName(x509.ObjectIdentifier(oid), utf8)


PAIRS = {  # two identities that getpeercert() renders alike (or that differ by one name)
    "otherName": ([_other("alice")], [_other("bob")]),
    "otherName-type": ([_other("alice")], [_other("alice", "1.3.6.1.4.1.55555.2")]),
    "registeredID": ([x509.RegisteredID(x509.ObjectIdentifier("1.2.3.4"))],
                     [x509.RegisteredID(x509.ObjectIdentifier("1.2.3.5"))]),
    "iPAddress": ([x509.IPAddress(ipaddress.ip_address("10.0.0.1"))],
                  [x509.IPAddress(ipaddress.ip_address("10.0.0.2"))]),
    "iPv6Address": ([x509.IPAddress(ipaddress.ip_address("fd00::1"))],
                    [x509.IPAddress(ipaddress.ip_address("fd00::1:0"))]),
}


@pytest.mark.parametrize("kind", list(PAIRS))
def test_certificates_naming_different_tenants_by_subject_alt_name_stay_apart(
        tls_server, kind):
    _, connect, _ = tls_server
    a_san, b_san = PAIRS[kind]
    alice, bob = connect("alice", x509.Name([]), a_san), connect("bob", x509.Name([]), b_san)
    alice.push("secret", make_snapshot(seed=1))
    with pytest.raises(hk.RemoteError) as exc:  # before: bob pulled alice's key
        bob.pull("secret")
    assert exc.value.code == E.UNKNOWN_TENSOR
    assert bob.list_keys() == [] and bob.stat()["objects_in_memory"] == 0
    with pytest.raises(hk.RemoteError):
        bob.delete("secret")
    # the same names in a certificate issued again (new key and serial): the same tenant
    again = connect("alice-again", x509.Name([]), a_san)
    assert again.pull("secret").equal(zeroed(make_snapshot(seed=1)))
    for c in (alice, bob, again):
        c.close()


@pytest.mark.parametrize("san", [_der(_x400("US")), _der(_edi("alice"))],
                         ids=["x400Address", "ediPartyName"])
def test_subject_alt_names_cryptography_does_not_read_are_refused_at_the_handshake(
        tls_server, san):
    # the DER reader gave them tenants of their own; cryptography (issue 33) reads neither
    _, connect, _ = tls_server
    with pytest.raises(hk.RemoteError) as exc:
        connect("x400-or-edi", x509.Name([]), san)
    assert exc.value.code == E.UNAUTHORIZED
    assert "x400Address/EDIPartyName are not supported" in str(exc.value)


def test_every_name_counts_and_their_order_does_not(tls_server):
    _, connect, _ = tls_server
    uri = x509.UniformResourceIdentifier("spiffe://example/ns/a")
    dns = x509.DNSName("a.example")
    first = connect("first", name(("CN", "svc")), [uri, dns])
    swapped = connect("swapped", name(("CN", "svc")), [dns, uri])
    fewer = connect("fewer", name(("CN", "svc")), [uri])
    first.push("k", make_snapshot(seed=4))
    assert swapped.pull("k").equal(zeroed(make_snapshot(seed=4)))  # a set, not a list
    with pytest.raises(hk.RemoteError):
        fewer.pull("k")  # one name less is another tenant
    for c in (first, swapped, fewer):
        c.close()


def _cert_der(pki: PKI, label: str, subject: x509.Name, san) -> bytes:
    cert, _ = pki.client(label, subject, san)
    return x509.load_pem_x509_certificate(open(cert, "rb").read()).public_bytes(
        serialization.Encoding.DER)


def test_identities_are_read_from_the_der_exactly(pki):
    sans = {repr(san): san for pair in PAIRS.values() for san in pair}  # 9 distinct
    ids = {key: tenant_identity(_cert_der(pki, f"c{i}", x509.Name([]), san))[0]
           for i, (key, san) in enumerate(sans.items())}
    assert len(set(ids.values())) == len(sans)
    assert tenant_identity(_cert_der(pki, "nobody", x509.Name([]), None)) is None
    good = _cert_der(pki, "good", name(("CN", "x")), None)
    for bad, why in ((good[:-7], "ShortData"), (b"\x30\x80" + good[2:], "InvalidLength"),
                     (b"", "no certificate")):
        with pytest.raises(UnreadableIdentity, match=why):
            tenant_identity(bad)
    with pytest.raises(UnreadableIdentity, match=r"extensions cannot be read: .*UnexpectedTag"):
        tenant_identity(_cert_der(pki, "odd", x509.Name([]), _der(b"\x0c\x01x")))


# ------------------------------------------------------------- issue 10: tenants
@pytest.fixture
def tls_client(tmp_path):
    pki = PKI(tmp_path)
    server, key = pki.pair("server")
    with KVServer(listen="127.0.0.1:0", tls_cert=server, tls_key=key,
                  tls_ca=pki.ca_pem).run_in_thread() as st:
        def client(label: str, subject: x509.Name, san: list | None = None) -> KVClient:
            cert, ckey = pki.client(label, subject, san)
            return KVClient(st.address, tls_cert=cert, tls_key=ckey, tls_ca=pki.ca_pem)
        yield client


def test_a_certificate_that_names_nobody_is_refused_at_the_handshake(tls_client):
    b = tls_client("tenant-b", name(("CN", "tenant-b")))
    b.push("secret", make_snapshot("float16", seed=3))
    with pytest.raises(hk.RemoteError) as exc:
        tls_client("empty", x509.Name([]))  # the old hole: tenant "" saw every key
    assert exc.value.code == E.UNAUTHORIZED and "names no tenant" in str(exc.value)
    b.close()


def test_subjects_that_flatten_to_the_same_text_are_different_tenants(tls_client):
    first = tls_client("two-rdns", name(("CN", "x"), ("O", "y")))
    second = tls_client("one-rdn", name(("CN", "x,organizationName=y")))
    s1, s2 = make_snapshot("float16", seed=1), make_snapshot("int8", seed=2)
    first.push("k", s1)
    with pytest.raises(hk.RemoteError) as exc:
        second.pull("k")
    assert exc.value.code == E.UNKNOWN_TENSOR
    second.push("k", s2)
    assert first.pull("k").equal(zeroed(s1)) and second.pull("k").equal(zeroed(s2))
    first.close()
    second.close()


def test_a_client_key_cannot_spell_another_tenants_key(tls_client):
    a = tls_client("tenant-a", name(("CN", "tenant-a")))
    for forged in ("commonName=tenant-b\x00secret", "\x00", ""):
        with pytest.raises(hk.RemoteError) as exc:
            a.push(forged, make_snapshot("float16"))
        assert exc.value.code == E.INVALID_MESSAGE and "NUL" in str(exc.value)
        with pytest.raises(hk.RemoteError):
            a.pull(forged)
    a.close()


def test_a_subject_alternative_name_alone_identifies_a_tenant(tls_client):
    spiffe = tls_client("spiffe", x509.Name([]),
                        [x509.UniformResourceIdentifier("spiffe://example/ns/a")])
    other = tls_client("spiffe-b", x509.Name([]),
                       [x509.UniformResourceIdentifier("spiffe://example/ns/b")])
    spiffe.push("k", make_snapshot("float16"))
    with pytest.raises(hk.RemoteError):
        other.pull("k")
    spiffe.close()
    other.close()


def test_tenant_identity_is_unambiguous_and_keys_never_cross(tmp_path):
    from cryptography.hazmat.primitives import serialization

    pki = PKI(tmp_path)

    def der(label: str, subject: x509.Name) -> bytes:
        pem = Path(pki.client(label, subject)[0]).read_bytes()
        return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)

    a = tenant_identity(der("a", name(("CN", "x"), ("O", "y"))))
    b = tenant_identity(der("b", name(("CN", "x,organizationName=y"))))
    c = tenant_identity(der("c", x509.Name([x509.RelativeDistinguishedName([
        x509.NameAttribute(x509.NameOID.COMMON_NAME, "x"),
        x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, "y")])])))
    assert a and b and c and len({a[0], b[0], c[0]}) == 3
    assert tenant_identity(der("nobody", x509.Name([]))) is None
    internal = scoped_key(a[0], "k")
    assert client_key(a[0], internal) == "k" and client_key(b[0], internal) is None
    assert client_key("", internal) is None and client_key("", "plain") == "plain"
    with pytest.raises(hk.HurrayError, match="without NUL"):
        scoped_key(a[0], b[0] + "\x00k")
