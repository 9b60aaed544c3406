"""Saved playground conversations over HTTP (list, read, rename, delete) and the chat request's validation."""

from __future__ import annotations

from typing import Any

import pytest

from agent import defaults
from agent.wire.frames import CONTEXT_CAP
from webapp.playground.chat import (
    ChatRequestError,
    check_context,
    parse_chat_request,
    parse_title,
    title_from,
)
from webapp.playground.models import Conversation, Message
from webapp.routing.session import capacity_of


@pytest.fixture
def chats(member: Any, staff: Any, artifact: Any) -> tuple[Conversation, Conversation]:
    mine = Conversation.objects.create(
        user=member,
        artifact=artifact,
        title="Sea poem",
        system_prompt="Rhyme.",
        settings={"temperature": 0.7},
    )
    Message.objects.create(conversation=mine, role="user", content="Write about the sea")
    Message.objects.create(
        conversation=mine, role="assistant", content="Waves <script>x()</script>", stopped=True
    )
    theirs = Conversation.objects.create(user=staff, title="Staff only")
    return mine, theirs


def test_the_page_lists_only_my_conversations_and_the_models_context(
    member_client: Any, chats: Any, artifact: Any
) -> None:
    mine, _ = chats
    r = member_client.get("/playground/")
    assert r.status_code == 200
    state = r.context["state"]
    assert [c["title"] for c in state["conversations"]] == ["Sea poem"]
    assert state["models"] == [
        {
            "id": artifact.pk,
            "name": "SmolLM2",
            "context": 8192,
            "placed": False,
            "routing": "layers",
            "routing_reason": "the native executor runs 'llama' layer windows: routes across nodes",
        }
    ]
    body = r.content.decode()
    assert 'id="pg-state"' in body and "markdown-it.min.js" in body and "purify.min.js" in body
    assert "<script>x()</script>" not in body  # messages reach the page as JSON, not HTML


def test_a_conversation_reads_back_with_its_messages_settings_and_system_prompt(
    member_client: Any, chats: Any
) -> None:
    mine, theirs = chats
    r = member_client.get(f"/playground/conversations/{mine.pk}.json")
    assert r.status_code == 200
    data = r.json()
    assert data["title"] == "Sea poem" and data["system_prompt"] == "Rhyme."
    assert data["settings"] == {"temperature": 0.7}
    assert [(m["role"], m["content"], m["stopped"]) for m in data["messages"]] == [
        ("user", "Write about the sea", False),
        ("assistant", "Waves <script>x()</script>", True),
    ]
    assert member_client.get(f"/playground/conversations/{theirs.pk}.json").status_code == 404
    assert [c["id"] for c in member_client.get("/playground/conversations.json").json()["conversations"]] == [
        mine.pk
    ]


def test_renaming_trims_the_title_and_refuses_empty_or_foreign_ones(member_client: Any, chats: Any) -> None:
    mine, theirs = chats
    r = member_client.post(f"/playground/conversations/{mine.pk}/rename", {"title": "  Ocean   verse "})
    assert r.status_code == 200 and r.json()["title"] == "Ocean verse"
    mine.refresh_from_db()
    assert mine.title == "Ocean verse"
    assert (
        member_client.post(f"/playground/conversations/{mine.pk}/rename", {"title": " "}).status_code == 400
    )
    assert (
        member_client.post(f"/playground/conversations/{mine.pk}/rename", {"title": "x" * 121}).status_code
        == 400
    )
    assert (
        member_client.post(f"/playground/conversations/{theirs.pk}/rename", {"title": "mine now"}).status_code
        == 404
    )
    theirs.refresh_from_db()
    assert theirs.title == "Staff only"


def test_deleting_removes_the_conversation_and_its_messages_but_not_someone_elses(
    member_client: Any, chats: Any
) -> None:
    mine, theirs = chats
    assert member_client.post(f"/playground/conversations/{theirs.pk}/delete").status_code == 404
    r = member_client.post(f"/playground/conversations/{mine.pk}/delete")
    assert r.status_code == 200 and r.json() == {"deleted": mine.pk}
    assert not Conversation.objects.filter(pk=mine.pk).exists() and not Message.objects.exists()
    assert Conversation.objects.filter(pk=theirs.pk).exists()
    assert member_client.get(f"/playground/conversations/{mine.pk}.json").status_code == 404


