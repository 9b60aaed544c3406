"""The /v1/ endpoints with a stand-in route client: shapes, streaming, stop, logprobs, usage, errors,
prefix reuse and cleanup. The real hops are exercised in tests/integration/test_openai_api.py."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from channels.db import database_sync_to_async

from agent.client.route import HopStats, RouteClient, RouteError
from agent.client.spec import SpecStats
from agent.wire.frames import Kind, Response
from webapp.api import engine, keys
from webapp.api.cache import PrefixCache
from webapp.api.models import ApiUsage
from webapp.api.params import parse_chat
from webapp.fleet.models import Node, ShardAssignment
from webapp.routing import session
from webapp.routing.models import RouteSession
from webapp.routing.prefix import common_prefix
from webapp.telemetry.models import GenerationRecord

pytestmark = pytest.mark.django_db(transaction=True)
ANSWER = " Paris is the capital of France."
Q = [{"role": "user", "content": "What is the capital of France?"}]


class FakeRouteClient:
    """Stands in for RouteClient: keeps a token history as the hops would and answers ANSWER then EOS."""

    instances: list[FakeRouteClient] = []
    hop_telemetry = RouteClient.hop_telemetry  # the real per-hop figures, from hops and hop_stats

    def __init__(self, hops: list[Any], tokenizer: Any, session_id: bytes | None = None, **kw: Any) -> None:
        self.hops, self.tok, self.session_id = hops, tokenizer, session_id
        self.history: list[int] = []
        self.hop_stats = [HopStats() for _ in hops]
        self.last_prefilled, self.mode = 0, "star"
        self.last_truncate: dict[str, Any] = {}
        self.recoveries: list[dict[str, Any]] = []
        self.shared_prefixes: list[int] = []  # each generate's shared_prefix
        self.speculates: list[int] = []  # each generate's draft limit
        self.drafters: list[Any] = []  # each generate's drafter (None: prompt lookup)
        self.mtp_draft = 0  # head drafts asked of the last hop at OPEN
        self.last_prefix: dict[str, Any] = {}
        self.last_spec = SpecStats()
        self.last_response: Response | None = None
        self.closed, self.generating = False, False
        self.prefills: list[int] = []
        FakeRouteClient.instances.append(self)

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
        common = common_prefix(self.history, prompt)
        common = min(common, len(prompt) - 1)
        del self.history[common:]
        self.last_prefilled = len(prompt) - common
        self.prefills.append(self.last_prefilled)
        self.history.extend(prompt[common:])
        answer = self.tok.encode(ANSWER, add_bos=False) + [self.tok.eos_id]
        self.generating = True
        for n, t in enumerate(answer[:max_tokens]):
            if n:
                self.history.append(answer[n - 1])
            logits = np.zeros(self.tok.n_vocab, dtype=np.float32)
            logits[t], logits[(t + 1) % self.tok.n_vocab] = 5.0, 4.0
            self.last_response = Response(
                step=n, kind=Kind.LOGITS, n_tokens=1, dim=self.tok.n_vocab, payload=logits.tobytes()
            )
            yield t, -0.25
            if stop_ids and t in stop_ids:
                break
        self.generating = False

    async def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    settings.REDIS_URL = ""  # rate windows in this process, per test
    FakeRouteClient.instances = []
    monkeypatch.setattr(session, "RouteClient", FakeRouteClient)
    monkeypatch.setattr(engine, "cache", PrefixCache(max_entries=8, max_per_key=2))
    monkeypatch.setattr(keys, "rate_limiter", keys.RateLimiter())


@pytest.fixture
def placed(artifact: Any) -> Any:
    for name, (a, b), port in (("a", (0, 15), 9001), ("b", (15, 30), 9002)):
        n = Node.objects.create(name=name, state=Node.State.ONLINE, dataplane_url=f"http://127.0.0.1:{port}")
        ShardAssignment.objects.create(
            node=n, artifact=artifact, layer_start=a, layer_end=b, state=ShardAssignment.State.READY
        )
    return artifact


@pytest.fixture
def api_key(member: Any) -> tuple[str, Any]:
    return keys.create_key(member, "test")


def auth(plain: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {plain}"}


async def post(client: Any, path: str, body: dict[str, Any], plain: str) -> Any:
    return await client.post(path, json.dumps(body), content_type="application/json", headers=auth(plain))


def assert_error(r: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.content
    err = json.loads(r.content)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


async def sse(r: Any) -> list[Any]:
    assert r["Content-Type"] == "text/event-stream"
    raw = b"".join([c async for c in r.streaming_content]).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def tokenizer(artifact: Any) -> Any:
    return session.tokenizer_for(artifact.path)


async def test_a_missing_a_malformed_and_a_revoked_key_get_401_in_openais_shape(
    async_client: Any, api_key: tuple[str, Any], placed: Any
) -> None:
    r = await async_client.get("/v1/models")
    assert_error(r, 401, "invalid_api_key")
    r = await async_client.get("/v1/models", headers={"Authorization": "Bearer sk-swarm-nope"})
    assert_error(r, 401, "invalid_api_key")
    plain, key = api_key
    assert (await async_client.get("/v1/models", headers=auth(plain))).status_code == 200
    await database_sync_to_async(keys.revoke_key)(key.user, key.pk)
    assert_error(await async_client.get("/v1/models", headers=auth(plain)), 401, "invalid_api_key")


async def test_models_lists_ready_models_by_name_with_their_context(
    async_client: Any, api_key: tuple[str, Any], placed: Any
) -> None:
    r = await async_client.get("/v1/models", headers=auth(api_key[0]))
    body = json.loads(r.content)
    assert body["object"] == "list"
    [m] = body["data"]
    assert m["id"] == placed.name and m["object"] == "model" and m["x_swarm"]["sha256"] == placed.sha256
    assert m["x_swarm"]["context_length"] > 0
    one = json.loads((await async_client.get(f"/v1/models/{placed.name}", headers=auth(api_key[0]))).content)
    assert one == m
    assert_error(await async_client.get("/v1/models/nope", headers=auth(api_key[0])), 404, "model_not_found")
    assert_error(await async_client.post("/v1/embeddings", headers=auth(api_key[0])), 404, "unknown_url")


async def test_an_unknown_model_is_404_and_bad_parameters_are_400(
    async_client: Any, api_key: tuple[str, Any], placed: Any
) -> None:
    plain = api_key[0]
    err = assert_error(
        await post(async_client, "/v1/chat/completions", {"model": "gpt-9", "messages": Q}, plain), 404
    )
    assert err["code"] == "model_not_found" and err["param"] == "model"
    err = assert_error(
        await post(
            async_client, "/v1/chat/completions", {"model": placed.name, "messages": Q, "n": 3}, plain
        ),
        400,
    )
    assert err["param"] == "n"
    r = await async_client.post(
        "/v1/chat/completions", b"{not json", content_type="application/json", headers=auth(plain)
    )
    assert_error(r, 400, "invalid_json")
    assert_error(await async_client.get("/v1/chat/completions", headers=auth(plain)), 405)


async def test_a_request_over_the_context_is_400_context_length_exceeded(
    async_client: Any, api_key: tuple[str, Any], placed: Any
) -> None:
    body = {"model": placed.name, "messages": Q, "max_tokens": 10**6}
    err = assert_error(await post(async_client, "/v1/chat/completions", body, api_key[0]), 400)
    assert err["code"] == "context_length_exceeded" and "maximum context length" in err["message"]


async def test_a_model_without_a_route_is_503_with_retry_after(
    async_client: Any, api_key: tuple[str, Any], artifact: Any
) -> None:
    r = await post(async_client, "/v1/chat/completions", {"model": artifact.name, "messages": Q}, api_key[0])
    assert_error(r, 503, "no_route")
    assert int(r["Retry-After"]) >= 1


async def test_a_key_over_its_rate_limit_gets_429_with_retry_after(
    async_client: Any, member: Any, placed: Any
) -> None:
    plain, _ = await database_sync_to_async(keys.create_key)(member, "slow", 2)
    for _ in range(2):
        assert (await async_client.get("/v1/models", headers=auth(plain))).status_code == 200
    r = await async_client.get("/v1/models", headers=auth(plain))
    err = assert_error(r, 429, "rate_limit_exceeded")
    assert err["type"] == "requests" and 1 <= int(r["Retry-After"]) <= 60


async def test_a_redis_that_never_answers_refuses_api_requests_with_503_and_retry_after(
    async_client: Any, api_key: tuple[str, Any], placed: Any, settings: Any, hung_redis_url: str
) -> None:
    """Rate limits live in Redis: when it fails or hangs, a request is refused the way OpenAI's clients
    retry (503, Retry-After) instead of a 500, and never served unmetered."""
    settings.REDIS_URL = hung_redis_url  # this test's rate limiter (the `fresh` fixture's) meets it
    r = await async_client.get("/v1/models", headers=auth(api_key[0]))
    assert_error(r, 503, "rate_limits_unavailable")
    assert int(r["Retry-After"]) >= 1


async def test_a_chat_completion_answers_with_usage_equal_to_the_tokenizers_and_per_hop_telemetry(
    async_client: Any, api_key: tuple[str, Any], placed: Any
) -> None:
    r = await post(
        async_client,
        "/v1/chat/completions",
        {"model": placed.name, "messages": Q, "temperature": 0},
        api_key[0],
    )
    assert r.status_code == 200, r.content
    body = json.loads(r.content)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": ANSWER, "refusal": None}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    tok = tokenizer(placed)
    assert body["usage"] == {
        "prompt_tokens": len(tok.encode_chat(Q)),
        "completion_tokens": len(tok.encode(ANSWER, add_bos=False)),
        "total_tokens": len(tok.encode_chat(Q)) + len(tok.encode(ANSWER, add_bos=False)),
    }
    x = body["x_swarm"]
    assert [h["layers"] for h in x["hops"]] == [[0, 15], [15, 30]] and x["n_prompt"] == len(
        tok.encode_chat(Q)
    )
    usage = await database_sync_to_async(lambda: ApiUsage.objects.get(key=api_key[1]))()
    assert (usage.requests, usage.tokens_in, usage.tokens_out) == (
        1,
        body["usage"]["prompt_tokens"],
        body["usage"]["completion_tokens"],
    )


async def test_a_chats_system_prompt_goes_to_the_route_client_as_its_shared_prefix(
    async_client: Any, api_key: tuple[str, Any], placed: Any
) -> None:
    system = {"role": "system", "content": "You are a careful geography tutor. " * 12}
    chat = [system, *Q]
    body = {"model": placed.name, "messages": chat, "temperature": 0}
    r = await post(async_client, "/v1/chat/completions", body, api_key[0])
    assert r.status_code == 200, r.content
    tok = tokenizer(placed)
    ids, alone = tok.encode_chat(chat), tok.encode_chat([system])
    n = FakeRouteClient.instances[-1].shared_prefixes[-1]
    # the system turn as the template renders it, up to where the user's turn begins
    assert 64 < n < len(alone) and ids[:n] == alone[:n] and ids[n] != alone[n]
    x = json.loads(r.content)["x_swarm"]
    assert x["prefix_shared_tokens"] == n and x["prefix_hit"] is False
    record = await database_sync_to_async(GenerationRecord.objects.get)()
    assert (record.prefix_shared_tokens, record.prefix_hit) == (n, False)
    # a chat without one shares nothing
    r = await post(async_client, "/v1/chat/completions", {"model": placed.name, "messages": Q}, api_key[0])
    assert r.status_code == 200 and FakeRouteClient.instances[-1].shared_prefixes[-1] == 0


async def test_an_api_answer_speculates_up_to_the_configured_draft_limit(
    async_client: Any, api_key: tuple[str, Any], placed: Any, settings: Any
) -> None:
    for limit in (8, 0):
        settings.ROUTE_SPECULATE = limit
        r = await post(
            async_client, "/v1/chat/completions", {"model": placed.name, "messages": Q}, api_key[0]
        )
        assert r.status_code == 200 and FakeRouteClient.instances[-1].speculates[-1] == limit
        assert json.loads(r.content)["x_swarm"]["speculation"]["verify_steps"] == 0  # the fake never drafts


async def test_an_answer_on_a_model_with_an_mtp_head_drafts_with_the_head_where_speculation_is_on(
    async_client: Any, api_key: tuple[str, Any], placed: Any, settings: Any
) -> None:
    from agent.client.drafts import MtpDrafter
    from agent.client.spec import NgramDrafter

    placed.manifest = {**placed.manifest, "mtp_layers": 1}  # the file carries one nextn block
    await database_sync_to_async(placed.save)(update_fields=["manifest"])
    for limit in (8, 0):
        settings.ROUTE_SPECULATE = limit
        messages = [{"role": "user", "content": f"Question {limit}?"}]  # a route of its own each
        r = await post(
            async_client, "/v1/chat/completions", {"model": placed.name, "messages": messages}, api_key[0]
        )
        assert r.status_code == 200, r.content
        fake = FakeRouteClient.instances[-1]
        drafter = fake.drafters[-1]
        if limit:  # the last hop is asked for the head's drafts at OPEN, the answer drafts with them
            assert fake.mtp_draft == limit
            assert isinstance(drafter, MtpDrafter) and isinstance(drafter.fallback, NgramDrafter)
        else:  # no speculation: nothing asked of the head, no drafter
            assert fake.mtp_draft == 0 and drafter is None


async def test_an_answer_on_a_model_without_an_mtp_head_drafts_by_prompt_lookup(
    async_client: Any, api_key: tuple[str, Any], placed: Any, settings: Any
) -> None:
    settings.ROUTE_SPECULATE = 8
    r = await post(async_client, "/v1/chat/completions", {"model": placed.name, "messages": Q}, api_key[0])
    assert r.status_code == 200, r.content
    fake = FakeRouteClient.instances[-1]
    assert fake.mtp_draft == 0 and fake.drafters[-1] is None and fake.speculates[-1] == 8


async def test_a_streamed_chat_sends_role_then_deltas_then_finish_then_usage_then_done(
    async_client: Any, api_key: tuple[str, Any], placed: Any
) -> None:
    body = {"model": placed.name, "messages": Q, "stream": True, "stream_options": {"include_usage": True}}
    events = await sse(await post(async_client, "/v1/chat/completions", body, api_key[0]))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == ANSWER
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["usage"] is None
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    assert events[-1]["x_swarm"]["hops"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_sequence_ends_the_answer_before_it_and_never_leaks_part_of_it(
    async_client: Any, api_key: tuple[str, Any], placed: Any, stream: bool
) -> None:
    body = {"model": placed.name, "messages": Q, "stop": ["the capital", "zzz"], "stream": stream}
    r = await post(async_client, "/v1/chat/completions", body, api_key[0])
    if stream:
        events = await sse(r)
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        choice = json.loads(r.content)["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    assert text == " Paris is " and finish == "stop"


async def test_max_tokens_ends_with_length_and_counts_exactly(
    async_client: Any, api_key: tuple[str, Any], placed: Any
) -> None:
    body = {"model": placed.name, "messages": Q, "max_completion_tokens": 3}
    b = json.loads((await post(async_client, "/v1/chat/completions", body, api_key[0])).content)
    assert b["choices"][0]["finish_reason"] == "length" and b["usage"]["completion_tokens"] == 3


async def test_chat_logprobs_carry_each_token_and_its_top_alternatives(
    async_client: Any, api_key: tuple[str, Any], placed: Any
) -> None:
    body = {"model": placed.name, "messages": Q, "logprobs": True, "top_logprobs": 2}
    b = json.loads((await post(async_client, "/v1/chat/completions", body, api_key[0])).content)
    content = b["choices"][0]["logprobs"]["content"]
    assert len(content) == b["usage"]["completion_tokens"]
    assert "".join(c["token"] for c in content) == ANSWER
    first = content[0]
    assert first["logprob"] == -0.25 and bytes(first["bytes"]).decode() == first["token"]
    assert [t["token"] for t in first["top_logprobs"]][0] == first["token"] and len(
        first["top_logprobs"]
    ) == 2
    assert first["top_logprobs"][0]["logprob"] > first["top_logprobs"][1]["logprob"]


async def test_completions_take_a_prompt_and_return_legacy_logprobs(
    async_client: Any, api_key: tuple[str, Any], placed: Any
) -> None:
    body = {"model": placed.name, "prompt": "The capital of France is", "logprobs": 1, "max_tokens": 4}
    b = json.loads((await post(async_client, "/v1/completions", body, api_key[0])).content)
    assert b["object"] == "text_completion" and b["id"].startswith("cmpl-")
    [choice] = b["choices"]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["token_logprobs"]) == 4
    assert lp["text_offset"][0] == 0 and all(len(t) == 1 for t in lp["top_logprobs"])
    tok = tokenizer(placed)
    assert b["usage"]["prompt_tokens"] == len(tok.encode("The capital of France is"))
    events = await sse(await post(async_client, "/v1/completions", {**body, "stream": True}, api_key[0]))
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]


async def test_turn_two_of_a_conversation_reuses_the_route_and_prefills_only_the_new_tokens(
    async_client: Any, api_key: tuple[str, Any], member: Any, placed: Any
) -> None:
    plain = api_key[0]
    one = json.loads(
        (
            await post(async_client, "/v1/chat/completions", {"model": placed.name, "messages": Q}, plain)
        ).content
    )
    turn2 = [*Q, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And of Italy?"}]
    two = json.loads(
        (
            await post(async_client, "/v1/chat/completions", {"model": placed.name, "messages": turn2}, plain)
        ).content
    )
    assert len(FakeRouteClient.instances) == 1, "turn 2 must reuse the cached route client"
    assert two["x_swarm"]["reused_route"] and two["x_swarm"]["session"] == one["x_swarm"]["session"]
    x = two["x_swarm"]
    assert (
        x["n_reused"] > one["usage"]["prompt_tokens"] - 1
        and x["n_prefilled"] == x["n_prompt"] - x["n_reused"]
    )
    assert x["n_prefilled"] < one["usage"]["prompt_tokens"]
    # Another key never sees this key's conversation; a new conversation of the same key opens its own route.
    other, _ = await database_sync_to_async(keys.create_key)(member, "other")
    await post(async_client, "/v1/chat/completions", {"model": placed.name, "messages": turn2}, other)
    assert len(FakeRouteClient.instances) == 2
    fresh = [{"role": "user", "content": "Tell me a joke about penguins please."}]
    await post(async_client, "/v1/chat/completions", {"model": placed.name, "messages": fresh}, plain)
    assert len(FakeRouteClient.instances) == 3
    sessions = await database_sync_to_async(lambda: RouteSession.objects.filter(state="open").count())()
    assert sessions == 3


async def test_a_stream_abandoned_mid_answer_closes_its_route_on_every_hop(
    api_key: tuple[str, Any], placed: Any
) -> None:
    key = await database_sync_to_async(
        lambda: type(api_key[1]).objects.select_related("user").get(pk=api_key[1].pk)
    )()
    req = parse_chat({"model": placed.name, "messages": Q, "stream": True})
    target = await database_sync_to_async(engine.resolve_model)(placed.name)
    gen = engine.Generation(req, key, target)
    await gen.prepare()
    pieces = gen.pieces()
    first = await pieces.__anext__()
    assert first.text
    client = FakeRouteClient.instances[0]
    assert client.generating and not client.closed
    await pieces.aclose()  # what a client disconnect does to the response's iterator
    assert client.closed and len(engine.cache) == 0
    session = await database_sync_to_async(RouteSession.objects.get)()
    assert session.state == RouteSession.State.CLOSED
    usage = await database_sync_to_async(ApiUsage.objects.get)()
    assert usage.tokens_in == len(gen.prompt) and usage.tokens_out == 1, "what was computed is counted"


async def test_a_body_over_the_upload_limit_is_413(
    async_client: Any, api_key: tuple[str, Any], settings: Any
) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}
    assert_error(await post(async_client, "/v1/chat/completions", body, api_key[0]), 413, "request_too_large")


def test_rate_windows_in_redis_are_shared_and_reset_each_minute(settings: Any) -> None:
    import redis

    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {url}")
    settings.REDIS_URL = url
    key_id = int.from_bytes(os.urandom(4), "big")
    first, second = keys.RateLimiter(), keys.RateLimiter()  # two web processes
    assert first.hit(key_id, 2) == 0 and second.hit(key_id, 2) == 0
    wait = first.hit(key_id, 2)
    assert 0 < wait <= 60


def test_the_keys_page_shows_a_new_secret_once_and_stores_only_its_hash(
    member_client: Any, member: Any
) -> None:
    r = member_client.post("/api-keys/new", {"name": "laptop", "rate_limit_per_min": "30"})
    assert r.status_code == 200 and r["Cache-Control"] == "no-store"
    html = r.content.decode()
    start = html.index("sk-swarm-")
    plain = html[start : html.index("<", start)]
    key = member.api_keys.get()
    assert key.hashed == keys.hash_key(plain) and plain not in (key.hashed, key.prefix)
    assert plain.startswith(key.prefix) and key.rate_limit_per_min == 30
    page = member_client.get("/api-keys/").content.decode()
    assert plain not in page and key.prefix in page and "laptop" in page
    assert keys.authenticate(f"Bearer {plain}") == key


def test_a_user_revokes_their_own_key_but_not_someone_elses(
    member_client: Any, member: Any, staff: Any
) -> None:
    _, theirs = keys.create_key(staff, "staff key")
    plain, mine = keys.create_key(member, "mine")
    member_client.post(f"/api-keys/{theirs.pk}/revoke")
    theirs.refresh_from_db()
    assert theirs.active
    member_client.post(f"/api-keys/{mine.pk}/revoke")
    mine.refresh_from_db()
    assert not mine.active and keys.authenticate(f"Bearer {plain}") is None


def test_a_rate_limit_above_the_maximum_is_refused(member_client: Any, member: Any) -> None:
    r = member_client.post(
        "/api-keys/new", {"name": "x", "rate_limit_per_min": str(keys.MAX_RATE_PER_MIN + 1)}
    )
    assert r.status_code == 302 and not member.api_keys.exists()


class EvictedRouteClient(FakeRouteClient):
    """A route whose hops dropped the session while it sat in the cache: the next step fails."""

    async def generate(self, prompt: list[int], *args: Any, **kw: Any) -> AsyncIterator[tuple[int, float]]:
        if self.history:
            raise RouteError("hop 0 answered 404 unknown_session", status=404, code="unknown_session", hop=0)
        async for x in super().generate(prompt, *args, **kw):
            yield x


async def test_a_cached_route_that_fails_before_the_first_token_is_replaced_once(
    async_client: Any, api_key: tuple[str, Any], placed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session, "RouteClient", EvictedRouteClient)
    plain = api_key[0]
    one = await post(async_client, "/v1/chat/completions", {"model": placed.name, "messages": Q}, plain)
    turn2 = [*Q, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And of Italy?"}]
    r = await post(async_client, "/v1/chat/completions", {"model": placed.name, "messages": turn2}, plain)
    assert r.status_code == 200, r.content
    body = json.loads(r.content)
    assert body["choices"][0]["message"]["content"] == ANSWER and not body["x_swarm"]["reused_route"]
    first, second = FakeRouteClient.instances
    assert first.closed and not second.closed
    states = await database_sync_to_async(lambda: dict(RouteSession.objects.values_list("id", "state")))()
    assert states[uuid.UUID(json.loads(one.content)["x_swarm"]["session"])] == RouteSession.State.BROKEN
    assert states[uuid.UUID(body["x_swarm"]["session"])] == RouteSession.State.OPEN


class FullRouteClient(FakeRouteClient):
    """Hops out of KV budget: the first step is refused with 503."""

    async def generate(self, prompt: list[int], *args: Any, **kw: Any) -> AsyncIterator[tuple[int, float]]:
        raise RouteError("hop 1 answered 503 kv_budget: no room", status=503, code="kv_budget", hop=1)
        yield 0, 0.0  # an async generator, like the real one


class DyingRouteClient(FakeRouteClient):
    """A hop dies after the answer started streaming."""

    async def generate(self, prompt: list[int], *args: Any, **kw: Any) -> AsyncIterator[tuple[int, float]]:
        n = 0
        async for x in super().generate(prompt, *args, **kw):
            yield x
            n += 1
            if n == 3:
                raise RouteError("hop 0 unreachable", hop=0)


async def test_hops_out_of_capacity_give_503_overloaded_with_retry_after(
    async_client: Any, api_key: tuple[str, Any], placed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session, "RouteClient", FullRouteClient)
    r = await post(async_client, "/v1/chat/completions", {"model": placed.name, "messages": Q}, api_key[0])
    assert_error(r, 503, "overloaded")
    assert r["Retry-After"] == engine.RETRY_AFTER_S and FakeRouteClient.instances[0].closed


async def test_a_route_failing_mid_stream_ends_the_stream_with_an_error_event(
    async_client: Any, api_key: tuple[str, Any], placed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session, "RouteClient", DyingRouteClient)
    body = {"model": placed.name, "messages": Q, "stream": True}
    r = await post(async_client, "/v1/chat/completions", body, api_key[0])
    raw = b"".join([c async for c in r.streaming_content]).decode()
    events = [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n") if e]
    assert "[DONE]" not in raw and events[-1]["error"]["code"] == "route_failed"
    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert FakeRouteClient.instances[0].closed
    assert (await database_sync_to_async(RouteSession.objects.get)()).state == RouteSession.State.BROKEN
    record = await database_sync_to_async(GenerationRecord.objects.get)()
    assert "hop 0 unreachable" in record.error and record.n_generated == 3, "the failure is on record"
