"""SWARM_SSL_TORRENTS: .torrents built at registration carry the data-plane CA as root (SSL torrents)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import libtorrent as lt

from agent.artifacts.manifest import Manifest
from webapp.catalog.services import build_torrent, torrent_root_cert
from webapp.core.dataplane_tls import ca_pem


def _small_file(tmp_path: Path) -> str:
    p = tmp_path / "model.gguf"
    p.write_bytes(os.urandom(1 << 20))
    return str(p)


def test_torrents_are_plain_unless_ssl_torrents_are_switched_on(
    settings: Any, tmp_path: Path, manifest: Manifest
) -> None:
    settings.SWARM_SSL_TORRENTS = False
    assert torrent_root_cert() is None
    tb, _ = build_torrent(_small_file(tmp_path), manifest)
    assert tb is not None and lt.torrent_info(tb).ssl_cert() == ""


def test_with_ssl_torrents_the_torrent_is_rooted_in_the_data_plane_ca(
    settings: Any, tmp_path: Path, manifest: Manifest
) -> None:
    settings.SWARM_SSL_TORRENTS = True
    assert torrent_root_cert() == ca_pem()
    tb, _ = build_torrent(_small_file(tmp_path), manifest)
    assert tb is not None and lt.torrent_info(tb).ssl_cert().strip() == ca_pem().strip()
