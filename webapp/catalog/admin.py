"""Django admin registrations for the catalog."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from webapp.catalog.models import ModelArtifact


@admin.register(ModelArtifact)
class ModelArtifactAdmin(admin.ModelAdmin):
    """Artifacts, without the (large) manifest in the list; the file path is never editable here.

    Whatever `path` names is served to nodes through /artifacts/<sha>/file, so it is set only by
    registration (models directory, package or upload: webapp.catalog.services), never typed in.
    """

    list_display = ("name", "state", "architecture", "n_layers", "size_bytes", "sha256", "created_at")
    list_filter = ("state", "source")
    readonly_fields = ("path", "source", "sha256", "manifest", "torrent", "infohash", "size_bytes")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # artifacts come from registration (the models page), which checks the file
