"""The playground websocket (JSON): answers stream token by token over a conversation's sticky route.

A conversation keeps one live route of the route-session service (webapp/routing/session.py), so turn 2
prefills only the new tokens; when the socket goes the route is parked (webapp/playground/live.py) and a
reload continues with the hops' KV. Stop ends generation between two steps, so every hop's KV still
equals the client's token history.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

from agent.client.tokenizer import TokenizerError
from agent.wire.control import CLOSE_UNAUTHORIZED
from webapp.catalog.models import ModelArtifact
from webapp.core.consumers import BadMessage, SafeJsonConsumer
from webapp.playground import store
from webapp.playground.chat import ChatRequest, ChatRequestError, bars_json, parse_chat_request
from webapp.playground.live import parking
from webapp.routing import prompt, quota, session
from webapp.routing.answer import AnswerSpec, LiveRoute
from webapp.routing.chooser import NoRoute
from webapp.routing.models import RouteSession

log = logging.getLogger(__name__)

_sockets: weakref.WeakSet[ChatConsumer] = weakref.WeakSet()  # open sockets, for the user's route cap
PROGRESS_S = 0.25  # how often the page's telemetry bars move while an answer streams
# After Stop, how long the step in flight (a decode step, or the prompt's prefill) may take to
# finish; past it the step is abandoned and the route closed, since a hop may or may not have applied it.
STOP_GRACE_S = 10.0


class _Abandoned(Exception):
    """Stop came while a step was in flight and it did not finish in time: the route's KV is unknown."""


def _cannot_answer(model: str, e: Exception) -> str:
    if isinstance(e, TokenizerError | prompt.PromptError):
        return f"{model} cannot answer: {e}"
    why = "it is no longer ready" if isinstance(e, ModelArtifact.DoesNotExist) else str(e)
    return f"{model} is not placed so that it can answer: {why}. An admin can place it from the Models page."


def _reclaim(live: LiveRoute) -> bool:
    return any(c.give_up_idle(live) for c in list(_sockets))


quota.routes.add_reclaimer(_reclaim)


