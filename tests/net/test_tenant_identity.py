"""Tenant identity under mutual TLS (``net/tenants.py``), issue 33 item 11: the reader is
cryptography's, and the ids stay the ones the hand-written DER reader gave.

``tests/data/tenant_ids.json`` (built by ``tests/support/tenant_certs.py``) holds certificates and
the id that reader gave each; every one keeps it, but for the few in ``CHANGED``."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hurraykv as hk
from hurraykv.net.server import KVServer
from hurraykv.net.tenants import UnreadableIdentity, certificate_names, tenant_identity
from tests.support.tenant_certs import certificate, cn, load, other, rdns, replace_once

CORPUS = load()

# Certificates the DER reader gave an id and cryptography refuses: not DER (an unsorted
# SET, a BER length, bytes after the end), a version X.509 has not got, strings outside
# their type's alphabet (PrintableString with '@' or '*', T61String of Latin-1), subjectAltName
# entries cryptography does not read (x400Address, ediPartyName, a constructed tag, a
# dNSName that is not UTF-8, an iPAddress that is neither an address nor a network), and
# extensions the DER reader skipped (one malformed, one repeated).  name -> the refusal.
CHANGED = {
    "unsorted-rdn": r"certificate cannot be read: .*InvalidSetOrdering.*TbsCertificate::subj",
    "non-minimal-length": r"certificate cannot be read: .*InvalidLength",
    "trailing-bytes": r"certificate cannot be read: .*ExtraData",
    "version-2": r"certificate cannot be read: 1 is not a valid X509 version",
    "cn-printable-at": r"certificate cannot be read: .*InvalidValue.*PrintableString",
    "cn-printable-star": r"certificate cannot be read: .*InvalidValue.*PrintableString",
    "cn-t61-latin1": r"subject cannot be read: .*InvalidValue",
    "x400": r"extensions cannot be read: x400Address/EDIPartyName are not supported",
    "x400-fr": r"extensions cannot be read: x400Address/EDIPartyName are not supported",
    "edi": r"extensions cannot be read: x400Address/EDIPartyName are not supported",
    "edi-bob": r"extensions cannot be read: x400Address/EDIPartyName are not supported",
    "dns-constructed": r"extensions cannot be read: .*UnexpectedTag.*constructed: true",
    "dns-latin1": r"extensions cannot be read: .*InvalidValue.*GeneralName::DNSName",
    "ip-five-bytes": r"extensions cannot be read: .* does not appear to be an IPv4 or IPv6",
    "ip-network-host-bits": r"extensions cannot be read: 10\.0\.0\.1/24 has host bits set",
    "bad-key-usage": r"extensions cannot be read: .*ShortData",
    "repeated-private-extension": r"extensions cannot be read: Duplicate 1\.2\.3\.4 ext",
}


@pytest.mark.parametrize("name", sorted(set(CORPUS) - set(CHANGED)))
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


# cryptography 42 reads these to the ids the DER reader gave; 50 refuses them
EITHER = {"cn-printable-at", "cn-printable-star"}


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_what_the_der_reader_took_and_cryptography_refuses(name):
    assert CORPUS[name].get("id"), "the DER reader gave it an id"
    try:
        got = tenant_identity(CORPUS[name]["der"])
    except UnreadableIdentity as e:
        assert re.search(CHANGED[name], str(e)), str(e)
        assert e.field in ("certificate", "subject", "extensions") and e.rule
    else:
        assert name in EITHER and got[0] == CORPUS[name]["id"]


def test_a_refusal_names_the_part_what_was_found_and_the_rule():
    with pytest.raises(UnreadableIdentity) as exc:
        tenant_identity(CORPUS["truncated"]["der"])
    e = exc.value
    assert (e.field, e.rule) == ("certificate", "an X.509 certificate in DER (RFC 5280)")
    assert "ShortData" in e.value and str(e).startswith("client certificate: certificate")
    with pytest.raises(UnreadableIdentity) as exc:
        tenant_identity(CORPUS["two-san-extensions"]["der"])
    assert exc.value.field == "extensions" and "Duplicate 2.5.29.17" in str(exc.value)
    with pytest.raises(UnreadableIdentity, match="no certificate"):
        tenant_identity(None)


def test_a_repeated_entry_is_one_entry_and_the_order_does_not_count():
    one, two = (certificate_names(CORPUS[n]["der"]) for n in ("dns-two", "dns-repeated"))
    assert one == two and one[2] == [b"\x82\x09a.example", b"\x82\x09b.example"]
    assert one[1] == b"\x30\x00"  # an empty subject


def test_names_cryptography_would_not_give_back_exactly_are_refused(monkeypatch):
    # whatever cryptography may normalise in a later release: an id is never over bytes
    # that are not the certificate's own (here a UTF8String read back as Printable)
    encode = x509.Name.public_bytes
    monkeypatch.setattr(x509.Name, "public_bytes", lambda self, backend=None: encode(
        self).replace(b"\x0c\x05alice", b"\x13\x05alice"))
    with pytest.raises(UnreadableIdentity, match=r"subject read back as .*not in the cert"):
        tenant_identity(CORPUS["cn"]["der"])


def test_what_cryptography_warns_about_is_refused_where_warnings_are_errors():
    said = r"(length must be|should be two characters)"  # cryptography 50 | 42
    with warnings.catch_warnings(record=True) as building:  # 50 warns as it builds it too
        warnings.simplefilter("always")
        der = certificate(rdns(x509.NameAttribute(NameOID.COUNTRY_NAME, "USA",
                                                  _validate=False)))
    assert all(re.search(said, str(w.message)) for w in building), building
    with pytest.warns(UserWarning, match=said):
        assert tenant_identity(der)  # a tenant, as for the DER reader
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UnreadableIdentity, match="subject cannot be read: .*" + said):
            tenant_identity(der)


def test_without_cryptography_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cryptography.x509", None)  # import fails
    with pytest.raises(hk.MissingDependencyError, match=r"pip install 'hurraykv\[tls\]'"):
        tenant_identity(CORPUS["cn"]["der"])


def test_without_cryptography_a_mutual_tls_server_does_not_start(monkeypatch, tmp_path):
    # not a server that starts and then fails every connection in connection_made
    from hurraykv.cli import main
    from tests.support.certs import PKI

    cert, key = PKI(tmp_path).pair("server")
    monkeypatch.setitem(sys.modules, "cryptography.x509", None)
    with pytest.raises(hk.MissingDependencyError, match=r"pip install 'hurraykv\[tls\]'"):
        KVServer(listen="127.0.0.1:0", tls_cert=cert, tls_key=key, tls_ca=cert)
    assert main(["serve", "--listen", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key,
                 "--tls-ca", cert]) == 2
    KVServer(listen="127.0.0.1:0", tls_cert=cert, tls_key=key).stop()  # no tenants: fine


def test_cryptography_is_imported_only_to_read_a_certificate():
    code = ("import sys, hurraykv, hurraykv.net.server, hurraykv.net.tenants as t\n"
            "assert 'cryptography' not in sys.modules\n"
            "t.scoped_key('ab', 'k')\n"
            "assert 'cryptography' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ fuzzing
SEEDS = [case["der"] for case in CORPUS.values() if case["der"]]


@st.composite
def mutated(draw) -> bytes:
    """A corpus certificate after one to four bit flips, byte changes, cuts, insertions of
    random bytes or deletions."""
    der = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(der)))
        op = draw(st.sampled_from(("flip", "byte", "cut", "insert", "delete")))
        if op == "flip" and i < len(der):
            der[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and i < len(der):
            der[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del der[i:]
        elif op == "insert":
            der[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del der[i:i + draw(st.integers(1, 8))]
    return bytes(der)


def _id_or_hurray_error(data: bytes) -> None:
    try:
        got = tenant_identity(data)
    except hk.HurrayError as e:  # UnreadableIdentity, with its reason
        assert str(e) and e.field
        return
    assert got is None or (re.fullmatch("[0-9a-f]{32}", got[0]) and isinstance(got[1], str))


# Found by differential fuzzing against the DER reader.  A BIT STRING under description
# (2.5.4.13): cryptography raised TypeError.
BIT_STRING_DESCRIPTION = bytes.fromhex(
    "3081ef3081a2a003020102020203e8300506032b657030243122302006035504030c196875727261796b"
    "762074656e616e7420636f72707573204341301e170d3235303130313030303030305a170d3335303130"
    "313030303030305a301e310e300c06035504030c05616c696365310c300a060355040d030300abcd302a"
    "300506032b657003210045e0f39cbdc1ecc9d724a3dc8e66c749075c517bf05b980304c3dd15a947d57c"
    "300506032b75700341002f073deff4b02eef38006c1a371446a9518e8fcbc400b4e264de6dc3290b4831"
    "c97bb27d37a9ce61f73390ba17c1020f5601a64114bb8529084777e6278a6f0f")

# CN=alice as an INTEGER, no string type: cryptography 42 raised KeyError
INTEGER_CN = replace_once(CORPUS["cn"]["der"], b"\x0c\x05alice", b"\x02\x05alice")


@settings(max_examples=400)
@given(st.one_of(mutated(), st.binary(max_size=300)))
@example(BIT_STRING_DESCRIPTION)
@example(INTEGER_CN)
def test_a_mutated_certificate_gives_an_id_or_a_hurray_error(data):
    _id_or_hurray_error(data)


@pytest.mark.slow  # ~7 s; test_fuzz's tenant target mutates 20000 more inputs
@settings(max_examples=4000)
@given(mutated())
def test_a_mutated_certificate_gives_an_id_or_a_hurray_error_campaign(data):
    _id_or_hurray_error(data)


@settings(max_examples=40)
@given(st.text(min_size=1, max_size=16), st.text(min_size=1, max_size=30))
def test_any_names_cryptography_builds_are_read_back_exactly(common_name, value):
    # at most 16 characters: 64 UTF-8 bytes (the CN limit); 30: under 128 (a short length)
    der = certificate(cn(common_name), [other(value)])
    issuer, subject, sans = certificate_names(der)
    assert issuer in der and subject in der and all(s in der for s in sans)
    again = certificate(cn(common_name), [other(value)], label="reissued", serial=2)
    assert tenant_identity(der)[0] == tenant_identity(again)[0]
