"""Playground views: the chat page, and a user's saved conversations as JSON (list, read, rename, delete)."""

from __future__ import annotations

from django.http import HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET, require_POST

from webapp.catalog.models import ModelArtifact
from webapp.core.auth import HtmxHttpRequest, login_required_403
from webapp.playground import store
from webapp.playground.chat import DEFAULT_MAX_TOKENS, ChatRequestError, parse_title
from webapp.playground.live import parking
from webapp.playground.models import Conversation
from webapp.routing.session import capacity_of


def _models() -> list[dict[str, object]]:
    """Ready models, placed ones first; the page says which cannot answer yet."""
    ready = ModelArtifact.objects.filter(state=ModelArtifact.State.READY)
    placed = set(ready.filter(shards__state="ready").values_list("pk", flat=True))
    rows = [
        {
            "id": m.pk,
            "name": m.name,
            "context": capacity_of(m.manifest),
            "placed": m.pk in placed,
            "routing": m.routing.mode,
            "routing_reason": m.routing.reason,
        }
        for m in ready
    ]
    return sorted(rows, key=lambda r: not r["placed"])


@require_GET
@login_required_403
def index(request: HtmxHttpRequest) -> HttpResponse:
    state = {
        "models": _models(),
        "conversations": store.list_conversations(request.user),
        "default_max_tokens": DEFAULT_MAX_TOKENS,
    }
    return render(request, "playground/index.html", {"state": state})


@require_GET
@login_required_403
def conversations(request: HtmxHttpRequest) -> HttpResponse:
    return JsonResponse({"conversations": store.list_conversations(request.user)})


@require_GET
@login_required_403
def conversation(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    try:
        conv = store.get_conversation(request.user, pk)
    except Conversation.DoesNotExist as e:
        return JsonResponse({"error": str(e)}, status=404)
    return JsonResponse(store.conversation_detail(conv))


@require_POST
@login_required_403
def rename(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    try:
        conv = store.get_conversation(request.user, pk)
        conv.title = parse_title(request.POST.get("title"))
    except Conversation.DoesNotExist as e:
        return JsonResponse({"error": str(e)}, status=404)
    except ChatRequestError as e:
        return JsonResponse({"error": str(e)}, status=400)
    conv.save(update_fields=["title", "updated_at"])
    return JsonResponse(store.summary(conv))


@require_POST
@login_required_403
def delete(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    if not store.delete_conversation(request.user, pk):
        return JsonResponse({"error": f"no conversation {pk} of yours"}, status=404)
    parking.discard(pk)  # its route, if parked, frees the hops' KV now
    return JsonResponse({"deleted": pk})
