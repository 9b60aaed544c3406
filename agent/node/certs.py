"""The node's data-plane certificate: its own key (0600, never sent), a CSR to the control plane, and
the TLS contexts `run` serves and forwards with, and the torrent peer certificate (docs/security.md)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from agent.artifacts.swarm_tls import PeerCertificate
from agent.node.config import ConfigError, NodeConfig, post_json
from agent.wire import tls


@dataclass(frozen=True)
class NodeTLS:
    """Paths of the node's key, its certificate and the swarm CA, in the config directory."""

    key: Path
    cert: Path
    ca: Path

    def server(self) -> ssl.SSLContext:
        return tls.server_context(self.cert, self.key, self.ca)

    def client(self) -> ssl.SSLContext:
        return tls.client_context(self.cert, self.key, self.ca)

    def torrent_certificate(self) -> PeerCertificate:
        """The same certificate for SSL torrents' peers (it carries the `*` torrent name)."""
        return PeerCertificate.from_files(self.cert, self.key)


def tls_paths(config_path: Path) -> NodeTLS:
    d = config_path.parent
    return NodeTLS(d / "node.key", d / "node.crt", d / "ca.crt")


def obtain_certificate(
    cfg: NodeConfig, config_path: Path, dataplane_url: str, timeout_s: float = 30.0
) -> NodeTLS:
    """Ask the control plane to certify this node's key for `dataplane_url` (a fresh certificate at
    every start: the URL may have changed). The key is made once and stays in the config directory."""
    paths = tls_paths(config_path)
    if not paths.key.exists():
        tls.write_private(paths.key, tls.key_pem(tls.make_key()))
    try:
        key = tls.load_private_key(paths.key)
    except tls.TLSError as e:
        raise ConfigError(f"{e}; delete it to make a new one") from None
    data = post_json(
        cfg.server.rstrip("/") + "/api/agent/certificate",
        {"csr": tls.make_csr(key, cfg.node_id).decode(), "dataplane_url": dataplane_url},
        "the control plane refused a data-plane certificate",
        timeout_s,
        authorization=cfg.authorization(),
    )
    cert, ca = data.get("certificate"), data.get("ca")
    if not isinstance(cert, str) or not isinstance(ca, str):
        raise ConfigError("the control plane's certificate answer has no certificate or CA")
    paths.cert.write_text(cert)
    paths.ca.write_text(ca)
    return paths