class ChatConsumer(SafeJsonConsumer):
    """/ws/chat/: logged-in users only. Messages `chat`, `stop` and `reset`; see docs/control-plane.md.

    It is the route-session service's Holder for the socket: the live route of its conversation."""

    live: LiveRoute | None = None
    live_conversation: int | None = None  # the conversation whose KV the live route holds
    live_dirty = False  # a step may be half-applied on the hops: close the route, never park it
    stream = quota.StreamLease(None, None)  # the running answer's place among the user's (issue 33)
    conversation_id: int | None = None  # the socket's current conversation
    task: asyncio.Task[None] | None = None
    turn = 0
    shown = ""  # the text of the answer now streaming that the page already has

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        self.stop_event = asyncio.Event()
        _sockets.add(self)
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

    def adopt(self, live: LiveRoute) -> None:
        self.live = live

    def drop(self, live: LiveRoute) -> None:
        if self.live is live:
            self.live = None

    def give_up_idle(self, live: LiveRoute) -> bool:
        """Hand the socket's route over to be closed for the user's route cap, unless an answer runs."""
        if self.live is not live or (self.task is not None and not self.task.done()):
            return False
        self.live, self.live_dirty = None, False
        return True

    async def _leave_live(self, state: str = RouteSession.State.CLOSED) -> None:
        """Park the live route for a later reopen, or close it when its KV cannot be trusted."""
        live, self.live = self.live, None
        dirty, self.live_dirty = self.live_dirty, False
        if live is None:
            return
        cid = self.live_conversation
        if dirty or state != RouteSession.State.CLOSED or cid is None:
            await session.close_live(live, state)
        elif not await database_sync_to_async(store.conversation_exists)(cid):
            await session.close_live(live, state)  # a deleted chat's KV goes at once
        else:
            parking.park(cid, live)

    async def _route_answer(self, req: ChatRequest, turn: store.Turn) -> session.RouteAnswer:
        """The turn's answer, on the route that holds its conversation's KV (this socket's or a parked
        one) or else on a new route."""
        target, cid = turn.target, turn.conversation_id
        if self.live is not None and (self.live_conversation, self.live.artifact_id) != (
            cid,
            target.artifact_id,
        ):
            await self._leave_live()
        if self.live is None:
            self.live = parking.claim(cid, target.artifact_id)
        self.live_conversation = cid
        tok = await session.load_tokenizer(target.path)
        # sizes checked, then rendered and tokenized off the event loop (issue 33)
        ids, shared = await prompt.encode_chat_shared(tok, turn.messages, target.capacity)
        spec = AnswerSpec(
            req.sampling, req.max_tokens, shared_prefix=shared, speculate=settings.ROUTE_SPECULATE
        )
        return session.RouteAnswer(target, self.scope["user"], tok, ids, spec, self, self.live)

    async def _next(self, it: Any, stop: asyncio.Future[Any]) -> Any:
        """The next piece of the answer; after Stop (`stop`, the answer's one waiter on the stop event),
        the step in flight gets STOP_GRACE_S to end."""
        step = asyncio.ensure_future(anext(it))
        try:
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                await asyncio.wait({step}, timeout=STOP_GRACE_S)
        finally:
            if not step.done():  # abandoned after Stop, or this task was cancelled (the socket went)
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await step
        if step.cancelled():
            raise _Abandoned
        return step.result()  # StopAsyncIteration at the end of the answer

    async def _stream(self, run: session.RouteAnswer, base: dict[str, Any]) -> bool:
        """Stream one answer to the page; True when Stop ended it."""
        last_progress, stopped = 0.0, False
        it = run.pieces()
        self.live_dirty = True
        stop = asyncio.ensure_future(self.stop_event.wait())  # one waiter for the answer, not one a piece
        try:
            while True:
                if self.stop_event.is_set():
                    stopped = True
                    break
                try:
                    piece = await self._next(it, stop)
                except StopAsyncIteration:
                    break
                await self.stream.keep()
                if piece.text:
                    self.shown += piece.text
                    await self.send_json({**base, "type": "delta", "text": piece.text})
                now = time.perf_counter()
                if now - last_progress >= PROGRESS_S:
                    last_progress = now
                    progress = run.telemetry()
                    await self.send_json(
                        {**base, "type": "progress", "telemetry": progress, "bars": bars_json(progress)}
                    )
        finally:
            stop.cancel()
            with contextlib.suppress(Exception):
                await it.aclose()  # between steps: nothing is in flight, the KV equals the history
        self.live_dirty = False
        return stopped

    async def _abandon(self, turn: store.Turn) -> None:
        await database_sync_to_async(store.abandon_turn)(turn)
        if turn.created:
            self.conversation_id = None

    async def _turn_error(self, base: dict[str, Any], text: str) -> None:
        """This turn got no answer; the page gives the user's text back to edit and resend."""
        await self.send_json({**base, "type": "error", "error": text})

    async def _answer(self, req: ChatRequest, turn_no: int) -> None:
        """Answer one turn within the user's answers at once (API answers count too, issue 33)."""
        base: dict[str, Any] = {"turn": turn_no}
        try:
            self.stream = await quota.hold_stream(self.scope["user"])
        except (quota.TooManyStreams, quota.StreamsUnavailable) as e:
            await self._turn_error(base, str(e))
            return
        try:
            await self._answer_turn(req, base)
        finally:
            self.stream.release()

    async def _answer_turn(self, req: ChatRequest, base: dict[str, Any]) -> None:
        """A hop failing mid-answer is replaced inside the route client (greedy or seeded sampling
        continues identically, so the user sees one seamless answer); when that recovery gives up, the
        turn ends with an error at once."""
        try:
            turn = await database_sync_to_async(store.begin_turn)(self.scope["user"], req)
        except ChatRequestError as e:
            await self._turn_error(base, str(e))
            return
        base["conversation"] = self.conversation_id = turn.conversation_id
        self.shown, closed = "", False
        try:
            run = await self._route_answer(req, turn)
            live = await run.open()
            start = {
                **base,
                "type": "start",
                "title": turn.title,
                "created": turn.created,
                "session": str(live.session_id),
                "route": live.route,
                "context": live.capacity,
                "message": req.message,
            }
            await self.send_json(start)
            stopped = await self._stream(run, base)
            telemetry = {**run.telemetry(), "stopped": True} if stopped else run.telemetry()
        except asyncio.CancelledError:  # the socket went: keep what the user saw of the answer
            if self.shown:
                await asyncio.shield(
                    database_sync_to_async(store.finish_turn)(turn, self.shown, {"stopped": True}, True)
                )
            raise
        except _Abandoned:
            log.info("stop abandoned a step in flight on session %s; closing it", live.session_id)
            stopped, closed = True, True
            telemetry = {**run.telemetry(), "stopped": True, "route_closed": True}
            await self._leave_live()
        except (NoRoute, ModelArtifact.DoesNotExist, TokenizerError, prompt.PromptError) as e:
            await self._leave_live()  # a route the socket holds is still sound: it waits parked
            await self._abandon(turn)
            await self._turn_error(base, _cannot_answer(turn.target.name, e))
            return
        except Exception as e:  # noqa: BLE001 - the client's own recovery gave up: tell the user
            # a route the failure did not come from (the service closed that one) is closed as well
            await self._leave_live(RouteSession.State.BROKEN)
            await self._abandon(turn)
            await self._turn_error(
                base, f"the route failed and could not be recovered, so this answer is lost: {e}"
            )
            return
        if not closed:
            await run.record(stopped)
        message_id = await database_sync_to_async(store.finish_turn)(turn, self.shown, telemetry, stopped)
        done = {
            **base,
            "type": "done",
            "message": message_id,
            "text": self.shown,
            "stopped": stopped,
            "telemetry": telemetry,
            "bars": bars_json(telemetry),
        }
        await self.send_json(done)
