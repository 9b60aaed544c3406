"""JSON nested 100,000 levels deep wherever JSON enters the web (issue 33, item 6; docs/security.md,
"Hostile JSON"): a 400 naming the limit on HTTP, an error message and a normal close on a websocket,
never a 500 or a socket closed with 1011. Through the real server: tests/integration/
test_security_web_abuse.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator

from tests.webapp.test_chat_socket import chat_socket
from webapp.api import keys
from webapp.asgi import application

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clear_channel_layer")]
DEEP = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"type": "chat", "x": ' + DEEP + "}"


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    settings.REDIS_URL = ""
    monkeypatch.setattr(keys, "rate_limiter", keys.RateLimiter())


@pytest.fixture
def api_key(member: Any) -> str:
    return keys.create_key(member, "test")[0]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_deep_json_to_the_api_is_a_400_naming_the_depth(
    async_client: Any, api_key: str, path: str
) -> None:
    plain = api_key
    r = await async_client.post(
        path, DEEP_OBJECT, content_type="application/json", headers={"Authorization": f"Bearer {plain}"}
    )
    assert r.status_code == 400, r.content
    err = json.loads(r.content)["error"]
    assert err["code"] == "invalid_json" and "nested more than 64 levels" in err["message"]


def test_deep_json_to_anonymous_enrollment_is_a_400(client: Any) -> None:
    r = client.post("/api/agent/enroll", DEEP, content_type="application/json")
    assert r.status_code == 400 and "token" in r.json()["error"]
    r = client.post(
        "/api/agent/enroll", '{"token": "t", "name": ' + DEEP + "}", content_type="application/json"
    )
    assert r.status_code == 400


def test_deep_json_to_the_certificate_api_is_a_400(client: Any, node_with_secret: Any) -> None:
    node, secret = node_with_secret
    r = client.post(
        "/api/agent/certificate",
        DEEP,
        content_type="application/json",
        headers={"Authorization": f"Node {node.id}:{secret}"},
    )
    assert r.status_code == 400


async def refused_then_closed(ws: WebsocketCommunicator, payload: str) -> dict[str, Any]:
    await ws.send_to(text_data=payload)
    msg = await ws.receive_json_from(timeout=5)
    closed = await ws.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": 1000}, closed
    # the client side goes too, so the consumer's disconnect runs inside the test, not in teardown's
    # cancellation of whatever is left (which once waited out the 420 s timeout on a loaded machine)
    await ws.disconnect()
    return msg


async def test_deep_json_on_the_playground_socket_gets_an_error_and_a_normal_close(member: Any) -> None:
    ws = chat_socket(member)
    assert (await ws.connect())[0]
    msg = await refused_then_closed(ws, DEEP_OBJECT)
    assert msg["type"] == "error" and "nested more than 64 levels" in msg["error"]


async def test_deep_json_on_the_agents_control_channel_gets_an_error_and_a_normal_close(
    node_with_secret: Any,
) -> None:
    node, secret = node_with_secret
    ws = WebsocketCommunicator(
        application, "/ws/agent/", headers=[(b"authorization", f"Node {node.id}:{secret}".encode())]
    )
    assert (await ws.connect())[0]
    assert (await ws.receive_json_from())["type"] == "welcome"
    msg = await refused_then_closed(ws, '{"type": "heartbeat", "telemetry": ' + DEEP + "}")
    assert msg["type"] == "error" and "nested" in msg["error"]


async def test_a_merely_malformed_message_still_leaves_the_socket_open(member: Any) -> None:
    ws = chat_socket(member)
    assert (await ws.connect())[0]
    await ws.send_to(text_data="{not json")
    assert "malformed JSON" in (await ws.receive_json_from(timeout=5))["error"]
    assert await ws.receive_nothing(timeout=0.2)
    await ws.disconnect()
