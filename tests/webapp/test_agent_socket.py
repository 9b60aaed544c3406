"""The agents' control websocket, driven with channels' WebsocketCommunicator."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from agent.wire.control import CLOSE_REMOVED, CLOSE_UNAUTHORIZED, MAX_STR, parse_server_message
from webapp.asgi import application
from webapp.fleet.models import Node, ShardAssignment
from webapp.fleet.tasks import place_model, remove_node, sweep_offline_nodes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clear_channel_layer")]
GB = 1 << 30
_opened: list[WebsocketCommunicator] = []


@pytest.fixture(autouse=True)
async def sockets_end_with_their_test() -> AsyncIterator[None]:
    """Disconnect, in the test's own loop, every socket the test left open: a consumer that closed with
    4401 still waits for its client's disconnect, and leaving it to the loop's teardown to cancel once
    hung the suite in the Redis channel layer's receive until pytest-timeout (420 s)."""
    yield
    while _opened:
        ws = _opened.pop()
        if not ws.future.done():
            await ws.disconnect()


def agent_socket(node_id: str | None = None, secret: str | None = None) -> WebsocketCommunicator:
    headers = [(b"authorization", f"Node {node_id}:{secret}".encode())] if node_id else []
    ws = WebsocketCommunicator(application, "/ws/agent/", headers=headers)
    _opened.append(ws)
    return ws


def hello(port: int = 9000, shards: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "type": "hello",
        "hardware": {"cpu_count": 2, "memory_bytes": 8 * GB},
        "backends": ["torch"],
        "version": "0.1.0",
        "dataplane_url": f"http://127.0.0.1:{port}",
        "speed": 10.0,
        "free_memory_bytes": 4 * GB,
        "shards": shards or [],
    }


async def connected(node_id: str, secret: str) -> WebsocketCommunicator:
    ws = agent_socket(node_id, secret)
    ok, _ = await ws.connect()
    assert ok
    welcome = await receive_command(ws)
    assert welcome["type"] == "welcome" and welcome["node_id"] == node_id
    return ws


async def receive_command(ws: WebsocketCommunicator) -> dict[str, Any]:
    """The server's next message, checked against the schema the agent enforces."""
    msg: dict[str, Any] = await ws.receive_json_from()
    parse_server_message(msg)
    return msg


async def test_a_socket_without_credentials_is_closed_with_4401() -> None:
    ws = agent_socket()
    await ws.connect()
    assert "credentials" in (await ws.receive_json_from())["error"]
    assert (await ws.receive_output())["code"] == CLOSE_UNAUTHORIZED


async def test_a_socket_with_a_wrong_secret_is_closed_with_4401(node_with_secret: Any) -> None:
    node, secret = node_with_secret
    ws = agent_socket(node.id, secret + "x")
    await ws.connect()
    await ws.receive_json_from()
    assert (await ws.receive_output())["code"] == CLOSE_UNAUTHORIZED


async def test_hello_records_the_node_and_a_closed_socket_marks_it_offline(node_with_secret: Any) -> None:
    node, secret = node_with_secret
    ws = await connected(node.id, secret)
    await ws.send_json_to(hello())
    await ws.send_to(text_data="{")  # the error reply proves the hello was handled first
    assert (await ws.receive_json_from())["type"] == "error"
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert (
        n.state == Node.State.ONLINE
        and n.backends == ["torch"]
        and n.dataplane_url == "http://127.0.0.1:9000"
    )
    assert n.hardware["cpu_count"] == 2 and n.hardware["memory_bytes"] == 8 * GB
    await ws.disconnect()
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert n.state == Node.State.OFFLINE


