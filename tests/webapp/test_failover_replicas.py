"""Replicas: a model keeps two copies of each layer range by default when the fleet's memory allows (one,
with a note, when it does not; the count is the model's own, set on the models page or by placing with
a number), a lost node's ranges go back up to that count (on a node not already holding them), and an
offline node whose data plane is gone too is replaced within seconds, not after the 30 s grace."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agent.wire.ids import NodeId
from tests.webapp.test_placement import node, shape
from webapp.catalog.models import ModelArtifact
from webapp.fleet.models import Node, ShardAssignment
from webapp.fleet.placement import Placement, below_target, replan_lost, shape_from_manifest
from webapp.fleet.tasks import place_model, replace_lost_node, sweep_offline_nodes

GB = 1 << 30


def test_ranges_below_their_replica_count_are_found() -> None:
    ps = [Placement(NodeId("a"), 0, 30), Placement(NodeId("b"), 0, 10)]
    assert below_target(30, ps, 2) == [(10, 30)]
    assert below_target(30, ps, 1) == []


def test_a_lost_replica_is_placed_again_on_a_node_that_does_not_hold_the_range() -> None:
    current = [Placement(NodeId("a"), 0, 30, 0), Placement(NodeId("b"), 0, 30, 1)]
    # a has room too, but a second copy on a survives nothing
    new = replan_lost([node("a", 1000, 9.0), node("c", 1000)], shape(), current, NodeId("b"), target=2)
    assert new == [Placement(NodeId("c"), 0, 30, 1)]


def test_a_replica_short_of_its_count_with_no_room_left_is_not_an_error() -> None:
    current = [Placement(NodeId("a"), 0, 30, 0), Placement(NodeId("b"), 0, 30, 1)]
    assert replan_lost([node("a", 1000), node("c", 1)], shape(), current, NodeId("b"), target=2) == []


def _online(name: str, free: int = 4 * GB) -> Node:
    return Node.objects.create(
        name=name,
        state=Node.State.ONLINE,
        dataplane_url=f"http://{name}.test:7070",
        free_memory_bytes=free,
        backends=["torch"],
        last_seen=timezone.now(),
    )


def _copies(artifact: Any) -> dict[tuple[int, int], set[str]]:
    """Each placed range and the nodes holding it."""
    out: dict[tuple[int, int], set[str]] = {}
    for a in ShardAssignment.objects.filter(artifact=artifact, state=ShardAssignment.State.ASSIGNED):
        out.setdefault((a.layer_start, a.layer_end), set()).add(a.node_id)
    return out


@pytest.mark.django_db
def test_a_model_keeps_two_copies_of_each_layer_range_by_default_when_memory_allows(
    artifact: Any, settings: Any
) -> None:
    settings.KV_RESERVE_BYTES = 0
    assert artifact.desired_replicas == 2
    _online("a"), _online("b")
    result = place_model(artifact.pk)
    assert result["ok"] and result["replicas"] == 2 and result["notes"] == []
    copies = _copies(artifact)
    placements = [Placement(NodeId(n), a, b) for (a, b), ns in copies.items() for n in ns]
    assert below_target(artifact.n_layers, placements, 2) == []
    # SmolLM2 fits on either node: each holds a whole copy, so a route is one hop and survives the other
    assert copies == {(0, artifact.n_layers): {n.pk for n in Node.objects.all()}}


@pytest.mark.django_db
def test_one_copy_with_a_note_when_the_fleet_s_memory_holds_only_one(artifact: Any, settings: Any) -> None:
    settings.KV_RESERVE_BYTES = 0
    total = shape_from_manifest(artifact.parsed_manifest).total_bytes
    _online("a", free=total * 3 // 4), _online("b", free=total * 3 // 4)  # one copy, split
    result = place_model(artifact.pk)
    assert result["ok"] and result["replicas"] == 1
    assert result["notes"] == ["only 1 of 2 requested replicas fit in the fleet's memory"]
    spans = sorted(_copies(artifact))
    assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == artifact.n_layers
    assert ModelArtifact.objects.get(pk=artifact.pk).desired_replicas == 2, "the target stays"


@pytest.mark.django_db
def test_the_replica_count_is_set_per_model_on_the_models_page_and_placement_respects_it(
    artifact: Any, staff_client: Any, member: Any, settings: Any
) -> None:
    settings.KV_RESERVE_BYTES = 0
    url = f"/models/{artifact.pk}/replicas"
    assert f'hx-post="{url}"' in staff_client.get("/models/").content.decode()
    outsider = Client()
    outsider.force_login(member)
    assert outsider.post(url, {"replicas": "1"}).status_code == 403
    for bad in ("0", "65", "", "1.5", "\u00b2", "9" * 5000):
        r = staff_client.post(url, {"replicas": bad})
        assert r.status_code == 400 and b"from 1 to 64" in r.content, bad
    r = staff_client.post(url, {"replicas": "1"}, HTTP_HX_REQUEST="true")
    assert r.status_code == 200 and b"Keeps 1 copy of each layer range" in r.content
    assert ModelArtifact.objects.get(pk=artifact.pk).desired_replicas == 1
    a, b = _online("a"), _online("b")
    result = place_model(artifact.pk)
    assert result["ok"] and result["replicas"] == 1
    copies = _copies(artifact)
    assert len(copies) == 2 and all(len(ns) == 1 for ns in copies.values()), "one copy, split over both"
    # with one copy wanted, a lost node's ranges go to the survivor; nothing more is added
    lost = ShardAssignment.objects.filter(node=b).get()
    Node.objects.filter(pk=b.pk).update(state=Node.State.OFFLINE)
    ids = replace_lost_node(b.pk)[artifact.sha256]
    assert [(s.node_id, s.layer_start, s.layer_end) for s in ShardAssignment.objects.filter(pk__in=ids)] == [
        (a.pk, lost.layer_start, lost.layer_end)
    ]


@pytest.mark.django_db
def test_placing_with_a_number_records_it_and_a_lost_copy_is_placed_again_up_to_it(
    artifact: Any, settings: Any
) -> None:
    settings.KV_RESERVE_BYTES = 0
    artifact.desired_replicas = 1
    artifact.save()
    a, b = _online("a"), _online("b")
    assert place_model(artifact.pk, replicas=2)["replicas"] == 2
    assert ModelArtifact.objects.get(pk=artifact.pk).desired_replicas == 2
    c = _online("c")
    Node.objects.filter(pk=b.pk).update(state=Node.State.OFFLINE)
    ids = replace_lost_node(b.pk)[artifact.sha256]
    # a still serves every layer; the second copy b held goes to c, the node that holds none of them
    new = [(s.node_id, s.layer_start, s.layer_end) for s in ShardAssignment.objects.filter(pk__in=ids)]
    assert new == [(c.pk, 0, artifact.n_layers)]
    assert _copies(artifact) == {(0, artifact.n_layers): {a.pk, c.pk}}


class _Health(BaseHTTPRequestHandler):
    node_id = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"status": "ok", "node_id": self.server.node_id}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def live_dataplane() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()


def _spare(name: str) -> Node:
    """An online node with room and no shards: somewhere a lost node's layers can go."""
    return Node.objects.create(
        name=name,
        state=Node.State.ONLINE,
        dataplane_url="http://127.0.0.1:9",  # nothing listens on the discard port
        free_memory_bytes=4 * GB,
        backends=["torch"],
        last_seen=timezone.now(),
    )


