"""Django admin registrations for the fleet (secrets and token hashes are read-only)."""

from __future__ import annotations

from django.contrib import admin

from webapp.fleet.models import EnrollmentToken, Node, NodeCredential, ShardAssignment


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """Nodes."""

    list_display = ("name", "id", "state", "last_seen", "dataplane_url", "version")
    list_filter = ("state",)


@admin.register(ShardAssignment)
class ShardAssignmentAdmin(admin.ModelAdmin):
    """Shards."""

    list_display = ("artifact", "node", "layer_start", "layer_end", "backend", "state", "progress")
    list_filter = ("state",)


@admin.register(EnrollmentToken)
class EnrollmentTokenAdmin(admin.ModelAdmin):
    """Enrollment tokens (hash only)."""

    list_display = ("pk", "note", "created_by", "created_at", "expires_at", "used_at", "node")
    readonly_fields = ("token_hash",)


@admin.register(NodeCredential)
class NodeCredentialAdmin(admin.ModelAdmin):
    """Node credentials (hash only)."""

    list_display = ("node", "created_at", "revoked_at")
    readonly_fields = ("secret_hash",)
