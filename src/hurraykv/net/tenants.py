"""Tenants under mutual TLS: who a client certificate names, and the keys it may touch.

The identity of a client is read from its certificate's DER bytes (what the TLS library
verified), never from a rendering of them: ``getpeercert()`` turns every otherName into
``'<unsupported>'``, so two certificates naming "alice" and "bob" as otherNames once read
as the same tenant.  The identity is the exact DER of the issuer name, of the subject name
and of every subjectAltName entry (otherName, rfc822Name, dNSName, directoryName, URI,
IP address, registeredID), the entries taken as a set (their order in the certificate
does not matter, nor does an entry repeated; DER itself orders the attributes of an RDN).
Certificates issued again with the same names (new key, new serial, new validity) are
the same tenant; any difference in a name, its attribute types or their string types is
another tenant.  A certificate with an empty subject and no subjectAltName names nobody.

The certificate is read by ``cryptography`` (the ``[tls]`` extra, imported on the first
certificate).  It takes strict DER only, parses every extension, and does not read
x400Address or ediPartyName entries; releases differ at the edges (42 reads a
PrintableString holding '@', 50 does not).  A certificate it cannot read is refused
(``UnreadableIdentity``), as is one whose names it would not give back byte for byte:
the ids are those of the DER reader this replaced, for every certificate both read
(``tests/data/tenant_ids.json``).  Refused certificates, and one naming nobody, are
answered ERROR UNAUTHORIZED before the Hurray handshake completes.

Inside the server a tenant's key is ``tenant_id + NUL + key``, where ``tenant_id`` is
the first 128 bits of SHA-256 over those DER bytes, in hex.  Client keys may not contain
NUL (``check_key``), so no key a client sends can spell another tenant's internal key, and
keys of a server without tenants (no NUL at all) never meet tenant keys either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import HurrayError, require

MAX_KEY_BYTES = 4096
SEPARATOR = "\x00"
DOMAIN = b"hurraykv tenant 2\x00"  # the hashed bytes' version: ids of releases before differ

T = TypeVar("T")


class UnreadableIdentity(HurrayError):
    """A client certificate whose names cannot be read exactly (ERROR UNAUTHORIZED)."""


def require_x509() -> Any:
    """cryptography's X.509 module, imported here so that a server without mutual TLS (and
    ``import hurraykv``) never needs it; MissingDependencyError names the extra."""
    return require("cryptography.x509", "tls", "reading client certificates (mutual TLS)")


def _read(what: str, rule: str, step: Callable[[], T]) -> T:
    """``step()``, with what cryptography raises on a malformed certificate turned into an
    UnreadableIdentity naming the part (``what``), what cryptography found and the rule."""
    x509 = require_x509()
    try:
        return step()
    # ValueError: DER parse errors, strings that do not decode; TypeError: a BIT STRING
    # under an attribute type other than x500UniqueIdentifier; KeyError: an attribute value
    # whose tag is no string type (cryptography 42; later releases raise ValueError);
    # Warning: its warnings about a certificate (serial <= 0, ...) made errors (-W error).
    except (ValueError, TypeError, KeyError, Warning, x509.DuplicateExtension,
            x509.UnsupportedGeneralNameType, x509.InvalidVersion) as e:
        raise UnreadableIdentity(f"client certificate: {what} cannot be read: {e}; {rule}",
                                 field=what, value=str(e), rule=rule) from e


def certificate_names(der: bytes) -> tuple[bytes, bytes, list[bytes]]:
    """``(issuer DER, subject DER, [subjectAltName entry DER, ...])`` of a certificate,
    the entries sorted and each once (a set), or ``UnreadableIdentity``."""
    x509 = require_x509()
    cert = _read("certificate", "an X.509 certificate in DER (RFC 5280)",
                 lambda: x509.load_der_x509_certificate(bytes(der)))
    issuer = _read("issuer", "a Name of string attributes (RFC 5280 4.1.2.4)",
                   lambda: cert.issuer.public_bytes())
    subject = _read("subject", "a Name of string attributes (RFC 5280 4.1.2.6)",
                    lambda: cert.subject.public_bytes())
    extensions = _read("extensions", "each extension once, in DER; subjectAltName entries "
                       "other than x400Address and ediPartyName (RFC 5280 4.2)",
                       lambda: cert.extensions)
    try:
        names = extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = None
    # cryptography hands back parsed values, so the bytes hashed are its encoding of them.
    # An id must be over the bytes the CA signed, whatever cryptography normalises now or
    # later: each part has to appear as such in the certificate.
    tbs = cert.tbs_certificate_bytes
    parts = [("issuer", issuer), ("subject", subject)]
    if names is not None:
        parts.append(("subjectAltName", names.public_bytes()))
    for what, part in parts:
        if part not in tbs:
            raise UnreadableIdentity(
                f"client certificate: {what} read back as {part.hex()}, which is not in the "
                "certificate: its names would not be hashed exactly", field=what,
                value=part.hex(), rule="tenant ids are over the certificate's own bytes")
    # Each entry's DER: cryptography's encoding of a one-entry GeneralNames, less that
    # SEQUENCE's header (2 bytes, or 2 + n for a long-form length of n bytes).
    entries = [x509.SubjectAlternativeName([name]).public_bytes() for name in names or ()]
    sans = [e[2 + (e[1] & 0x7F if e[1] & 0x80 else 0):] for e in entries]
    return issuer, subject, sorted(set(sans))


def tenant_identity(der: bytes | None, rendered: dict[str, Any] | None = None
                    ) -> tuple[str, str] | None:
    """``(tenant_id, readable)`` of a peer certificate in DER
    (``getpeercert(binary_form=True)``), or None when it names nobody (empty subject, no
    subjectAltName); ``UnreadableIdentity`` when its names cannot be read exactly.
    ``rendered`` (``getpeercert()``) only labels the tenant in logs."""
    if not der:
        raise UnreadableIdentity("the client sent no certificate the server can read",
                                 field="certificate", rule="a client certificate")
    issuer, subject, sans = certificate_names(der)
    if subject == b"\x30\x00" and not sans:
        return None
    digest = hashlib.sha256(DOMAIN)
    for part in (issuer, subject, *sans):
        digest.update(len(part).to_bytes(4, "big") + part)
    return digest.hexdigest()[:32], _readable(rendered or {})


def _readable(cert: dict[str, Any]) -> str:
    """A label for logs (lossy: never an identity)."""
    subject = [f"{k}={v}" for rdn in cert.get("subject") or () for k, v in rdn]
    san = [f"{k}:{v}" for k, v in cert.get("subjectAltName") or ()]
    return ",".join(subject + san) or "?"


def check_key(key: str, field: str = "key") -> str:
    """A key as a client may send it: 1 to 4096 UTF-8 bytes, no NUL."""
    raw = key.encode("utf-8")
    if not raw or len(raw) > MAX_KEY_BYTES or SEPARATOR in key:
        shown = key if len(key) <= 64 else key[:64] + "..."
        raise HurrayError(f"{field} {shown!r} ({len(raw)} bytes): a key is 1 to "
                          f"{MAX_KEY_BYTES} UTF-8 bytes without NUL", field=field,
                          value=shown, rule="keys are 1..4096 bytes, no NUL")
    return key


def scoped_key(tenant_id: str, key: str) -> str:
    """The server-side key of a client key (``key`` itself without tenants)."""
    check_key(key)
    return f"{tenant_id}{SEPARATOR}{key}" if tenant_id else key


def tenant_of(internal: str) -> str:
    """The tenant id an internal key belongs to ("" for a key of a server without
    tenants)."""
    return internal.split(SEPARATOR, 1)[0] if SEPARATOR in internal else ""


def client_key(tenant_id: str, internal: str) -> str | None:
    """The client's view of an internal key, or None when it belongs to someone else."""
    if not tenant_id:
        return internal if SEPARATOR not in internal else None
    prefix = tenant_id + SEPARATOR
    return internal[len(prefix):] if internal.startswith(prefix) else None
