"""Fleet tasks with the database: placement errors, lost-node replacement, drain, sampling, the dashboard socket."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser
from django.utils import timezone

from agent.wire.control import CLOSE_UNAUTHORIZED, Telemetry
from webapp.core.channels import notify_fleet
from webapp.fleet.consumers import FleetConsumer
from webapp.fleet.models import Node, ShardAssignment
from webapp.fleet.services import apply_heartbeat
from webapp.fleet.tasks import drain_node, place_model, replace_lost_node
from webapp.telemetry.models import NodeTelemetrySample
from webapp.telemetry.services import should_sample

GB = 1 << 30


def online(name: str, free: int = 4 * GB, speed: float = 1.0) -> Node:
    return Node.objects.create(
        name=name,
        state=Node.State.ONLINE,
        dataplane_url=f"http://{name}:1",
        free_memory_bytes=free,
        speed=speed,
        backends=["torch"],
        last_seen=timezone.now(),
    )


@pytest.mark.django_db
def test_placing_on_a_fleet_too_small_reports_the_shortfall(artifact: Any, settings: Any) -> None:
    settings.KV_RESERVE_BYTES = 0
    online("tiny", free=10 << 20)
    result = place_model(artifact.pk)
    assert not result["ok"] and "cannot hold the model" in result["error"]
    assert not ShardAssignment.objects.exists()


@pytest.mark.django_db
def test_placing_twice_is_refused_until_unplaced(artifact: Any) -> None:
    online("a")
    assert place_model(artifact.pk)["ok"]
    assert "already placed" in place_model(artifact.pk)["error"]


@pytest.mark.django_db
def test_a_lost_node_s_layers_are_placed_on_a_survivor(artifact: Any) -> None:
    a, b = online("a", speed=1.0), online("b", speed=1.0)
    assert place_model(artifact.pk, replicas=1)["ok"]  # one copy split over both: b's layers only on b
    lost = ShardAssignment.objects.get(node=b)
    Node.objects.filter(pk=b.pk).update(state=Node.State.OFFLINE)
    result = replace_lost_node(b.pk)
    assert result[artifact.sha256]
    lost.refresh_from_db()
    assert lost.state == ShardAssignment.State.FAILED and lost.error == "node lost"
    new = ShardAssignment.objects.get(pk=result[artifact.sha256][0])
    assert (new.node_id, new.layer_start, new.layer_end) == (a.pk, lost.layer_start, lost.layer_end)
    assert replace_lost_node(b.pk) == {}, "a second replacer finds nothing to claim"


@pytest.mark.django_db
def test_draining_a_node_stops_routing_to_it_and_moves_its_layers(artifact: Any) -> None:
    a, b = online("a"), online("b")
    place_model(artifact.pk, replicas=1)  # one copy split over both: b's layers must move to a
    assert drain_node(b.pk)
    assert Node.objects.get(pk=b.pk).state == Node.State.DRAINING
    assert set(ShardAssignment.objects.filter(node=b).values_list("state", flat=True)) == {"draining"}
    covered = sorted(ShardAssignment.objects.filter(node=a).values_list("layer_start", "layer_end"))
    assert covered[0][0] == 0 and covered[-1][1] == 30


@pytest.mark.django_db
def test_heartbeats_are_downsampled_to_one_sample_per_interval(node_with_secret: Any, settings: Any) -> None:
    node, _ = node_with_secret
    settings.TELEMETRY_SAMPLE_EVERY_S = 10
    t = Telemetry(
        tok_s=5.0,
        sessions=1,
        kv_bytes=2,
        kv_budget_bytes=3,
        tokens_served=4,
        cpu_percent=5.0,
        mem_used_bytes=6,
        free_memory_bytes=7,
    )
    assert apply_heartbeat(node.id, t) is True, "a pending node's first heartbeat revives it"
    assert apply_heartbeat(node.id, t) is False
    assert NodeTelemetrySample.objects.filter(node=node).count() == 1
    assert Node.objects.get(pk=node.id).state == Node.State.ONLINE
    now = timezone.now()
    assert should_sample(now - timedelta(seconds=11), now, 10) and not should_sample(now, now, 10)


@pytest.mark.django_db(transaction=True)
async def test_the_dashboard_socket_is_staff_only_and_pushes_node_rows(staff: Any, member: Any) -> None:
    from channels.db import database_sync_to_async

    for user in (AnonymousUser(), member):
        ws = WebsocketCommunicator(FleetConsumer.as_asgi(), "/ws/fleet/")
        ws.scope["user"] = user
        ok, code = await ws.connect()
        assert not ok and code == CLOSE_UNAUTHORIZED
        await ws.disconnect()  # the refused consumer waits for its client's disconnect: end it here
    ws = WebsocketCommunicator(FleetConsumer.as_asgi(), "/ws/fleet/")
    ws.scope["user"] = staff
    assert (await ws.connect())[0]
    node = await database_sync_to_async(online)("pushed")
    await database_sync_to_async(notify_fleet)(node.pk)
    html = await ws.receive_from(timeout=5)
    assert f'id="node-{node.pk}"' in html and 'hx-swap-oob="outerHTML"' in html and "online" in html
    await ws.send_to(text_data="nonsense")
    assert "error" in await ws.receive_from()
    await ws.disconnect()


@pytest.mark.django_db
def test_the_fleet_page_seeds_its_throughput_plot_from_samples(staff_client: Any) -> None:
    n = online("plotted")
    NodeTelemetrySample.objects.create(node=n, ts=timezone.now(), tok_s=42.5)
    body = staff_client.get("/fleet/").content.decode()
    assert 'id="throughput-history"' in body and n.pk in body and "42.5" in body


@pytest.mark.django_db
def test_the_dashboard_lists_open_sessions_and_recent_answers(
    staff_client: Any, artifact: Any, member: Any
) -> None:
    from webapp.routing.models import RouteSession
    from webapp.telemetry.services import record_generation

    s = RouteSession.objects.create(
        artifact=artifact,
        user=member,
        hops=[{"node": "node-x", "layer_start": 0, "layer_end": 30, "url": "http://x"}],
    )
    record_generation(
        s.id,
        artifact.pk,
        member,
        {
            "ttft_ms": 123.0,
            "tok_s": 45.6,
            "n_prompt": 7,
            "n_generated": 3,
            "hops": [{"layers": [0, 30], "compute_ms": 5, "network_ms": 1}],
        },
    )
    body = staff_client.get("/fleet/generations").content.decode()
    assert "node-x [0:30)" in body and "bob" in body and "123 ms" in body and "45.6" in body
    assert "shared," not in body  # no shared prefix, nothing said of one
    record_generation(
        s.id, artifact.pk, member, {"n_prompt": 900, "prefix_shared_tokens": 880, "prefix_hit": True}
    )
    body = staff_client.get("/fleet/generations").content.decode()
    assert "(880 shared, hit)" in body
    assert "/trip)" not in body  # no answer speculated yet
    spec = {"verify_steps": 12, "drafted": 60, "accepted": 30, "tokens_per_round_trip": 3.5}
    record_generation(s.id, artifact.pk, member, {"n_prompt": 9, "speculation": spec})
    body = staff_client.get("/fleet/generations").content.decode()
    assert "(3.50/trip)" in body


def test_tokens_per_round_trip_are_read_only_from_a_sane_speculation_record() -> None:
    from webapp.telemetry.services import spec_rate

    assert spec_rate({"verify_steps": 3, "tokens_per_round_trip": 2.5}) == 2.5
    assert spec_rate({"verify_steps": 0, "tokens_per_round_trip": 2.5}) == 0.0  # it never verified
    assert spec_rate({"verify_steps": 3, "tokens_per_round_trip": 1e9}) == 16.0  # at most 16 a trip
    for bad in (
        None,
        [],
        {"verify_steps": 3, "tokens_per_round_trip": "x"},
        {"verify_steps": 1, "tokens_per_round_trip": float("nan")},
    ):
        assert spec_rate(bad) == 0.0
