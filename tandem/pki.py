"""A private CA and one certificate per role, for mTLS between the tiers.

    paths = make_pki(Path("certs"))   # ca.crt, ca.key, <role>.crt, <role>.key for ROLES
    paths.ca, paths.cert("router"), paths.key("router")

`tandem up` makes a throwaway set at start (so the local cluster is authenticated too);
`tandem certs DIR` makes one for a deployment (docs/deploy.md: one Secret per tier). Each
certificate names its holder's role as the subject's common name and carries
INTERNAL_NAME (plus localhost / 127.0.0.1) as its DNS/IP names, which is what clients
check the server against (tandem/internal_tls.py): pod addresses need not be listed.
ECDSA P-256 keys; the CA's key is written only so that more certificates can be signed
later (keep it out of the cluster).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("router", "encoder", "language", "operator")
INTERNAL_NAME = "tandem-internal"


@dataclass(frozen=True)
class PKIPaths:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def cert(self, role: str) -> Path:
        return self.dir / f"{role}.crt"

    def key(self, role: str) -> Path:
        return self.dir / f"{role}.key"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tandem"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, secret: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_pki(out: Path, roles: tuple[str, ...] = ROLES, days: int = 365) -> PKIPaths:
    """A new CA in `out` and a certificate + key for each role, signed by it."""
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("tandem internal CA"))
          .issuer_name(_name("tandem internal CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start)
          .not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    paths = PKIPaths(out)
    _write(paths.ca, ca.public_bytes(serialization.Encoding.PEM))
    _write(out / "ca.key", _pem_key(ca_key), secret=True)
    sans = x509.SubjectAlternativeName([
        x509.DNSName(INTERNAL_NAME), x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(role)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(sans, critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(paths.cert(role), cert.public_bytes(serialization.Encoding.PEM))
        _write(paths.key(role), _pem_key(key), secret=True)
    return paths


def common_name(pem: bytes) -> str:
    """The subject common name of a PEM certificate (a tier's role)."""
    cert = x509.load_pem_x509_certificate(pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""
