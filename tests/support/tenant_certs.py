"""A fixed corpus of client certificates for the tenant-identity tests
(``tests/net/test_tenant_identity.py``, the ``tenant`` fuzz target).

Every certificate is built here with ``cryptography``, deterministically: Ed25519 keys
from fixed seeds (Ed25519 signatures are deterministic too), fixed serials and dates.
A few are then edited byte by byte into shapes no certificate builder makes (an unsorted
RDN, two subjectAltName extensions, a non-minimal length, trailing bytes, ...), because
the tenant reader must decide about those as well.

``tests/data/tenant_ids.json`` holds each certificate's DER and the tenant id that the
hand-written DER reader (``net/tenants.py`` before issue 33) gave it, or its refusal.  It
was written by ``python -m tests.support.tenant_certs`` with that reader in place (commit 79c7e45;
the three cases cn-printable-at, cn-printable-star and cn-t61-latin1 were added later with
that reader loaded from ``git show 79c7e45:src/hurraykv/net/tenants.py``).  Do not
regenerate it with the current reader: its ids are the ones deployed servers hand out.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.name import _ASN1Type
from cryptography.x509.oid import ExtensionOID, NameOID

CORPUS = Path(__file__).parents[1] / "data" / "tenant_ids.json"
UTC = datetime.UTC


def _key(label: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(label.encode()).digest())


CA_KEY, OTHER_CA_KEY = _key("tenant corpus ca"), _key("tenant corpus ca 2")
CA = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hurraykv tenant corpus CA")])
OTHER_CA = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hurraykv tenant corpus CA 2")])
NOBODY = x509.Name([])


def attr(oid: x509.ObjectIdentifier, value: str | bytes, kind: _ASN1Type | None = None
         ) -> x509.NameAttribute:
    return x509.NameAttribute(oid, value, kind) if kind else x509.NameAttribute(oid, value)


def rdns(*attrs: x509.NameAttribute) -> x509.Name:
    """One attribute per RDN, in order."""
    return x509.Name(list(attrs))


def cn(value: str, kind: _ASN1Type | None = None) -> x509.Name:
    return rdns(attr(NameOID.COMMON_NAME, value, kind))


def other(value: str, oid: str = "1.3.6.1.4.1.55555.1") -> x509.OtherName:
    """An otherName of a private type holding a UTF8String."""
    raw = value.encode()
    return x509.OtherName(x509.ObjectIdentifier(oid), b"\x0c" + bytes([len(raw)]) + raw)


def general_names(*entries: bytes) -> bytes:
    """The DER of a GeneralNames value holding ``entries`` (each a whole GeneralName),
    for the entries cryptography does not build (x400Address, ediPartyName, odd tags)."""
    body = b"".join(entries)
    return b"\x30" + bytes([len(body)]) + body


def tlv(tag: int, body: bytes) -> bytes:
    return bytes([tag, len(body)]) + body


def x400(country: str) -> bytes:
    """[3] x400Address: an ORAddress whose built-in attributes hold a country name."""
    country_name = tlv(0x61, tlv(0x13, country.encode()))  # [APPLICATION 1] Printable
    return tlv(0xA3, tlv(0x30, country_name))


def edi(party: str) -> bytes:
    """[5] ediPartyName with partyName [1] (explicit) as a UTF8String."""
    return tlv(0xA5, tlv(0xA1, tlv(0x0C, party.encode())))


def certificate(subject: x509.Name, san: list | bytes | None = None, *,
                critical: bool = False, issuer: str = "ca", label: str = "client",
                serial: int = 1000, year: int = 2025, extra: tuple = ()) -> bytes:
    """The DER of a client certificate: ``san`` as GeneralName objects, or as the raw DER
    of a whole GeneralNames value; ``extra`` more ``(extension, critical)`` pairs."""
    ca_name, ca_key = (CA, CA_KEY) if issuer == "ca" else (OTHER_CA, OTHER_CA_KEY)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name)
               .public_key(_key(label).public_key()).serial_number(serial)
               .not_valid_before(datetime.datetime(year, 1, 1, tzinfo=UTC))
               .not_valid_after(datetime.datetime(year + 10, 1, 1, tzinfo=UTC)))
    if isinstance(san, bytes):
        builder = builder.add_extension(x509.UnrecognizedExtension(
            ExtensionOID.SUBJECT_ALTERNATIVE_NAME, san), critical=critical)
    elif san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=critical)
    for extension, crit in extra:
        builder = builder.add_extension(extension, critical=crit)
    return builder.sign(ca_key, None).public_bytes(serialization.Encoding.DER)


def replace_once(der: bytes, old: bytes, new: bytes) -> bytes:
    """``der`` with its one occurrence of ``old`` replaced (signature left as it was: the
    tenant reader takes certificates the TLS library has already verified)."""
    assert der.count(old) == 1, (old.hex(), der.hex())
    return der.replace(old, new)


def _length(n: int) -> bytes:
    """A DER length: one byte below 128, else 0x80 + count and the big-endian count."""
    return bytes([n]) if n < 0x80 else bytes([0x80 | (n.bit_length() + 7) // 8]) + \
        n.to_bytes((n.bit_length() + 7) // 8, "big")


def _body(der: bytes) -> bytes:
    """The content of the DER element at the start of ``der`` (built here, so well-formed)."""
    n = der[1]
    start = 2 + (n & 0x7F if n & 0x80 else 0)
    size = int.from_bytes(der[2:start], "big") if n & 0x80 else n
    return der[start:start + size]


def _v1(der: bytes) -> bytes:
    """A version 1 certificate: the [0] version field dropped, both lengths fixed."""
    cert = _body(der)
    tbs = _body(cert)
    rest = cert[cert.index(tbs) + len(tbs):]
    assert tbs.startswith(bytes.fromhex("a003020102"))
    tbs = b"\x30" + _length(len(tbs) - 5) + tbs[5:]
    return b"\x30" + _length(len(tbs) + len(rest)) + tbs + rest


def _non_minimal_length(der: bytes) -> bytes:
    """The outer SEQUENCE's length in one more byte than it needs (BER, not DER)."""
    body = _body(der)
    size = len(body).to_bytes(3, "big")
    return b"\x30\x83" + size + body


