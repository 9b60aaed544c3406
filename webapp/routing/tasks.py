"""Routing tasks: close route sessions idle for longer than ROUTE_SESSION_IDLE_S."""

from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from webapp.routing.models import RouteSession


@shared_task
def gc_sessions() -> int:
    """Mark idle open sessions closed (the hops expire their KV on their own TTL)."""
    cutoff = timezone.now() - timedelta(seconds=settings.ROUTE_SESSION_IDLE_S)
    return RouteSession.objects.filter(state=RouteSession.State.OPEN, last_used__lt=cutoff).update(
        state=RouteSession.State.CLOSED
    )
