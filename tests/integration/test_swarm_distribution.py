"""Model distribution over the torrent swarm with real processes on 127.0.0.1 (issue 4 acceptance).

The control plane (web + worker in real mode) is the web seed and the passkey tracker; three agents
enrolled over HTTP each get a third of SmolLM2's layers, download only the pieces of their range and
role (real libtorrent, sparse files), verify every tensor, load, and the route generates what the
whole file generates.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.artifacts.manifest import Manifest
from agent.artifacts.torrent import shard_byte_ranges, verify_tensors
from agent.client.route import Hop, RouteClient
from agent.client.tokenizer import ChatTokenizer
from agent.procs import stop
from agent.wire.routetoken import mint
from agent.wire.sampling import SamplingParams
from tests.integration.swarm import QUESTION, Swarm, control_plane

pytestmark = pytest.mark.slow
MAX_RATIO = 1.10
THIRDS = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[Swarm]:
    # The tampering test stops an agent and starts it again: on a loaded machine that takes longer than
    # the default 5 s after which a stopped agent's shards are placed elsewhere (its own then stay
    # failed, "node lost", and never become ready again). This module tests distribution, not failover.
    quiet = {"NODE_DEAD_AFTER_S": "300", "NODE_LOST_AFTER_S": "300"}
    with control_plane(tmp_path_factory.mktemp("swarm-distribution"), **quiet) as s:
        yield s


def needed_bytes(manifest: Manifest, a: int, b: int) -> int:
    """Header + the tensors of layers [a, b) + the role tensors: what a node must download at least."""
    return sum(end - start for start, end in shard_byte_ranges(manifest, a, b))


def sparse_file(s: Swarm, node_id: str, manifest: Manifest, model_path: str) -> Path:
    return s.agent_dirs[node_id] / "swarm" / manifest.sha256 / Path(model_path).name


def shards_by_range(s: Swarm) -> dict[tuple[int, int], dict[str, Any]]:
    return {
        (sh["layer_start"], sh["layer_end"]): {**sh, "node": n["id"]}
        for n in s.admin.status()["nodes"]
        for sh in n["shards"]
    }


def test_three_agents_each_download_little_more_than_their_third_over_the_swarm(
    swarm: Swarm, manifest: Manifest, model_path: str
) -> None:
    s = swarm
    for i in (1, 2, 3):
        config, _ = s.enroll(f"agent-{i}")
        s.run_agent(f"agent-{i}", config, "--speed", "1.0")  # equal speeds: the planner deals thirds
    s.online(list(s.agents))
    s.register_smollm2()
    code, body = s.admin.post(f"/models/{s.model['id']}/place", {"replicas": "1"})
    assert code == 200, body
    s.shards_ready(300)

    shards = shards_by_range(s)
    assert sorted(shards) == THIRDS
    rows = []
    for a, b in THIRDS:
        t = shards[(a, b)]["transfer"]
        assert t.get("source") == "swarm", t
        need = needed_bytes(manifest, a, b)
        path = sparse_file(s, shards[(a, b)]["node"], manifest, model_path)
        allocated = os.stat(path).st_blocks * 512
        rows.append(
            {
                "layers": f"{a}:{b}",
                "needed": need,
                "downloaded": int(t["downloaded_bytes"]),
                "ratio": round(t["downloaded_bytes"] / need, 4),
                "from_peers": int(t["peer_bytes"]),
                "from_web_seed": int(t["web_seed_bytes"]),
                "allocated_on_disk": allocated,
            }
        )
    print("\nswarm distribution:", json.dumps(rows, indent=1))
    print("origin bytes:", sum(r["from_web_seed"] for r in rows), "file:", manifest.file_size)
    for r in rows:
        assert r["ratio"] <= MAX_RATIO, r
        assert r["allocated_on_disk"] <= MAX_RATIO * r["needed"] + (4 << 20), r  # sparse, not the whole file
    # the first and last thirds overlap (header + the tied embedding): the later one took from the first
    assert rows[0]["from_peers"] + rows[2]["from_peers"] > 0, rows


async def test_the_route_over_the_sparse_files_generates_what_the_whole_file_does(
    swarm: Swarm, serve_factory: Any, signing_key: Any, manifest: Manifest, model_path: str
) -> None:
    s = swarm
    texts, route = await s.playground_chat([QUESTION])
    assert [(h["layer_start"], h["layer_end"]) for h in route] == THIRDS
    whole = serve_factory("0:30")  # torch backend on the complete GGUF
    session = os.urandom(16)
    hop = Hop(whole.url, 0, 30, mint(signing_key, session, manifest.sha256, 0, 30, whole.node_id, 600))
    client = RouteClient([hop], ChatTokenizer(model_path), session_id=session)
    try:
        parts = [
            ev.text async for ev in client.chat([{"role": "user", "content": QUESTION}], SamplingParams(), 24)
        ]
    finally:
        await client.close()
    assert texts[0].strip() and texts[0] == "".join(parts)


def test_a_shard_tampered_on_disk_is_fetched_again_before_it_is_loaded(
    swarm: Swarm, manifest: Manifest, model_path: str
) -> None:
    s = swarm
    node_id = shards_by_range(s)[(10, 20)]["node"]
    proc = s.agents[node_id]
    stop([proc], grace_s=30)
    path = sparse_file(s, node_id, manifest, model_path)
    victim = manifest.tensors_for_range(10, 20)[5]
    with open(path, "r+b") as f:
        f.seek(victim.offset + victim.nbytes // 2)
        f.write(b"\xde\xad\xbe\xef" * 16)
    with pytest.raises(ValueError, match=victim.name):
        verify_tensors(path, manifest, 10, 20)

    before = shards_by_range(s)[(10, 20)]["transfer"]
    s.run_agent(f"{node_id}-restarted", s.agent_dirs[node_id].parent / "node.json", "--speed", "1.0")
    s.admin.wait_for(
        "the restarted agent's shard fetched and ready again",
        lambda st: any(
            sh["layer_start"] == 10 and sh["state"] == "ready" and sh["transfer"] != before
            for n in st["nodes"]
            if n["id"] == node_id and n["state"] == "online"
            for sh in n["shards"]
        ),
        180,
        every_s=0.5,
    )
    t = shards_by_range(s)[(10, 20)]["transfer"]
    print("\nrepair after tampering:", t)
    assert 0 < t["downloaded_bytes"] <= 2 * (256 << 10), "only the tampered piece came again"
    verify_tensors(path, manifest, 10, 20)  # the file is whole again, and only then was it loaded