SPIFFE = x509.UniformResourceIdentifier("spiffe://example.org/ns/prod/sa/alice")
DNS_A, DNS_B = x509.DNSName("a.example"), x509.DNSName("b.example")
CN_A, O_B = (bytes.fromhex("300806035504030c0161"),  # SEQUENCE { CN, UTF8String "a" }
             bytes.fromhex("3008060355040a0c0162"))  # SEQUENCE { O, UTF8String "b" }
P = _ASN1Type


def _cases() -> dict[str, tuple[str, Callable[[], bytes]]]:
    """name -> (what it shows, how to build it)."""
    ip = ipaddress
    every = [DNS_A, SPIFFE, x509.RFC822Name("alice@example.org"),
             x509.IPAddress(ip.ip_address("10.0.0.1")), other("alice"),
             x509.RegisteredID(x509.ObjectIdentifier("1.2.3.4")),
             x509.DirectoryName(cn("alice"))]
    return {
        # ---- the subject alone
        "cn": ("subject CN=alice (UTF8String), no subjectAltName", lambda: certificate(
            cn("alice"))),
        "cn-reissued": ("as cn with a new key, serial and validity: the same tenant",
                        lambda: certificate(cn("alice"), label="again", serial=7,
                                            year=2030)),
        "cn-other-issuer": ("as cn from another CA: another tenant", lambda: certificate(
            cn("alice"), issuer="other")),
        "cn-bob": ("subject CN=bob", lambda: certificate(cn("bob"))),
        "cn-printable": ("CN=alice as a PrintableString: another tenant than cn",
                         lambda: certificate(cn("alice", P.PrintableString))),
        "cn-t61": ("CN=alice as a T61String", lambda: certificate(cn("alice", P.T61String))),
        "cn-bmp": ("CN=alice as a BMPString", lambda: certificate(cn("alice", P.BMPString))),
        "cn-universal": ("CN=alice as a UniversalString", lambda: certificate(
            cn("alice", P.UniversalString))),
        "cn-non-ascii": ("CN with non-ASCII characters (UTF8String)", lambda: certificate(
            cn("Zoë 東京 🔑"))),
        "cn-non-ascii-bmp": ("the same characters as a BMPString (no emoji: BMP only)",
                             lambda: certificate(cn("Zoë 東京", P.BMPString))),
        "two-cns": ("CN=a, CN=b in two RDNs", lambda: certificate(rdns(
            attr(NameOID.COMMON_NAME, "a"), attr(NameOID.COMMON_NAME, "b")))),
        "two-cns-swapped": ("CN=b, CN=a: RDN order counts", lambda: certificate(rdns(
            attr(NameOID.COMMON_NAME, "b"), attr(NameOID.COMMON_NAME, "a")))),
        "two-cns-one-rdn": ("CN=a+CN=b in one multi-valued RDN", lambda: certificate(
            x509.Name([x509.RelativeDistinguishedName([
                attr(NameOID.COMMON_NAME, "a"), attr(NameOID.COMMON_NAME, "b")])]))),
        "cn-o": ("CN=x, O=y", lambda: certificate(rdns(
            attr(NameOID.COMMON_NAME, "x"), attr(NameOID.ORGANIZATION_NAME, "y")))),
        "cn-with-comma": ('CN="x,organizationName=y": not cn-o', lambda: certificate(
            cn("x,organizationName=y"))),
        "cn-plus-o": ("CN=x+O=y in one RDN: neither cn-o nor cn-with-comma",
                      lambda: certificate(x509.Name([x509.RelativeDistinguishedName([
                          attr(NameOID.COMMON_NAME, "x"),
                          attr(NameOID.ORGANIZATION_NAME, "y")])]))),
        "full-subject": ("C, ST, L, O, OU, CN, emailAddress (IA5), serialNumber, DC",
                         lambda: certificate(rdns(
                             attr(NameOID.COUNTRY_NAME, "US"),
                             attr(NameOID.STATE_OR_PROVINCE_NAME, "CA"),
                             attr(NameOID.LOCALITY_NAME, "San Francisco"),
                             attr(NameOID.ORGANIZATION_NAME, "Example"),
                             attr(NameOID.ORGANIZATIONAL_UNIT_NAME, "kv"),
                             attr(NameOID.COMMON_NAME, "alice"),
                             attr(NameOID.EMAIL_ADDRESS, "alice@example.org"),
                             attr(NameOID.SERIAL_NUMBER, "42"),
                             attr(NameOID.DOMAIN_COMPONENT, "example")))),
        "unique-identifier": ("CN plus an x500UniqueIdentifier (BIT STRING)",
                              lambda: certificate(rdns(
                                  attr(NameOID.COMMON_NAME, "alice"),
                                  attr(NameOID.X500_UNIQUE_IDENTIFIER, b"\x00\xab\xcd",
                                       P.BitString)))),
        "private-attribute": ("an attribute of a private type", lambda: certificate(rdns(
            attr(x509.ObjectIdentifier("1.3.6.1.4.1.55555.9"), "z")))),
        "nobody": ("empty subject, no subjectAltName: names nobody (None)",
                   lambda: certificate(NOBODY)),
        "v1": ("a version 1 certificate (no version field, no extensions), CN=alice",
               lambda: _v1(certificate(cn("alice")))),
        # ---- subjectAltName, empty subject
        "dns": ("DNS a.example", lambda: certificate(NOBODY, [DNS_A])),
        "dns-two": ("DNS a.example, b.example", lambda: certificate(NOBODY, [DNS_A, DNS_B])),
        "dns-two-swapped": ("the same two in the other order: the same tenant",
                            lambda: certificate(NOBODY, [DNS_B, DNS_A])),
        "dns-repeated": ("a.example, b.example, a.example: the same tenant as dns-two",
                         lambda: certificate(NOBODY, [DNS_A, DNS_B, DNS_A])),
        "dns-upper-case": ("DNS A.EXAMPLE: the exact bytes count", lambda: certificate(
            NOBODY, [x509.DNSName("A.EXAMPLE")])),
        "dns-wildcard": ("DNS *.example", lambda: certificate(
            NOBODY, [x509.DNSName("*.example")])),
        "dns-utf8": ("DNS zoë.example as UTF-8 inside the IA5String", lambda: certificate(
            NOBODY, [x509.DNSName._init_without_validation("zoë.example")])),
        "dns-latin1": ("DNS zoë.example as Latin-1 inside the IA5String", lambda:
                       certificate(NOBODY, general_names(tlv(0x82, "zoë.example".encode(
                           "latin-1"))))),
        "spiffe": ("URI spiffe://example.org/ns/prod/sa/alice", lambda: certificate(
            NOBODY, [SPIFFE])),
        "spiffe-critical": ("the same in a critical extension: the same tenant",
                            lambda: certificate(NOBODY, [SPIFFE], critical=True)),
        "spiffe-bob": ("URI spiffe://example.org/ns/prod/sa/bob", lambda: certificate(
            NOBODY, [x509.UniformResourceIdentifier("spiffe://example.org/ns/prod/sa/bob")])),
        "cn-spiffe-dns": ("CN=svc with URI and DNS names", lambda: certificate(
            cn("svc"), [SPIFFE, DNS_A])),
        "cn-dns-spiffe": ("the same names in the other order", lambda: certificate(
            cn("svc"), [DNS_A, SPIFFE])),
        "cn-spiffe": ("CN=svc with the URI only: one name fewer", lambda: certificate(
            cn("svc"), [SPIFFE])),
        "email": ("rfc822Name alice@example.org", lambda: certificate(
            NOBODY, [x509.RFC822Name("alice@example.org")])),
        "ipv4": ("IP 10.0.0.1", lambda: certificate(
            NOBODY, [x509.IPAddress(ip.ip_address("10.0.0.1"))])),
        "ipv6": ("IP fd00::1", lambda: certificate(
            NOBODY, [x509.IPAddress(ip.ip_address("fd00::1"))])),
        "ipv4-network": ("IP 10.0.0.0/24 (address and mask)", lambda: certificate(
            NOBODY, [x509.IPAddress(ip.ip_network("10.0.0.0/24"))])),
        "ipv6-network": ("IP fd00::/64", lambda: certificate(
            NOBODY, [x509.IPAddress(ip.ip_network("fd00::/64"))])),
        "othername": ("otherName of a private type, UTF8String alice", lambda: certificate(
            NOBODY, [other("alice")])),
        "othername-bob": ("the same type, bob", lambda: certificate(NOBODY, [other("bob")])),
        "othername-other-type": ("alice under another type id", lambda: certificate(
            NOBODY, [other("alice", "1.3.6.1.4.1.55555.2")])),
        "othername-upn": ("a Microsoft UPN otherName", lambda: certificate(
            NOBODY, [other("alice@example.org", "1.3.6.1.4.1.311.20.2.3")])),
        "registered-id": ("registeredID 1.2.3.4", lambda: certificate(
            NOBODY, [x509.RegisteredID(x509.ObjectIdentifier("1.2.3.4"))])),
        "directory-name": ("directoryName CN=alice: not the subject CN=alice",
                           lambda: certificate(NOBODY, [x509.DirectoryName(cn("alice"))])),
        "every-type": ("one of each type cryptography builds, and CN=alice",
                       lambda: certificate(cn("alice"), every)),
        "cn-empty-general-names": ("CN=alice and a subjectAltName with no entries",
                                   lambda: certificate(cn("alice"), general_names())),
        "nobody-empty-general-names": ("no subject, a subjectAltName with no entries",
                                       lambda: certificate(NOBODY, general_names())),
        "x400": ("x400Address (country US)", lambda: certificate(
            NOBODY, general_names(x400("US")))),
        "x400-fr": ("x400Address (country FR)", lambda: certificate(
            NOBODY, general_names(x400("FR")))),
        "edi": ("ediPartyName alice", lambda: certificate(NOBODY, general_names(edi("alice")))),
        "edi-bob": ("ediPartyName bob", lambda: certificate(NOBODY, general_names(edi("bob")))),
        "dns-constructed": ("a dNSName tag with the constructed bit ([2] 0xa2)",
                            lambda: certificate(NOBODY, general_names(
                                tlv(0xA2, tlv(0x04, b"x"))))),
        "ip-five-bytes": ("an iPAddress of 5 bytes", lambda: certificate(
            NOBODY, general_names(tlv(0x87, bytes([10, 0, 0, 1, 255]))))),
        "ip-network-host-bits": ("10.0.0.1 with mask 255.255.255.0 (host bits set)",
                                 lambda: certificate(NOBODY, general_names(tlv(
                                     0x87, bytes([10, 0, 0, 1, 255, 255, 255, 0]))))),
        # ---- byte edits and other extensions
        "cn-printable-at": ("CN=alice@example.org as a PrintableString (no '@' in its "
                            "alphabet, a slip some CAs make)", lambda: replace_once(
                                certificate(cn("alice-example.org", P.PrintableString)),
                                b"alice-example.org", b"alice@example.org")),
        "cn-printable-star": ("CN=*.example as a PrintableString (no '*' in its alphabet)",
                              lambda: replace_once(certificate(cn("x.example",
                                                                  P.PrintableString)),
                                                   b"\x13\x09x.example", b"\x13\x09*.example")),
        "cn-t61-latin1": ("CN=Zoë as a T61String of Latin-1 bytes (legacy CAs)",
                          lambda: replace_once(certificate(cn("Zo?", P.T61String)),
                                               b"\x14\x03Zo?", b"\x14\x03Zo\xeb")),
        "unsorted-rdn": ("CN=a+O=b with the SET's two members out of DER order",
                         lambda: replace_once(certificate(x509.Name([
                             x509.RelativeDistinguishedName([
                                 attr(NameOID.COMMON_NAME, "a"),
                                 attr(NameOID.ORGANIZATION_NAME, "b")])])),
                             CN_A + O_B, O_B + CN_A)),
        "two-san-extensions": ("two subjectAltName extensions", lambda: replace_once(
            certificate(NOBODY, [DNS_A], extra=((x509.UnrecognizedExtension(
                x509.ObjectIdentifier("2.5.29.99"), general_names(tlv(0x82, b"b"))),
                False),)), bytes.fromhex("0603551d63"), bytes.fromhex("0603551d11"))),
        "bad-key-usage": ("CN=alice, a keyUsage extension that is not DER", lambda:
                          certificate(cn("alice"), extra=((x509.UnrecognizedExtension(
                              ExtensionOID.KEY_USAGE, b"xx"), False),))),
        "repeated-private-extension": ("CN=alice, one private extension twice",
                                       lambda: replace_once(certificate(cn("alice"), extra=(
                                           (x509.UnrecognizedExtension(
                                               x509.ObjectIdentifier("1.2.3.4"), b"\x05\x00"),
                                            False),
                                           (x509.UnrecognizedExtension(
                                               x509.ObjectIdentifier("1.2.3.5"), b"\x05\x00"),
                                            False))), bytes.fromhex("06032a0305"),
                                           bytes.fromhex("06032a0304"))),
        "version-2": ("CN=alice with version field 1 (v2)", lambda: replace_once(
            certificate(cn("alice")), bytes.fromhex("a003020102"),
            bytes.fromhex("a003020101"))),
        "trailing-bytes": ("CN=alice with two zero bytes after the certificate",
                           lambda: certificate(cn("alice")) + b"\x00\x00"),
        "non-minimal-length": ("CN=alice, the outer length in 3 bytes (BER)",
                               lambda: _non_minimal_length(certificate(cn("alice")))),
        "truncated": ("CN=alice cut 7 bytes short", lambda: certificate(cn("alice"))[:-7]),
        "indefinite-length": ("an indefinite length (0x80) at the start",
                              lambda: b"\x30\x80" + certificate(cn("alice"))[2:]),
        "general-name-universal-tag": ("a GeneralName with a UTF8String tag", lambda:
                                       certificate(NOBODY, general_names(tlv(0x0C, b"x")))),
        "not-der": ("five ASCII bytes", lambda: b"hello"),
        "empty": ("no bytes at all", lambda: b""),
    }


