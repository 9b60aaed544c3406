"""Telemetry tasks: drop node samples older than TELEMETRY_KEEP_HOURS."""

from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from webapp.telemetry.models import NodeTelemetrySample


@shared_task
def prune_samples() -> int:
    cutoff = timezone.now() - timedelta(hours=settings.TELEMETRY_KEEP_HOURS)
    return NodeTelemetrySample.objects.filter(ts__lt=cutoff).delete()[0]
