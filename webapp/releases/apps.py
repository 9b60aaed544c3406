"""Django app config for webapp.releases."""

from __future__ import annotations

from django.apps import AppConfig


class ReleasesConfig(AppConfig):
    """Registers webapp.releases and connects it to the fleet's agent events."""

    name = "webapp.releases"
    label = "releases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from webapp.releases import receivers  # noqa: F401 - connects the signal receivers
