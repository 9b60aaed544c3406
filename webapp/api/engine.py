"""Running one API generation over a route: prefix-cache lookup, route opening, stop sequences,
logprobs, usage and per-hop telemetry, and cleanup (KV freed on every hop) on failure or disconnect."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from channels.db import database_sync_to_async
from django.conf import settings

from agent import defaults
from agent.client.route import ContextLimitError, Hop, HopStats, RouteClient, RouteError
from agent.client.tokenizer import ChatTokenizer, StreamDecoder, TokenizerError
from agent.client.transport import shared_transport
from agent.wire.frames import CONTEXT_CAP
from webapp.api import keys
from webapp.api.cache import Entry, PrefixCache
from webapp.api.params import ApiError, GenRequest
from webapp.catalog.models import ModelArtifact
from webapp.core import dataplane_tls
from webapp.routing import services as routing
from webapp.routing.chooser import NoRoute
from webapp.routing.models import RouteSession
from webapp.telemetry.services import record_generation

log = logging.getLogger(__name__)
RETRY_AFTER_S = "2"

cache = PrefixCache(max_age_s=settings.ROUTE_TOKEN_TTL_S * 0.8)
# Closing evicted or failed routes runs in tasks that must not be garbage-collected mid-flight.
_closing: set[asyncio.Task[None]] = set()


@lru_cache(maxsize=8)
def tokenizer_for(path: str) -> ChatTokenizer:
    return ChatTokenizer(path)


@dataclass(frozen=True)
class Target:
    """The model a request names, resolved to a ready artifact."""

    artifact_id: int
    name: str
    path: str
    max_context: int
    token_id_layers: int = 0  # hops starting below this need the token ids too (deepseek4 hash layers)


def _context_of(a: ModelArtifact) -> int:
    ctx = int((a.manifest or {}).get("context_length") or 0)
    return min(ctx, CONTEXT_CAP) if ctx > 0 else defaults.MAX_CONTEXT


def ready_models() -> list[ModelArtifact]:
    return list(ModelArtifact.objects.filter(state=ModelArtifact.State.READY).order_by("-created_at"))


def resolve_model(name: str) -> Target:
    a = find_model(name)
    ids = a.parsed_manifest.token_id_layers if a.manifest else 0
    return Target(a.pk, a.name, a.path, _context_of(a), ids)


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


def _open(target: Target, user: Any) -> tuple[RouteSession, list[routing.HopGrant]]:
    return routing.open_route(target.artifact_id, user)


def _finish_db(
    entry: Entry,
    key_id: int,
    user: Any,
    tokens_in: int,
    tokens_out: int,
    telemetry: dict[str, Any],
    error: str,
) -> None:
    keys.record_usage(key_id, tokens_in, tokens_out)
    routing.touch_session(entry.session_id, len(entry.client.history))
    record_generation(entry.session_id, entry.artifact_id, user, telemetry, error=error)


async def close_entry(entry: Entry, state: str = RouteSession.State.CLOSED) -> None:
    """Free the entry's KV on every hop and mark its route session closed."""
    try:
        await entry.client.close()
    except Exception:  # noqa: BLE001 - a dead hop frees its KV by TTL; the session is still closed here
        log.warning("closing route session %s failed", entry.session_id, exc_info=True)
    await database_sync_to_async(routing.close_session)(entry.session_id, state)


def close_later(entries: list[Entry], state: str = RouteSession.State.CLOSED) -> None:
    for e in entries:
        task = asyncio.get_running_loop().create_task(close_entry(e, state))
        _closing.add(task)
        task.add_done_callback(_closing.discard)


@dataclass
class Piece:
    """A streamed part of the answer: new text and the logprobs of the tokens it completes."""

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


def _logprob_entry(
    tok: ChatTokenizer, token: int, logprob: float, logits: np.ndarray | None, top: int
) -> dict[str, Any]:
    text, raw = _token_text(tok, token)
    entry: dict[str, Any] = {"token": text, "logprob": float(logprob), "bytes": raw, "top_logprobs": []}
    if logits is not None and top > 0:
        row = logits.astype(np.float64)
        m = float(row.max())
        lse = m + math.log(float(np.exp(row - m).sum()))
        idx = np.argpartition(-row, top - 1)[:top]
        idx = idx[np.argsort(-row[idx])]
        for i in idx:
            t_text, t_raw = _token_text(tok, int(i))
            entry["top_logprobs"].append({"token": t_text, "logprob": float(row[i] - lse), "bytes": t_raw})
    return entry


