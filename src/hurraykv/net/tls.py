"""TLS contexts of the server and the client from the PEM files ``--tls-cert``,
``--tls-key`` and ``--tls-ca`` name, each file checked first: a file that cannot be read,
is empty or holds no PEM block of its kind, and a certificate and key that do not belong
together, are ``ConfigError`` naming the option and the path (``ssl`` alone says ``[SSL]
PEM lib (_ssl.c:3905)`` or ``No such file or directory``, naming neither)."""

from __future__ import annotations

import ssl

from ..errors import ConfigError

# option -> (what it must hold, the PEM armour lines that hold it)
KINDS = {
    "--tls-cert": ("a PEM certificate", (b"-----BEGIN CERTIFICATE-----",)),
    "--tls-key": ("a PEM private key", (b"PRIVATE KEY-----",)),
    "--tls-ca": ("PEM CA certificates", (b"-----BEGIN CERTIFICATE-----",
                                          b"-----BEGIN TRUSTED CERTIFICATE-----")),
}
MAX_PEM = 16 << 20  # a certificate bundle is kilobytes; a bigger file is not one


def check_pem(option: str, path: str) -> None:
    """``path``, named by ``option``, is readable, not empty and holds its PEM kind."""
    what, armour = KINDS[option]
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM)
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot read: {e.strerror or e}", field=option,
                          value=path, rule=f"a readable file holding {what}") from None
    if not data.strip():
        raise ConfigError(f"{option} {path}: the file is empty; it must hold {what}",
                          field=option, value=path, rule=f"a file holding {what}")
    if not any(a in data for a in armour):
        raise ConfigError(f"{option} {path}: not {what} (no {armour[0].decode()!r} line "
                          f"in its {len(data)} bytes)", field=option, value=path,
                          rule=f"a file holding {what}")


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str | None) -> None:
    check_pem("--tls-cert", cert)
    if key:
        check_pem("--tls-key", key)
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        shown = f"--tls-cert {cert} and --tls-key {key}" if key else f"--tls-cert {cert}"
        why = ("the key is not the certificate's" if "KEY_VALUES_MISMATCH" in str(e)
               else "no private key in it: give --tls-key" if not key
               else f"cannot be loaded: {e.reason or e}")
        raise ConfigError(f"{shown}: {why}", field="--tls-cert", value=cert,
                          rule="a certificate and its own private key") from None


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    check_pem("--tls-ca", ca)
    try:
        ctx.load_verify_locations(ca)
    except ssl.SSLError as e:
        raise ConfigError(f"--tls-ca {ca}: cannot be loaded: {e.reason or e}",
                          field="--tls-ca", value=ca, rule="PEM CA certificates") from None


def server_context(cert: str | None, key: str | None, ca: str | None
                   ) -> ssl.SSLContext | None:
    """The server's context (None without ``cert``: no TLS); with ``ca`` client
    certificates are required (mutual TLS)."""
    if not cert:
        for option, value in (("--tls-key", key), ("--tls-ca", ca)):
            if value:
                raise ConfigError(f"{option} {value}: the server has no certificate of "
                                  "its own: give --tls-cert (and --tls-key) too, or the "
                                  "server would listen without TLS", field=option,
                                  value=value, rule=f"{option} needs --tls-cert")
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(ctx, cert, key)
    if ca:
        _load_ca(ctx, ca)
        ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: the subject scopes the keys
        # each client's tenant is read from its certificate: without the [tls] extra
        # every connection would fail, so the server does not start
        from .tenants import _x509

        _x509()
    return ctx


def client_context(cert: str | None, key: str | None, ca: str | None
                   ) -> ssl.SSLContext | None:
    """The client's context (None without ``ca`` or ``cert``: no TLS): ``ca`` verifies
    the server (the system's CAs without it), ``cert`` is the client's own."""
    if key and not cert:
        raise ConfigError(f"--tls-key {key}: the key of no certificate: give --tls-cert",
                          field="--tls-key", value=key, rule="--tls-key needs --tls-cert")
    if not (ca or cert):
        return None
    if ca:
        check_pem("--tls-ca", ca)
    try:  # with a CA bundle, only its certificates verify the server
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except ssl.SSLError as e:
        raise ConfigError(f"--tls-ca {ca}: cannot be loaded: {e.reason or e}",
                          field="--tls-ca", value=ca, rule="PEM CA certificates") from None
    if cert:
        _load_chain(ctx, cert, key)
    return ctx


__all__ = ["check_pem", "client_context", "server_context"]
