"""App config of the OpenAI-compatible API."""

from __future__ import annotations

from django.apps import AppConfig


class ApiConfig(AppConfig):
    """The /v1/ API and API keys."""

    name = "webapp.api"
    label = "api"
    verbose_name = "OpenAI-compatible API"
