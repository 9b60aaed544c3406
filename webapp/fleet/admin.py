"""Django admin registrations for the fleet (secrets and token hashes are read-only)."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from webapp.fleet.models import EnrollmentToken, Node, NodeCredential, ShardAssignment
from webapp.fleet.passkeys import rotate_passkey


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """Nodes; what a node reports about itself is shown, never edited here."""

    list_display = ("name", "id", "state", "last_seen", "dataplane_url", "dataplane_problem", "version")
    list_filter = ("state",)
    readonly_fields = (
        "dataplane_url",
        "dataplane_problem",
        "dataplane_rtt_ms",
        "speed",
        "telemetry",
        "hardware",
        "passkey_generation",
    )
    actions = ("rotate_tracker_passkeys",)

    @admin.action(description="Rotate tracker passkeys (every earlier passkey URL is refused)")
    def rotate_tracker_passkeys(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        for node in queryset:
            rotate_passkey(node.id)
        self.message_user(request, f"rotated the tracker passkey of {queryset.count()} node(s)")


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
