"""SSL torrents: model pieces between agents over TLS, exchanged only by holders of a swarm certificate.

A torrent built with the swarm CA as its root certificate (BEP 35-style `ssl-cert` in the info dict,
libtorrent's SSL torrents) is served only on the session's SSL listen socket: each side presents a
certificate the torrent's root signed and whose DNS name is the torrent's name or `*` (node
certificates carry `*`, agent/wire/tls.py). A peer without one never completes the handshake, so it
gets no piece. Plain torrents stay for loopback development, said loudly, as on the data plane.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from agent.wire.tls import is_loopback

log = logging.getLogger(__name__)

# One switch for every plain transport off loopback (the data plane reads the same variable).
INSECURE_ENV = "GGSWARM_INSECURE_PLAIN_HTTP"

# RFC 7919 ffdhe2048, public parameters: libtorrent refuses a torrent certificate without DH
# parameters (even though TLS 1.3 / ECDHE never use them), and generating them takes seconds.
FFDHE2048_PEM = """-----BEGIN DH PARAMETERS-----
MIIBCAKCAQEA//////////+t+FRYortKmq/cViAnPTzx2LnFg84tNpWp4TZBFGQz
+8yTnc4kmz75fS/jY2MMddj2gbICrsRhetPfHtXV/WVhJDP1H18GbtCFY2VVPe0a
87VXE15/V8k1mE8McODmi3fipona8+/och3xWKE2rec1MKzKT0g6eXq8CrGCsyT7
YdEIqUuyyOP7uWrat2DX9GgdT0Kj3jlN9K5W7edjcrsZCwenyO4KbXCeAvzhzffi
7MA0BM0oNC9hkXL+nOmFg/+OTxIy7vKBg8P+OxtMb61zO7X8vC7CIAXFjvGDfRaD
ssbzSibBsu/6iGtCOGEoXJf//////////wIBAg==
-----END DH PARAMETERS-----
"""


class PlainTransportRefused(RuntimeError):
    """Model bytes would cross a non-loopback network in the clear and nobody said that is fine
    (callers raise it on as their FetchError)."""


@dataclass(frozen=True)
class PeerCertificate:
    """The node's certificate and key (PEM) it presents to the peers of every SSL torrent."""

    cert_pem: str
    key_pem: str

    @classmethod
    def from_files(cls, cert: Path, key: Path) -> PeerCertificate:
        return cls(cert.read_text(), key.read_text())


def split_listen(listen: str) -> tuple[str, int]:
    """(host, port) of a libtorrent listen interface such as `0.0.0.0:6881` or `[::1]:0`."""
    host, _, port = listen.strip().rpartition(":")
    return host.strip("[]"), int(port)


def listen_interfaces(listen: str, ssl: bool) -> str:
    """`listen` plus, for SSL torrents, an SSL socket on the next port (or any port for port 0)."""
    if not ssl:
        return listen
    host, port = split_listen(listen)
    shown = f"[{host}]" if ":" in host else host
    return f"{listen},{shown}:{port + 1 if port else 0}s"


def allow_plain(host: str, what: str) -> None:
    """Loopback, or GGSWARM_INSECURE_PLAIN_HTTP=1: go on with a loud warning; else refuse."""
    if not is_loopback(host) and os.environ.get(INSECURE_ENV) != "1":
        raise PlainTransportRefused(
            f"refusing {what} in the clear on {host}: model bytes would cross the network unencrypted "
            f"and any peer could take part. Use SSL torrents (the control plane's swarm CA as root, "
            f"this node's certificate), bind 127.0.0.1, or set {INSECURE_ENV}=1 (development only)"
        )
    log.warning(
        "%s IS PLAIN (no TLS) on %s: development only; anyone who sees this traffic reads the model "
        "bytes, and any peer with the torrent can join",
        what.upper(),
        host,
    )


def check_url(url: str, what: str) -> None:
    """https is fine (verified by the client); http only to loopback or when told loudly."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        return
    if parts.scheme != "http":
        raise PlainTransportRefused(f"{what}: {url!r} is neither http:// nor https://")
    allow_plain(parts.hostname or "", f"{what} over plain HTTP")


def check_torrent(
    name: str, is_ssl: bool, has_peer_cert: bool, listen_host: str, urls: Iterable[str]
) -> None:
    """An SSL torrent needs our certificate; a plain one, and http:// trackers and web seeds, are for
    loopback (or GGSWARM_INSECURE_PLAIN_HTTP=1) only, with a loud warning."""
    if is_ssl and not has_peer_cert:
        raise PlainTransportRefused(
            f"{name} is an SSL torrent (peers must show a swarm certificate) and this node's torrent "
            "session has none; enroll with an https data plane"
        )
    if not is_ssl:
        allow_plain(listen_host, f"torrent {name}: peer traffic")
    for url in urls:
        check_url(url, f"torrent {name}: tracker/web seed")