@pytest.mark.parametrize(
    "bad",
    [
        "{",
        "[1, 2]",
        '{"type": "launch"}',
        '{"type": "progress", "assignment_id": "x"}',
        '{"type": "heartbeat", "telemetry": 5}',
        '{"type": "hello", "protocol": 99}',
        '{"type": "progress", "assignment_id": 1, "state": "failed", "error": "%s"}' % ("x" * (MAX_STR + 1)),
        "\u0000" * 10,
    ],
)
async def test_a_malformed_message_gets_an_error_reply_and_the_socket_stays_up(
    node_with_secret: Any, bad: str
) -> None:
    node, secret = node_with_secret
    ws = await connected(node.id, secret)
    await ws.send_to(text_data=bad)
    reply = await receive_command(ws)
    assert reply["type"] == "error" and reply["error"]
    await ws.send_json_to({"type": "heartbeat", "telemetry": {"sessions": 3, "kv_bytes": 42}})
    await ws.send_to(text_data="{")
    await ws.receive_json_from()
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert n.telemetry["sessions"] == 3
    await ws.disconnect()


async def test_an_error_report_from_an_agent_is_never_answered_with_another_error(
    node_with_secret: Any,
) -> None:
    node, secret = node_with_secret
    ws = await connected(node.id, secret)
    await ws.send_json_to({"type": "error", "error": "bad 'load' message: backend: Field required"})
    await ws.send_json_to({"type": "error", "error": 5})  # malformed, still not answered
    await ws.send_to(text_data="{")
    assert "malformed JSON" in (await receive_command(ws))["error"], "the first reply is to the last message"
    await ws.disconnect()


async def test_placement_pushes_load_commands_to_both_agents_and_progress_reaches_ready(
    artifact: Any,
) -> None:
    from webapp.fleet.services import create_enrollment_token, redeem_enrollment_token

    def enroll(name: str) -> tuple[str, str]:
        e = redeem_enrollment_token(create_enrollment_token(None)[0], name)
        return e.node_id, e.secret

    a_id, a_secret = await database_sync_to_async(enroll)("a")
    b_id, b_secret = await database_sync_to_async(enroll)("b")
    wa, wb = await connected(a_id, a_secret), await connected(b_id, b_secret)
    await wa.send_json_to(hello(9001))
    await wb.send_json_to(hello(9002))
    for ws in (wa, wb):
        await ws.send_to(text_data="{")
        await ws.receive_json_from()

    result = await database_sync_to_async(place_model)(artifact.pk, 1)  # one copy split over both agents
    assert result["ok"], result
    la, lb = await receive_command(wa), await receive_command(wb)
    assert la["type"] == lb["type"] == "load"
    ranges = sorted([(la["layer_start"], la["layer_end"]), (lb["layer_start"], lb["layer_end"])])
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 30

    await wa.send_json_to(
        {"type": "progress", "assignment_id": la["assignment_id"], "state": "ready", "progress": 1}
    )
    await wa.send_json_to(
        {"type": "progress", "assignment_id": lb["assignment_id"], "state": "ready", "progress": 1}
    )
    assert "not yours" in (await wa.receive_json_from())["error"]
    states = dict(
        await database_sync_to_async(lambda: list(ShardAssignment.objects.values_list("node_id", "state")))()
    )
    assert states == {a_id: "ready", b_id: "assigned"}
    await wa.disconnect()
    await wb.disconnect()


async def test_a_reconnecting_agent_that_lost_its_shard_is_told_to_load_it_again(
    node_with_secret: Any, artifact: Any
) -> None:
    node, secret = node_with_secret
    a = await database_sync_to_async(ShardAssignment.objects.create)(
        node=node, artifact=artifact, layer_start=0, layer_end=30, state=ShardAssignment.State.READY
    )
    ws = await connected(node.id, secret)
    await ws.send_json_to(hello())
    cmd = await receive_command(ws)
    assert cmd["type"] == "load" and cmd["assignment_id"] == a.pk
    await ws.disconnect()


async def test_a_removed_node_is_disconnected_with_4403_and_cannot_reconnect(node_with_secret: Any) -> None:
    node, secret = node_with_secret
    ws = await connected(node.id, secret)
    await database_sync_to_async(remove_node)(node.id)
    assert (await receive_command(ws))["type"] == "removed"
    assert (await ws.receive_output())["code"] == CLOSE_REMOVED
    again = agent_socket(node.id, secret)
    await again.connect()
    await again.receive_json_from()
    assert (await again.receive_output())["code"] == CLOSE_UNAUTHORIZED


