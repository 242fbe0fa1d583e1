"""TLS contexts of the server and the client from the PEM files ``--tls-cert``,
``--tls-key`` and ``--tls-ca`` name, each file checked first: a file that cannot be read,
is empty or holds no PEM block of its kind, and a certificate and key that do not belong
together, are ``ConfigError`` naming the setting and the path (``ssl`` alone says ``[SSL]
PEM lib (_ssl.c:3905)`` or ``No such file or directory``, naming neither).  The settings
are named as the caller's user wrote them: options of the command line by default, keys
of the vLLM connector's config (``names``) there."""

from __future__ import annotations

import ssl
from collections.abc import Mapping

from ..errors import ConfigError

# kind -> (what it must hold, the PEM armour lines that hold it)
KINDS = {
    "cert": ("a PEM certificate", (b"-----BEGIN CERTIFICATE-----",)),
    "key": ("a PEM private key", (b"PRIVATE KEY-----",)),
    "ca": ("PEM CA certificates", (b"-----BEGIN CERTIFICATE-----",
                                   b"-----BEGIN TRUSTED CERTIFICATE-----")),
}
OPTIONS = {"cert": "--tls-cert", "key": "--tls-key", "ca": "--tls-ca"}
MAX_PEM = 16 << 20  # a certificate bundle is kilobytes; a bigger file is not one


def _refuse(names: Mapping[str, str], kind: str, why: str, value: str, rule: str
            ) -> ConfigError:
    return ConfigError(f"{names[kind]} {value}: {why}", field=names[kind], value=value,
                       rule=rule)


def check_pem(kind: str, path: str, names: Mapping[str, str] = OPTIONS) -> None:
    """``path``, the ``kind`` file (cert, key, ca), is readable, not empty and holds its
    PEM kind."""
    what, armour = KINDS[kind]
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM)
    except OSError as e:
        raise _refuse(names, kind, f"cannot read: {e.strerror or e}", path,
                      f"a readable file holding {what}") from None
    if not data.strip():
        raise _refuse(names, kind, f"the file is empty; it must hold {what}", path,
                      f"a file holding {what}")
    if not any(a in data for a in armour):
        raise _refuse(names, kind, f"not {what} (no {armour[0].decode()!r} line in its "
                      f"{len(data)} bytes)", path, f"a file holding {what}")


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str | None,
                names: Mapping[str, str]) -> None:
    check_pem("cert", cert, names)
    if key:
        check_pem("key", key, names)
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        why = ("the key is not the certificate's" if "KEY_VALUES_MISMATCH" in str(e)
               else f"no private key in it: give {names['key']}" if not key
               else f"cannot be loaded: {e.reason or e}")
        shown = f"{cert} and {names['key']} {key}" if key else cert
        raise _refuse(names, "cert", why, shown, "a certificate and its own private key"
                      ) from None


def _load_ca(ctx: ssl.SSLContext, ca: str, names: Mapping[str, str]) -> None:
    check_pem("ca", ca, names)
    try:
        ctx.load_verify_locations(ca)
    except ssl.SSLError as e:
        raise _refuse(names, "ca", f"cannot be loaded: {e.reason or e}", ca,
                      "PEM CA certificates") from None


def server_context(cert: str | None, key: str | None, ca: str | None
                   ) -> ssl.SSLContext | None:
    """The server's context (None without ``cert``: no TLS); with ``ca`` client
    certificates are required (mutual TLS)."""
    if not cert:
        for kind, value in (("key", key), ("ca", ca)):
            if value:
                raise _refuse(OPTIONS, kind, "the server has no certificate of its own: "
                              "give --tls-cert (and --tls-key) too, or the server would "
                              "listen without TLS", value, f"{OPTIONS[kind]} needs --tls-cert")
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(ctx, cert, key, OPTIONS)
    if ca:
        _load_ca(ctx, ca, OPTIONS)
        ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: the subject scopes the keys
        # each client's tenant is read from its certificate: without the [tls] extra
        # every connection would fail, so the server does not start
        from .tenants import require_x509

        require_x509()
    return ctx


def client_context(cert: str | None, key: str | None, ca: str | None,
                   names: Mapping[str, str] = OPTIONS) -> ssl.SSLContext | None:
    """The client's context (None without ``ca`` or ``cert``: no TLS): ``ca`` verifies
    the server (the system's CAs without it), ``cert`` is the client's own; ``names``:
    how the caller's settings name the files (cert, key, ca)."""
    if key and not cert:
        raise _refuse(names, "key", f"the key of no certificate: give {names['cert']}",
                      key, f"{names['key']} needs {names['cert']}")
    if not (ca or cert):
        return None
    if ca:
        check_pem("ca", ca, names)
    try:  # with a CA bundle, only its certificates verify the server
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except ssl.SSLError as e:
        raise _refuse(names, "ca", f"cannot be loaded: {e.reason or e}", str(ca),
                      "PEM CA certificates") from None
    if cert:
        _load_chain(ctx, cert, key, names)
    return ctx


__all__ = ["OPTIONS", "check_pem", "client_context", "server_context"]
