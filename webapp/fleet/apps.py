"""Django app config for webapp.fleet."""

from __future__ import annotations

from django.apps import AppConfig


class FleetConfig(AppConfig):
    """Registers webapp.fleet."""

    name = "webapp.fleet"
    label = "fleet"
    default_auto_field = "django.db.models.BigAutoField"
