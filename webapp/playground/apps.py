"""Django app config for webapp.playground."""

from __future__ import annotations

from django.apps import AppConfig


class PlaygroundConfig(AppConfig):
    """Registers webapp.playground."""

    name = "webapp.playground"
    label = "playground"
    default_auto_field = "django.db.models.BigAutoField"
