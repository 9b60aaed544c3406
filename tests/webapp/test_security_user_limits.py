"""Issue 33, item 5: limits were per key and keys were free. One user made 30 keys in 0.7 s and had 1,200
requests answered in 14 s (~5,100/min against 60 per key); nothing capped a user's concurrent streams;
closed playground tabs kept their hops' KV for 10 minutes with no per-user cap.

Now every key of a user shares the owner's budget (API_USER_RATE_PER_MIN), keys per user and key
creation are capped, a user's answers at once (API and playground together) are capped with a 429 and
a clear message, and past a user's route cap the oldest idle routes close on their hops. The route
clients are the playground tests' stand-ins (tests/webapp/test_chat_socket.py); the fair admission of
prefills is tested in tests/webapp/test_route_quota.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from channels.db import database_sync_to_async

from tests.webapp.test_chat_socket import (
    FakeRouteClient,
    FakeTokenizer,
    SlowRouteClient,
    answer,
    chat_socket,
)
from webapp.api import engine, keys
from webapp.api.cache import PrefixCache
from webapp.api.models import ApiKey
from webapp.core.throttle import WindowCounter
from webapp.fleet.models import Node, ShardAssignment
from webapp.playground import consumers, live, views
from webapp.routing import quota
from webapp.routing import session as route_session
from webapp.routing.models import RouteSession

pytestmark = pytest.mark.django_db(transaction=True)
Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    """Counters of this test's own, in this process; the route clients are stand-ins."""
    settings.REDIS_URL = ""
    monkeypatch.setattr(keys, "rate_limiter", keys.RateLimiter())
    monkeypatch.setattr(keys, "key_creations", WindowCounter("api-key-create"))
    parking = live.Parking()  # closed tabs of this test only (quota's are fresh: tests/webapp/conftest.py)
    monkeypatch.setattr(live, "parking", parking)
    monkeypatch.setattr(consumers, "parking", parking)
    monkeypatch.setattr(views, "parking", parking)  # (imported above, before any of this is patched)
    quota.routes.add_reclaimer(parking.reclaim)  # as webapp/playground/live.py does for its own
    monkeypatch.setattr(engine, "cache", PrefixCache(max_entries=32, max_per_key=4))
    FakeRouteClient.instances = []
    tok = FakeTokenizer()
    monkeypatch.setattr(route_session, "RouteClient", FakeRouteClient)
    monkeypatch.setattr(route_session, "tokenizer_for", lambda path: tok)
    monkeypatch.setattr(route_session, "shared_transport", lambda context: None)  # the stand-ins need none
    monkeypatch.setattr(live, "PARK_S", 0.0)


@pytest.fixture
def placed(artifact: Any) -> Any:
    for name, (a, b), port in (("a", (0, 15), 9001), ("b", (15, 30), 9002)):
        n = Node.objects.create(name=name, state=Node.State.ONLINE, dataplane_url=f"http://127.0.0.1:{port}")
        ShardAssignment.objects.create(
            node=n, artifact=artifact, layer_start=a, layer_end=b, state=ShardAssignment.State.READY
        )
    return artifact


