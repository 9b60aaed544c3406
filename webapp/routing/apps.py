"""Django app config for webapp.routing."""

from __future__ import annotations

from django.apps import AppConfig


class RoutingConfig(AppConfig):
    """Registers webapp.routing."""

    name = "webapp.routing"
    label = "routing"
    default_auto_field = "django.db.models.BigAutoField"