def corpus() -> dict[str, tuple[str, bytes]]:
    """name -> (what it shows, DER)."""
    return {name: (what, build()) for name, (what, build) in _cases().items()}


def load() -> dict[str, dict]:
    """The committed corpus: name -> {"what", "der" (bytes), "id" or "refused"}."""
    cases = json.loads(CORPUS.read_text())["cases"]
    return {c["name"]: {**c, "der": bytes.fromhex(c["der"])} for c in cases}


def _record() -> None:
    """Write the corpus with the ids the tenant reader in place gives (run once, before
    the reader was rewritten: see the module docstring)."""
    from hurraykv.net.tenants import UnreadableIdentity, tenant_identity

    cases = []
    for name, (what, der) in corpus().items():
        case = {"name": name, "what": what, "der": der.hex()}
        try:
            got = tenant_identity(der)
        except UnreadableIdentity as e:
            case["refused"] = str(e)
        else:
            case["id"] = got[0] if got else None
        cases.append(case)
    CORPUS.parent.mkdir(exist_ok=True)
    CORPUS.write_text(json.dumps({
        "about": "Tenant ids the hand-written DER reader (net/tenants.py before issue 33) "
                 "gave these certificates; built by tests/support/tenant_certs.py. id null: names "
                 "nobody; refused: that reader's message.",
        "cases": cases}, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    _record()
