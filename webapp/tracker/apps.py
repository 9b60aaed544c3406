"""Django app config for webapp.tracker."""

from __future__ import annotations

from django.apps import AppConfig


class TrackerConfig(AppConfig):
    """Registers webapp.tracker: artifact endpoints, the BitTorrent HTTP tracker and the BEP 19 web seed."""

    name = "webapp.tracker"
    label = "tracker"
    default_auto_field = "django.db.models.BigAutoField"
