"""Tenants under mutual TLS: who a client certificate names, and the keys it may touch.

The identity of a client is read from its certificate's DER bytes (what the TLS library
verified), never from a rendering of them: ``getpeercert()`` turns every otherName,
x400Address and ediPartyName into ``'<unsupported>'``, so two certificates naming
"alice" and "bob" as otherNames once read as the same tenant.  The identity is the exact
DER of the issuer name, of the subject name and of every subjectAltName entry (all
types: otherName, rfc822Name, dNSName, x400Address, directoryName, ediPartyName, URI,
IP address, registeredID), the entries taken as a set (their order in the certificate
does not matter, nor does an entry repeated; DER itself orders the attributes of an RDN).
Certificates issued again with the same names (new key, new serial, new validity) are
the same tenant; any difference in a name, its attribute types or their string types is
another tenant.  A certificate with an empty subject and no subjectAltName names nobody,
and one whose names cannot be read exactly (a structure this reader does not take) is
refused too: both are answered ERROR UNAUTHORIZED before the Hurray handshake completes.

Inside the server a tenant's key is ``tenant_id + NUL + key``, where ``tenant_id`` is
the first 128 bits of SHA-256 over those DER bytes, in hex.  Client keys may not contain
NUL (``check_key``), so no key a client sends can spell another tenant's internal key, and
keys of a server without tenants (no NUL at all) never meet tenant keys either.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..errors import HurrayError

MAX_KEY_BYTES = 4096
SEPARATOR = "\x00"


SAN_OID = bytes.fromhex("0603551d11")  # 2.5.29.17 subjectAltName, as its DER TLV
DOMAIN = b"hurraykv tenant 2\x00"  # the hashed bytes' version


class UnreadableIdentity(HurrayError):
    """A client certificate whose names cannot be read exactly (ERROR UNAUTHORIZED)."""


def _element(der: bytes, pos: int, end: int, what: str) -> tuple[int, int, int]:
    """``(tag, content start, element end)`` of the DER element at ``pos``; definite
    lengths of at most 4 bytes and one-byte tags only, nothing past ``end``."""
    if pos + 2 > end:
        raise UnreadableIdentity(f"client certificate: {what} at byte {pos} is cut short",
                                 field=what, offset=pos, rule="DER, within its parent")
    tag, n = der[pos], der[pos + 1]
    start = pos + 2
    if tag & 0x1F == 0x1F:
        raise UnreadableIdentity(f"client certificate: {what} at byte {pos} has a multi-byte "
                                 f"tag 0x{tag:02x}", field=what, offset=pos, value=tag,
                                 rule="one-byte DER tags")
    if n & 0x80:
        k = n & 0x7F
        if not 1 <= k <= 4 or start + k > end:
            raise UnreadableIdentity(f"client certificate: {what} at byte {pos} has length "
                                     f"form 0x{n:02x}", field=what, offset=pos, value=n,
                                     rule="definite DER lengths of 1-4 bytes")
        n = int.from_bytes(der[start:start + k], "big")
        start += k
    if start + n > end:
        raise UnreadableIdentity(f"client certificate: {what} at byte {pos} claims {n} "
                                 f"bytes, {end - start} remain", field=what, offset=pos,
                                 value=n, rule="DER, within its parent")
    return tag, start, start + n


def _children(der: bytes, start: int, end: int, what: str) -> list[tuple[int, int, int]]:
    """``(tag, element start, element end)`` of each element in ``[start, end)``."""
    out = []
    pos = start
    while pos < end:
        tag, _, stop = _element(der, pos, end, what)
        out.append((tag, pos, stop))
        pos = stop
    return out


def _expect(tag: int, want: int, pos: int, what: str) -> None:
    if tag != want:
        raise UnreadableIdentity(f"client certificate: {what} at byte {pos} has tag "
                                 f"0x{tag:02x}, expected 0x{want:02x}", field=what,
                                 offset=pos, value=tag, rule="RFC 5280 Certificate")


def certificate_names(der: bytes) -> tuple[bytes, bytes, list[bytes]]:
    """``(issuer DER, subject DER, [subjectAltName entry DER, ...])`` of a certificate,
    the entries sorted and each once (a set), or ``UnreadableIdentity``."""
    der = bytes(der)
    tag, start, end = _element(der, 0, len(der), "certificate")
    _expect(tag, 0x30, 0, "certificate")
    tag, tbs_start, tbs_end = _element(der, start, end, "tbsCertificate")
    _expect(tag, 0x30, start, "tbsCertificate")
    fields = _children(der, tbs_start, tbs_end, "tbsCertificate field")
    if fields and fields[0][0] == 0xA0:  # [0] version
        fields = fields[1:]
    if len(fields) < 6:
        raise UnreadableIdentity(f"client certificate: tbsCertificate holds {len(fields)} "
                                 "fields after its version, at least 6 expected",
                                 field="tbsCertificate", value=len(fields),
                                 rule="RFC 5280 Certificate")
    for (tag, pos, _), what in zip(fields[:6], ("serialNumber", "signature", "issuer",
                                                "validity", "subject",
                                                "subjectPublicKeyInfo"), strict=True):
        _expect(tag, 0x02 if what == "serialNumber" else 0x30, pos, what)
    issuer = der[fields[2][1]:fields[2][2]]
    subject = der[fields[4][1]:fields[4][2]]
    sans: list[bytes] | None = None
    for tag, pos, stop in fields[6:]:
        if tag != 0xA3:  # [1] / [2] unique identifiers
            continue
        _, inner, _ = _element(der, pos, stop, "extensions")
        etag, estart, eend = _element(der, inner, stop, "extensions")
        _expect(etag, 0x30, inner, "extensions")
        for xtag, xpos, xend in _children(der, estart, eend, "extension"):
            _expect(xtag, 0x30, xpos, "extension")
            parts = _children(der, _element(der, xpos, xend, "extension")[1], xend,
                              "extension field")
            if not parts or der[parts[0][1]:parts[0][2]] != SAN_OID:
                continue
            if sans is not None:
                raise UnreadableIdentity("client certificate: two subjectAltName extensions",
                                         field="subjectAltName", offset=xpos,
                                         rule="one subjectAltName extension (RFC 5280)")
            vtag, vpos, vend = parts[-1]
            _expect(vtag, 0x04, vpos, "subjectAltName.extnValue")
            gtag, gstart, gend = _element(der, _element(der, vpos, vend, "extnValue")[1],
                                          vend, "GeneralNames")
            _expect(gtag, 0x30, vpos, "GeneralNames")
            sans = [der[a:b] for t, a, b in _children(der, gstart, gend, "GeneralName")
                    if _general_name(t, a)]
    return issuer, subject, sorted(set(sans or []))


def _general_name(tag: int, pos: int) -> bool:
    if tag & 0xC0 != 0x80 or tag & 0x1F > 8:
        raise UnreadableIdentity(f"client certificate: GeneralName at byte {pos} has tag "
                                 f"0x{tag:02x}", field="GeneralName", offset=pos, value=tag,
                                 rule="GeneralName [0]..[8] (RFC 5280)")
    return True


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


def client_key(tenant_id: str, internal: str) -> str | None:
    """The client's view of an internal key, or None when it belongs to someone else."""
    if not tenant_id:
        return internal if SEPARATOR not in internal else None
    prefix = tenant_id + SEPARATOR
    return internal[len(prefix):] if internal.startswith(prefix) else None
