"""The /v1/ endpoints (async, under ASGI) and the API key pages of the web UI."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from functools import wraps
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib import messages as flash
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from redis.exceptions import RedisError

from webapp.api import engine, keys
from webapp.api.engine import Generation, Piece
from webapp.api.models import ApiKey
from webapp.api.params import ApiError, GenRequest, parse_body, parse_chat, parse_completion
from webapp.core.auth import login_required_403
from webapp.routing import prompt, session

log = logging.getLogger(__name__)
ApiView = Callable[..., Coroutine[Any, Any, HttpResponseBase]]
PARSE_INLINE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop (about a millisecond)


def error_response(e: ApiError) -> JsonResponse:
    r = JsonResponse(e.body(), status=e.status)
    for k, v in e.headers.items():
        r[k] = v
    return r


def _auth(header: str) -> ApiKey:
    if not header:
        raise ApiError(
            401, "You didn't provide an API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )
    key = keys.authenticate(header)
    if key is None:
        raise ApiError(401, "Incorrect or revoked API key", code="invalid_api_key")
    try:
        wait = keys.rate_limiter.hit(key.pk, key.rate_limit_per_min)
        user_wait = 0.0 if wait else keys.hit_user(key.user_id)
    except RedisError as e:  # the rate windows' store: refuse, never serve unmetered
        log.warning("API request refused: Redis %s", e.__class__.__name__)
        raise ApiError(
            503,
            "the service cannot check rate limits right now; retry shortly",
            "server_error",
            code="rate_limits_unavailable",
            headers={"Retry-After": "2"},
        ) from None
    if wait:
        raise ApiError(
            429,
            f"Rate limit of {key.rate_limit_per_min} requests per minute reached for this key",
            "requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(int(wait + 0.999))},
        )
    # Every key of a user shares the owner's budget too: more keys do not buy more requests (issue 33).
    if user_wait:
        raise ApiError(
            429,
            f"Rate limit of {keys.user_limit_per_min()} requests per minute reached for your account "
            "(all your API keys share it)",
            "requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(int(user_wait + 0.999))},
        )
    return key


def api_view(
    method: str,
) -> Callable[[ApiView], Callable[[HttpRequest], Coroutine[Any, Any, HttpResponseBase]]]:
    """Bearer-key authentication, the method check, and OpenAI-shaped errors for one /v1/ endpoint."""

    def deco(view: ApiView) -> ApiView:
        @csrf_exempt
        @wraps(view)
        async def wrapper(request: HttpRequest, **kwargs: Any) -> HttpResponseBase:
            try:
                if request.method != method:
                    raise ApiError(405, f"use {method} on {request.path}", code="method_not_allowed")
                key = await database_sync_to_async(_auth)(request.headers.get("Authorization", ""))
                return await view(request, key, **kwargs)
            except ApiError as e:
                return error_response(e)
            except RequestDataTooBig:
                return error_response(
                    ApiError(413, "the request body is too large", code="request_too_large")
                )
            except Exception:  # noqa: BLE001 - the client gets OpenAI's shape, the log gets the trace
                log.exception("API request failed")
                return error_response(ApiError(500, "internal server error", "server_error", code="internal"))

        return wrapper

    return deco


def _model_row(a: Any) -> dict[str, Any]:
    routing = a.routing
    return {
        "id": a.name,
        "object": "model",
        "created": int(a.created_at.timestamp()),
        "owned_by": "swarm",
        "x_swarm": {
            "sha256": a.sha256,
            "n_layers": a.n_layers,
            "context_length": session.capacity_of(a.manifest),
            "architecture": a.architecture,
            # "layers": layer windows routed across nodes; "whole": every layer on one llamacpp node
            "routing": routing.mode,
            "routing_reason": routing.reason,
        },
    }


@api_view("GET")
async def models(request: HttpRequest, key: ApiKey) -> HttpResponseBase:
    rows = await database_sync_to_async(engine.ready_models)()
    seen: set[str] = set()
    data = []
    for a in rows:  # newest first: a name used twice resolves to the newest, so list that one
        if a.name not in seen:
            seen.add(a.name)
            data.append(_model_row(a))
    return JsonResponse({"object": "list", "data": data})


@api_view("GET")
async def model(request: HttpRequest, key: ApiKey, model: str) -> HttpResponseBase:
    return JsonResponse(_model_row(await database_sync_to_async(engine.find_model)(model)))


@csrf_exempt
def unknown(request: HttpRequest, rest: str) -> HttpResponse:
    """Any other /v1/ path: OpenAI's 404 shape rather than an HTML page."""
    return error_response(ApiError(404, f"Invalid URL ({request.method} {request.path})", code="unknown_url"))


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Shaper:
    """Chat and completion objects differ only in their envelope and how text and logprobs sit in it."""

    def __init__(self, gen: Generation) -> None:
        self.gen, self.chat = gen, gen.req.kind == "chat"
        self.offset = 0

    def head(self, stream: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
            prefix = "chatcmpl-"
        else:
            obj, prefix = "text_completion", "cmpl-"
        return {
            "id": prefix + self.gen.id,
            "object": obj,
            "created": self.gen.created,
            "model": self.gen.target.name,
            "system_fingerprint": None,
        }

    def logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not self.gen.req.logprobs:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        top = self.gen.req.top_logprobs
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]
            if top
            else None,
            "text_offset": offsets,
        }

    def chunk(self, piece: Piece | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        lp = self.logprobs(piece.logprobs) if piece is not None else None
        text = piece.text if piece is not None else ""
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text} if first else ({"content": text} if piece else {})
            )
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        out = {**self.head(True), "choices": [choice]}
        if self.gen.req.include_usage:
            out["usage"] = None
        return out

    def whole(self, pieces: list[Piece]) -> dict[str, Any]:
        o = self.gen.outcome
        assert o is not None
        text = "".join(p.text for p in pieces)
        lp = self.logprobs([e for p in pieces for e in p.logprobs])
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": lp,
                "finish_reason": o.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": o.finish_reason}
        return {**self.head(False), "choices": [choice], "usage": o.usage(), "x_swarm": o.x_swarm}