def test_conversation_urls_need_a_login_and_changes_need_post(member_client: Any, chats: Any) -> None:
    from django.test import Client

    mine, _ = chats
    client = Client()
    assert client.get("/playground/conversations.json").status_code == 302
    assert client.post(f"/playground/conversations/{mine.pk}/delete").status_code == 302
    assert member_client.get(f"/playground/conversations/{mine.pk}/delete").status_code == 405


def test_a_chat_request_carries_every_sampling_control_and_the_system_prompt() -> None:
    req = parse_chat_request(
        {
            "model": "3",
            "conversation": "7",
            "message": "hi",
            "system": "Be terse.",
            "max_tokens": "20000",
            "temperature": "0.8",
            "top_p": "0.9",
            "top_k": "40",
            "seed": "42",
            "min_p": "0.05",
            "repeat_penalty": "1.1",
        }
    )
    assert (req.model_id, req.conversation_id, req.system, req.max_tokens) == (3, 7, "Be terse.", 20000)
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.min_p, s.repeat_penalty) == (
        0.8,
        0.9,
        40,
        42,
        0.05,
        1.1,
    )
    assert req.settings()["seed"] == 42 and req.settings()["max_tokens"] == 20000
    fresh = parse_chat_request({"model": 1, "message": "hi", "conversation": None, "temperature": ""})
    assert fresh.conversation_id is None and fresh.system is None and fresh.sampling.temperature == 0.0
    assert fresh.sampling.seed == 0 and fresh.settings()["seed"] is None, "greedy needs no seed"


def test_an_empty_seed_box_samples_afresh_and_is_remembered_empty() -> None:
    seeds = {
        parse_chat_request({"model": 1, "message": "hi", "temperature": "0.8"}).sampling.seed
        for _ in range(4)
    }
    assert len(seeds) > 1
    negative = parse_chat_request({"model": 1, "message": "hi", "seed": "-1"})
    assert negative.sampling.seed == 2**64 - 1 and negative.settings()["seed"] == -1, "as the user typed it"


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("max_tokens", 2**31 + 1, "'max_tokens' must be between 1 and 2147483648"),
        ("max_tokens", "1.5", "'max_tokens' must be an integer"),
        ("temperature", "nan", "'temperature' must be between 0 and 2, not nan"),
        ("temperature", "2.5", "'temperature' must be between 0 and 2, not 2.5"),
        ("top_p", -0.1, "'top_p' must be between 0 and 1"),
        ("top_k", 1001, "'top_k' must be between 0 and 1000"),
        ("seed", 2**64, "'seed' must be between -9223372036854775808 and 18446744073709551615"),
        ("seed", True, "'seed' must be an integer"),
        ("conversation", "abc", "'conversation' must be an integer"),
        ("system", "x" * 16001, "system prompt longer than 16000 characters"),
    ],
)
def test_a_bad_sampling_control_is_refused_with_a_message_that_names_it(
    field: str, value: Any, why: str
) -> None:
    with pytest.raises(ChatRequestError, match=why):
        parse_chat_request({"model": 1, "message": "hi", field: value})


def test_max_tokens_may_reach_the_models_own_context_capped_at_128k() -> None:
    assert capacity_of({"context_length": 8192}) == 8192
    assert capacity_of({"context_length": 1_000_000}) == CONTEXT_CAP
    assert capacity_of({"context_length": 0}) == defaults.SESSION_CAPACITY == capacity_of(None)
    with pytest.raises(ChatRequestError, match=f"exceeds this model's context of {CONTEXT_CAP} tokens"):
        check_context(
            parse_chat_request({"model": 1, "message": "hi", "max_tokens": CONTEXT_CAP + 1}), CONTEXT_CAP
        )
    check_context(parse_chat_request({"model": 1, "message": "hi", "max_tokens": 8192}), 8192)
    with pytest.raises(ChatRequestError, match="exceeds this model's context of 8192 tokens"):
        check_context(parse_chat_request({"model": 1, "message": "hi", "max_tokens": 8193}), 8192)


def test_titles_come_from_the_first_line_and_renames_are_checked() -> None:
    assert title_from("  Tell me\nabout whales") == "Tell me"
    assert len(title_from("w" * 200)) == 60 and title_from("w" * 200).endswith("…")
    assert parse_title(" a\tb ") == "a b"
    with pytest.raises(ChatRequestError):
        parse_title(None)
