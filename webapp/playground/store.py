"""Saved conversations: what the consumer and the views read and write (sync; callers wrap for async)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction

from webapp.catalog.models import ModelArtifact
from webapp.playground.chat import ChatRequest, ChatRequestError, check_context, title_from
from webapp.playground.models import Conversation, Message
from webapp.routing.session import Target, target_of


@dataclass(frozen=True)
class Turn:
    """A user turn saved and ready to answer: the whole chat to send, and the model to answer it."""

    conversation_id: int
    title: str
    created: bool
    user_message_id: int
    messages: list[dict[str, str]]
    target: Target


def begin_turn(user: Any, req: ChatRequest) -> Turn:
    """Validate the request against the model, save the user's message, return the chat so far."""
    artifact = ModelArtifact.objects.filter(pk=req.model_id).first()
    if artifact is None:
        raise ChatRequestError(f"no model with id {req.model_id}")
    if artifact.state != ModelArtifact.State.READY:
        raise ChatRequestError(f"model {artifact.name} is not ready ({artifact.state})")
    target = target_of(artifact)
    check_context(req, target.capacity)
    with transaction.atomic():
        created = req.conversation_id is None
        if req.conversation_id is None:
            conv = Conversation(user=user, title=title_from(req.message))
        else:
            found = Conversation.objects.select_for_update().filter(pk=req.conversation_id, user=user).first()
            if found is None:
                raise ChatRequestError("no such conversation (deleted, or not yours)")
            conv = found
        if req.system is not None:
            conv.system_prompt = req.system
        conv.artifact = artifact
        conv.settings = req.settings()
        conv.save()
        msg = Message.objects.create(conversation=conv, role=Message.Role.USER, content=req.message)
        history = list(conv.messages.values_list("role", "content"))
    messages = [{"role": "system", "content": conv.system_prompt}] if conv.system_prompt.strip() else []
    messages += [{"role": r, "content": c} for r, c in history]
    return Turn(conv.pk, conv.title, created, msg.pk, messages, target)


def finish_turn(turn: Turn, text: str, telemetry: dict[str, Any], stopped: bool) -> int:
    """Save the answer (also a partial one that Stop cut); returns its message id."""
    with transaction.atomic():
        msg = Message.objects.create(
            conversation_id=turn.conversation_id,
            role=Message.Role.ASSISTANT,
            content=text,
            stopped=stopped,
            telemetry=telemetry,
        )
        Conversation.objects.filter(pk=turn.conversation_id).update(updated_at=msg.created_at)
    return msg.pk


def abandon_turn(turn: Turn) -> None:
    """The turn got no answer at all (no route, the route failed): forget the user's message too, and
    a conversation that has nothing left."""
    Message.objects.filter(pk=turn.user_message_id).delete()
    if turn.created:
        Conversation.objects.filter(pk=turn.conversation_id, messages__isnull=True).delete()


def summary(c: Conversation) -> dict[str, Any]:
    return {
        "id": c.pk,
        "title": c.title,
        "model": c.artifact_id,
        "updated_at": c.updated_at.isoformat(),
    }


def list_conversations(user: Any, limit: int = 200) -> list[dict[str, Any]]:
    return [summary(c) for c in Conversation.objects.filter(user=user)[:limit]]


def get_conversation(user: Any, conversation_id: int) -> Conversation:
    conv = Conversation.objects.filter(pk=conversation_id, user=user).first()
    if conv is None:
        raise Conversation.DoesNotExist(f"no conversation {conversation_id} of yours")
    return conv


def conversation_exists(conversation_id: int) -> bool:
    return Conversation.objects.filter(pk=conversation_id).exists()


def delete_conversation(user: Any, conversation_id: int) -> bool:
    n, _ = Conversation.objects.filter(pk=conversation_id, user=user).delete()
    return n > 0


def conversation_detail(conv: Conversation) -> dict[str, Any]:
    return {
        **summary(conv),
        "system_prompt": conv.system_prompt,
        "settings": conv.settings,
        "messages": [
            {
                "id": m.pk,
                "role": m.role,
                "content": m.content,
                "stopped": m.stopped,
                "telemetry": m.telemetry,
            }
            for m in conv.messages.all()
        ],
    }
