"""The playground websocket: sticky route sessions, streamed deltas, telemetry, and refusals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from agent.wire.control import CLOSE_UNAUTHORIZED
from webapp.fleet.models import Node, ShardAssignment
from webapp.playground import consumers
from webapp.playground.consumers import ChatConsumer
from webapp.routing.models import RouteSession
from webapp.telemetry.models import GenerationRecord

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass
class Event:
    text: str = ""
    done: bool = False
    telemetry: dict[str, Any] = field(default_factory=dict)


class FakeRouteClient:
    """Stands in for agent.client.route.RouteClient: records what it was asked and streams a fixed answer."""

    instances: list[FakeRouteClient] = []

    def __init__(self, hops: list[Any], tokenizer: Any, session_id: bytes | None = None) -> None:
        self.hops, self.session_id, self.calls, self.closed = hops, session_id, [], False
        FakeRouteClient.instances.append(self)

    async def chat(self, messages: list[dict[str, str]], sampling: Any, max_tokens: int):  # noqa: ANN201
        self.calls.append([dict(m) for m in messages])
        for part in ("Hel", "lo"):
            yield Event(text=part)
        yield Event(
            done=True,
            telemetry={
                "ttft_ms": 12.5,
                "tok_s": 80.0,
                "n_prompt": 10,
                "n_generated": 2,
                "wire_bytes": 100,
                "hops": [
                    {"url": h.url, "layers": [h.layer_start, h.layer_end], "compute_ms": 5, "network_ms": 1}
                    for h in self.hops
                ],
            },
        )

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> type[FakeRouteClient]:
    import agent.client.route

    FakeRouteClient.instances = []
    monkeypatch.setattr(agent.client.route, "RouteClient", FakeRouteClient)
    monkeypatch.setattr(consumers, "_tokenizer", lambda path: object())
    return FakeRouteClient


@pytest.fixture
def placed(artifact: Any) -> Any:
    for name, (a, b), port in (("a", (0, 15), 9001), ("b", (15, 30), 9002)):
        n = Node.objects.create(name=name, state=Node.State.ONLINE, dataplane_url=f"http://127.0.0.1:{port}")
        ShardAssignment.objects.create(
            node=n, artifact=artifact, layer_start=a, layer_end=b, state=ShardAssignment.State.READY
        )
    return artifact


def chat_socket(user: Any, fmt: str = "json") -> WebsocketCommunicator:
    ws = WebsocketCommunicator(ChatConsumer.as_asgi(), f"/ws/chat/?format={fmt}")
    ws.scope["user"] = user
    return ws


async def answer(ws: WebsocketCommunicator) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events = []
    while True:
        ev = await ws.receive_json_from(timeout=5)
        events.append(ev)
        if ev["type"] in ("done", "error"):
            return events, ev


async def test_anonymous_users_are_closed_with_4401() -> None:
    ws = chat_socket(AnonymousUser())
    ok, code = await ws.connect()
    assert not ok and code == CLOSE_UNAUTHORIZED


async def test_an_answer_streams_and_turn_two_reuses_the_same_route_session(
    member: Any, placed: Any, fake_client: Any
) -> None:
    ws = chat_socket(member)
    assert (await ws.connect())[0]
    await ws.send_json_to({"type": "chat", "model": placed.pk, "message": "hi"})
    events, done = await answer(ws)
    assert [e["type"] for e in events] == ["start", "delta", "delta", "done"]
    assert done["text"] == "Hello" and done["telemetry"]["ttft_ms"] == 12.5
    assert [(h["layer_start"], h["layer_end"]) for h in events[0]["route"]] == [(0, 15), (15, 30)]

    await ws.send_json_to({"type": "chat", "model": str(placed.pk), "message": "again", "max_tokens": "8"})
    _, done2 = await answer(ws)
    assert done2["type"] == "done"
    assert len(fake_client.instances) == 1, "turn 2 must reuse the sticky route client"
    client = fake_client.instances[0]
    assert client.calls[1] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "again"},
    ]
    session = await database_sync_to_async(RouteSession.objects.get)()
    assert session.id.bytes == client.session_id and session.state == RouteSession.State.OPEN
    assert session.n_turns == 2 and session.n_positions == 12
    assert await database_sync_to_async(GenerationRecord.objects.filter(session=session).count)() == 2
    await ws.disconnect()
    assert client.closed
    session = await database_sync_to_async(RouteSession.objects.get)()
    assert session.state == RouteSession.State.CLOSED


async def test_htmx_clients_get_out_of_band_fragments_with_telemetry_bars(
    member: Any, placed: Any, fake_client: Any
) -> None:
    ws = chat_socket(member, fmt="html")
    await ws.connect()
    await ws.send_json_to({"model": str(placed.pk), "message": "hi", "HEADERS": {"HX-Request": "true"}})
    frames = [await ws.receive_from(timeout=5) for _ in range(4)]
    assert 'hx-swap-oob="beforeend"' in frames[1] and "Hel" in frames[1]
    assert 'id="telemetry-1"' in frames[3] and "TTFT" in frames[3] and 'class="compute"' in frames[3]
    await ws.disconnect()


@pytest.mark.parametrize(
    "bad",
    [
        "{",
        '{"message": "hi"}',
        '{"model": 1, "message": ""}',
        '{"model": 1, "message": "x", "temperature": "hot"}',
        "[]",
    ],
)
async def test_a_malformed_chat_message_gets_an_error_and_the_socket_stays_up(
    member: Any, placed: Any, fake_client: Any, bad: str
) -> None:
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_to(text_data=bad)
    assert (await ws.receive_json_from())["type"] == "error"
    await ws.send_json_to({"model": placed.pk, "message": "hi"})
    _, done = await answer(ws)
    assert done["type"] == "done"
    await ws.disconnect()


async def test_a_model_without_a_full_route_gets_a_clear_error(
    member: Any, artifact: Any, fake_client: Any
) -> None:
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": artifact.pk, "message": "hi"})
    _, ev = await answer(ws)
    assert ev["type"] == "error" and "no ready shard starts at layer 0" in ev["error"]
    await ws.disconnect()


class DyingRouteClient(FakeRouteClient):
    """The first route dies after one delta; later routes answer normally."""

    async def chat(self, messages: list[dict[str, str]], sampling: Any, max_tokens: int):  # noqa: ANN201
        if len(FakeRouteClient.instances) == 1:
            self.calls.append(messages)
            yield Event(text="Hel")
            raise ConnectionResetError("hop 2 went away")
        async for ev in super().chat(messages, sampling, max_tokens):
            yield ev


async def test_a_route_dying_mid_answer_fails_over_once_and_the_user_sees_one_seamless_answer(
    member: Any, placed: Any, fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agent.client.route

    monkeypatch.setattr(agent.client.route, "RouteClient", DyingRouteClient)
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": placed.pk, "message": "hi"})
    events, done = await answer(ws)
    assert [e["text"] for e in events if e["type"] == "delta"] == ["Hel", "lo"]
    assert done["type"] == "done" and done["text"] == "Hello"
    first, second = FakeRouteClient.instances
    assert first.closed and second.calls[0] == [{"role": "user", "content": "hi"}]
    states = await database_sync_to_async(
        lambda: sorted(RouteSession.objects.values_list("state", flat=True))
    )()
    assert states == ["broken", "open"]
    await ws.disconnect()
