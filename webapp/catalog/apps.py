"""Django app config for webapp.catalog."""

from __future__ import annotations

from django.apps import AppConfig


class CatalogConfig(AppConfig):
    """Registers webapp.catalog."""

    name = "webapp.catalog"
    label = "catalog"
    default_auto_field = "django.db.models.BigAutoField"
