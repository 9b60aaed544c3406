"""SSL torrents on 127.0.0.1 with real libtorrent: only holders of a swarm node certificate get pieces,
the traffic goes over the SSL listen sockets, and plain transports off loopback are refused."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import libtorrent as lt
import pytest
from aiohttp import ClientSession

from agent.artifacts import swarm_tls
from agent.artifacts.fetch import FetchError, fetch_shard
from agent.artifacts.manifest import Manifest
from agent.artifacts.torrent import PeerCertificate, SwarmClient, create_torrent
from agent.wire import tls
from webapp.devcluster import Origin

SIZE = 3 << 20
PIECE = 256 << 10


class SwarmCA:
    """A control plane's data-plane CA in miniature: node certificates the way fleet issues them."""

    def __init__(self) -> None:
        self.key, self.cert = tls.make_ca()
        self.pem = tls.cert_pem(self.cert).decode()

    def peer(self, identity: str) -> PeerCertificate:
        key = tls.make_key()
        csr = tls.make_csr(key, identity)
        cert = tls.issue_cert(self.key, self.cert, csr, identity, ["127.0.0.1"])
        return PeerCertificate(cert.decode(), tls.key_pem(key).decode())

    def node(self, node_id: str) -> PeerCertificate:
        return self.peer(tls.node_identity(node_id))


@pytest.fixture(scope="module")
def ca() -> SwarmCA:
    return SwarmCA()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory, ca: SwarmCA) -> tuple[Path, bytes, str]:
    d = tmp_path_factory.mktemp("ssl-artifact")
    path = d / "model.gguf"
    path.write_bytes(os.urandom(SIZE))
    tb, ih = create_torrent(path, PIECE, root_cert=ca.pem)
    return path, tb, ih


@pytest.fixture
def seed(artifact: tuple[Path, bytes, str], ca: SwarmCA) -> Iterator[SwarmClient]:
    path, tb, _ = artifact
    with SwarmClient("127.0.0.1:0", peer_cert=ca.node("seed")) as s:
        s.seed(tb, path, trackers=[])
        yield s


def test_an_ssl_torrent_carries_the_swarm_ca_as_its_root_and_a_different_infohash(
    artifact: tuple[Path, bytes, str], ca: SwarmCA
) -> None:
    path, tb, ih = artifact
    ti = lt.torrent_info(tb)
    assert ti.ssl_cert().strip() == ca.pem.strip()
    assert create_torrent(path, PIECE)[1] != ih  # the root is part of the info dict


def test_two_enrolled_agents_exchange_pieces_over_ssl_through_the_tracker(
    artifact: tuple[Path, bytes, str], ca: SwarmCA, tmp_path: Path
) -> None:
    path, tb, ih = artifact
    with (
        Origin(path, infohashes={bytes.fromhex(ih)}, passkeys={"a", "b"}) as origin,
        SwarmClient("127.0.0.1:0", peer_cert=ca.node("node-a")) as a,
        SwarmClient("127.0.0.1:0", peer_cert=ca.node("node-b")) as b,
    ):
        assert a.ssl_listen_port and a.ssl_listen_port != a.listen_port
        a.seed(tb, path, trackers=[origin.tracker_url("a")])
        got = b.fetch(
            tb,
            tmp_path,
            [(0, SIZE)],
            timeout=60,
            trackers=[origin.tracker_url("b")],
            web_seeds=[origin.web_seed_url("b")],
            web_seed_policy="never",
        )
        assert got.read_bytes() == path.read_bytes()
        d = b.get(ih)
        assert d is not None
        progress = b.progress(d)
        # every byte from the peer: the web seed never came on and the origin served nothing
        assert progress.downloaded_bytes >= SIZE and progress.web_seed_bytes == 0
        assert origin.origin_bytes == 0
        # both announced their SSL listen port, so the tracker hands out only TLS endpoints
        announced = {p.port for p in origin.store.peers(bytes.fromhex(ih), b"", 50, time.time())}
        assert announced == {a.ssl_listen_port, b.ssl_listen_port}


def _raw_session() -> lt.session:
    """Stock libtorrent as an intruder would run it, TCP only (the agents accept no uTP)."""
    return lt.session(
        {
            "listen_interfaces": "127.0.0.1:0,127.0.0.1:0s",
            "enable_dht": False,
            "enable_lsd": False,
            "enable_upnp": False,
            "enable_natpmp": False,
            "allow_multiple_connections_per_ip": True,
            "enable_outgoing_utp": False,
            "enable_incoming_utp": False,
            "alert_mask": lt.alert.category_t.status_notification | lt.alert.category_t.error_notification,
        }
    )