def _fleet(artifact: Any, names: list[str]) -> list[Node]:
    nodes = [_spare(n) for n in names]
    assert place_model(artifact.pk, replicas=1)["ok"]
    return nodes


@pytest.mark.django_db
def test_an_offline_node_whose_data_plane_is_gone_is_replaced_within_seconds(
    artifact: Any, settings: Any
) -> None:
    settings.KV_RESERVE_BYTES = 0
    settings.DATAPLANE_PROBE_TIMEOUT_S = 1
    a, b = _fleet(artifact, ["a", "b"])
    held = ShardAssignment.objects.filter(state=ShardAssignment.State.ASSIGNED).first()
    assert held is not None
    Node.objects.filter(pk=held.node_id).update(state=Node.State.OFFLINE, last_seen=timezone.now())
    settings.NODE_DEAD_AFTER_S = 5
    sweep_offline_nodes()  # a restart gets a few seconds to come back
    held.refresh_from_db()
    assert held.state == ShardAssignment.State.ASSIGNED
    Node.objects.filter(pk=held.node_id).update(last_seen=timezone.now() - timedelta(seconds=6))
    sweep_offline_nodes()  # silent for NODE_DEAD_AFTER_S, well inside NODE_LOST_AFTER_S
    held.refresh_from_db()
    assert held.state == ShardAssignment.State.FAILED
    assert (
        ShardAssignment.objects.exclude(node_id=held.node_id)
        .filter(state=ShardAssignment.State.ASSIGNED, layer_start=held.layer_start)
        .exists()
    )


