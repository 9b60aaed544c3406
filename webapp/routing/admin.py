"""Django admin registrations for routing."""

from __future__ import annotations

from django.contrib import admin

from webapp.routing.models import RouteSession


@admin.register(RouteSession)
class RouteSessionAdmin(admin.ModelAdmin):
    """Route sessions."""

    list_display = ("id", "artifact", "user", "state", "n_positions", "n_turns", "last_used")
    list_filter = ("state",)
