"""The playground websocket (JSON): answers stream token by token over a conversation's sticky route.

A conversation keeps one route session and RouteClient, so turn 2 prefills only the new tokens; when the
socket goes the route is parked (webapp/playground/live.py) and a reload continues with the hops' KV.
Stop ends generation between two steps, so every hop's KV still equals the client's token history.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import lru_cache
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

from agent.wire.control import CLOSE_UNAUTHORIZED
from webapp.catalog.models import ModelArtifact
from webapp.core import dataplane_tls
from webapp.core.consumers import BadMessage, SafeJsonConsumer
from webapp.playground import store
from webapp.playground.chat import ChatRequest, ChatRequestError, bars_json, parse_chat_request
from webapp.playground.live import LiveRoute, close_live, parking
from webapp.routing import services as routing
from webapp.routing.chooser import NoRoute
from webapp.routing.models import RouteSession
from webapp.telemetry.services import record_generation

log = logging.getLogger(__name__)

PROGRESS_S = 0.25  # how often the page's telemetry bars move while an answer streams
# After Stop, how long the step in flight (a decode step, or the prompt's prefill) may take to
# finish; past it the step is abandoned and the route closed, since a hop may or may not have applied it.
STOP_GRACE_S = 10.0


@lru_cache(maxsize=8)
def _tokenizer(path: str) -> Any:
    from agent.client.tokenizer import ChatTokenizer

    return ChatTokenizer(path)


def _open(artifact_id: int, user: Any) -> tuple[ModelArtifact, RouteSession, list[routing.HopGrant], Any]:
    artifact = ModelArtifact.objects.get(pk=artifact_id, state=ModelArtifact.State.READY)
    session, hops = routing.open_route(artifact_id, user)
    return artifact, session, hops, _tokenizer(artifact.path)


class _Abandoned(Exception):
    """Stop came while a step was in flight and it did not finish in time: the route's KV is unknown."""


def _hops(client: Any) -> list[dict[str, Any]]:
    """Per-hop compute and network time of the answer so far (the client adds to them every step)."""
    return [
        {
            "url": h.url,
            "layers": [h.layer_start, h.layer_end],
            "compute_ms": round(s.compute_ms, 2),
            "network_ms": round(s.network_ms, 2),
            "wall_ms": round(getattr(s, "wall_ms", 0.0), 2),
        }
        for h, s in zip(getattr(client, "hops", []), getattr(client, "hop_stats", []), strict=False)
    ]


def _so_far(client: Any, n_generated: int, t0: float, t_first: float | None) -> dict[str, Any]:
    """Telemetry of an answer still streaming (or cut by Stop), in the shape of the final one."""
    now = time.perf_counter()
    decode_s = now - t_first if t_first is not None else 0.0
    return {
        "n_generated": n_generated,
        "total_ms": round((now - t0) * 1e3, 1),
        "ttft_ms": round((t_first - t0) * 1e3, 1) if t_first is not None else None,
        "tok_s": round((n_generated - 1) / decode_s, 1) if n_generated > 1 and decode_s > 0 else 0.0,
        "hops": _hops(client),
    }


