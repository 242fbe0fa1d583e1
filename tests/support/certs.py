"""A throwaway PKI for the mutual-TLS tests: a CA, a server certificate for 127.0.0.1 and
client certificates with whatever subject and subjectAltName a test needs."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtensionOID, NameOID


def name(*pairs: tuple[str, str]) -> x509.Name:
    """``name(("CN", "x"), ("O", "y"))``: one attribute per RDN, in order."""
    oids = {"CN": NameOID.COMMON_NAME, "O": NameOID.ORGANIZATION_NAME,
            "OU": NameOID.ORGANIZATIONAL_UNIT_NAME}
    return x509.Name([x509.NameAttribute(oids[k], v) for k, v in pairs])


class PKI:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.now = datetime.datetime.now(datetime.UTC)
        self.ca = self._make("test-ca", name(("CN", "test-ca")), None, ca=True)
        self._make("server", name(("CN", "server")), self.ca,
                   san=[x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])

    @property
    def ca_pem(self) -> str:
        return str(self.dir / "test-ca.pem")

    def pair(self, label: str) -> tuple[str, str]:
        return str(self.dir / f"{label}.pem"), str(self.dir / f"{label}.key")

    def client(self, label: str, subject: x509.Name, san: list | bytes | None = None
               ) -> tuple[str, str]:
        """A client certificate; ``san`` as GeneralName objects, or as the DER of a whole
        GeneralNames value (for the types cryptography cannot build: x400Address,
        ediPartyName)."""
        self._make(label, subject, self.ca, san=san)
        return self.pair(label)

    def _make(self, label: str, subject: x509.Name, issuer, *, ca: bool = False,
              san: list | bytes | None = None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(issuer[0].subject if issuer else subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(self.now - datetime.timedelta(minutes=5))
                   .not_valid_after(self.now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None),
                                  critical=True))
        if isinstance(san, bytes):
            builder = builder.add_extension(x509.UnrecognizedExtension(
                ExtensionOID.SUBJECT_ALTERNATIVE_NAME, san), critical=False)
        elif san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
        (self.dir / f"{label}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (self.dir / f"{label}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        return cert, key
