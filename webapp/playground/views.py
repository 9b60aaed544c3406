"""Playground views: the chat page (any logged-in user)."""

from __future__ import annotations

from django.http import HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from webapp.catalog.models import ModelArtifact
from webapp.core.auth import HtmxHttpRequest, login_required_403


@require_GET
@login_required_403
def index(request: HtmxHttpRequest) -> HttpResponse:
    models = ModelArtifact.objects.filter(state=ModelArtifact.State.READY, shards__state="ready").distinct()
    return render(request, "playground/index.html", {"models": models})
