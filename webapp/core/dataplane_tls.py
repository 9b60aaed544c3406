"""The control plane's data-plane CA: node certificates from CSRs, and the web's own client certificate.

The CA lives in DATA_DIR/ca (ca.key 0600, ca.crt). A node keeps its private key: it sends a CSR with
the data-plane URL it will serve on, authenticated by its node credentials, and gets back a certificate
naming its node id and that host (agent/node/certs.py). The web's route clients (API, playground) talk
to https hops with a client certificate from the same CA. docs/security.md has the model.

In core because fleet issues node certificates and api/playground use the client context.
"""

from __future__ import annotations

import ssl
import urllib.parse
from functools import lru_cache
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from django.conf import settings

from agent.wire import tls


class CertificateRequestError(Exception):
    """The CSR or the data-plane URL cannot be certified."""


def ca_dir() -> Path:
    return Path(settings.DATA_DIR) / "ca"


@lru_cache(maxsize=1)
def dataplane_ca() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    return tls.load_or_create_ca(ca_dir())


def ca_pem() -> str:
    return tls.cert_pem(dataplane_ca()[1]).decode()


def dataplane_host(url: str) -> str:
    """The host an https data-plane URL names (what the node's certificate will be valid for)."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as e:
        raise CertificateRequestError(f"data-plane URL is malformed: {e}") from None
    if parts.scheme != "https" or not parts.hostname:
        raise CertificateRequestError("a certificate is only issued for an https:// data-plane URL")
    return parts.hostname


def issue_node_certificate(node_id: str, csr_pem: str, dataplane_url: str) -> str:
    """A PEM certificate for `node_id`'s own key, valid for the host of `dataplane_url`."""
    host = dataplane_host(dataplane_url)
    key, cert = dataplane_ca()
    try:
        return tls.issue_cert(key, cert, csr_pem.encode(), tls.node_identity(node_id), [host]).decode()
    except tls.TLSError as e:
        raise CertificateRequestError(str(e)) from None


@lru_cache(maxsize=1)
def client_context() -> ssl.SSLContext:
    """The web's client context for https hops: its own certificate (made once), the swarm CA only."""
    d = ca_dir()
    key_path, cert_path = d / "control-plane.key", d / "control-plane.crt"
    ca_key, ca_cert = dataplane_ca()
    if not cert_path.exists() or not key_path.exists():
        key = tls.make_key()
        tls.write_private(key_path, tls.key_pem(key))
        csr = tls.make_csr(key, "control-plane")
        cert_path.write_bytes(tls.issue_cert(ca_key, ca_cert, csr, tls.client_identity("control-plane"), []))
    return tls.client_context(cert_path, key_path, d / "ca.crt")


def context_for(urls: list[str]) -> ssl.SSLContext | None:
    """The client context when any hop is https (so plain loopback development never makes a CA)."""
    return client_context() if any(u.startswith("https://") for u in urls) else None
