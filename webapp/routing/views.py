"""Routing views: open route sessions and the latest answers (a live panel of the fleet page)."""

from __future__ import annotations

from django.http import HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from webapp.core.auth import HtmxHttpRequest, staff_required
from webapp.routing.models import RouteSession
from webapp.telemetry.models import GenerationRecord


@require_GET
@staff_required
def generations(request: HtmxHttpRequest) -> HttpResponse:
    """Open route sessions and the latest answers with their latency (refreshed live on the fleet page)."""
    rows = GenerationRecord.objects.select_related("user", "artifact")[:20]
    sessions = RouteSession.objects.select_related("user", "artifact").filter(state=RouteSession.State.OPEN)[
        :20
    ]
    return render(request, "fleet/htmx/generations.html", {"generations": rows, "sessions": sessions})