class ChatConsumer(SafeJsonConsumer):
    """/ws/chat/: logged-in users only. Messages `chat`, `stop` and `reset`; see docs/control-plane.md."""

    live: LiveRoute | None = None
    live_dirty = False  # a step may be half-applied on the hops: close the route, never park it
    conversation_id: int | None = None  # the socket's current conversation
    task: asyncio.Task[None] | None = None
    turn = 0

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        self.stop_event = asyncio.Event()
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self._leave_live()

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        kind = content.get("type", "chat") if isinstance(content, dict) else None
        if kind == "stop":
            if self.task is not None and not self.task.done():
                self.stop_event.set()
            return
        if kind == "reset":  # the page starts a new conversation: the current one's route is parked
            if self.task is not None and not self.task.done():
                raise BadMessage("stop the current answer first")
            await self._leave_live()
            self.conversation_id = None
            await self.send_json({"type": "reset"})
            return
        if kind != "chat":
            raise BadMessage(f"unknown message type {kind!r}")
        if "conversation" not in content and self.conversation_id is not None:
            # Scripts that omit the key continue the socket's conversation; the page always sends it.
            content = {**content, "conversation": self.conversation_id}
        try:
            req = parse_chat_request(content)
        except ChatRequestError as e:
            raise BadMessage(str(e)) from None
        if self.task is not None and not self.task.done():
            raise BadMessage("wait for the current answer to finish, or stop it")
        self.turn += 1
        self.stop_event.clear()
        self.task = asyncio.create_task(self._answer(req, self.turn))

    async def _leave_live(self, state: str = RouteSession.State.CLOSED) -> None:
        """Park the live route for a later reopen, or close it when its KV cannot be trusted."""
        live, self.live = self.live, None
        if live is None:
            return
        dirty, self.live_dirty = self.live_dirty, False
        kept = await database_sync_to_async(store.conversation_exists)(live.conversation_id)
        if dirty or state != RouteSession.State.CLOSED or not kept:  # a deleted chat's KV goes at once
            await close_live(live, state)
        else:
            parking.park(live)

    async def _ensure_live(self, req: ChatRequest, turn: store.Turn) -> LiveRoute:
        cid = turn.conversation_id
        if self.live is not None and (self.live.conversation_id, self.live.artifact_id) == (
            cid,
            req.model_id,
        ):
            return self.live
        await self._leave_live()
        live = parking.claim(cid, req.model_id)
        if live is None:
            from agent.client.route import Hop, RouteClient
            from agent.client.transport import shared_transport

            user = self.scope["user"]
            artifact, session, grants, tokenizer = await database_sync_to_async(_open)(req.model_id, user)
            hops = [Hop(g.url, g.layer_start, g.layer_end, g.token) for g in grants]
            client = RouteClient(
                hops,
                tokenizer,
                session_id=session.id.bytes,
                max_context=turn.context,
                token_id_layers=artifact.parsed_manifest.token_id_layers,  # deepseek4 hash layers
                # a failed hop is replaced inside the client (snapshot hand-off or re-prefill): issue 14
                replacements=routing.replacement_provider(session.id),
                # one transport per process and TLS context: sessions' decode steps to a hop travel and run
                # together (agent/client/transport.py)
                transport=shared_transport(dataplane_tls.context_for([h.url for h in hops])),
                # hidden states stay between the hops (chain), not through this process: settings.ROUTE_MODE
                mode=settings.ROUTE_MODE,
            )
            live = LiveRoute(cid, req.model_id, session.id, client, session.hops, turn.context)
        self.live = live
        return live

    async def _next(self, it: Any) -> Any:
        """The next event of the answer, or None when Stop was pressed (after the step in flight ends)."""
        step = asyncio.ensure_future(anext(it))
        stop = asyncio.ensure_future(self.stop_event.wait())
        try:
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                await asyncio.wait({step}, timeout=STOP_GRACE_S)
        finally:
            stop.cancel()
            if not step.done():  # abandoned after Stop, or this task was cancelled (the socket went)
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await step
        if step.cancelled():
            raise _Abandoned
        return step.result()  # StopAsyncIteration at the end of the answer

    async def _stream(
        self,
        live: LiveRoute,
        req: ChatRequest,
        messages: list[dict[str, str]],
        base: dict[str, Any],
        shown: list[str],
    ) -> tuple[str, dict[str, Any], bool]:
        """Stream one answer; returns (text, telemetry, stopped). After a failover, text the user already
        saw (`shown[0]`) is not sent again."""
        text, telemetry, n = "", {}, 0
        t0, t_first, last_progress = time.perf_counter(), None, 0.0
        it = aiter(live.client.chat(messages, req.sampling, req.max_tokens))
        self.live_dirty = True
        try:
            while not self.stop_event.is_set():
                try:
                    ev = await self._next(it)
                except StopAsyncIteration:
                    break
                delta = getattr(ev, "text", "") or ""
                if getattr(ev, "token", None) is not None or delta:
                    n += 1
                    t_first = t_first or time.perf_counter()
                if delta:
                    before, text = len(text), text + delta
                    fresh = text[max(before, len(shown[0])) :]
                    if fresh:
                        shown[0] += fresh
                        await self.send_json({**base, "type": "delta", "text": fresh})
                if getattr(ev, "telemetry", None):
                    telemetry = dict(ev.telemetry)
                now = time.perf_counter()
                if now - last_progress >= PROGRESS_S and not telemetry:
                    last_progress = now
                    progress = _so_far(live.client, n, t0, t_first)
                    await self.send_json(
                        {**base, "type": "progress", "telemetry": progress, "bars": bars_json(progress)}
                    )
        finally:
            with contextlib.suppress(Exception):
                await it.aclose()  # between steps: nothing is in flight, the KV equals the history
        self.live_dirty = False
        stopped = self.stop_event.is_set() and not telemetry
        if stopped:
            telemetry = {**_so_far(live.client, n, t0, t_first), "stopped": True}
        return text, telemetry, stopped

    async def _abandon(self, turn: store.Turn) -> None:
        await database_sync_to_async(store.abandon_turn)(turn)
        if turn.created:
            self.conversation_id = None

    async def _turn_error(self, base: dict[str, Any], text: str) -> None:
        """This turn got no answer; the page gives the user's text back to edit and resend."""
        await self.send_json({**base, "type": "error", "error": text})

    async def _answer(self, req: ChatRequest, turn_no: int) -> None:
        """Answer one turn. A hop failing mid-answer is replaced inside the route client (greedy or seeded
        sampling continues identically, so the user sees one seamless answer); when that recovery gives
        up, the turn ends with an error at once."""
        base: dict[str, Any] = {"turn": turn_no}
        user = self.scope["user"]
        try:
            turn = await database_sync_to_async(store.begin_turn)(user, req)
        except ChatRequestError as e:
            await self._turn_error(base, str(e))
            return
        base["conversation"] = turn.conversation_id
        self.conversation_id = turn.conversation_id
        shown, started, text, stopped = [""], False, "", False
        telemetry: dict[str, Any] = {}
        try:
            while True:
                try:
                    live = await self._ensure_live(req, turn)
                except (NoRoute, ModelArtifact.DoesNotExist) as e:
                    why = str(e) if isinstance(e, NoRoute) else "it is no longer ready"
                    await self._abandon(turn)
                    await self._turn_error(
                        base,
                        f"{turn.model_name} is not placed so that it can answer: {why}. "
                        "An admin can place it from the Models page.",
                    )
                    return
                if not started:
                    started = True
                    start = {
                        **base,
                        "type": "start",
                        "title": turn.title,
                        "created": turn.created,
                        "session": str(live.session_id),
                        "route": live.route,
                        "context": live.context,
                        "message": req.message,
                    }
                    await self.send_json(start)
                try:
                    text, telemetry, stopped = await self._stream(live, req, turn.messages, base, shown)
                    break
                except asyncio.CancelledError:
                    raise
                except _Abandoned:
                    log.info("stop abandoned a step in flight on session %s; closing it", live.session_id)
                    text, stopped, telemetry = shown[0], True, {"stopped": True, "route_closed": True}
                    await self._leave_live()
                    break
                except Exception as e:  # noqa: BLE001 - the client's own recovery gave up: tell the user
                    log.warning("generation failed on session %s", live.session_id, exc_info=True)
                    await self._leave_live(RouteSession.State.BROKEN)
                    await database_sync_to_async(record_generation)(
                        live.session_id, req.model_id, user, {}, error=str(e)
                    )
                    await self._abandon(turn)
                    await self._turn_error(
                        base, f"the route failed and could not be recovered, so this answer is lost: {e}"
                    )
                    return
        except asyncio.CancelledError:  # the socket went: keep what the user saw of the answer
            if shown[0]:
                await asyncio.shield(
                    database_sync_to_async(store.finish_turn)(turn, shown[0], {"stopped": True}, True)
                )
            raise
        if self.live is live:  # still open: record what its hops hold
            history = getattr(live.client, "history", None)
            n_positions = (
                len(history)
                if isinstance(history, list)
                else (int(telemetry.get("n_prompt", 0) or 0) + int(telemetry.get("n_generated", 0) or 0))
            )
            await database_sync_to_async(routing.touch_session)(live.session_id, n_positions)
        if not stopped:
            await database_sync_to_async(record_generation)(live.session_id, req.model_id, user, telemetry)
        message_id = await database_sync_to_async(store.finish_turn)(turn, text, telemetry, stopped)
        done = {
            **base,
            "type": "done",
            "message": message_id,
            "text": text,
            "stopped": stopped,
            "telemetry": telemetry,
            "bars": bars_json(telemetry),
        }
        await self.send_json(done)