async def _stream(gen: Generation) -> AsyncIterator[bytes]:
    shape = Shaper(gen)
    if shape.chat:
        yield _sse(shape.chunk(None, None, first=True))
    pieces = gen.pieces()
    try:
        async for piece in pieces:
            yield _sse(shape.chunk(piece, None))
    except ApiError as e:
        yield _sse(e.body())  # mid-stream: the status line is gone, the error travels as an event
        return
    finally:
        # Closed while suspended at a yield (the client left between tokens): free the route now.
        await pieces.aclose()
    o = gen.outcome
    assert o is not None
    await gen.finish()
    last = shape.chunk(None, o.finish_reason)
    if gen.req.include_usage:
        yield _sse(last)
        yield _sse({**shape.head(True), "choices": [], "usage": o.usage(), "x_swarm": o.x_swarm})
    else:
        yield _sse({**last, "x_swarm": o.x_swarm})
    yield b"data: [DONE]\n\n"


async def _generate(request: HttpRequest, key: ApiKey, req: GenRequest) -> HttpResponseBase:
    target = await database_sync_to_async(engine.resolve_model)(req.model)
    gen = Generation(req, key, target)
    await gen.prepare()
    if req.stream:
        r = StreamingHttpResponse(_stream(gen), content_type="text/event-stream")
        r["Cache-Control"] = "no-cache"
        r["X-Accel-Buffering"] = "no"  # a buffering proxy would hold the tokens back
        return r
    pieces = [p async for p in gen.pieces()]
    await gen.finish()
    return JsonResponse(Shaper(gen).whole(pieces))


