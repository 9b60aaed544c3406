"""A shard of SmolLM2 over the torrent swarm across the link harness: a real libtorrent seeder in one
network namespace, the fetching node in another, the tracker in the root namespace; every byte from
the seeder through both namespaces' shaped links and the delaying relays, and the shard verifies."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.artifacts.manifest import Manifest
from agent.artifacts.torrent import create_torrent, shard_byte_ranges, verify_tensors
from agent.dev import links_swarm
from agent.dev.links import LinkLab
from agent.procs import wait_until
from tests.integration.links import fresh_labs  # noqa: F401 - a fixture
from webapp.devcluster import Origin

pytestmark = pytest.mark.slow
LAYERS = (10, 20)
RATE_MBIT = 100.0
DELAY_MS = 5.0
FETCH_TIMEOUT_S = 90.0
PLAIN = {"GGSWARM_INSECURE_PLAIN_HTTP": "1"}  # plain torrents off loopback: the lab has no swarm CA


def _digest(path: str | Path, ranges: list[tuple[int, int]]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for start, end in ranges:
            f.seek(start)
            h.update(f.read(end - start))
    return h.hexdigest()


def test_a_shard_crosses_the_namespaces_from_a_seeder_to_a_node_over_the_swarm_and_verifies(
    fresh_labs: Callable[..., LinkLab],  # noqa: F811
    manifest: Manifest,
    model_path: str,
    tmp_path: Path,
) -> None:
    lab = fresh_labs(2, tls=False)  # namespace 0: the seeder; 1: the node
    torrent, infohash = create_torrent(
        model_path, smallest_layer_bytes=min(x.nbytes for x in manifest.layers)
    )
    (tmp_path / "model.torrent").write_bytes(torrent)
    (tmp_path / "manifest.json").write_text(manifest.to_json())
    lab.shape(RATE_MBIT)
    lab.set_delay(DELAY_MS, DELAY_MS / 10)
    with Origin(
        Path(model_path), infohashes={bytes.fromhex(infohash)}, passkeys={"seeder", "node"}
    ) as origin:

        def peer(index: int, port: int, passkey: str, action: str, *extra: str) -> list[str]:
            """A peer in namespace `index` on `port`, exposed through its relay (where the others reach
            it), announcing through another relay: the tracker sees it at that host-side address."""
            lab.expose(index, port)
            host, relay = lab.reach(index, "127.0.0.1", origin.port)
            tracker = origin.tracker_url(passkey).replace(f"127.0.0.1:{origin.port}", f"{host}:{relay}")
            listen = f"{lab.links[index].ns_ip}:{port}"
            return links_swarm.command(action, tmp_path / "model.torrent", listen, tracker, *extra)

        seeder_port = lab.port(0)
        seeder = lab.spawn(
            0, peer(0, seeder_port, "seeder", "seed", "--file", model_path), tmp_path / "seeder.log", PLAIN
        )

        def announced() -> bool:
            return any(passkey == "seeder" for passkey, _ in origin.announces)

        wait_until("the seeder's first announce", announced, 60, procs=[seeder])

        a, b = LAYERS
        out = tmp_path / "fetched.json"
        fetch = ["--dest", str(tmp_path / "node"), "--manifest", str(tmp_path / "manifest.json"),
                 "--layers", f"{a}:{b}", "--out", str(out), "--timeout", str(FETCH_TIMEOUT_S)]  # fmt: skip
        node = lab.spawn(1, peer(1, lab.port(1), "node", "fetch", *fetch), tmp_path / "node.log", PLAIN)
        code = node.wait(FETCH_TIMEOUT_S + 30)
        result = json.loads(out.read_text()) if out.exists() else {"error": f"no result (exit {code})"}
        assert code == 0 and "error" not in result, (result, (tmp_path / "node.log").read_text()[-3000:])
        assert origin.served.get("node", 0) == 0  # nothing from the origin's web seed
        # the tracker saw the seeder at its namespace's host-side address, its relay's (the node has
        # left the swarm by now): the address the node was handed and dialled, through the relay
        swarm = origin.store.peers(bytes.fromhex(infohash), b"", 10, time.time())
        assert [(p.ip, p.port) for p in swarm] == [(lab.links[0].host_ip, seeder_port)], swarm

    progress = result["progress"]
    ranges = shard_byte_ranges(manifest, a, b)
    needed = sum(end - start for start, end in ranges)
    print(f"\nover the links: {progress['peer_bytes']} bytes from the seeder in {result['seconds']:.2f} s")
    # every byte came from the seeder, in the other namespace: nothing from a web seed
    assert progress["web_seed_bytes"] == 0 and progress["peer_bytes"] >= needed, progress
    assert progress["done_bytes"] == progress["wanted_bytes"], progress
    # the node verified every tensor of its range before it wrote its result; so does the test, and
    # the bytes it needs are the original file's
    verify_tensors(result["path"], manifest, a, b)
    assert _digest(result["path"], ranges) == _digest(model_path, ranges)
    # it crossed the shaped links: the bytes took at least their time at the link's rate
    assert result["seconds"] >= progress["peer_bytes"] * 8 / (RATE_MBIT * 1e6), result
