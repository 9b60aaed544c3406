"""Django app config for webapp.telemetry."""

from __future__ import annotations

from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    """Registers webapp.telemetry."""

    name = "webapp.telemetry"
    label = "telemetry"
    default_auto_field = "django.db.models.BigAutoField"
