"""The route-session service the API and the playground share: a model as a route needs it, its
tokenizer, opening a live route (the one place a RouteClient is made), answering on it, closing it.

Callers keep their live routes where their users come back for them (the API's prefix cache, the
playground's socket and parking) and hand them in as a `Holder`: an answer runs on the route that holds
the prompt's prefix, and replaces it with a fresh one when it fails before its first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

from channels.db import database_sync_to_async
from django.conf import settings

from agent import defaults
from agent.client.drafts import MtpDrafter
from agent.client.route import ContextLimitError, Hop, RouteClient, RouteError
from agent.client.spec import NgramDrafter
from agent.client.tokenizer import ChatTokenizer
from agent.client.transport import shared_transport
from agent.wire.frames import CONTEXT_CAP
from webapp.catalog.models import ModelArtifact
from webapp.core import dataplane_tls
from webapp.core.channels import notify_fleet_async
from webapp.routing import quota, services
from webapp.routing.answer import Answer, AnswerSpec, LiveRoute, Piece
from webapp.routing.models import RouteSession
from webapp.telemetry.services import record_generation

log = logging.getLogger(__name__)
# Background closes must not be garbage-collected mid-flight.
_closing: set[asyncio.Task[None]] = set()


def capacity_of(manifest: dict[str, Any] | None) -> int:
    """The context a route for this model opens with: its own context length, capped at 128K."""
    ctx = (manifest or {}).get("context_length") or 0
    return min(ctx, CONTEXT_CAP) if isinstance(ctx, int) and ctx > 0 else defaults.SESSION_CAPACITY


@dataclass(frozen=True)
class Target:
    """A ready model, as a route for it needs it."""

    artifact_id: int
    name: str
    path: str
    capacity: int
    token_id_layers: int = 0  # hops starting below this need the token ids too (deepseek4 hash layers)
    mtp_layers: int = 0  # the file's multi-token-prediction head (nextn blocks): its last hop can draft


def target_of(a: ModelArtifact) -> Target:
    m = a.parsed_manifest if a.manifest else None
    return Target(
        a.pk,
        a.name,
        a.path,
        capacity_of(a.manifest),
        m.token_id_layers if m else 0,
        m.mtp_layers if m else 0,
    )


@lru_cache(maxsize=8)
def tokenizer_for(path: str) -> ChatTokenizer:
    return ChatTokenizer(path)


async def load_tokenizer(path: str) -> ChatTokenizer:
    """The model's tokenizer (cached per process); the first load reads the GGUF, off the event loop."""
    return await asyncio.to_thread(tokenizer_for, path)


async def open_live(target: Target, tok: ChatTokenizer, user: Any) -> LiveRoute:
    """Choose and record a route for `target` and connect a client to its hops; raises NoRoute, or
    ModelArtifact.DoesNotExist when the model is no longer ready."""
    session, grants = await database_sync_to_async(services.open_route)(target.artifact_id, user)
    hops = [Hop(g.url, g.layer_start, g.layer_end, g.token) for g in grants]
    client = RouteClient(
        hops,
        tok,
        session_id=session.id.bytes,
        capacity=target.capacity,
        token_id_layers=target.token_id_layers,
        # one transport per process and TLS context: sessions' decode steps to a hop travel and run
        # together (agent/client/transport.py)
        transport=shared_transport(dataplane_tls.context_for([h.url for h in hops])),
        # hidden states stay between the hops (chain), not through this process: settings.ROUTE_MODE
        mode=settings.ROUTE_MODE,
        replacements=services.replacement_provider(session.id),  # a failed hop is replaced mid-answer
    )
    live = LiveRoute(session.id, target.artifact_id, client, session.hops, target.capacity)
    if target.mtp_layers and settings.ROUTE_SPECULATE:
        # the model's own head drafts on its last hop (a node started with --mtp; docs/speculative.md),
        # prompt lookup where it sends none
        client.mtp_draft = settings.ROUTE_SPECULATE
        live.drafter = MtpDrafter(fallback=NgramDrafter())
    quota.routes.add(user, live)  # counted against the user's USER_MAX_ROUTE_SESSIONS until closed
    return live


async def close_live(live: LiveRoute, state: str = RouteSession.State.CLOSED) -> None:
    """Free the route's KV on every hop and record the session's end."""
    quota.routes.remove(live)
    try:
        await live.client.close()
    except Exception:  # noqa: BLE001 - a dead hop frees its KV by TTL; the session is still closed here
        log.warning("closing route session %s failed", live.session_id, exc_info=True)
    await database_sync_to_async(services.close_session)(live.session_id, state)


