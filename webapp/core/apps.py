"""Django app config for webapp.core."""

from __future__ import annotations

from django.apps import AppConfig


class CoreConfig(AppConfig):
    """Registers webapp.core."""

    name = "webapp.core"
    label = "core"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.contrib import admin

        from webapp.core import throttle  # noqa: F401  (connects the login-failure signal receivers)
        from webapp.core.login import ThrottledAdminAuthenticationForm

        admin.site.login_form = ThrottledAdminAuthenticationForm
