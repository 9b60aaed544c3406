"""Issue 17, lying node: what an enrolled node says about itself never wins it routes.

The attack: a node reported negative sessions and speed 1e300, and the route chooser sent it every
session (a node holding layer 0 sees every prompt). Now the schema refuses such figures, the chooser
prices hops with the control plane's own measurements, and a data-plane URL is routed to only once it
is the socket's peer and answers its health probe with the node's id.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from agent.wire.ids import NodeId
from webapp.asgi import application
from webapp.catalog.models import ModelArtifact
from webapp.fleet.models import Node, ShardAssignment
from webapp.routing.chooser import ShardCandidate, choose_route
from webapp.routing.services import open_route, ready_candidates
from webapp.telemetry.models import GenerationRecord

pytestmark = pytest.mark.usefixtures("clear_channel_layer")


def _artifact() -> ModelArtifact:
    return ModelArtifact.objects.create(
        name="m",
        source="path",
        path="/nonexistent",
        state=ModelArtifact.State.READY,
        sha256="a" * 64,
        n_layers=4,
    )


def _node(name: str, artifact: ModelArtifact, **fields: Any) -> Node:
    n = Node.objects.create(
        name=name, state=Node.State.ONLINE, dataplane_url=f"http://127.0.0.1:{9000 + len(name)}", **fields
    )
    ShardAssignment.objects.create(
        node=n, artifact=artifact, layer_start=0, layer_end=4, state=ShardAssignment.State.READY
    )
    return n


@pytest.mark.django_db
def test_a_node_claiming_speed_1e300_and_negative_sessions_does_not_draw_every_session() -> None:
    artifact = _artifact()
    liar = _node("liar", artifact, speed=1e300, telemetry={"sessions": -1000})
    honest = _node("honest", artifact, speed=1.0, telemetry={"sessions": 0})
    chosen = Counter(open_route(artifact.pk, None)[0].hops[0]["node"] for _ in range(10))
    # The control plane counts the sessions it opened itself, so the two share the load.
    assert chosen[liar.id] == 5 and chosen[honest.id] == 5, chosen


@pytest.mark.django_db
def test_routes_follow_observed_step_times_not_the_node_s_word() -> None:
    artifact = _artifact()
    slow = _node("slow", artifact, speed=1e6)  # claims to be fast
    fast = _node("fast", artifact, speed=0.01)  # modest
    for node, ms in ((slow, 400.0), (fast, 40.0)):
        session, _ = open_route(artifact.pk, None)
        session.hops = [{"node": node.id, "url": node.dataplane_url, "layer_start": 0, "layer_end": 4}]
        session.save(update_fields=["hops"])
        GenerationRecord.objects.create(
            session=session,
            artifact=artifact,
            n_generated=10,
            # the slow node claims it computed nothing and spent the round trip in its handler: only
            # the client's own clock (wall_ms) counts
            hops=[
                {
                    "url": node.dataplane_url,
                    "layers": [0, 4],
                    "compute_ms": 0.0,
                    "network_ms": 0.0 if node is slow else ms,
                    "wall_ms": ms,
                }
            ],
        )
        session.state = "closed"
        session.save(update_fields=["state"])
    by_node = {c.node_id: c for c in ready_candidates(artifact.pk)}
    assert by_node[NodeId(slow.id)].layer_ms == pytest.approx(10.0)
    assert by_node[NodeId(fast.id)].layer_ms == pytest.approx(1.0)
    assert open_route(artifact.pk, None)[0].hops[0]["node"] == fast.id


def test_the_chooser_clamps_whatever_it_is_given() -> None:
    def shard(node: str, speed: float, sessions: int) -> ShardCandidate:
        return ShardCandidate(NodeId(node), f"http://{node}", 0, 30, speed, sessions)

    liar, honest = shard("liar", 1e300, -(10**9)), shard("honest", 1.0, 0)
    # Clamped, a liar's figures are worth at most a bounded advantage, never a free hop.
    from webapp.routing.chooser import hop_cost_ms

    assert hop_cost_ms(liar) > 1.0 and hop_cost_ms(liar) >= hop_cost_ms(shard("x", 1e3, 0))
    observed = [
        ShardCandidate(NodeId("liar"), "http://l", 0, 30, 1e300, -5, layer_ms=5.0),
        ShardCandidate(NodeId("honest"), "http://h", 0, 30, 1.0, 0, layer_ms=1.0),
    ]
    assert [s.node_id for s in choose_route(observed, 30)] == ["honest"]
    assert [s.node_id for s in choose_route([liar, honest], 30)]  # still a route, no crash on extremes


# --- over the control socket -------------------------------------------------------------------------


def _socket(node_id: str, secret: str, peer: str | None = "127.0.0.1") -> WebsocketCommunicator:
    ws = WebsocketCommunicator(
        application, "/ws/agent/", headers=[(b"authorization", f"Node {node_id}:{secret}".encode())]
    )
    if peer is not None:
        ws.scope["client"] = (peer, 40000)
    return ws


async def _connected(node_id: str, secret: str, peer: str | None = "127.0.0.1") -> WebsocketCommunicator:
    ws = _socket(node_id, secret, peer)
    ok, _ = await ws.connect()
    assert ok
    assert (await ws.receive_json_from())["type"] == "welcome"
    return ws


async def _after(ws: WebsocketCommunicator) -> None:
    """Wait until the previous message was handled: a malformed one is answered with an error."""
    await ws.send_to(text_data="{")
    while (await ws.receive_json_from())["type"] != "error":
        pass


async def _sent(ws: WebsocketCommunicator, node_id: str, message: dict[str, Any]) -> Node:
    """Send `message`, wait until it was handled, and read the node's row back."""
    await ws.send_json_to(message)
    await _after(ws)
    return await database_sync_to_async(Node.objects.get)(pk=node_id)


