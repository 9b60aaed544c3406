"""Django app config for webapp.core."""

from __future__ import annotations

from django.apps import AppConfig


class CoreConfig(AppConfig):
    """Registers webapp.core."""

    name = "webapp.core"
    label = "core"
    default_auto_field = "django.db.models.BigAutoField"