async def _close_logged(live: LiveRoute) -> None:
    try:
        await close_live(live)
    except Exception:  # noqa: BLE001 - a background close has nobody to tell but the log
        log.exception("closing route session %s failed", live.session_id)


def close_later(lives: Iterable[LiveRoute]) -> None:
    """Close routes in the background (evicted, expired, parked too long); call it in the event loop."""
    loop = asyncio.get_running_loop()
    for live in lives:
        # A fresh context: a sync caller's (a view's thread) would make asgiref refuse the DB call.
        task = loop.create_task(_close_logged(live), context=contextvars.Context())
        _closing.add(task)
        task.add_done_callback(_closing.discard)


class Holder(Protocol):
    """Where a caller keeps its live routes: told of a route opened for it and of one that failed."""

    def adopt(self, live: LiveRoute) -> None: ...

    def drop(self, live: LiveRoute) -> None: ...


def _record(live: LiveRoute, user: Any, telemetry: dict[str, Any] | None) -> None:
    services.touch_session(live.session_id, len(live.client.history))
    if telemetry is not None:
        record_generation(live.session_id, live.artifact_id, user, telemetry)


class RouteAnswer:
    """One answer of a route session, on `live` (a held route whose KV shares the prompt's prefix) or on
    a route it opens. A reused route that fails before the first token is closed and the answer starts
    again on a fresh one; any other failure closes the route, is recorded and raised."""

    def __init__(
        self,
        target: Target,
        user: Any,
        tok: ChatTokenizer,
        prompt: list[int],
        spec: AnswerSpec,
        holder: Holder,
        live: LiveRoute | None = None,
    ) -> None:
        self.target, self.user, self.tok, self.prompt, self.spec = target, user, tok, prompt, spec
        self.holder, self.live, self.reused = holder, live, live is not None
        self.answer: Answer | None = None

    async def open(self) -> LiveRoute:
        """The route this answer runs on, opened and handed to the holder when there is none yet."""
        if self.live is None:
            self.live = await open_live(self.target, self.tok, self.user)
            self.holder.adopt(self.live)
            # past the user's cap the oldest idle routes close on their hops (issue 33)
            close_later(quota.routes.over_cap(self.user, keep=self.live))
        quota.routes.touch(self.live)
        return self.live

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """The answer's text as it comes; a failure is raised once the route is closed and recorded."""
        sent = False
        for attempt in (1, 2):
            live = await self.open()
            self.answer = Answer(live, self.tok, self.prompt, self.spec, self.reused)
            try:
                # until its first piece (the prefill) an answer holds a place of the fair gate, where
                # waiting answers are admitted round-robin by user; then its decode steps give way to
                # the prefills of users running fewer answers (issue 33)
                async with quota.prefills().turn(quota.user_key(self.user)) as turn:
                    # a user running other answers prefills in steps that let a lighter user's go first
                    self.answer.prefill_chunk, self.answer.between_chunks = turn.prefill_steps()
                    # closed with this generator, so a caller that stops reading stops the route client
                    async with contextlib.aclosing(self.answer.pieces()) as pieces:
                        async for piece in pieces:
                            turn.prefilled()
                            sent = True
                            yield piece
                            await turn.pace()
                return
            except (RouteError, OSError) as e:
                log.warning("answer failed on route session %s", live.session_id, exc_info=True)
                self.holder.drop(live)
                self.live = None
                await close_live(live, RouteSession.State.BROKEN)
                if sent or attempt == 2 or not self.reused or isinstance(e, ContextLimitError):
                    await database_sync_to_async(record_generation)(
                        live.session_id, live.artifact_id, self.user, self.answer.telemetry(), error=str(e)
                    )
                    await notify_fleet_async(kind="generations")
                    raise
                self.reused = False

    def telemetry(self) -> dict[str, Any]:
        """The answer's figures so far, or final once `pieces` ended; empty before it started."""
        return self.answer.telemetry() if self.answer is not None else {}

    async def record(self, stopped: bool = False) -> None:
        """Record what the route's hops now hold and, for an answer Stop did not cut, its telemetry."""
        if self.live is not None:
            telemetry = None if stopped else self.telemetry()
            await database_sync_to_async(_record)(self.live, self.user, telemetry)
            if telemetry is not None:
                await notify_fleet_async(kind="generations")
