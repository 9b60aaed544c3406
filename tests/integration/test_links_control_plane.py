"""The control plane across the link harness: web and Celery in the root namespace, two `agent run` nodes each in a namespace of its own, enrolled, fed and chatted with through the delaying relays and shaped links."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from agent.client.route import Hop, RouteClient
from agent.client.tokenizer import ChatTokenizer
from agent.dev.cluster import ServeHop, wait_ready
from agent.dev.links import LinkedNode, LinkLab
from agent.wire.routetoken import mint
from agent.wire.sampling import SamplingParams
from tests.integration.links import fresh_labs  # noqa: F401 - a fixture
from tests.integration.swarm import QUESTION, control_plane

pytestmark = pytest.mark.slow
RATE_MBIT = 100.0
DELAY_MS = 5.0
SHARDS_TIMEOUT_S = 150.0
MAX_TOKENS = 24


async def _loopback_chat(
    hops: list[ServeHop],
    windows: list[tuple[int, int]],
    key: Any,  # noqa: ANN401 - the route-token signing key
    sha256: str,
    model_path: str,
) -> str:
    """The playground's question over serve hops on 127.0.0.1 (`windows` their layers), greedy, with
    the route client: what the playground's chat answers on loopback."""
    session = os.urandom(16)
    route = [
        Hop(h.url, a, b, mint(key, session, sha256, a, b, h.node_id, 600))
        for h, (a, b) in zip(hops, windows, strict=True)
    ]
    client = RouteClient(route, ChatTokenizer(model_path), session_id=session)
    try:
        messages = [{"role": "user", "content": QUESTION}]
        return "".join([ev.text async for ev in client.chat(messages, SamplingParams(), MAX_TOKENS)])
    finally:
        await client.close()


async def test_agents_in_namespaces_enroll_fetch_their_shards_and_serve_a_chat_across_the_links(
    fresh_labs: Callable[..., LinkLab],  # noqa: F811
    serve_factory: Callable[..., ServeHop],
    signing_key: Any,  # noqa: ANN401
    model_path: str,
    tmp_path: Path,
) -> None:
    from agent.backends import libggswarm

    if not libggswarm.is_available():
        pytest.skip("native library not built (bash native/build.sh)")
    lab = fresh_labs(2, tls=False)  # namespace i: agent-i's node
    lab.shape(RATE_MBIT)
    lab.set_delay(DELAY_MS, DELAY_MS / 10)
    # the nodes reach the web server at their namespaces' host-side addresses (the relays')
    hosts = ",".join(["127.0.0.1", "localhost", *(link.host_ip for link in lab.links)])
    with control_plane(tmp_path / "cp", DEFAULT_BACKEND="native", ALLOWED_HOSTS=hosts) as s:
        web_port = int(s.base.rsplit(":", 1)[1])
        nodes: dict[str, LinkedNode] = {}
        for i in range(2):
            node = lab.node(i, "127.0.0.1", web_port)
            # enrolled from inside the namespace: its config names the control plane's relay
            config, _ = s.enroll(f"agent-{i}", server=node.server, prefix=node.prefix)
            node_id = s.run_agent(
                f"agent-{i}",
                config,
                *node.args,
                torrent_listen=node.torrent_listen,
                prefix=node.prefix,
                env=node.env,
            )
            nodes[node_id] = node
        s.register_smollm2()  # the manifest is built while the agents start
        status = s.online(list(nodes))
        # the control plane believed each advertised relay URL: its host is where the node's socket
        # came from (the relay dials from it) and its probe, through the relay, reached the node
        urls = {n["id"]: n["dataplane_url"] for n in status["nodes"]}
        assert urls == {nid: node.url for nid, node in nodes.items()}, urls

        code, body = s.admin.post(f"/models/{s.model['id']}/place", {"replicas": "1"})
        assert code == 200, body
        shards = s.shards_ready(SHARDS_TIMEOUT_S)
        by_node = {n["id"]: n["shards"] for n in s.admin.status()["nodes"]}
        assert all(len(by_node[nid]) == 1 and by_node[nid][0]["state"] == "ready" for nid in nodes), by_node
        ranges = sorted((sh["layer_start"], sh["layer_end"]) for sh in shards)
        assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 30, ranges

        # every shard came over the swarm (libtorrent: the web seed and the other node, through the
        # relays), not the HTTP range fallback
        transfers = [sh["transfer"] for sh in shards]
        assert all(t and t["source"] == "swarm" for t in transfers), transfers
        # the same layers on loopback, loading while the chat runs: the answer to compare with
        windows = ranges
        loopback = [serve_factory(f"{a}:{b}", backend="native", wait=False) for a, b in windows]

        texts, route = await s.playground_chat([QUESTION], max_tokens=MAX_TOKENS)
        print(f"\nacross the links: {texts[0]!r}; {s.telemetry[-1]}; transfers {transfers}")
        assert texts[0].strip()
        # two hops, the namespaced nodes, each dialled at its namespace's host-side address (its relay):
        # every byte of the route crossed the delaying relays and the shaped links
        assert len(route) == 2 and {h["node"] for h in route} == set(nodes), route
        for h in route:
            node = nodes[h["node"]]
            assert h["url"] == node.url and urlsplit(node.url).hostname == lab.links[node.index].host_ip, h

        for hop in loopback:
            wait_ready(hop)
        assert texts[0] == await _loopback_chat(loopback, windows, signing_key, s.model["sha256"], model_path)
