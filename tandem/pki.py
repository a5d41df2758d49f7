"""A private CA and one certificate per role, for mTLS between the tiers.

    paths = make_pki(Path("certs"))   # ca.crt, ca.key, <role>.crt, <role>.key for ROLES
    paths.ca, paths.cert("router"), paths.key("router")

`tandem up` makes a throwaway set at start (so the local cluster is authenticated too);
`tandem certs DIR` makes one for a deployment (docs/deploy.md: one Secret per tier), and
`tandem certs --kube-namespace NS ...` (the Helm chart's hook Job) creates those Secrets in
a cluster where they are missing (below, "Kubernetes Secrets"). Each
certificate names its holder's role as the subject's common name and carries
INTERNAL_NAME (plus localhost / 127.0.0.1) as its DNS/IP names, which is what clients
check the server against (tandem/internal_tls.py): pod addresses need not be listed.
ECDSA P-256 keys; the CA's key is written only so that more certificates can be signed
later (keep it out of the cluster).
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("router", "encoder", "language", "operator")
INTERNAL_NAME = "tandem-internal"
CAKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


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


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def new_ca(days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA that signs the role certificates (and nothing below them)."""
    start, end = _validity(days)
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
    return ca, ca_key


def sign_role(ca: x509.Certificate, ca_key: CAKey, role: str,
              days: int) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for `role`, signed by `ca` (an ECDSA CA of new_ca, or the
    RSA one the chart's genCA made in earlier releases). It never outlives the CA (whose
    expiry ends the chain's validity anyway)."""
    start, end = _validity(days)
    end = min(end, ca.not_valid_after_utc)
    sans = x509.SubjectAlternativeName([
        x509.DNSName(INTERNAL_NAME), x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
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
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def make_pki(out: Path, roles: tuple[str, ...] = ROLES, days: int = 365) -> PKIPaths:
    """A new CA in `out` and a certificate + key for each role, signed by it."""
    out.mkdir(parents=True, exist_ok=True)
    ca, ca_key = new_ca(days)
    paths = PKIPaths(out)
    _write(paths.ca, ca.public_bytes(serialization.Encoding.PEM))
    _write(out / "ca.key", _pem_key(ca_key), secret=True)
    for role in roles:
        cert, key = sign_role(ca, ca_key, role, days)
        _write(paths.cert(role), cert)
        _write(paths.key(role), key, secret=True)
    return paths


def common_name(pem: bytes) -> str:
    """The subject common name of a PEM certificate (a tier's role)."""
    cert = x509.load_pem_x509_certificate(pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


# ---- Kubernetes Secrets: `tandem certs --kube-namespace`, the Helm chart's hook Job ---------
#
# The chart (deploy/k8s/tandem, templates/internal-tls.yaml) runs this before every install
# and upgrade. It creates what is missing and never replaces what exists, so the rendered
# Job is the same on every render and running it again rotates nothing:
#   - <ca Secret> (type kubernetes.io/tls: tls.crt, tls.key), the CA, mounted by no pod; a
#     CA Secret the chart's earlier genCA releases left behind has this same shape;
#   - one Secret per role (ca.crt, tls.crt, tls.key), the one that role's pods mount.
# A role's missing Secret is signed by the stored CA, so old and new certificates verify
# alike. plan_kube_secrets decides (tested against real certificates); KubeAPI is the
# only part that talks to a cluster.

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeSecretsError(RuntimeError):
    """A state `tandem certs --kube-namespace` will not resolve on its own."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _secret(name: str, labels: dict[str, str], type_: str, data: dict[str, bytes]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "labels": dict(labels)},
            "type": type_, "data": {k: _b64(v) for k, v in data.items()}}


def plan_kube_secrets(present: dict[str, dict | None], ca_secret: str,
                      role_secrets: dict[str, str], labels: dict[str, str],
                      days: int) -> list[dict]:
    """The Secrets to create, in order (the CA's first), so that every role in
    `role_secrets` (role -> Secret name) has its Secret; `present` maps the CA's and each
    role's Secret name to the object the API returned, or None where there is none.
    Nothing to create: []. A role Secret is missing and so is the CA's while another role's
    exists: KubeSecretsError (a new CA would split the tiers into two trust domains)."""
    missing = [role for role, name in role_secrets.items() if present[name] is None]
    if not missing:
        return []
    out = []
    ca_obj = present[ca_secret]
    if ca_obj is not None:
        data = {k: base64.b64decode(v) for k, v in (ca_obj.get("data") or {}).items()}
        if "tls.crt" not in data or "tls.key" not in data:
            raise KubeSecretsError(f"Secret {ca_secret} holds no tls.crt/tls.key (the CA)")
        ca = x509.load_pem_x509_certificate(data["tls.crt"])
        ca_key = serialization.load_pem_private_key(data["tls.key"], password=None)
        if not isinstance(ca_key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
            raise KubeSecretsError(f"Secret {ca_secret}: the CA key is neither ECDSA nor RSA")
        if ca.not_valid_after_utc <= datetime.datetime.now(datetime.timezone.utc):
            # a certificate it signed would be void from its first second (and the tiers'
            # existing ones already are): only a new CA for every role mends it
            everything = " ".join([ca_secret, *sorted(role_secrets.values())])
            ended = ca.not_valid_after_utc.strftime("%Y-%m-%d %H:%M")
            raise KubeSecretsError(
                f"the CA in Secret {ca_secret} expired at {ended} UTC: it cannot sign {', '.join(role_secrets[r] for r in missing)}; "
                f"delete it and the roles' Secrets (kubectl delete secret {everything}) to "
                f"issue all under a new CA, then restart the tiers")
    else:
        kept = sorted(name for name in role_secrets.values() if present[name] is not None)
        if kept:
            raise KubeSecretsError(
                f"the CA Secret {ca_secret} is gone but {', '.join(kept)} still exist: their CA "
                f"cannot sign the missing ones; delete them too (kubectl delete secret "
                f"{' '.join(kept)}) to issue all under a new CA, then restart the tiers")
        ca, ca_key = new_ca(days)
        out.append(_secret(ca_secret, labels, "kubernetes.io/tls",
                           {"tls.crt": ca.public_bytes(serialization.Encoding.PEM),
                            "tls.key": _pem_key(ca_key)}))
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    for role in missing:
        cert, key = sign_role(ca, ca_key, role, days)
        out.append(_secret(role_secrets[role], labels, "Opaque",
                           {"ca.crt": ca_pem, "tls.crt": cert, "tls.key": key}))
    return out


class KubeAPI:
    """The namespace's Secrets through the Kubernetes API, as the pod's ServiceAccount (its
    token and the cluster CA, mounted at SA_DIR; the API server's address from the
    KUBERNETES_SERVICE_* variables every pod gets). NOTE: not exercised by the test suite,
    which has no cluster (docs/deploy.md, "Internal TLS")."""

    def __init__(self, namespace: str, timeout_s: float = 30.0):
        import ssl

        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        if not host or not (SA_DIR / "token").is_file():
            raise KubeSecretsError("--kube-namespace runs in a pod with a ServiceAccount token "
                                   f"(KUBERNETES_SERVICE_HOST, {SA_DIR}/token): not here")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.base = (f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}")
        self.path = f"/api/v1/namespaces/{namespace}/secrets"
        self.token = (SA_DIR / "token").read_text().strip()
        self.ssl = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        import json
        import urllib.error
        import urllib.request

        req = urllib.request.Request(
            self.base + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Accept": "application/json",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.ssl, timeout=self.timeout_s) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"{}")
            except ValueError:  # not the API server's JSON Status (a proxy's page)
                return e.code, {}
        except (urllib.error.URLError, OSError) as e:
            raise KubeSecretsError(f"{method} {self.base}{path}: {e}") from e

    def get_secret(self, name: str) -> dict | None:
        code, obj = self._call("GET", f"{self.path}/{name}")
        if code == 404:
            return None
        if code != 200:
            raise KubeSecretsError(f"GET Secret {name}: HTTP {code}: {obj.get('message', obj)}")
        return obj

    def create_secret(self, obj: dict) -> None:
        name = obj["metadata"]["name"]
        code, answer = self._call("POST", self.path, obj)
        if code == 409:  # created by someone else since we looked: the next run re-reads
            raise KubeSecretsError(f"Secret {name} was created meanwhile; run again")
        if code != 201:
            raise KubeSecretsError(
                f"POST Secret {name}: HTTP {code}: {answer.get('message', answer)}")


def ensure_kube_secrets(api: KubeAPI, ca_secret: str, role_secrets: dict[str, str],
                        labels: dict[str, str], days: int) -> list[str]:
    """Create the missing Secrets (plan_kube_secrets); the names created, [] for none."""
    names = [ca_secret, *role_secrets.values()]
    present = {name: api.get_secret(name) for name in names}
    plan = plan_kube_secrets(present, ca_secret, role_secrets, labels, days)
    for obj in plan:
        api.create_secret(obj)
    return [obj["metadata"]["name"] for obj in plan]