def _intrude(
    tb: bytes, dest: Path, seed: SwarmClient, cert: PeerCertificate | None, wait_s: float = 6.0
) -> tuple[int, int]:
    """Join the torrent with stock libtorrent (optionally presenting `cert`), dial the seed's plain and
    SSL ports for `wait_s` (until a first piece); returns (pieces received, payload bytes received)."""
    ses = _raw_session()
    atp = lt.add_torrent_params()
    atp.ti = lt.torrent_info(tb)
    atp.save_path = str(dest)
    atp.flags &= ~(lt.torrent_flags.auto_managed | lt.torrent_flags.paused)
    h = ses.add_torrent(atp)
    deadline = time.monotonic() + wait_s
    next_dial = 0.0
    while time.monotonic() < deadline:
        for a in ses.pop_alerts():
            if isinstance(a, lt.torrent_need_cert_alert) and cert is not None:
                h.set_ssl_certificate_buffer(cert.cert_pem, cert.key_pem, swarm_tls.FFDHE2048_PEM)
        if time.monotonic() >= next_dial:  # again after each refusal, for the whole window
            next_dial = time.monotonic() + 1.0
            for port in (seed.listen_port, seed.ssl_listen_port):
                h.connect_peer(("127.0.0.1", port))
        if h.status().num_pieces:
            break
        time.sleep(0.2)
    st = h.status()
    ses.remove_torrent(h)
    return int(st.num_pieces), int(st.total_payload_download)


@pytest.mark.parametrize("who", ["no certificate", "another CA's node", "the swarm CA's non-node client"])
def test_a_peer_without_a_swarm_node_certificate_gets_no_piece_from_an_ssl_torrent(
    who: str, artifact: tuple[Path, bytes, str], ca: SwarmCA, seed: SwarmClient, tmp_path: Path
) -> None:
    _, tb, _ = artifact
    cert = {
        "no certificate": None,
        "another CA's node": SwarmCA().node("intruder"),
        # signed by the right CA but not a node's (no `*` torrent name): the web's route client
        "the swarm CA's non-node client": ca.peer(tls.client_identity("control-plane")),
    }[who]
    assert _intrude(tb, tmp_path, seed, cert) == (0, 0)


def test_the_same_stock_libtorrent_with_a_node_certificate_does_get_pieces(
    artifact: tuple[Path, bytes, str], ca: SwarmCA, seed: SwarmClient, tmp_path: Path
) -> None:
    # the control for the refusals above: the intruder harness itself can download
    _, tb, _ = artifact
    pieces, payload = _intrude(tb, tmp_path, seed, ca.node("enrolled"), wait_s=30.0)
    assert pieces > 0 and payload >= PIECE


def test_an_agent_without_a_certificate_refuses_an_ssl_torrent_at_once(
    artifact: tuple[Path, bytes, str], tmp_path: Path
) -> None:
    _, tb, _ = artifact
    with SwarmClient("127.0.0.1:0") as c, pytest.raises(FetchError, match="SSL torrent"):
        c.add(tb, tmp_path, [(0, SIZE)], trackers=[], web_seeds=[])