def max_body_containers() -> int:
    """Objects and arrays a request body may hold: a message, its content parts and the parameters'
    own, for the most messages a chat takes."""
    return 8 * int(settings.MAX_CHAT_MESSAGES) + 1024


def _parse_chat(raw: bytes) -> GenRequest:
    body = parse_body(raw, settings.MAX_REQUEST_BYTES, max_body_containers())
    return parse_chat(body, settings.MAX_CHAT_MESSAGES)


def _parse_completion(raw: bytes) -> GenRequest:
    return parse_completion(parse_body(raw, settings.MAX_REQUEST_BYTES, max_body_containers()))


async def _parse(parse: Callable[[bytes], GenRequest], raw: bytes) -> GenRequest:
    """Small bodies are parsed here; large ones (up to MAX_REQUEST_BYTES, a second of JSON and checks)
    on the prompt pool, off the event loop (issue 33)."""
    if len(raw) <= PARSE_INLINE_BYTES:
        return parse(raw)
    try:
        return await prompt.pool().run(parse, raw)
    except prompt.PromptBusy as e:
        raise ApiError(503, str(e), "server_error", code=e.code, headers={"Retry-After": "2"}) from None


@api_view("POST")
async def chat_completions(request: HttpRequest, key: ApiKey) -> HttpResponseBase:
    return await _generate(request, key, await _parse(_parse_chat, request.body))


@api_view("POST")
async def completions(request: HttpRequest, key: ApiKey) -> HttpResponseBase:
    return await _generate(request, key, await _parse(_parse_completion, request.body))


# -- web UI: API keys ---------------------------------------------------------------------------------
def _keys_page(request: HttpRequest, new_key: dict[str, str] | None = None) -> HttpResponse:
    user_keys = list(ApiKey.objects.filter(user_id=request.user.pk or 0))
    today = keys.usage_today(user_keys)
    rows = [(k, today.get(k.pk)) for k in user_keys]
    return render(
        request,
        "api/keys.html",
        {
            "rows": rows,
            "by_day": keys.usage_by_day(request.user),
            "new_key": new_key,
            "max_rate": keys.MAX_RATE_PER_MIN,
            "user_rate": keys.user_limit_per_min(),
            "user_streams": settings.USER_MAX_STREAMS,
            "keys_per_user": settings.API_KEYS_PER_USER,
            "base_url": settings.SITE_URL + "/v1",
        },
    )


@require_GET
@login_required_403
def key_list(request: HttpRequest) -> HttpResponse:
    return _keys_page(request)


@require_POST
@login_required_403
def key_create(request: HttpRequest) -> HttpResponse:
    name = request.POST.get("name", "").strip()
    raw_rate = request.POST.get("rate_limit_per_min", "").strip()
    try:
        rate = int(raw_rate) if raw_rate else keys.MAX_RATE_PER_MIN
        if not 1 <= rate <= keys.MAX_RATE_PER_MIN:
            raise ValueError
    except ValueError:
        flash.error(request, f"the rate limit must be a whole number from 1 to {keys.MAX_RATE_PER_MIN}")
        return redirect("api:keys")
    if not name:
        flash.error(request, "give the key a name")
        return redirect("api:keys")
    try:
        keys.check_new_key(request.user)
    except keys.KeyLimit as e:
        flash.error(request, str(e))
        return redirect("api:keys")
    plain, key = keys.create_key(request.user, name, rate)
    # Shown once, in this response only: neither the database nor the session ever holds it.
    r = _keys_page(request, {"name": key.name, "key": plain})
    r["Cache-Control"] = "no-store"
    return r


@require_POST
@login_required_403
def key_revoke(request: HttpRequest, key_id: int) -> HttpResponse:
    if keys.revoke_key(request.user, key_id):
        flash.success(request, "key revoked")
    else:
        flash.error(request, "no such active key")
    return redirect("api:keys")
