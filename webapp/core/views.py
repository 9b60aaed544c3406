"""Landing and health views."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_GET

from agent.eventloop import running_loop_name


@require_GET
def home(request: HttpRequest) -> HttpResponse:
    if not request.user.is_authenticated:
        return redirect("login")
    return redirect("fleet:index" if request.user.is_staff else "playground:index")


@require_GET
async def healthz(request: HttpRequest) -> JsonResponse:
    """Readiness probe for scripts and tests; names the event loop the server answers on (uvloop where
    installed, as the agents': webapp.serve)."""
    return JsonResponse({"ok": True, "loop": running_loop_name()})