def _routable_at(n: Node, url: str) -> bool:
    return n.dataplane_url == url and n.dataplane_problem == "" and n.dataplane_rtt_ms is not None


@pytest_asyncio.fixture
async def health_server() -> AsyncIterator[tuple[str, dict[str, str]]]:
    """A stand-in data plane: /v1/health answers with whatever node id the test puts in `answer`."""
    answer = {"node_id": ""}

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node_id": answer["node_id"]})

    app = web.Application()
    app.router.add_get("/v1/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", answer
    await runner.cleanup()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("hello", "refused"),
    [
        ({"speed": 1e300}, "speed"),
        ({"speed": float("inf")}, "speed"),
    ],
)
async def test_a_hello_with_an_impossible_speed_is_refused(
    node_with_secret: Any, hello: dict[str, Any], refused: str
) -> None:
    node, secret = node_with_secret
    ws = await _connected(node.id, secret)
    # json writes inf as Infinity, which is not JSON; 1e999 is, and parses to inf.
    await ws.send_to(text_data=json.dumps({"type": "hello", **hello}).replace("Infinity", "1e999"))
    reply = await ws.receive_json_from()
    assert reply["type"] == "error" and refused in reply["error"]
    await ws.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_a_heartbeat_with_negative_sessions_is_refused_and_not_stored(node_with_secret: Any) -> None:
    node, secret = node_with_secret
    ws = await _connected(node.id, secret)
    await ws.send_json_to({"type": "heartbeat", "telemetry": {"sessions": -5}})
    reply = await ws.receive_json_from()
    assert reply["type"] == "error" and "sessions" in reply["error"]
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert n.telemetry.get("sessions", 0) >= 0
    await ws.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_a_data_plane_that_answers_its_probe_with_the_node_s_id_is_routable(
    node_with_secret: Any, health_server: tuple[str, dict[str, str]]
) -> None:
    node, secret = node_with_secret
    url, answer = health_server
    answer["node_id"] = node.id
    ws = await _connected(node.id, secret)
    assert _routable_at(await _sent(ws, node.id, {"type": "hello", "dataplane_url": url}), url)
    await ws.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_a_data_plane_that_failed_its_check_is_checked_again_on_a_heartbeat_and_becomes_routable(
    node_with_secret: Any, health_server: tuple[str, dict[str, str]], settings: Any
) -> None:
    node, secret = node_with_secret
    url, answer = health_server
    answer["node_id"] = "node-000000000000"  # not yet this node's: the check fails
    settings.DATAPLANE_REPROBE_S = 3600
    ws = await _connected(node.id, secret)
    await _sent(ws, node.id, {"type": "hello", "dataplane_url": url})
    answer["node_id"] = node.id
    n = await _sent(ws, node.id, {"type": "heartbeat", "telemetry": {}})
    assert "belongs to another node" in n.dataplane_problem, "checked again before DATAPLANE_REPROBE_S"
    settings.DATAPLANE_REPROBE_S = 0
    assert _routable_at(await _sent(ws, node.id, {"type": "heartbeat", "telemetry": {}}), url)
    await ws.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_a_re_probe_never_clears_the_problem_of_a_url_the_node_no_longer_reports(
    node_with_secret: Any, health_server: tuple[str, dict[str, str]], settings: Any
) -> None:
    from webapp.fleet import services

    node, _ = node_with_secret
    url, _answer = health_server
    await database_sync_to_async(Node.objects.filter(pk=node.id).update)(
        dataplane_url="http://127.0.0.1:2", dataplane_problem="did not answer its health check"
    )
    changed = await database_sync_to_async(services.apply_reprobe)(node.id, url, "", 1.0)
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert not changed and n.dataplane_problem == "did not answer its health check"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("peer", "probe_id", "url_of", "problem"),
    [
        ("10.9.8.7", "self", "server", "is not the address this node connects from"),
        ("127.0.0.1", "other", "server", "belongs to another node"),
        ("127.0.0.1", "self", "closed", "did not answer its health check"),
        ("127.0.0.1", "self", "userinfo", "origin only"),
    ],
)
async def test_a_data_plane_url_that_fails_its_checks_is_never_routed_to(
    node_with_secret: Any,
    health_server: tuple[str, dict[str, str]],
    peer: str,
    probe_id: str,
    url_of: str,
    problem: str,
) -> None:
    node, secret = node_with_secret
    server, answer = health_server
    answer["node_id"] = node.id if probe_id == "self" else "node-000000000000"
    url = {"server": server, "closed": "http://127.0.0.1:1", "userinfo": server.replace("//", "//u:p@")}[
        url_of
    ]
    ws = await _connected(node.id, secret, peer)
    await ws.send_json_to({"type": "hello", "dataplane_url": url})
    await _after(ws)
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert problem in n.dataplane_problem

    def routable() -> bool:
        artifact = _artifact()
        ShardAssignment.objects.create(
            node=n, artifact=artifact, layer_start=0, layer_end=4, state=ShardAssignment.State.READY
        )
        return any(c.node_id == node.id for c in ready_candidates(artifact.pk))

    assert not await database_sync_to_async(routable)()
    await ws.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_an_admin_may_allow_a_data_plane_host_other_than_the_peer(
    node_with_secret: Any, health_server: tuple[str, dict[str, str]], settings: Any
) -> None:
    settings.DATAPLANE_ALLOWED_HOSTS = ["127.0.0.1"]
    node, secret = node_with_secret
    url, answer = health_server
    answer["node_id"] = node.id
    ws = await _connected(node.id, secret, peer="10.9.8.7")  # e.g. behind NAT
    await ws.send_json_to({"type": "hello", "dataplane_url": url})
    await _after(ws)
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert n.dataplane_problem == ""
    await ws.disconnect()