class Generation:
    """One request: `prepare` (tokenize, check the context, find or open a route) raises ApiError before
    anything is sent; then `pieces` streams the answer and `outcome` says how it ended."""

    def __init__(self, req: GenRequest, key: Any, target: Target) -> None:
        self.req, self.key, self.target = req, key, target
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self.outcome: Outcome | None = None
        self.entry: Entry | None = None
        self.reused = False
        self.prompt: list[int] = []
        self.tok: ChatTokenizer | None = None
        self.n_out = 0  # tokens generated so far (counted in usage even if the client leaves)
        self.text = ""

    async def prepare(self) -> None:
        try:
            self.tok = await asyncio.to_thread(tokenizer_for, self.target.path)
        except TokenizerError as e:
            raise ApiError(
                500, f"cannot load the model's tokenizer: {e}", "server_error", code="tokenizer"
            ) from None
        tok, req = self.tok, self.req
        try:
            if req.kind == "chat":
                self.prompt = tok.encode_chat(req.messages)
            elif isinstance(req.prompt, str):
                self.prompt = tok.encode(req.prompt)
            else:
                if max(req.prompt) >= tok.n_vocab:
                    raise ApiError(
                        400, f"token ids must be below {tok.n_vocab}", param="prompt", code="invalid_value"
                    )
                self.prompt = list(req.prompt)
        except TokenizerError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_value") from None
        limit = self.target.max_context
        room = limit - len(self.prompt)
        if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(self.prompt) + (req.max_tokens or 1)} tokens ({len(self.prompt)} in the prompt, "
                f"{req.max_tokens or 1} for the completion). Please reduce the prompt or max_tokens.",
                param="messages" if req.kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        self.max_tokens = req.max_tokens or room
        close_later(cache.expired())
        entry, _ = cache.take(self.key.pk, self.target.artifact_id, self.prompt)
        self.reused = entry is not None
        self.entry = entry or await self._open_entry()

    async def _open_entry(self) -> Entry:
        try:
            session, grants = await database_sync_to_async(_open)(self.target, self.key.user)
        except NoRoute as e:
            raise ApiError(
                503,
                f"no route can serve '{self.target.name}' now: {e}",
                "server_error",
                code="no_route",
                headers={"Retry-After": RETRY_AFTER_S},
            ) from None
        except ModelArtifact.DoesNotExist:
            raise ApiError(
                404, f"The model '{self.target.name}' is not ready", param="model", code="model_not_found"
            ) from None
        hops = [Hop(g.url, g.layer_start, g.layer_end, g.token) for g in grants]
        client = RouteClient(
            hops,
            self.tok,
            session_id=session.id.bytes,
            max_context=self.target.max_context,
            token_id_layers=self.target.token_id_layers,
            # one transport per process and TLS context: sessions' decode steps to a hop travel and run
            # together (agent/client/transport.py)
            transport=shared_transport(dataplane_tls.context_for([h.url for h in hops])),
            # hidden states stay between the hops (chain), not through this process: settings.ROUTE_MODE
            mode=settings.ROUTE_MODE,
            replacements=routing.replacement_provider(session.id),  # a failed hop is replaced mid-answer
        )
        entry = Entry(self.key.pk, self.target.artifact_id, session.id, client, session.hops)
        close_later(cache.add_busy(entry))
        return entry

    def _error_for(self, e: Exception) -> ApiError:
        if isinstance(e, ContextLimitError):
            return ApiError(400, str(e), code="context_length_exceeded")
        if isinstance(e, RouteError) and e.status == 503:
            return ApiError(
                503,
                f"the route is out of capacity: {e}",
                "server_error",
                code="overloaded",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        return ApiError(
            503,
            f"the route failed: {e}",
            "server_error",
            code="route_failed",
            headers={"Retry-After": RETRY_AFTER_S},
        )

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """The answer as it comes. On a reused route that fails before the first token, one fresh route
        is tried; any other failure raises ApiError. Cancellation (client gone) closes the route."""
        assert self.entry is not None and self.tok is not None
        done = False
        sent_any = False
        try:
            for attempt in (1, 2):
                try:
                    async for piece in self._run(self.entry):
                        sent_any = True
                        yield piece
                    done = True
                    return
                except (RouteError, OSError) as e:
                    failed = self.entry
                    cache.drop(failed)
                    log.warning("API generation failed on session %s", failed.session_id, exc_info=True)
                    await close_entry(failed, RouteSession.State.BROKEN)
                    if sent_any or attempt == 2 or not self.reused or isinstance(e, ContextLimitError):
                        self.entry = None
                        raise self._error_for(e) from None
                    self.reused = False
                    self.entry = await self._open_entry()
        finally:
            if not done and self.entry is not None:
                # The client went away (or we failed): stop here and free the KV on every hop.
                entry, self.entry = self.entry, None
                cache.drop(entry)
                await asyncio.shield(close_entry(entry))
                # What was computed counts, even for a client that did not stay to read it.
                usage = database_sync_to_async(keys.record_usage)(self.key.pk, len(self.prompt), self.n_out)
                await asyncio.shield(usage)

    async def _run(self, entry: Entry) -> AsyncIterator[Piece]:
        tok, req, client = self.tok, self.req, entry.client
        assert tok is not None
        client.hop_stats = [HopStats() for _ in client.hops]
        want_top = req.logprobs and req.top_logprobs > 0
        dec = StreamDecoder(tok)
        stops, hold = req.stop, max((len(s) for s in req.stop), default=1) - 1
        text, emitted, search_from = "", 0, 0
        pending: list[dict[str, Any]] = []
        n_out, finish = 0, "length"
        t0 = time.perf_counter()
        ttft = 0.0
        gen = client.generate(self.prompt, req.sampling, self.max_tokens, tok.eot_ids, want_logits=want_top)
        try:
            async for token, logprob in gen:
                if ttft == 0.0:
                    ttft = time.perf_counter() - t0
                if tok.is_end(token):
                    finish = "stop"
                    break
                n_out += 1
                self.n_out = n_out
                if req.logprobs:
                    resp = client.last_response
                    logits = resp.logits()[-1] if want_top and resp is not None and resp.n_tokens else None
                    pending.append(_logprob_entry(tok, token, logprob, logits, req.top_logprobs))
                text += dec.push(token)
                cut = self._find_stop(text, search_from)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    break
                search_from = max(0, len(text) - hold)
                safe = len(text) - hold if stops else len(text)
                if safe > emitted:
                    yield Piece(text[emitted:safe], pending)
                    emitted, pending = safe, []
        finally:
            await gen.aclose()
        if finish == "length":
            text += dec.flush()
            cut = self._find_stop(text, search_from)
            if cut is not None:
                text, finish = text[:cut], "stop"
        if len(text) > emitted or pending:
            yield Piece(text[emitted:], pending)
        total = time.perf_counter() - t0
        self.outcome = Outcome(finish, len(self.prompt), n_out, self._telemetry(entry, ttft, total, n_out))
        self.text = text

    def _find_stop(self, text: str, start: int) -> int | None:
        hits = [i for i in (text.find(s, start) for s in self.req.stop) if i >= 0]
        return min(hits) if hits else None

    def _telemetry(self, entry: Entry, ttft: float, total: float, n_out: int) -> dict[str, Any]:
        c = entry.client
        prefilled = c.last_prefilled
        decode_s = total - ttft
        return {
            "session": str(entry.session_id),
            "route": entry.route,
            "reused_route": self.reused,
            "ttft_ms": round(ttft * 1e3, 2),
            "tok_s": round((n_out - 1) / decode_s, 2) if n_out > 1 and decode_s > 0 else 0.0,
            "total_ms": round(total * 1e3, 2),
            "n_prompt": len(self.prompt),
            "n_reused": len(self.prompt) - prefilled,
            "n_prefilled": prefilled,
            # Tokens this request sent through the hops: the new prompt tokens, then one per decode step.
            "tokens_sent": len(c.history) - (len(self.prompt) - prefilled),
            "n_generated": n_out,
            "mode": c.mode,
            "hops": c.hop_telemetry(),
            "wire_bytes": sum(s.bytes_out + s.bytes_in for s in c.hop_stats),
        }

    async def finish(self) -> None:
        """Keep the route for the next turn and record usage, session and telemetry."""
        entry, self.entry = self.entry, None
        if entry is None or self.outcome is None:
            return
        close_later(cache.put(entry))
        o = self.outcome
        await database_sync_to_async(_finish_db)(
            entry, self.key.pk, self.key.user, o.prompt_tokens, o.completion_tokens, o.x_swarm, ""
        )