def test_a_node_silent_for_longer_than_the_limit_is_swept_offline(
    node_with_secret: Any, settings: Any
) -> None:
    node, _ = node_with_secret
    Node.objects.filter(pk=node.id).update(
        state=Node.State.ONLINE,
        last_seen=timezone.now() - timedelta(seconds=settings.NODE_OFFLINE_AFTER_S + 1),
    )
    other = Node.objects.create(name="fresh", state=Node.State.ONLINE, last_seen=timezone.now())
    assert sweep_offline_nodes() == [node.id]
    assert Node.objects.get(pk=node.id).state == Node.State.OFFLINE
    assert Node.objects.get(pk=other.id).state == Node.State.ONLINE


async def test_a_replaced_socket_closing_late_does_not_mark_the_node_offline(
    node_with_secret: Any, artifact: Any
) -> None:
    node, secret = node_with_secret
    old = await connected(node.id, secret)
    new = await connected(node.id, secret)
    await old.disconnect()
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert n.state == Node.State.ONLINE
    await new.disconnect()
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert n.state == Node.State.OFFLINE


async def test_a_connecting_node_is_not_routable_until_its_hello(
    node_with_secret: Any, artifact: Any
) -> None:
    node, secret = node_with_secret
    await database_sync_to_async(Node.objects.filter(pk=node.id).update)(dataplane_url="http://stale:1")
    a = await database_sync_to_async(ShardAssignment.objects.create)(
        node=node, artifact=artifact, layer_start=0, layer_end=30, state=ShardAssignment.State.READY
    )
    ws = await connected(node.id, secret)
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    a = await database_sync_to_async(ShardAssignment.objects.get)(pk=a.pk)
    assert n.dataplane_url == "" and a.state == ShardAssignment.State.ASSIGNED
    await ws.send_json_to(
        hello(shards=[{"model_sha256": artifact.sha256, "layer_start": 0, "layer_end": 30}])
    )
    await ws.send_to(text_data="{")
    await ws.receive_json_from()
    a = await database_sync_to_async(ShardAssignment.objects.get)(pk=a.pk)
    assert a.state == ShardAssignment.State.READY
    await ws.disconnect()


async def test_a_heartbeat_from_a_node_marked_offline_asks_it_to_resync(node_with_secret: Any) -> None:
    node, secret = node_with_secret
    ws = await connected(node.id, secret)
    await database_sync_to_async(Node.objects.filter(pk=node.id).update)(state=Node.State.OFFLINE)
    await ws.send_json_to({"type": "heartbeat", "telemetry": {}})
    assert await receive_command(ws) == {"type": "resync"}
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert n.state == Node.State.ONLINE
    await ws.disconnect()


async def test_a_progress_report_with_transfer_figures_is_kept_on_the_assignment(
    node_with_secret: Any, artifact: Any
) -> None:
    node, secret = node_with_secret
    a = await database_sync_to_async(ShardAssignment.objects.create)(
        node=node, artifact=artifact, layer_start=0, layer_end=30
    )
    ws = await connected(node.id, secret)
    transfer = {"done_bytes": 5, "wanted_bytes": 10, "peers": 1, "peer_bytes": 3, "web_seed_bytes": 2}
    await ws.send_json_to(
        {
            "type": "progress",
            "assignment_id": a.pk,
            "state": "fetching",
            "progress": 0.5,
            "transfer": transfer,
        }
    )
    await ws.send_to(text_data="{")  # the error reply means the report before it was handled
    await ws.receive_json_from()
    a = await database_sync_to_async(ShardAssignment.objects.get)(pk=a.pk)
    assert a.state == "fetching" and a.transfer == transfer
    await ws.disconnect()


def _hang(monkeypatch: pytest.MonkeyPatch, method: str, group: str | None = None) -> asyncio.Event:
    """The channel layer's `method` never answers (a Redis restarting, or accepting and never
    answering), for `group` only when given (other groups' calls go through); the event is set once a
    call waits."""
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    real, waiting = getattr(layer, method), asyncio.Event()

    async def never(*args: Any) -> Any:
        if group is not None and args[0] != group:
            return await real(*args)
        waiting.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(layer, method, never)
    return waiting


