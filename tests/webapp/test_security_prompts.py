"""One API request or playground turn must not freeze the web (issue 33, item 1; docs/security.md, "One
request freezes the web"): prompts are refused by size before anything is tokenized, and rendered and
tokenized on a bounded pool off the event loop. The real server under attack: tests/integration/
test_security_web_abuse.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from agent.client.tokenizer import ChatTokenizer
from tests.webapp import test_chat_socket as chat_tests
from tests.webapp.test_chat_socket import FakeTokenizer, answer, chat_socket
from webapp.api import keys
from webapp.routing import prompt

pytestmark = pytest.mark.django_db(transaction=True)
placed, fake_client = chat_tests.placed, chat_tests.fake_client  # the playground tests' fixtures


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    settings.REDIS_URL = ""
    monkeypatch.setattr(keys, "rate_limiter", keys.RateLimiter())
    monkeypatch.setattr(prompt, "_pool", None)  # a pool per test, made from its settings


@pytest.fixture
def api_key(member: Any) -> str:
    return keys.create_key(member, "test")[0]


@pytest.fixture
def encodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The threads ChatTokenizer tokenized in, one entry per call."""
    threads: list[int] = []
    real = ChatTokenizer.encode

    def spy(self: ChatTokenizer, text: str, add_bos: bool | None = None) -> list[int]:
        threads.append(threading.get_ident())
        return real(self, text, add_bos)

    monkeypatch.setattr(ChatTokenizer, "encode", spy)
    return threads


async def chat(
    client: Any, key: str, model: str, messages: list[dict[str, str]]
) -> tuple[Any, dict[str, Any]]:
    body = json.dumps({"model": model, "messages": messages})
    r = await client.post(
        "/v1/chat/completions",
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {key}"},
    )
    return r, json.loads(r.content)


async def test_a_9_9_mb_prompt_is_refused_by_its_size_before_it_is_tokenized(
    async_client: Any, api_key: str, artifact: Any, encodes: list[int]
) -> None:
    t = time.perf_counter()
    r, body = await chat(async_client, api_key, artifact.name, [{"role": "user", "content": "x" * 9_900_000}])
    assert r.status_code == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "9900" in body["error"]["message"] and "bytes" in body["error"]["message"]
    assert encodes == [], "refused before any tokenizing (it took 13.6 s on the event loop)"
    assert time.perf_counter() - t < 5


async def test_more_messages_than_the_cap_are_refused_before_they_are_read(
    async_client: Any, api_key: str, artifact: Any, encodes: list[int], settings: Any
) -> None:
    many = [{"role": "user", "content": "x"}] * (settings.MAX_CHAT_MESSAGES + 1)
    r, body = await chat(async_client, api_key, artifact.name, many)
    assert r.status_code == 400 and body["error"]["param"] == "messages", body
    assert f"at most {settings.MAX_CHAT_MESSAGES}" in body["error"]["message"]
    assert encodes == []


async def test_a_body_of_250_000_messages_is_refused_before_its_json_is_parsed(
    async_client: Any, api_key: str, artifact: Any, encodes: list[int], settings: Any
) -> None:
    """Its parse alone held the web's GIL for 157 ms (bench/abuse.py's worst stall): the objects are
    counted by a byte scan first."""
    r, body = await chat(async_client, api_key, artifact.name, [{"role": "user", "content": "x"}] * 250_000)
    assert r.status_code == 400 and body["error"]["code"] == "invalid_json", body
    most = 8 * settings.MAX_CHAT_MESSAGES + 1024
    assert f"holds 250002 objects and arrays; the limit is {most}" in body["error"]["message"]
    assert encodes == []


