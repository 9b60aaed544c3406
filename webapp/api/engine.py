"""Running one API generation over the shared route-session service (webapp/routing/session.py): the
prefix cache's routes, OpenAI's context check, errors and logprobs, usage per key, cleanup on disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

from agent.client.route import ContextLimitError, RouteError
from agent.client.tokenizer import ChatTokenizer, TokenizerError
from webapp.api import keys
from webapp.api.cache import Entry, PrefixCache
from webapp.api.params import ApiError, GenRequest
from webapp.catalog.models import ModelArtifact
from webapp.routing import prompt, quota, session
from webapp.routing.answer import AnswerSpec, LiveRoute, TokenLogprob
from webapp.routing.chooser import NoRoute
from webapp.routing.session import RouteAnswer, Target

RETRY_AFTER_S = "2"

cache = PrefixCache(max_age_s=settings.ROUTE_TOKEN_TTL_S * 0.8)


def _reclaim(live: LiveRoute) -> bool:
    """Give up a cached route for its user's route cap (webapp.routing.quota) when no request runs on it."""
    for e in cache.entries:
        if e.live is live:
            if e.busy:
                return False
            cache.drop(e)
            return True
    return False


quota.routes.add_reclaimer(_reclaim)


def ready_models() -> list[ModelArtifact]:
    return list(ModelArtifact.objects.filter(state=ModelArtifact.State.READY).order_by("-created_at"))


def resolve_model(name: str) -> Target:
    return session.target_of(find_model(name))


def find_model(name: str) -> ModelArtifact:
    """A ready model by name (newest first), sha256 (or a 12+ character prefix) or id; 404 otherwise."""
    ready = ModelArtifact.objects.filter(state=ModelArtifact.State.READY).order_by("-created_at")
    a = ready.filter(name=name).first()
    if a is None and len(name) >= 12 and all(c in "0123456789abcdef" for c in name):
        a = ready.filter(sha256__startswith=name).first()
    if a is None and name.isdigit():
        a = ready.filter(pk=int(name)).first()
    if a is None:
        raise ApiError(
            404, f"The model '{name}' does not exist or is not ready", param="model", code="model_not_found"
        )
    return a


def _close(entries: Iterable[Entry]) -> None:
    session.close_later(e.live for e in entries)


@dataclass
class Piece:
    """A streamed part of the answer: new text and the logprobs (OpenAI's entries) of the tokens it completes."""

    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Outcome:
    """How the answer ended, with OpenAI's usage and our per-hop telemetry."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    x_swarm: dict[str, Any]

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _token_text(tok: ChatTokenizer, t: int) -> tuple[str, list[int]]:
    raw = tok.decode_bytes([t])
    return raw.decode("utf-8", "replace"), list(raw)


def logprob_entry(tok: ChatTokenizer, lp: TokenLogprob) -> dict[str, Any]:
    """A token's logprob as OpenAI writes it: text, bytes, and the top alternatives likewise."""
    text, raw = _token_text(tok, lp.token)
    top = []
    for t, logprob in lp.top:
        t_text, t_raw = _token_text(tok, t)
        top.append({"token": t_text, "logprob": logprob, "bytes": t_raw})
    return {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}


def error_for(e: Exception, model: str) -> ApiError:
    """OpenAI's error for a route that could not open, or failed while answering."""
    if isinstance(e, NoRoute):
        return ApiError(
            503, f"no route can serve '{model}' now: {e}", "server_error", code="no_route", headers=_retry()
        )
    if isinstance(e, ModelArtifact.DoesNotExist):
        return ApiError(404, f"The model '{model}' is not ready", param="model", code="model_not_found")
    if isinstance(e, ContextLimitError):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, RouteError) and e.status == 503:
        msg = f"the route is out of capacity: {e}"
        return ApiError(503, msg, "server_error", code="overloaded", headers=_retry())
    return ApiError(503, f"the route failed: {e}", "server_error", code="route_failed", headers=_retry())


def _retry() -> dict[str, str]:
    return {"Retry-After": RETRY_AFTER_S}


