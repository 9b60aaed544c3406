"""Data-plane TLS: the swarm's own CA, node certificates from CSRs, pinned mutual-TLS contexts.

The control plane keeps a small CA (key 0600); a node makes its own key, sends a CSR at enrollment and
gets back a certificate naming its node id (URI SAN `urn:ggswarm:node:<id>`) and its data-plane host.
Hops and clients trust only that CA (never the system store) and present their own certificate, so a
route token sniffed or stolen elsewhere is useless without a swarm certificate (docs/security.md).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NODE_URI_PREFIX = "urn:ggswarm:node:"
CLIENT_URI_PREFIX = "urn:ggswarm:client:"
CERT_DAYS = 365
SSL_TORRENT_WILDCARD = "*"


class TLSError(Exception):
    """A CSR, certificate or key that cannot be used for the data plane."""


def make_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(name: str = "gguf-swarm data plane CA") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = make_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=10 * 365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def load_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as e:
        raise TLSError(f"{path}: cannot read the private key ({e})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TLSError(f"{path}: not an EC private key")
    return key


def load_or_create_ca(directory: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The CA in `directory` (ca.key 0600, ca.crt), created on first use."""
    key_path, cert_path = directory / "ca.key", directory / "ca.crt"
    if not key_path.exists():
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        key, cert = make_ca()
        write_private(key_path, key_pem(key))
        cert_path.write_bytes(cert_pem(cert))
    return load_private_key(key_path), x509.load_pem_x509_certificate(cert_path.read_bytes())


def write_private(path: Path, data: bytes) -> None:
    """Create `path` 0600 from the start (never briefly readable by others)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)
        f.write(data)


def make_csr(key: ec.EllipticCurvePrivateKey, node_id: str) -> bytes:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def _san_for_host(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue_cert(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    csr_pem: bytes,
    identity: str,
    hosts: list[str],
    days: int = CERT_DAYS,
) -> bytes:
    """Sign a CSR as `identity` (a `urn:ggswarm:...` URI the CA chooses, never the CSR's own names),
    valid for `hosts` (the data-plane host names or addresses the control plane registered)."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise TLSError(f"not a PEM certificate signing request: {e}") from None
    if not csr.is_signature_valid:
        raise TLSError("the CSR's signature does not match its key")
    pub = csr.public_key()
    if not isinstance(pub, ec.EllipticCurvePublicKey):
        raise TLSError("the CSR's key must be an EC key (P-256)")
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity)]
    if identity.startswith(NODE_URI_PREFIX):
        names.append(x509.DNSName(node_dns_name(identity[len(NODE_URI_PREFIX) :])))
        # `*`: libtorrent lets a peer into an SSL torrent only with the torrent's name or `*` as a DNS
        # name (agent/artifacts/swarm_tls.py); OpenSSL matches a bare `*` to no host name but "*".
        names.append(x509.DNSName(SSL_TORRENT_WILDCARD))
    names += [_san_for_host(h) for h in hosts]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity[-64:])]))
        .issuer_name(ca_cert.subject)
        .public_key(pub)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert_pem(cert)


def server_context(cert_path: Path, key_path: Path, ca_path: Path) -> ssl.SSLContext:
    """A hop's listening side: its own certificate; clients must present one the swarm CA signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_path, key_path)
    ctx.load_verify_locations(cafile=ca_path)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(cert_path: Path, key_path: Path, ca_path: Path) -> ssl.SSLContext:
    """A hop forwarding (chain mode) or a route client: presents its certificate, trusts the swarm CA
    only, and checks the host name in the URL against the hop's certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_path, key_path)
    ctx.load_verify_locations(cafile=ca_path)  # and nothing else: no system CAs
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def node_dns_name(node_id: str) -> str:
    """The name a node's certificate carries for its node id, as a host name TLS can check: a hop
    dials the next hop's URL with this as server_hostname, so only that node's certificate passes."""
    return "n-" + hashlib.sha256(node_id.encode()).hexdigest()[:40] + ".node.ggswarm"


def node_identity(node_id: str) -> str:
    return NODE_URI_PREFIX + node_id


def client_identity(name: str) -> str:
    return CLIENT_URI_PREFIX + name


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
