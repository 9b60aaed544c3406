"""The node's libtorrent session: settings, listen sockets, its torrents and the alert thread's counters."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import libtorrent as lt

from agent import defaults
from agent.artifacts.fetch import FetchError
from agent.artifacts.pieces import WEB_SEED_FALLBACK, WEB_SEED_POLICIES
from agent.artifacts.swarm_tls import (
    FFDHE2048_PEM,
    PeerCertificate,
    PlainTransportRefused,
    check_torrent,
    listen_interfaces,
    split_listen,
)

log = logging.getLogger("agent.artifacts.torrent")  # the name its records always had

BLOCK = 16 * 1024  # libtorrent's request size


@dataclass
class Download:
    """A torrent in the session and what we want of it; counters are fed by the alert thread."""

    handle: lt.torrent_handle
    infohash: str
    path: Path
    piece_length: int
    total_size: int
    wanted: set[int]
    web_seeds: list[str]
    policy: str
    has_trackers: bool
    web_seed_active: bool = False
    web_seed_endpoints: set[tuple[str, int]] = field(default_factory=set)
    peer_bytes: int = 0
    web_seed_bytes: int = 0
    hash_failures: int = 0
    payload_before_recheck: int = 0  # libtorrent restarts its payload counter on a recheck
    tracker_peers: int | None = None  # peers in the tracker's latest reply
    arrival_rank: int | None = None  # peers in the tracker's first reply: our place in the swarm
    tracker_error: str = ""
    error: str = ""
    flushed: threading.Event = field(default_factory=threading.Event)


class SwarmSession:
    """One libtorrent session for a node (SwarmClient adds downloading and seeding on top).

    A background thread drains libtorrent's alerts (block sources, hash failures, tracker replies) so
    counters stay exact while seeding long after a fetch returns.
    """

    def __init__(
        self,
        listen: str = defaults.TORRENT_LISTEN,
        *,
        web_seed_policy: str = WEB_SEED_FALLBACK,
        peer_wait_s: float = 2.0,
        stall_s: float = 1.0,
        settings: lt.settings_pack | None = None,
        peer_cert: PeerCertificate | None = None,
    ) -> None:
        """`peer_cert` (the node's swarm certificate) lets this session join SSL torrents: an SSL
        listen socket opens on the next port (any port for port 0) next to `listen`."""
        if web_seed_policy not in WEB_SEED_POLICIES:
            raise ValueError(f"unknown web seed policy {web_seed_policy!r}")
        self.web_seed_policy = web_seed_policy
        self.peer_wait_s = peer_wait_s
        self.stall_s = stall_s
        self.peer_cert = peer_cert
        self._listen_host = split_listen(listen)[0]
        pack: lt.settings_pack = {
            "listen_interfaces": listen_interfaces(listen, ssl=peer_cert is not None),
            "enable_dht": False,
            "enable_lsd": False,
            "enable_upnp": False,
            "enable_natpmp": False,
            # Several agents may share one host (tests, small fleets): let peers on loopback / one IP in.
            "allow_multiple_connections_per_ip": True,
            "no_connect_privileged_ports": False,
            # SSRF mitigation blocks trackers/web seeds on localhost; our .torrents come only from our
            # own authenticated control plane, which may well run on the same host (demo, tests).
            "ssrf_mitigation": False,
            # TCP only: uTP adds nothing inside a datacenter/LAN and makes loopback runs jittery.
            "enable_outgoing_utp": False,
            "enable_incoming_utp": False,
            "alert_mask": (
                lt.alert.category_t.error_notification
                | lt.alert.category_t.status_notification
                | lt.alert.category_t.tracker_notification
                | lt.alert.category_t.block_progress_notification
                | lt.alert.category_t.storage_notification
            ),
            "alert_queue_size": 100_000,
            "stop_tracker_timeout": 1,
            "min_reconnect_time": 1,
            "peer_connect_timeout": 3,
            "user_agent": "gguf-swarm-agent/0.1",
        }
        pack.update(settings or {})
        self._session = lt.session(pack)
        self._lock = threading.Lock()
        self._downloads: dict[str, Download] = {}
        self._closed = threading.Event()
        self._pump = threading.Thread(target=self._pump_alerts, name="swarm-alerts", daemon=True)
        self._pump.start()

    # ---------------------------------------------------------------- lifecycle
    @property
    def listen_port(self) -> int:
        return int(self._session.listen_port())

    @property
    def ssl_listen_port(self) -> int:
        """The port SSL torrents' peers connect to (0 without a peer certificate)."""
        return int(self._session.ssl_listen_port()) if self.peer_cert else 0

    def close(self) -> None:
        """Stop seeding and close the session (files stay on disk)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._pump.join(timeout=5)
        with self._lock:
            for d in self._downloads.values():
                self._session.remove_torrent(d.handle)
            self._downloads.clear()
        del self._session

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- alerts
    def _pump_alerts(self) -> None:
        while not self._closed.is_set():
            if self._session.wait_for_alert(100) is None:
                continue
            for a in self._session.pop_alerts():
                try:
                    self._on_alert(a)
                except Exception:  # noqa: BLE001 - one odd alert must not stop the counters
                    log.exception("alert %s", type(a).__name__)

    def _download_for(self, a: lt.torrent_alert) -> Download | None:
        try:
            ih = str(a.handle.info_hashes().v1)
        except RuntimeError:  # handle already removed
            return None
        return self._downloads.get(ih)

    def _on_alert(self, a: lt.alert) -> None:
        if not isinstance(a, lt.torrent_alert):
            return
        with self._lock:
            d = self._download_for(a)
            if d is None:
                return
            if isinstance(a, lt.torrent_need_cert_alert):
                # an SSL torrent's context exists now: present our swarm certificate to its peers
                if self.peer_cert is not None:
                    a.handle.set_ssl_certificate_buffer(
                        self.peer_cert.cert_pem, self.peer_cert.key_pem, FFDHE2048_PEM
                    )
            elif isinstance(a, lt.block_finished_alert):
                start = a.piece_index * d.piece_length + a.block_index * BLOCK
                piece_end = min((a.piece_index + 1) * d.piece_length, d.total_size)
                n = max(0, min(BLOCK, piece_end - start))
                ep = (str(a.endpoint[0]), int(a.endpoint[1]))
                if ep in d.web_seed_endpoints:
                    d.web_seed_bytes += n
                else:
                    d.peer_bytes += n
            elif isinstance(a, lt.cache_flushed_alert):
                d.flushed.set()
            elif isinstance(a, lt.hash_failed_alert):
                d.hash_failures += 1
            elif isinstance(a, lt.tracker_reply_alert):
                d.tracker_peers = int(a.num_peers)
                if d.arrival_rank is None:
                    d.arrival_rank = d.tracker_peers
                d.tracker_error = ""
            elif isinstance(a, lt.tracker_error_alert):
                d.tracker_error = a.message()
            elif isinstance(a, lt.torrent_error_alert | lt.file_error_alert):
                d.error = a.message()

    # ---------------------------------------------------------------- torrents
    def _check_transport(self, ti: lt.torrent_info, urls: Iterable[str]) -> None:
        """The plain-transport rule for a torrent and its URLs (swarm_tls.check_torrent), as FetchError."""
        try:
            check_torrent(
                str(ti.info_hashes().v1)[:8],
                bool(ti.ssl_cert()),
                self.peer_cert is not None,
                self._listen_host,
                urls,
            )
        except PlainTransportRefused as e:
            raise FetchError(str(e)) from None

    def get(self, infohash: str) -> Download | None:
        with self._lock:
            return self._downloads.get(infohash)