def auth(plain: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {plain}"}


async def chat(client: Any, plain: str, model: str, **extra: Any) -> Any:
    body = json.dumps({"model": model, "messages": Q, "max_tokens": 3, **extra})
    return await client.post(
        "/v1/chat/completions", body, content_type="application/json", headers=auth(plain)
    )


async def eventually(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- one budget per user --------------------------------------------------------------------------------
def test_thirty_keys_of_one_user_share_the_users_requests_per_minute(
    client: Any, member: Any, settings: Any
) -> None:
    settings.API_USER_RATE_PER_MIN = 20
    keys.rate_limiter.clock = lambda: 6000.0  # one minute's window throughout
    plains = [keys.create_key(member, f"k{i}")[0] for i in range(30)]  # made directly: past the page's caps
    answered = 0
    for n in range(300):
        r = client.get("/v1/models", headers=auth(plains[n % 30]))
        assert r.status_code in (200, 429)
        answered += r.status_code == 200
    assert answered == settings.API_USER_RATE_PER_MIN, f"{answered} answered in one minute"
    err = json.loads(r.content)["error"]
    assert err["code"] == "rate_limit_exceeded" and "all your API keys share it" in err["message"]
    assert 1 <= int(r["Retry-After"]) <= 60
    keys.rate_limiter.clock = lambda: 6060.0  # a minute after the first request
    assert client.get("/v1/models", headers=auth(plains[0])).status_code == 200


def test_a_user_cannot_hold_more_keys_than_the_cap_nor_create_them_faster_than_the_rate(
    member_client: Any, member: Any, settings: Any
) -> None:
    settings.API_KEYS_PER_USER, settings.API_KEY_CREATES_PER_HOUR = 10, 15
    for i in range(30):
        member_client.post("/api-keys/new", {"name": f"k{i}"})
    assert ApiKey.objects.filter(user=member, revoked_at=None).count() == 10
    r = member_client.post("/api-keys/new", {"name": "one more"}, follow=True)
    assert "you have 10 active keys, the most one user may hold" in r.content.decode()
    for key in ApiKey.objects.filter(user=member):
        member_client.post(f"/api-keys/{key.pk}/revoke")
    for i in range(10):
        member_client.post("/api-keys/new", {"name": f"again{i}"})
    assert ApiKey.objects.filter(user=member, revoked_at=None).count() == 5, "15 an hour in all"
    r = member_client.post("/api-keys/new", {"name": "later"}, follow=True)
    assert "you created 15 keys in this hour" in r.content.decode()


# -- answers at once per user ---------------------------------------------------------------------------
async def test_a_users_answers_past_the_cap_are_refused_api_and_playground_together(
    async_client: Any, member: Any, staff: Any, placed: Any, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    settings.USER_MAX_STREAMS = 2
    monkeypatch.setattr(route_session, "RouteClient", SlowRouteClient)
    plain, _ = await database_sync_to_async(keys.create_key)(member, "k")
    stream = await chat(async_client, plain, placed.name, stream=True)  # prepared: it holds its place
    assert stream.status_code == 200
    ws = chat_socket(member)
    assert (await ws.connect())[0]
    await ws.send_json_to({"model": str(placed.pk), "message": "a long one", "max_tokens": "400"})
    while (await ws.receive_json_from(timeout=5))["type"] != "delta":
        pass  # the playground answer streams: the user's second place

    refused = await chat(async_client, plain, placed.name)
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    err = json.loads(refused.content)["error"]
    assert err["code"] == "too_many_streams"
    assert "2 answers of yours are running already" in err["message"]
    assert "API requests and playground answers count together" in err["message"]
    tab = chat_socket(member)
    assert (await tab.connect())[0]
    await tab.send_json_to({"model": str(placed.pk), "message": "and another", "max_tokens": "4"})
    _, ev = await answer(tab)
    assert ev["type"] == "error" and "2 answers of yours are running already" in ev["error"]

    other_plain, _ = await database_sync_to_async(keys.create_key)(staff, "theirs")
    assert (await chat(async_client, other_plain, placed.name)).status_code == 200, "another user's own"

    await ws.send_json_to({"type": "stop"})
    _, done = await answer(ws)
    assert done["type"] == "done" and done["stopped"]
    assert (await chat(async_client, plain, placed.name)).status_code == 200, "a place came free"
    body = b"".join([c async for c in stream.streaming_content])
    assert body.endswith(b"data: [DONE]\n\n")
    assert quota.streams.held(member.pk) == 0, "every answer gave its place back"
    for w in (ws, tab):
        await w.disconnect()


async def test_when_the_store_of_running_answers_never_answers_no_answer_starts_and_the_user_is_told(
    async_client: Any,
    member: Any,
    placed: Any,
    monkeypatch: pytest.MonkeyPatch,
    settings: Any,
    hung_redis_url: str,
) -> None:
    """The leases of running answers live in Redis: when it fails or hangs, an answer nobody counted is
    not started. The playground's turn ends with a message (the page gives the text back) instead of an
    exception that closed the socket, and the API answers 503 with Retry-After instead of a 500."""
    plain, _ = await database_sync_to_async(keys.create_key)(member, "k")
    settings.REDIS_URL = hung_redis_url  # the streams' store (conftest: fresh per test) meets it
    monkeypatch.setattr(keys.rate_limiter, "hit", lambda *a, **k: 0.0)  # the API's limits pass
    monkeypatch.setattr(keys, "hit_user", lambda *a, **k: 0.0)
    ws = chat_socket(member)
    assert (await ws.connect())[0]
    await ws.send_json_to({"model": str(placed.pk), "message": "hello", "max_tokens": "4"})
    _, ev = await answer(ws)
    assert ev["type"] == "error" and "try again shortly" in ev["error"]
    refused = await chat(async_client, plain, placed.name)
    assert refused.status_code == 503 and int(refused["Retry-After"]) >= 1
    assert json.loads(refused.content)["error"]["code"] == "streams_unavailable"
    assert not FakeRouteClient.instances, "no route was opened for an uncounted answer"
    await ws.disconnect()


# -- route sessions (KV on the hops) per user -----------------------------------------------------------
async def test_closed_tabs_past_the_users_route_cap_close_their_oldest_routes_on_the_hops(
    member: Any, staff: Any, placed: Any, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    settings.USER_MAX_ROUTE_SESSIONS = 2
    monkeypatch.setattr(live, "PARK_S", 600.0)  # closed tabs' routes wait ten minutes
    others = chat_socket(staff)
    assert (await others.connect())[0]
    await others.send_json_to({"model": str(placed.pk), "message": "someone else's"})
    await answer(others)
    await others.disconnect()
    for i in range(6):  # six conversations in six tabs, each closed after its answer
        ws = chat_socket(member)
        assert (await ws.connect())[0]
        await ws.send_json_to({"model": str(placed.pk), "message": f"conversation {i}"})
        _, done = await answer(ws)
        assert done["type"] == "done"
        await ws.disconnect()
    clients = FakeRouteClient.instances
    await eventually(lambda: sum(c.closed for c in clients) == 4)
    assert [c.closed for c in clients] == [False, True, True, True, True, False, False]
    open_sessions = await database_sync_to_async(
        lambda: RouteSession.objects.filter(user=member, state=RouteSession.State.OPEN).count()
    )()
    assert open_sessions == 2 and len(live.parking) == 3, "the user's two newest and the other user's one"
    await live.parking.close_all()


async def test_a_users_many_api_keys_hold_no_more_routes_than_the_users_cap(
    async_client: Any, member: Any, placed: Any, settings: Any
) -> None:
    settings.USER_MAX_ROUTE_SESSIONS = 3
    plains = [(await database_sync_to_async(keys.create_key)(member, f"k{i}"))[0] for i in range(8)]
    for i, plain in enumerate(plains):  # a new conversation on each key: each leaves a cached route
        body = json.dumps({"model": placed.name, "messages": [{"role": "user", "content": f"q{i}"}]})
        r = await async_client.post(
            "/v1/chat/completions", body, content_type="application/json", headers=auth(plain)
        )
        assert r.status_code == 200
    clients = FakeRouteClient.instances
    await eventually(lambda: sum(not c.closed for c in clients) == 3)
    assert [c.closed for c in clients] == [True] * 5 + [False] * 3, "the oldest idle went first"
    assert len(engine.cache) == 3 and quota.routes.count(member) == 3
