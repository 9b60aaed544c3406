"""The playground websocket: saved conversations, sticky and parked routes, Stop, streamed telemetry, refusals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from agent.client.route import HopStats, RouteClient, RouteError
from agent.client.spec import SpecStats
from agent.wire.control import CLOSE_UNAUTHORIZED
from webapp.fleet.models import Node, ShardAssignment
from webapp.playground import consumers, live
from webapp.playground.consumers import ChatConsumer
from webapp.playground.models import Conversation, Message
from webapp.routing import session as route_session
from webapp.routing.models import RouteSession
from webapp.telemetry.models import GenerationRecord

pytestmark = pytest.mark.django_db(transaction=True)


class FakeTokenizer:
    """Stands in for ChatTokenizer: a prompt is one token per chat message, an answer one per part."""

    eos_id = 0
    eot_ids = {eos_id}
    n_vocab = 1 << 30

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.texts: dict[int, str] = {}
        self.messages: dict[int, dict[str, str]] = {}

    def _id(self, key: str) -> int:
        return self.ids.setdefault(key, len(self.ids) + 1)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        ids = [self._id(f"{m['role']}\0{m['content']}") for m in messages]
        self.messages.update({t: dict(m) for t, m in zip(ids, messages, strict=True)})
        return ids

    def token(self, text: str) -> int:
        t = self._id(text)
        self.texts[t] = text
        return t

    def decode_bytes(self, ids: list[int]) -> bytes:
        return "".join(self.texts[i] for i in ids).encode()

    def token_bytes(self, token: int) -> bytes:
        return self.decode_bytes([token])

    def is_end(self, token: int) -> bool:
        return token in self.eot_ids


class FakeRouteClient:
    """Stands in for agent.client.route.RouteClient: records what it was asked and streams a fixed answer.

    `history` is what the hops would hold: every step appends to it only once the step has completed."""

    instances: list[FakeRouteClient] = []
    answer: tuple[str, ...] = ("Hel", "lo")
    step_s = 0.0
    hop_telemetry = RouteClient.hop_telemetry  # the real per-hop figures, from hops and hop_stats

    def __init__(
        self,
        hops: list[Any],
        tokenizer: FakeTokenizer,
        session_id: bytes | None = None,
        capacity: int = 8192,
        **options: Any,
    ) -> None:
        self.hops, self.tok, self.session_id, self.capacity = hops, tokenizer, session_id, capacity
        self.options = options  # replacements: the failover provider the service passes
        self.calls: list[list[dict[str, str]]] = []
        self.closed, self.in_flight, self.generator_closed = False, False, False
        self.hop_stats = [HopStats() for _ in hops]
        self.history: list[int] = []
        self.sampled = 0  # tokens handed out, the end token included
        self.last_prefilled, self.mode, self.last_truncate = 0, "chain", {}
        self.recoveries: list[dict[str, Any]] = []
        self.shared_prefixes: list[int] = []  # each generate's shared_prefix
        self.speculates: list[int] = []  # each generate's draft limit
        self.drafters: list[Any] = []  # each generate's drafter (None: prompt lookup)
        self.mtp_draft = 0  # head drafts asked of the last hop at OPEN
        self.last_prefix: dict[str, Any] = {}
        self.last_spec = SpecStats()
        FakeRouteClient.instances.append(self)

    async def _step(self, ids: list[int]) -> None:
        self.in_flight = True
        await asyncio.sleep(self.step_s)
        for s in self.hop_stats:
            s.compute_ms += 5
            s.network_ms += 1
        self.history.extend(ids)
        self.in_flight = False

    async def generate(
        self,
        prompt: list[int],
        sampling: Any,
        max_tokens: int,
        stop_ids: Any = None,
        want_logits: bool = False,
        shared_prefix: int = 0,
        speculate: int = 0,
        drafter: Any = None,
        prefill_chunk: int = 512,
        between_chunks: Any = None,
    ) -> AsyncIterator[tuple[int, float]]:
        self.shared_prefixes.append(shared_prefix)
        self.speculates.append(speculate)
        self.drafters.append(drafter)
        # as the real client reports it: a prefix this long is asked for, never found by the fake
        self.last_prefix = (
            {"shared_tokens": shared_prefix, "hit": False, "saved": True} if shared_prefix else {}
        )
        self.calls.append([self.tok.messages[t] for t in prompt])
        self.sampling, self.max_tokens = sampling, max_tokens
        common = 0  # the prefix the hops keep; the last prompt position is always computed again
        while common < min(len(self.history), len(prompt) - 1) and self.history[common] == prompt[common]:
            common += 1
        del self.history[common:]
        self.last_prefilled = len(prompt) - common
        tokens = [self.tok.token(part) for part in self.answer] + [self.tok.eos_id]
        try:
            await self._step(prompt[common:])
            for n, t in enumerate(tokens[:max_tokens]):
                if n:
                    await self._step([tokens[n - 1]])
                self.sampled += 1
                yield t, 0.0
                if stop_ids and t in stop_ids:
                    break
        finally:
            self.generator_closed = True

    async def close(self) -> None:
        self.closed = True


class SlowRouteClient(FakeRouteClient):
    """A long answer, one token every 20 ms: time enough to press Stop."""

    answer = tuple(f"w{i} " for i in range(500))
    step_s = 0.02


class HangingRouteClient(FakeRouteClient):
    """Streams two tokens, then a step that never completes (a hop that stopped answering)."""

    answer = ("Hel", "lo", " world")

    async def _step(self, ids: list[int]) -> None:
        if self.sampled >= 2:
            self.in_flight = True
            await asyncio.sleep(3600)
        await super()._step(ids)


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> type[FakeRouteClient]:
    FakeRouteClient.instances = []
    tok = FakeTokenizer()
    monkeypatch.setattr(route_session, "RouteClient", FakeRouteClient)
    monkeypatch.setattr(route_session, "tokenizer_for", lambda path: tok)
    monkeypatch.setattr(live, "PARK_S", 0.0)  # a socket's route closes with it unless a test parks it
    return FakeRouteClient


@pytest.fixture
def placed(artifact: Any) -> Any:
    for name, (a, b), port in (("a", (0, 15), 9001), ("b", (15, 30), 9002)):
        n = Node.objects.create(name=name, state=Node.State.ONLINE, dataplane_url=f"http://127.0.0.1:{port}")
        ShardAssignment.objects.create(
            node=n, artifact=artifact, layer_start=a, layer_end=b, state=ShardAssignment.State.READY
        )
    return artifact


def chat_socket(user: Any) -> WebsocketCommunicator:
    ws = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/?format=json")
    ws.scope["user"] = user
    return ws


async def answer(
    ws: WebsocketCommunicator, timeout: float = 5
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events = []
    while True:
        ev = await ws.receive_json_from(timeout=timeout)
        events.append(ev)
        if ev["type"] in ("done", "error"):
            return events, ev


@database_sync_to_async
def db(fn: Any) -> Any:
    return fn()


async def test_anonymous_users_are_closed_with_4401() -> None:
    ws = chat_socket(AnonymousUser())
    ok, code = await ws.connect()
    assert not ok and code == CLOSE_UNAUTHORIZED
    await ws.disconnect()  # the refused consumer waits for its client's disconnect: end it here


async def test_an_answer_streams_into_a_new_saved_conversation_and_turn_two_reuses_the_route(
    member: Any, placed: Any, fake_client: Any
) -> None:
    ws = chat_socket(member)
    assert (await ws.connect())[0]
    await ws.send_json_to({"type": "chat", "model": placed.pk, "message": "hi there", "system": "Be brief."})
    events, done = await answer(ws)
    assert [e["type"] for e in events if e["type"] != "progress"] == ["start", "delta", "delta", "done"]
    start = events[0]
    assert start["created"] and start["title"] == "hi there" and start["context"] == 8192
    assert done["text"] == "Hello" and not done["stopped"]
    t = done["telemetry"]
    assert t["ttft_ms"] > 0 and t["n_generated"] == 2 and t["session"] == start["session"]
    assert t["n_prompt"] == 2 and t["n_prefilled"] == 2 and not t["reused_route"]
    assert [b["layers"] for b in done["bars"]] == ["0–15", "15–30"]
    assert [(h["layer_start"], h["layer_end"]) for h in start["route"]] == [(0, 15), (15, 30)]
    cid = done["conversation"]

    await ws.send_json_to(
        {"model": str(placed.pk), "conversation": cid, "message": "again", "max_tokens": "8"}
    )
    _, done2 = await answer(ws)
    assert done2["type"] == "done" and done2["conversation"] == cid
    assert len(fake_client.instances) == 1, "turn 2 must reuse the sticky route client"
    client = fake_client.instances[0]
    assert client.calls[1] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "again"},
    ]
    assert client.max_tokens == 8 and client.capacity == 8192
    assert done2["telemetry"]["n_reused"] == 2, "turn 2 prefills only what the hops do not hold"
    msgs = await db(lambda: list(Message.objects.filter(conversation_id=cid).values_list("role", "content")))
    assert msgs == [("user", "hi there"), ("assistant", "Hello"), ("user", "again"), ("assistant", "Hello")]
    # the system prompt (one token of this tokenizer) is the part other users' sessions may share
    assert client.shared_prefixes == [1, 1]
    session = await db(RouteSession.objects.get)
    assert session.id.bytes == client.session_id and session.state == RouteSession.State.OPEN
    assert session.n_turns == 2 and session.n_positions == len(client.history)
    assert await db(GenerationRecord.objects.filter(session=session).count) == 2
    await ws.disconnect()
    assert client.closed
    assert (await db(RouteSession.objects.get)).state == RouteSession.State.CLOSED


async def test_telemetry_bars_move_while_the_answer_streams(
    member: Any, placed: Any, fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(route_session, "RouteClient", SlowRouteClient)
    monkeypatch.setattr(SlowRouteClient, "answer", tuple(f"w{i} " for i in range(40)))
    monkeypatch.setattr(consumers, "PROGRESS_S", 0.05)
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"type": "chat", "model": placed.pk, "message": "count"})
    events, done = await answer(ws)
    progress = [e for e in events if e["type"] == "progress"]
    assert len(progress) >= 3
    generated = [p["telemetry"]["n_generated"] for p in progress]
    assert generated == sorted(generated) and generated[-1] > generated[0]
    compute = [p["bars"][0]["compute_ms"] for p in progress]
    assert compute[-1] > compute[0] and len(progress[-1]["bars"]) == 2
    await ws.disconnect()


async def test_stop_ends_the_answer_between_steps_keeps_the_route_and_saves_the_partial_answer(
    member: Any, placed: Any, fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(route_session, "RouteClient", SlowRouteClient)
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"type": "chat", "model": placed.pk, "message": "talk forever"})
    for _ in range(6):
        while (await ws.receive_json_from(timeout=5))["type"] != "delta":
            pass
    await ws.send_json_to({"type": "stop"})
    events, done = await answer(ws)
    assert done["type"] == "done" and done["stopped"] and done["telemetry"]["stopped"]
    client = FakeRouteClient.instances[0]
    assert not client.in_flight and client.generator_closed and not client.closed
    n, held = client.sampled, len(client.history)
    assert 6 <= n < 100 and done["telemetry"]["n_generated"] == n
    assert done["text"].startswith("w0 w1 w2 w3 w4 w5 ")
    saved = await db(lambda: Message.objects.get(role="assistant"))
    assert saved.stopped and saved.content == done["text"]
    await asyncio.sleep(0.1)
    assert len(client.history) == held, "nothing runs on the hops after Stop"
    session = await db(RouteSession.objects.get)
    assert session.state == RouteSession.State.OPEN and session.n_positions == held

    # The route (and its KV) carries on: turn 2 goes to the same client.
    monkeypatch.setattr(SlowRouteClient, "answer", ("ok",))
    await ws.send_json_to({"model": placed.pk, "conversation": done["conversation"], "message": "and?"})
    _, done2 = await answer(ws)
    assert done2["text"] == "ok" and not done2["stopped"] and len(FakeRouteClient.instances) == 1
    assert client.calls[1][1] == {"role": "assistant", "content": done["text"]}
    await ws.disconnect()


async def test_stop_during_a_step_that_never_ends_abandons_it_and_closes_the_route(
    member: Any, placed: Any, fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(route_session, "RouteClient", HangingRouteClient)
    monkeypatch.setattr(consumers, "STOP_GRACE_S", 0.2)
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"type": "chat", "model": placed.pk, "message": "hi"})
    for _ in range(2):
        while (await ws.receive_json_from(timeout=5))["type"] != "delta":
            pass
    await ws.send_json_to({"type": "stop"})
    _, done = await answer(ws)
    assert done["stopped"] and done["telemetry"]["route_closed"] and done["text"] == "Hello"
    client = FakeRouteClient.instances[0]
    assert client.closed, "a half-applied step leaves the hops' KV unknown: the route is closed"
    assert (await db(RouteSession.objects.get)).state == RouteSession.State.CLOSED
    await ws.disconnect()


async def test_a_reload_reclaims_the_parked_route_and_another_conversation_does_not(
    member: Any, placed: Any, fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live, "PARK_S", 60.0)
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": placed.pk, "message": "remember me"})
    _, done = await answer(ws)
    await ws.disconnect()
    first = FakeRouteClient.instances[0]
    assert not first.closed and len(live.parking) == 1, "the route waits for the page to come back"

    ws2 = chat_socket(member)  # the reloaded page
    await ws2.connect()
    await ws2.send_json_to({"model": placed.pk, "conversation": done["conversation"], "message": "well?"})
    _, again = await answer(ws2)
    assert again["type"] == "done" and len(FakeRouteClient.instances) == 1 and len(first.calls) == 2
    await ws2.send_json_to({"model": placed.pk, "conversation": None, "message": "a new chat"})
    _, other = await answer(ws2)
    assert other["conversation"] != done["conversation"] and len(FakeRouteClient.instances) == 2
    assert not first.closed and len(live.parking) == 1  # parked again, for its next reopen
    await ws2.disconnect()
    await live.parking.close_all()
    assert first.closed and FakeRouteClient.instances[1].closed and len(live.parking) == 0


async def test_deleting_a_conversation_frees_its_parked_route(
    member: Any, placed: Any, fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from webapp.playground import views

    monkeypatch.setattr(live, "PARK_S", 60.0)
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": placed.pk, "message": "short-lived"})
    _, done = await answer(ws)
    await ws.disconnect()
    client = FakeRouteClient.instances[0]
    assert not client.closed

    from django.test import RequestFactory

    request = RequestFactory().post(f"/playground/conversations/{done['conversation']}/delete")
    request.user = member
    resp = await database_sync_to_async(views.delete)(request, pk=done["conversation"])
    assert resp.status_code == 200
    for _ in range(100):
        if client.closed:
            break
        await asyncio.sleep(0.01)
    assert client.closed and len(live.parking) == 0
    assert (await db(RouteSession.objects.get)).state == RouteSession.State.CLOSED
    assert not await db(Conversation.objects.exists)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("{", "malformed JSON"),
        ('{"message": "hi"}', "'model' is required"),
        ('{"model": 1, "message": ""}', "type a message first"),
        ('{"model": 1, "message": "x", "temperature": "hot"}', "'temperature' must be a number"),
        ('{"model": 1, "message": "x", "temperature": 3}', "'temperature' must be between 0 and 2, not 3"),
        ('{"model": 1, "message": "x", "top_p": 1.5}', "'top_p' must be between 0 and 1, not 1.5"),
        ('{"model": 1, "message": "x", "max_tokens": 0}', "'max_tokens' must be between 1 and 2147483648"),
        ('{"model": 1, "message": "x", "seed": "1.5"}', "'seed' must be an integer"),
        ('{"model": 1, "message": "x", "system": 5}', "system prompt must be text"),
        ('{"type": "dance"}', "unknown message type"),
        ("[]", "unknown message type"),
    ],
)
async def test_a_malformed_chat_message_gets_an_error_and_the_socket_stays_up(
    member: Any, placed: Any, fake_client: Any, bad: str, why: str
) -> None:
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_to(text_data=bad)
    err = await ws.receive_json_from()
    assert err["type"] == "error" and why in err["error"]
    await ws.send_json_to({"model": placed.pk, "message": "hi"})
    _, done = await answer(ws)
    assert done["type"] == "done"
    await ws.disconnect()


async def test_max_tokens_beyond_the_models_own_context_is_refused_and_nothing_is_saved(
    member: Any, placed: Any, fake_client: Any
) -> None:
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": placed.pk, "message": "hi", "max_tokens": 8193})
    _, ev = await answer(ws)
    assert ev["type"] == "error" and "exceeds this model's context of 8192 tokens" in ev["error"]
    assert ev["turn"] == 1 and not fake_client.instances
    await ws.send_json_to({"model": placed.pk, "message": "hi", "max_tokens": 8192})
    _, done = await answer(ws)
    assert done["type"] == "done" and fake_client.instances[0].max_tokens == 8192
    await ws.disconnect()


async def test_someone_elses_conversation_cannot_be_continued(
    member: Any, staff: Any, placed: Any, fake_client: Any
) -> None:
    theirs = await db(lambda: Conversation.objects.create(user=staff, title="private"))
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": placed.pk, "conversation": theirs.pk, "message": "hi"})
    _, ev = await answer(ws)
    assert ev["type"] == "error" and "no such conversation" in ev["error"]
    assert await db(Message.objects.count) == 0
    await ws.disconnect()


async def test_a_model_that_is_not_placed_gets_a_clear_error_and_the_turn_is_forgotten(
    member: Any, artifact: Any, fake_client: Any
) -> None:
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": artifact.pk, "message": "hi"})
    _, ev = await answer(ws)
    assert ev["type"] == "error" and "SmolLM2 is not placed" in ev["error"]
    assert "no ready shard starts at layer 0" in ev["error"]
    assert await db(Conversation.objects.count) == 0 and await db(Message.objects.count) == 0
    await ws.disconnect()


class DyingRouteClient(FakeRouteClient):
    """The first route dies after one delta (its own recovery gave up); later routes answer normally."""

    async def generate(self, prompt: list[int], *args: Any, **kw: Any) -> AsyncIterator[tuple[int, float]]:
        if len(FakeRouteClient.instances) == 1:
            self.calls.append([self.tok.messages[t] for t in prompt])
            yield self.tok.token("Hel"), 0.0
            raise ConnectionResetError("hop 2 went away")
        async for x in super().generate(prompt, *args, **kw):
            yield x


async def test_a_route_whose_recovery_gives_up_ends_the_turn_with_a_clear_error_at_once(
    member: Any, placed: Any, fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(route_session, "RouteClient", DyingRouteClient)
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": placed.pk, "message": "hi"})
    events, done = await answer(ws)
    assert [e["text"] for e in events if e["type"] == "delta"] == ["Hel"]
    assert done["type"] == "error" and "could not be recovered" in done["error"]
    (first,) = FakeRouteClient.instances  # failover is the client's: the consumer does not retry
    assert first.closed and callable(first.options["replacements"])
    states = await db(lambda: sorted(RouteSession.objects.values_list("state", flat=True)))
    assert states == ["broken"]
    record = await db(GenerationRecord.objects.get)
    assert "hop 2 went away" in record.error and record.n_generated == 1
    await ws.disconnect()


async def test_leaving_a_deleted_conversation_closes_its_route_instead_of_parking_it(
    member: Any, placed: Any, fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live, "PARK_S", 60.0)
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": placed.pk, "message": "soon deleted"})
    _, done = await answer(ws)
    await db(lambda: Conversation.objects.filter(pk=done["conversation"]).delete())  # the page's Delete
    await ws.send_json_to({"type": "reset"})
    assert (await ws.receive_json_from())["type"] == "reset"
    assert FakeRouteClient.instances[0].closed and len(live.parking) == 0
    await ws.disconnect()


async def test_a_script_that_omits_the_conversation_continues_the_sockets_one_until_reset(
    member: Any, placed: Any, fake_client: Any
) -> None:
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": placed.pk, "message": "one"})
    _, first = await answer(ws)
    await ws.send_json_to({"model": placed.pk, "message": "two"})
    _, second = await answer(ws)
    assert second["conversation"] == first["conversation"] and len(fake_client.instances) == 1
    await ws.send_json_to({"type": "reset"})
    assert (await ws.receive_json_from())["type"] == "reset"
    await ws.send_json_to({"model": placed.pk, "message": "three"})
    _, third = await answer(ws)
    assert third["conversation"] != first["conversation"]
    await ws.disconnect()


async def test_reopening_a_conversation_whose_route_is_gone_re_prefills_its_saved_history(
    member: Any, placed: Any, fake_client: Any
) -> None:
    ws = chat_socket(member)  # PARK_S is 0 here: the route closes with the socket
    await ws.connect()
    await ws.send_json_to({"model": placed.pk, "message": "first", "system": "Be kind."})
    _, done = await answer(ws)
    await ws.disconnect()
    assert FakeRouteClient.instances[0].closed

    ws2 = chat_socket(member)
    await ws2.connect()
    await ws2.send_json_to({"model": placed.pk, "conversation": done["conversation"], "message": "second"})
    _, again = await answer(ws2)
    assert again["type"] == "done" and len(FakeRouteClient.instances) == 2
    assert FakeRouteClient.instances[1].calls[0] == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "second"},
    ]
    states = await db(lambda: sorted(RouteSession.objects.values_list("state", flat=True)))
    assert states == ["closed", "open"]
    await ws2.disconnect()


class EvictedRouteClient(FakeRouteClient):
    """A route whose hops dropped the session while it was parked: its next step fails."""

    async def generate(self, prompt: list[int], *args: Any, **kw: Any) -> AsyncIterator[tuple[int, float]]:
        if self.history:
            raise RouteError("hop 0 answered 404 unknown_session", status=404, code="unknown_session", hop=0)
        async for x in super().generate(prompt, *args, **kw):
            yield x


async def test_a_reclaimed_route_that_fails_before_the_first_token_is_replaced_once(
    member: Any, placed: Any, fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(route_session, "RouteClient", EvictedRouteClient)
    monkeypatch.setattr(live, "PARK_S", 60.0)
    ws = chat_socket(member)
    await ws.connect()
    await ws.send_json_to({"model": placed.pk, "message": "remember me"})
    _, done = await answer(ws)
    await ws.disconnect()

    ws2 = chat_socket(member)  # the reloaded page, after the hops forgot the session
    await ws2.connect()
    await ws2.send_json_to({"model": placed.pk, "conversation": done["conversation"], "message": "well?"})
    events, again = await answer(ws2)
    assert again["type"] == "done" and again["text"] == "Hello", "the user sees one answer"
    assert not again["telemetry"]["reused_route"] and again["telemetry"]["n_reused"] == 0
    first, second = FakeRouteClient.instances
    assert first.closed and not second.closed
    states = await db(lambda: dict(RouteSession.objects.values_list("id", "state")))
    assert sorted(states.values()) == ["broken", "open"]
    await ws2.disconnect()
