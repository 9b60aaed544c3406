"""The playground websocket: one sticky route session per conversation, tokens streamed as they come.

The conversation's RouteClient lives as long as the socket, so turn 2 reuses the hops' KV caches and
sends only the new tokens. `?format=json` speaks JSON; otherwise replies are htmx out-of-band fragments.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from django.template.loader import render_to_string

from agent.wire.control import CLOSE_UNAUTHORIZED
from webapp.catalog.models import ModelArtifact
from webapp.core.consumers import BadMessage, SafeJsonConsumer
from webapp.playground.chat import ChatRequest, ChatRequestError, parse_chat_request, telemetry_bars
from webapp.routing import services as routing
from webapp.routing.chooser import NoRoute
from webapp.routing.models import RouteSession
from webapp.telemetry.services import record_generation

log = logging.getLogger(__name__)


@lru_cache(maxsize=8)
def _tokenizer(path: str) -> Any:
    from agent.client.tokenizer import ChatTokenizer

    return ChatTokenizer(path)


@dataclass
class Conversation:
    """The live route of one chat: its route session, client and hops (the history lives on the consumer)."""

    artifact_id: int
    session_id: uuid.UUID
    client: Any
    route: list[dict[str, Any]]


def _open(artifact_id: int, user: Any) -> tuple[ModelArtifact, RouteSession, list[routing.HopGrant], Any]:
    artifact = ModelArtifact.objects.get(pk=artifact_id, state=ModelArtifact.State.READY)
    session, hops = routing.open_route(artifact_id, user)
    return artifact, session, hops, _tokenizer(artifact.path)


class ChatConsumer(SafeJsonConsumer):
    """/ws/chat/: logged-in users only."""

    conv: Conversation | None = None
    messages: list[dict[str, str]]
    messages_model: int | None = None
    task: asyncio.Task[None] | None = None
    turn = 0

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        qs = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        self.json_mode = qs.get("format", [""])[0] == "json"
        self.messages = []
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if self.task is not None:
            self.task.cancel()
        await self._close_conversation()

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if isinstance(content, dict) and content.get("type") == "reset":
            await self._close_conversation()
            self.messages = []
            await self._emit({"type": "reset"}, "playground/htmx/reset.html", {})
            return
        try:
            req = parse_chat_request(content)
        except ChatRequestError as e:
            raise BadMessage(str(e)) from None
        if self.task is not None and not self.task.done():
            raise BadMessage("wait for the current answer to finish")
        self.turn += 1
        self.task = asyncio.create_task(self._answer(req, self.turn))

    async def send_error(self, text: str) -> None:
        await self._emit({"type": "error", "error": text}, "playground/htmx/error.html", {})

    async def _emit(self, msg: dict[str, Any], template: str, ctx: dict[str, Any]) -> None:
        if self.json_mode:
            await self.send_json(msg)
        else:
            await self.send(
                text_data=await database_sync_to_async(render_to_string)(template, {**msg, **ctx})
            )

    async def _close_conversation(self, state: str = RouteSession.State.CLOSED) -> None:
        conv, self.conv = self.conv, None
        if conv is None:
            return
        try:
            await conv.client.close()
        except Exception:  # noqa: BLE001 - a dead hop must not stop us from recording the close
            log.warning("closing route session %s failed", conv.session_id, exc_info=True)
        await database_sync_to_async(routing.close_session)(conv.session_id, state)

    async def _ensure_conversation(self, req: ChatRequest) -> Conversation:
        if self.conv is not None and self.conv.artifact_id == req.model_id:
            return self.conv
        await self._close_conversation()
        from agent.client.route import Hop, RouteClient

        user = self.scope["user"]
        _, session, grants, tokenizer = await database_sync_to_async(_open)(req.model_id, user)
        hops = [Hop(g.url, g.layer_start, g.layer_end, g.token) for g in grants]
        client = RouteClient(hops, tokenizer, session_id=session.id.bytes)
        self.conv = Conversation(req.model_id, session.id, client, session.hops)
        return self.conv

    async def _stream(
        self, conv: Conversation, req: ChatRequest, base: dict[str, Any], shown: list[str]
    ) -> tuple[str, dict[str, Any]]:
        """Stream one answer; after a failover, text the user already saw (`shown[0]`) is not re-sent."""
        text, telemetry = "", {}
        async for ev in conv.client.chat(self.messages, req.sampling, req.max_tokens):
            delta = getattr(ev, "text", "") or ""
            if delta:
                before, text = len(text), text + delta
                fresh = text[max(before, len(shown[0])) :]
                if fresh:
                    shown[0] += fresh
                    await self._emit(
                        {**base, "type": "delta", "text": fresh}, "playground/htmx/delta.html", {}
                    )
            if getattr(ev, "telemetry", None):
                telemetry = dict(ev.telemetry)
        return text, telemetry

    async def _answer(self, req: ChatRequest, turn: int) -> None:
        """Answer one turn; if the route fails mid-answer, re-open a route once and re-prefill the history
        (greedy or seeded sampling continues identically, so the user sees one seamless answer)."""
        base = {"turn": turn}
        if self.messages_model != req.model_id:
            self.messages, self.messages_model = [], req.model_id
        self.messages.append({"role": "user", "content": req.message})
        shown, started = [""], False
        for attempt in (1, 2):
            try:
                conv = await self._ensure_conversation(req)
            except (NoRoute, ModelArtifact.DoesNotExist) as e:
                text = str(e) if isinstance(e, NoRoute) else "no such ready model"
                self.messages.pop()
                await self.send_error(f"cannot open a route: {text}")
                return
            if not started:
                started = True
                start = {
                    **base,
                    "type": "start",
                    "session": str(conv.session_id),
                    "route": conv.route,
                    "message": req.message,
                }
                await self._emit(start, "playground/htmx/turn_start.html", {})
            try:
                text, telemetry = await self._stream(conv, req, base, shown)
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the route failed: fail over once, then tell the user
                log.warning(
                    "generation failed on session %s (attempt %d)", conv.session_id, attempt, exc_info=True
                )
                await self._close_conversation(RouteSession.State.BROKEN)
                await database_sync_to_async(record_generation)(
                    conv.session_id, req.model_id, self.scope["user"], {}, error=str(e)
                )
                if attempt == 2:
                    self.messages.pop()
                    await self.send_error(f"generation failed: {e}")
                    return
        self.messages.append({"role": "assistant", "content": text})
        n_positions = int(telemetry.get("n_prompt", 0) or 0) + int(telemetry.get("n_generated", 0) or 0)
        await database_sync_to_async(routing.touch_session)(conv.session_id, n_positions)
        await database_sync_to_async(record_generation)(
            conv.session_id, req.model_id, self.scope["user"], telemetry
        )
        await self._emit(
            {**base, "type": "done", "text": text, "telemetry": telemetry},
            "playground/htmx/turn_done.html",
            {"bars": telemetry_bars(telemetry), "route": conv.route},
        )
