"""Django admin registrations for the catalog."""

from __future__ import annotations

from django.contrib import admin

from webapp.catalog.models import ModelArtifact


@admin.register(ModelArtifact)
class ModelArtifactAdmin(admin.ModelAdmin):
    """Artifacts, without the (large) manifest in the list."""

    list_display = ("name", "state", "architecture", "n_layers", "size_bytes", "sha256", "created_at")
    list_filter = ("state", "source")
    readonly_fields = ("sha256", "manifest")