@pytest.mark.django_db(transaction=True)
async def test_a_sweep_waiting_on_a_health_check_leaves_the_shared_database_thread_to_others(
    artifact: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's heartbeat sweeps on the event loop: a dead data plane's health check (up to
    DATAPLANE_PROBE_TIMEOUT_S) once held the thread every consumer's database calls share, so other
    agents' welcomes and heartbeats waited behind it."""
    from channels.db import database_sync_to_async

    from webapp.fleet import probe
    from webapp.fleet.tasks import sweep_offline_nodes_async

    settings.KV_RESERVE_BYTES = 0
    a, _b = await database_sync_to_async(_fleet)(artifact, ["a", "b"])
    await database_sync_to_async(Node.objects.filter(pk=a.pk).update)(
        state=Node.State.OFFLINE, last_seen=timezone.now() - timedelta(seconds=6)
    )
    probing, answer = asyncio.Event(), asyncio.Event()

    async def hung_probe(url: str, node_id: str, timeout_s: float) -> tuple[str, float | None]:
        probing.set()
        await answer.wait()  # a data plane that never answers, until the test says so
        return "no answer", None

    monkeypatch.setattr(probe, "probe_health", hung_probe)
    sweep = asyncio.ensure_future(sweep_offline_nodes_async())
    await asyncio.wait_for(probing.wait(), 10)
    # another consumer's database call while the health check waits
    assert await asyncio.wait_for(database_sync_to_async(Node.objects.count)(), 5) == 2
    answer.set()
    assert await asyncio.wait_for(sweep, 10) == []
    # the check failed: a's layers went to b within NODE_DEAD_AFTER_S, not after the 30 s grace
    failed = ShardAssignment.objects.filter(node_id=a.pk, state=ShardAssignment.State.FAILED).exists
    assert await database_sync_to_async(failed)()


@pytest.mark.django_db
def test_an_offline_node_whose_data_plane_still_answers_keeps_its_shards_for_the_grace(
    artifact: Any, settings: Any, live_dataplane: ThreadingHTTPServer
) -> None:
    settings.KV_RESERVE_BYTES = 0
    (a,) = _fleet(artifact, ["a"])
    _spare("spare")  # where a's layers go once it is lost
    live_dataplane.node_id = a.pk  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{live_dataplane.server_address[1]}"
    Node.objects.filter(pk=a.pk).update(
        state=Node.State.OFFLINE, last_seen=timezone.now() - timedelta(seconds=10), dataplane_url=url
    )
    sweep_offline_nodes()
    assert not ShardAssignment.objects.filter(state=ShardAssignment.State.FAILED).exists()
    Node.objects.filter(pk=a.pk).update(
        last_seen=timezone.now() - timedelta(seconds=settings.NODE_LOST_AFTER_S + 1)
    )
    sweep_offline_nodes()
    assert ShardAssignment.objects.filter(state=ShardAssignment.State.FAILED).exists()


@pytest.mark.django_db
def test_a_node_silent_while_the_web_was_down_gets_the_grace_from_the_web_start(
    artifact: Any, settings: Any
) -> None:
    """The control plane's own restart is not its nodes' loss: agents reconnect with a backoff of up to
    AGENT_RECONNECT_MAX_S, and their silence counts from the latest web start plus that at the earliest."""
    import time

    from webapp.fleet.services import record_web_start

    settings.KV_RESERVE_BYTES = 0
    (a,) = _fleet(artifact, ["a"])
    _spare("spare")  # where a's layers go once it is lost
    silent = timezone.now() - timedelta(seconds=settings.NODE_LOST_AFTER_S + 10)
    Node.objects.filter(pk=a.pk).update(state=Node.State.OFFLINE, last_seen=silent)
    settings.AGENT_RECONNECT_MAX_S = 30
    record_web_start(time.time() - 2)  # the web came back 2 s ago
    sweep_offline_nodes()
    assert not ShardAssignment.objects.filter(state=ShardAssignment.State.FAILED).exists()
    # Up for longer than the grace, but an agent that kept failing to reach it may still be in its backoff.
    record_web_start(time.time() - settings.NODE_LOST_AFTER_S - 1)
    sweep_offline_nodes()
    assert not ShardAssignment.objects.filter(state=ShardAssignment.State.FAILED).exists()
    # Up for the agents' longest backoff plus the grace: a node still silent is lost.
    record_web_start(time.time() - settings.AGENT_RECONNECT_MAX_S - settings.NODE_LOST_AFTER_S - 1)
    sweep_offline_nodes()
    assert ShardAssignment.objects.filter(node=a, state=ShardAssignment.State.FAILED).exists()


@pytest.mark.django_db
def test_a_lost_nodes_layers_nobody_can_take_stay_with_it_until_a_node_can(
    artifact: Any, settings: Any
) -> None:
    """A web down longer than the grace makes every agent look lost (they heartbeat to it): with no
    survivor to take their layers, failing them would leave the model without a route after the
    agents reconnect. They stay assigned; a node that joins takes them on a later sweep."""
    settings.KV_RESERVE_BYTES = 0
    (a,) = _fleet(artifact, ["a"])
    before = sorted(ShardAssignment.objects.filter(node=a).values_list("layer_start", "layer_end", "state"))
    silent = timezone.now() - timedelta(seconds=settings.NODE_LOST_AFTER_S + 10)
    Node.objects.filter(pk=a.pk).update(state=Node.State.OFFLINE, last_seen=silent)
    sweep_offline_nodes()
    after = sorted(ShardAssignment.objects.filter(node=a).values_list("layer_start", "layer_end", "state"))
    assert after == before and not ShardAssignment.objects.filter(state=ShardAssignment.State.FAILED).exists()
    b = _spare("b")
    sweep_offline_nodes()  # a still silent: now b takes its layers
    assert ShardAssignment.objects.filter(node=a, state=ShardAssignment.State.FAILED).exists()
    assert ShardAssignment.objects.filter(node=b, state=ShardAssignment.State.ASSIGNED).exists()


def _two_replicas(artifact: Any) -> list[Node]:
    nodes = []
    for name in ("x", "y"):
        n = Node.objects.create(
            name=name,
            state=Node.State.ONLINE,
            dataplane_url=f"http://{name}.test:7070",
            free_memory_bytes=4 * GB,
            backends=["torch"],
            last_seen=timezone.now(),
        )
        ShardAssignment.objects.create(
            node=n, artifact=artifact, layer_start=0, layer_end=30, state=ShardAssignment.State.READY
        )
        nodes.append(n)
    return nodes


@pytest.mark.django_db
def test_sessions_spread_over_replicas_and_a_failed_hop_gets_the_other_replica_with_a_handoff_grant(
    artifact: Any,
) -> None:
    from agent.wire.handofftoken import verify_handoff
    from agent.wire.routetoken import TokenVerifier
    from webapp.core.keys import route_signing_key
    from webapp.routing.models import RouteSession
    from webapp.routing.services import open_route, replace_hop

    x, y = _two_replicas(artifact)
    s1, g1 = open_route(artifact.pk, None)
    s2, g2 = open_route(artifact.pk, None)
    assert {g1[0].node_id, g2[0].node_id} == {x.pk, y.pk}  # the second session goes to the idle replica

    spare = replace_hop(s1.id, 0, 30, g1[0].url, record=False)  # a warm spare: the route stays
    assert spare is not None and RouteSession.objects.get(pk=s1.id).hops[0]["node"] == g1[0].node_id
    rep = replace_hop(s1.id, 0, 30, g1[0].url)
    assert rep is not None and rep.grant.node_id != g1[0].node_id
    key = route_signing_key().public_key()
    claims = TokenVerifier(key).verify(rep.grant.token)
    assert (claims.node, claims.session) == (rep.grant.node_id, s1.id.bytes)
    h = verify_handoff(key, rep.handoff_token)
    assert (h.src, h.dst, h.layer_start, h.layer_end) == (g1[0].node_id, rep.grant.node_id, 0, 30)
    assert RouteSession.objects.get(pk=s1.id).hops[0]["node"] == rep.grant.node_id
    # never the hop that failed (here the other replica comes back), and a range nobody else holds has none
    again = replace_hop(s1.id, 0, 30, rep.grant.url)
    assert again is not None and again.grant.node_id == g1[0].node_id
    assert replace_hop(s1.id, 0, 10, g1[0].url) is None
