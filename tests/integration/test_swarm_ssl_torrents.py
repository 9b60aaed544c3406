"""SSL torrents end to end (SWARM_SSL_TORRENTS=1): agents with https data planes get node certificates at
start, the registered model's .torrent is rooted in the data-plane CA, and the shards still arrive over
the swarm, real processes on 127.0.0.1 with the Django tracker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import libtorrent as lt
import pytest

from agent.procs import free_port
from tests.integration.swarm import Swarm, control_plane

pytestmark = pytest.mark.slow
THIRDS = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    with control_plane(tmp_path_factory.mktemp("swarm-ssl"), SWARM_SSL_TORRENTS="1") as s:
        yield s


def test_enrolled_agents_fetch_their_thirds_over_an_ssl_torrent(swarm: Swarm) -> None:
    s = swarm
    for i in (1, 2, 3):
        config, _ = s.enroll(f"agent-{i}")
        port = free_port()
        s.run_agent(
            f"agent-{i}",
            config,
            "--speed",
            "1.0",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--advertise-url",
            f"https://127.0.0.1:{port}",  # a node certificate, so the torrent session can join
        )
    s.online(list(s.agents))
    model = s.register_smollm2()
    with s.admin.opener.open(f"{s.base}/artifacts/{model['sha256']}/torrent", timeout=30) as r:
        torrent = r.read()  # as staff (the admin's session)
    ca = (s.data_dir / "ca" / "ca.crt").read_text()
    assert lt.torrent_info(torrent).ssl_cert().strip() == ca.strip()  # an SSL torrent
    code, body = s.admin.post(f"/models/{model['id']}/place", {"replicas": "1"})
    assert code == 200, body
    s.shards_ready(300)

    shards: dict[tuple[int, int], dict[str, Any]] = {
        (sh["layer_start"], sh["layer_end"]): sh for n in s.admin.status()["nodes"] for sh in n["shards"]
    }
    assert sorted(shards) == THIRDS
    transfers = [shards[r]["transfer"] for r in THIRDS]
    assert all(t.get("source") == "swarm" for t in transfers), transfers
    # the first and last thirds overlap (header, tied embedding): one took those pieces from the other
    assert transfers[0]["peer_bytes"] + transfers[2]["peer_bytes"] > 0, transfers
    for i in (1, 2, 3):
        log = (s.logs / f"agent-{i}.log").read_text()
        assert "SSL torrents on port" in log and "none: no certificate" not in log
        assert "PEER TRAFFIC IS PLAIN" not in log  # only the loopback http tracker is said to be plain
        assert "TRACKER/WEB SEED OVER PLAIN HTTP IS PLAIN (no TLS) on 127.0.0.1" in log