async def test_a_long_chat_is_tokenized_off_the_event_loop_which_keeps_answering(
    async_client: Any, api_key: str, artifact: Any, encodes: list[int]
) -> None:
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:  # what every other request on this process would see
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    messages = [{"role": "user", "content": "<|im_end|>x" * 3}] * 1500  # 55 KB, 7,500 special tokens
    r, body = await chat(async_client, api_key, artifact.name, messages)
    done.set()
    await ticker
    # tokenized (16,525 tokens), then over the context: the answer only counting tokens gives
    assert r.status_code == 400 and "maximum context length" in body["error"]["message"], body
    assert encodes and threading.get_ident() not in encodes, "tokenized on the event loop's thread"
    assert max(gaps) < 0.2, f"the event loop stalled {max(gaps):.3f} s"


async def test_prompts_past_the_admitted_number_get_503_instead_of_queueing(
    async_client: Any, api_key: str, artifact: Any, settings: Any
) -> None:
    settings.TOKENIZE_QUEUE = 1
    release = threading.Event()
    held = asyncio.ensure_future(prompt.pool().run(release.wait, 10))  # the one admitted prompt
    try:
        r, body = await chat(async_client, api_key, artifact.name, [{"role": "user", "content": "hi"}])
        assert r.status_code == 503 and body["error"]["code"] == "overloaded", body
        assert int(r["Retry-After"]) >= 1
    finally:
        release.set()
        await held
    r, body = await chat(async_client, api_key, artifact.name, [{"role": "user", "content": "hi"}])
    assert body["error"]["code"] == "no_route", body  # admitted again once the slot is free


async def test_the_pool_frees_a_slot_when_the_job_ends_not_when_its_caller_gives_up() -> None:
    pool = prompt.BoundedPool(threads=1, admitted=2)
    release = threading.Event()
    first = asyncio.ensure_future(pool.run(release.wait, 10))
    second = asyncio.ensure_future(pool.run(release.wait, 10))
    await asyncio.sleep(0.05)
    with pytest.raises(prompt.PromptBusy):
        await pool.run(time.sleep, 0)
    first.cancel()  # its client went; the thread still works on it
    with pytest.raises(prompt.PromptBusy):
        await pool.run(time.sleep, 0)
    release.set()
    await second
    await asyncio.sleep(0.05)
    assert await pool.run(lambda: 42) == 42


def test_sizes_are_counted_in_utf8_bytes_against_the_models_context(settings: Any) -> None:
    settings.PROMPT_BYTES_PER_TOKEN = 2
    prompt.check_messages([{"role": "user", "content": "x" * 90}], capacity=50)  # 94 bytes of 100
    with pytest.raises(prompt.PromptError, match="104 bytes"):
        prompt.check_messages([{"role": "user", "content": "é" * 50}], capacity=50)
    with pytest.raises(prompt.TooManyMessages):
        prompt.check_messages([{"role": "user", "content": ""}] * 51, capacity=50)  # a token each at least
    with pytest.raises(prompt.PromptError, match="the prompt is 101 bytes"):
        prompt.check_text("x" * 101, capacity=50)


async def test_the_playground_refuses_a_conversation_too_long_for_the_model_before_tokenizing(
    member: Any,
    placed: Any,
    fake_client: Any,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings.PROMPT_BYTES_PER_TOKEN = 1  # SmolLM2's 8,192 tokens: 8,192 bytes
    threads: list[int] = []
    real = FakeTokenizer.encode_chat

    def spy(self: FakeTokenizer, messages: list[dict[str, str]]) -> list[int]:
        threads.append(threading.get_ident())
        return real(self, messages)

    monkeypatch.setattr(FakeTokenizer, "encode_chat", spy)
    ws = chat_socket(member)
    assert (await ws.connect())[0]
    await ws.send_json_to({"type": "chat", "model": placed.pk, "message": "x" * 9000})
    _, last = await answer(ws)
    assert last["type"] == "error" and "bytes" in last["error"] and "8192" in last["error"], last
    assert threads == []
    await ws.send_json_to({"type": "chat", "model": placed.pk, "message": "hello"})
    _, last = await answer(ws)
    assert last["type"] == "done", last
    assert threads and threading.get_ident() not in threads, "tokenized on the event loop's thread"
    await ws.disconnect()