def test_plain_torrents_and_http_off_loopback_are_refused_unless_told_loudly(
    manifest: Manifest,
    monkeypatch: pytest.MonkeyPatch,
    artifact: tuple[Path, bytes, str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, _, _ = artifact
    plain, _ = create_torrent(path, PIECE)
    monkeypatch.delenv(swarm_tls.INSECURE_ENV, raising=False)
    with SwarmClient("0.0.0.0:0") as c, pytest.raises(FetchError, match="in the clear"):
        c.add(plain, tmp_path, [(0, SIZE)], trackers=[], web_seeds=[])
    with SwarmClient("127.0.0.1:0") as c:
        with pytest.raises(FetchError, match="plain HTTP"):
            c.add(plain, tmp_path, [(0, SIZE)], trackers=["http://10.1.2.3/tracker/k/announce"], web_seeds=[])
        c.add(plain, tmp_path, [(0, SIZE)], trackers=["https://cp.example/tracker/k/announce"], web_seeds=[])
    assert "IS PLAIN (no TLS) on 127.0.0.1" in caplog.text
    with pytest.raises(swarm_tls.PlainTransportRefused, match="plain HTTP"):
        swarm_tls.check_url("http://cp.example:8000/artifacts/x/file", "HTTP range fallback")
    swarm_tls.check_url("http://127.0.0.1:8000/artifacts/x/file", "HTTP range fallback")

    async def http_fallback() -> None:
        async with ClientSession() as http:
            await fetch_shard(
                http, "http://10.1.2.3:8000/artifacts/x/file", {}, manifest, 0, 1, tmp_path / "x"
            )

    with pytest.raises(FetchError, match="HTTP range fallback over plain HTTP"):
        asyncio.run(http_fallback())  # refused before any connection is tried
    assert not (tmp_path / "x").exists()
    monkeypatch.setenv(swarm_tls.INSECURE_ENV, "1")
    swarm_tls.check_url("http://cp.example:8000/artifacts/x/file", "HTTP range fallback")
    with SwarmClient("0.0.0.0:0") as c:
        c.add(plain, tmp_path / "told", [(0, SIZE)], trackers=[], web_seeds=[])
    assert "IS PLAIN (no TLS) on 0.0.0.0" in caplog.text


def test_listen_interfaces_add_an_ssl_socket_on_the_next_port() -> None:
    assert swarm_tls.listen_interfaces("0.0.0.0:6881", ssl=True) == "0.0.0.0:6881,0.0.0.0:6882s"
    assert swarm_tls.listen_interfaces("127.0.0.1:0", ssl=True) == "127.0.0.1:0,127.0.0.1:0s"
    assert swarm_tls.listen_interfaces("[::1]:7000", ssl=True) == "[::1]:7000,[::1]:7001s"
    assert swarm_tls.listen_interfaces("0.0.0.0:6881", ssl=False) == "0.0.0.0:6881"


def _https_origin_context(issuer: SwarmCA, tmp: Path) -> ssl.SSLContext:
    """A control plane's https front for 127.0.0.1 whose certificate `issuer` signed."""
    key = tls.make_key()
    cert = tls.issue_cert(issuer.key, issuer.cert, tls.make_csr(key, "cp"), "urn:ggswarm:web", ["127.0.0.1"])
    (tmp / "web.crt").write_bytes(cert)
    tls.write_private(tmp / "web.key", tls.key_pem(key))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp / "web.crt", tmp / "web.key")
    return ctx


def test_an_ssl_torrents_https_tracker_and_web_seed_are_pinned_to_the_swarm_ca(
    artifact: tuple[Path, bytes, str], ca: SwarmCA, tmp_path: Path
) -> None:
    path, tb, ih = artifact
    pinned = _https_origin_context(ca, tmp_path)
    with (
        Origin(path, infohashes={bytes.fromhex(ih)}, passkeys={"a", "b"}, ssl_context=pinned) as origin,
        SwarmClient("127.0.0.1:0", peer_cert=ca.node("node-a")) as a,
        SwarmClient("127.0.0.1:0", peer_cert=ca.node("node-b")) as b,
    ):
        a.seed(tb, path, trackers=[origin.tracker_url("a")])
        b.fetch(tb, tmp_path / "b", [(0, SIZE)], timeout=60, trackers=[origin.tracker_url("b")], web_seeds=[])
        assert len(origin.announces) >= 2
        with SwarmClient("127.0.0.1:0", peer_cert=ca.node("node-c")) as c:
            c.fetch(
                tb,
                tmp_path / "c",
                [(0, SIZE)],
                timeout=60,
                trackers=[],
                web_seeds=[origin.web_seed_url("a")],
                web_seed_policy="always",
            )
        assert origin.origin_bytes >= SIZE


def test_an_https_control_plane_the_swarm_ca_did_not_sign_is_refused_by_an_ssl_torrent(
    artifact: tuple[Path, bytes, str], ca: SwarmCA, tmp_path: Path
) -> None:
    path, tb, ih = artifact
    foreign = _https_origin_context(SwarmCA(), tmp_path)
    with (
        Origin(path, infohashes={bytes.fromhex(ih)}, passkeys={"b"}, ssl_context=foreign) as origin,
        SwarmClient("127.0.0.1:0", peer_cert=ca.node("node-b")) as b,
        pytest.raises(FetchError, match="timed out") as e,
    ):
        b.fetch(
            tb,
            tmp_path,
            [(0, SIZE)],
            timeout=8,
            trackers=[origin.tracker_url("b")],
            web_seeds=[origin.web_seed_url("b")],
            web_seed_policy="always",
        )
    assert "tracker:" in str(e.value)  # the announce failed its TLS handshake
    assert origin.announces == [] and origin.origin_bytes == 0