def _room(req: GenRequest, n_prompt: int, capacity: int) -> int:
    """Tokens the completion may take; OpenAI's 400 when the prompt and max_tokens do not fit."""
    room = capacity - n_prompt
    if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
        raise ApiError(
            400,
            f"This model's maximum context length is {capacity} tokens. However, you requested "
            f"{n_prompt + (req.max_tokens or 1)} tokens ({n_prompt} in the prompt, "
            f"{req.max_tokens or 1} for the completion). Please reduce the prompt or max_tokens.",
            param="messages" if req.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    return req.max_tokens or room


ROUTE_FAILURES = (RouteError, OSError, NoRoute, ModelArtifact.DoesNotExist)


class Generation:
    """One request: `prepare` (tokenize, check the context, find or open a route) raises ApiError before
    anything is sent; then `pieces` streams the answer and `outcome` says how it ended.

    It is the route-session service's Holder for the prefix cache: a route it opens is cached busy, one
    that fails is dropped from it."""

    def __init__(self, req: GenRequest, key: Any, target: Target) -> None:
        self.req, self.key, self.target = req, key, target
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self.outcome: Outcome | None = None
        self.entry: Entry | None = None
        self.prompt: list[int] = []
        self.tok: ChatTokenizer | None = None
        self.run: RouteAnswer | None = None
        self.stream: quota.StreamLease | None = None

    async def prepare(self) -> None:
        """Everything before the answer streams; a refusal leaves nothing held."""
        try:
            # one of the user's answers at once (API and playground together), before any work (issue 33)
            self.stream = await quota.hold_stream(self.key.user)
        except quota.TooManyStreams as e:
            raise ApiError(429, str(e), "requests", code="too_many_streams", headers=_retry()) from None
        except quota.StreamsUnavailable as e:
            raise ApiError(
                503, str(e), "server_error", code="streams_unavailable", headers=_retry()
            ) from None
        try:
            await self._prepare()
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give back the user's stream place (idempotent)."""
        if self.stream is not None:
            self.stream.release()

    async def _prepare(self) -> None:
        try:
            self.tok = tok = await session.load_tokenizer(self.target.path)
        except TokenizerError as e:
            raise ApiError(
                500, f"cannot load the model's tokenizer: {e}", "server_error", code="tokenizer"
            ) from None
        self.prompt, shared = await self._encode(tok)
        max_tokens = _room(self.req, len(self.prompt), self.target.capacity)
        _close(cache.expired())
        self.entry, _ = cache.take(self.key.pk, self.target.artifact_id, self.prompt)
        req = self.req
        spec = AnswerSpec(
            req.sampling,
            max_tokens,
            req.stop,
            req.logprobs,
            req.top_logprobs,
            shared,
            speculate=settings.ROUTE_SPECULATE,
        )
        held = self.entry.live if self.entry is not None else None
        self.run = RouteAnswer(self.target, self.key.user, tok, self.prompt, spec, self, held)
        try:
            await self.run.open()
        except (NoRoute, ModelArtifact.DoesNotExist) as e:
            raise error_for(e, self.target.name) from None

    async def _encode(self, tok: ChatTokenizer) -> tuple[list[int], int]:
        """The prompt's ids, its size checked first, then rendered and tokenized off the event loop
        (webapp/routing/prompt.py, issue 33); and how many of them other users may share (a chat's
        system prompt; none of a raw prompt)."""
        req, param = self.req, "messages" if self.req.kind == "chat" else "prompt"
        capacity = self.target.capacity
        try:
            if req.kind == "chat":
                return await prompt.encode_chat_shared(tok, req.messages, capacity)
            if isinstance(req.prompt, str):
                return await prompt.encode_text(tok, req.prompt, capacity), 0
        except TokenizerError as e:
            raise ApiError(400, str(e), param=param, code="invalid_value") from None
        except prompt.PromptError as e:
            headers = _retry() if isinstance(e, prompt.PromptBusy) else None
            kind = "server_error" if e.status >= 500 else "invalid_request_error"
            raise ApiError(e.status, str(e), kind, param=param, code=e.code, headers=headers) from None
        if len(req.prompt) > capacity:  # cheaper than the context check's message, same answer
            _room(req, len(req.prompt), capacity)
        if max(req.prompt) >= tok.n_vocab:
            raise ApiError(400, f"token ids must be below {tok.n_vocab}", param=param, code="invalid_value")
        return list(req.prompt), 0

    def adopt(self, live: LiveRoute) -> None:
        self.entry = Entry(self.key.pk, live)
        _close(cache.add_busy(self.entry))

    def drop(self, live: LiveRoute) -> None:
        if self.entry is not None:
            cache.drop(self.entry)
            self.entry = None

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """The answer as it comes; a failure raises ApiError, and cancellation (client gone) closes the
        route and still counts the tokens computed."""
        assert self.run is not None and self.tok is not None
        run, tok, done = self.run, self.tok, False
        try:
            async with contextlib.aclosing(run.pieces()) as pieces:
                async for p in pieces:
                    if self.stream is not None:
                        await self.stream.keep()
                    yield Piece(p.text, [logprob_entry(tok, lp) for lp in p.logprobs])
            done = True
        except ROUTE_FAILURES as e:
            raise error_for(e, self.target.name) from None
        finally:
            if not done and self.entry is not None:
                entry, self.entry = self.entry, None
                cache.drop(entry)
                await asyncio.shield(session.close_live(entry.live))
                n_out = run.answer.n_out if run.answer is not None else 0
                usage = database_sync_to_async(keys.record_usage)(self.key.pk, len(self.prompt), n_out)
                await asyncio.shield(usage)
            self.release()  # the answer is over (or abandoned): the user's stream place is free
        a = run.answer
        assert a is not None and a.finish_reason is not None
        self.outcome = Outcome(a.finish_reason, len(self.prompt), a.n_out, a.telemetry())

    async def finish(self) -> None:
        """Keep the route for the next turn and record usage, session and telemetry."""
        entry, self.entry = self.entry, None
        if entry is None or self.outcome is None or self.run is None:
            return
        _close(cache.put(entry))
        await self.run.record()
        o = self.outcome
        await database_sync_to_async(keys.record_usage)(self.key.pk, o.prompt_tokens, o.completion_tokens)
