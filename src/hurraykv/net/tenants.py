"""Tenants under mutual TLS: who a client certificate names, and the keys it may touch.

The identity of a client is its certificate's issuer together with its subject, or,
for a certificate with an empty subject, its issuer together with its subjectAltName
entries.  Both are taken as the parsed sequences TLS hands over (relative distinguished
names, attribute types and values kept apart) and serialised as JSON, so no two different
certificates flatten to the same text: ``CN=x, O=y`` and ``CN="x,O=y"`` are different
tenants.  A certificate with neither subject nor subjectAltName names nobody and is
refused before the Hurray handshake completes.

Inside the server a tenant's key is ``tenant_id + NUL + key``, where ``tenant_id`` is
the first 128 bits of SHA-256 over that JSON, in hex.  Client keys may not contain NUL
(``check_key``), so no key a client sends can spell another tenant's internal key, and
keys of a server without tenants (no NUL at all) never meet tenant keys either.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..errors import HurrayError

MAX_KEY_BYTES = 4096
SEPARATOR = "\x00"


def _rdns(name: Any) -> list[list[list[str]]]:
    return [[[str(k), str(v)] for k, v in rdn] for rdn in name or ()]


def tenant_identity(cert: dict[str, Any]) -> tuple[str, str] | None:
    """``(tenant_id, readable)`` of a peer certificate as ``SSLSocket.getpeercert()``
    returns it, or None when it names nobody (empty subject, no subjectAltName)."""
    subject = _rdns(cert.get("subject"))
    san = [[str(k), str(v)] for k, v in cert.get("subjectAltName", ()) or ()]
    if subject:
        ident: dict[str, Any] = {"issuer": _rdns(cert.get("issuer")), "subject": subject}
        readable = ",".join(f"{k}={v}" for rdn in subject for k, v in rdn)
    elif san:
        ident = {"issuer": _rdns(cert.get("issuer")), "subjectAltName": san}
        readable = ",".join(f"{k}:{v}" for k, v in san)
    else:
        return None
    canonical = json.dumps(ident, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:32], readable


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