@pytest.fixture
def fleet_pings_never_answered(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """The dashboards' pings are never answered; NOTIFY_TIMEOUT_S is 1 s."""
    from webapp.core import channels as core_channels

    monkeypatch.setattr(core_channels, "NOTIFY_TIMEOUT_S", 1.0)
    return _hang(monkeypatch, "group_send", core_channels.FLEET_GROUP)


async def test_a_dashboard_ping_the_channel_layer_never_answers_holds_up_neither_the_database_thread_nor_the_agent(
    node_with_secret: Any,
    fleet_pings_never_answered: asyncio.Event,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A heartbeat's dashboard ping ran inside its database call, on the thread every consumer's
    database calls share: a Redis that accepted and never answered held that thread (and every other
    agent's welcome and heartbeat) for channels-redis' socket timeout, 30 s, at each beat. The ping now
    goes from the event loop after the database call and gives up after NOTIFY_TIMEOUT_S."""
    from webapp.core import channels as core_channels

    node, secret = node_with_secret
    ws = await connected(node.id, secret)
    # longer than the database call's bound below, so a ping inside that call fails the test
    monkeypatch.setattr(core_channels, "NOTIFY_TIMEOUT_S", 8.0)
    await ws.send_json_to({"type": "heartbeat", "telemetry": {}})
    await asyncio.wait_for(fleet_pings_never_answered.wait(), 10)
    # another consumer's database call while the ping waits
    # (with the ping inside the database call it returns only when the ping gives up, after 8 s)
    assert await asyncio.wait_for(database_sync_to_async(Node.objects.filter(pk=node.id).count)(), 5) == 1
    # the agent's next message is handled once the ping gave up (the error reply says so)
    await ws.send_to(text_data="{")
    assert "error" in await ws.receive_json_from(timeout=30)
    assert "dashboard ping (node" in caplog.text


def test_a_dashboard_ping_from_a_task_gives_up_after_its_timeout(
    fleet_pings_never_answered: asyncio.Event,
) -> None:
    """Celery tasks and views ping through the same bound: a hung channel layer costs them 1 s here, not
    channels-redis' 30 s socket timeout."""
    from webapp.core.channels import notify_fleet

    t0 = time.monotonic()
    notify_fleet(kind="placement")
    assert fleet_pings_never_answered.is_set() and time.monotonic() - t0 < 5


@pytest.fixture
def group_ops_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """GROUP_OP_TIMEOUT_S is 0.5 s."""
    from webapp.fleet import consumers

    monkeypatch.setattr(consumers, "GROUP_OP_TIMEOUT_S", 0.5)


@pytest.mark.usefixtures("group_ops_bounded")
async def test_a_socket_that_cannot_join_its_command_group_is_closed_for_the_agent_to_connect_again(
    node_with_secret: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent socket accepted while Redis restarted was never welcomed: its join to the node's group
    never returned, and the agent heartbeated to nobody. Now the join is bounded and a socket that
    cannot join is closed with 1011 (the agent reconnects with its backoff), the node left as it was."""
    node, secret = node_with_secret
    waiting = _hang(monkeypatch, "group_add")
    ws = agent_socket(node.id, secret)
    assert (await ws.connect())[0]
    await asyncio.wait_for(waiting.wait(), 10)
    assert (await ws.receive_output(timeout=10))["code"] == 1011
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert n.state != Node.State.ONLINE and n.connected_at == node.connected_at


@pytest.mark.usefixtures("group_ops_bounded")
async def test_a_closed_socket_whose_group_leave_never_returns_still_marks_the_node_offline(
    node_with_secret: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, secret = node_with_secret
    ws = await connected(node.id, secret)
    waiting = _hang(monkeypatch, "group_discard")
    await ws.disconnect(timeout=10)  # its handler waits GROUP_OP_TIMEOUT_S, then the database
    assert waiting.is_set()
    n = await database_sync_to_async(Node.objects.get)(pk=node.id)
    assert n.state == Node.State.OFFLINE
