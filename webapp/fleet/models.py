"""Fleet models: nodes, their enrollment tokens and credentials, and the shards placed on them."""

from __future__ import annotations

import hashlib
import secrets

from django.conf import settings
from django.db import models

from agent import defaults


def new_node_id() -> str:
    return "node-" + secrets.token_hex(6)


def hash_secret(secret: str) -> str:
    """Secrets are 256-bit random strings, so one sha256 is enough (no password stretching needed)."""
    return hashlib.sha256(secret.encode()).hexdigest()


class Node(models.Model):
    """A machine running the agent: its state, last heartbeat, hardware and live telemetry."""

    class State(models.TextChoices):
        PENDING = "pending", "enrolled, never connected"
        ONLINE = "online"
        OFFLINE = "offline"
        DRAINING = "draining"
        REMOVED = "removed"

    id = models.CharField(primary_key=True, max_length=40, default=new_node_id, editable=False)
    name = models.CharField(max_length=100)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    last_seen = models.DateTimeField(null=True, blank=True)
    connected_at = models.DateTimeField(null=True, blank=True)
    hardware = models.JSONField(default=dict, blank=True)
    backends = models.JSONField(default=list, blank=True)
    version = models.CharField(max_length=40, blank=True, default="")
    dataplane_url = models.CharField(max_length=300, blank=True, default="")
    free_memory_bytes = models.BigIntegerField(default=0)
    speed = models.FloatField(default=1.0, help_text="measured relative compute speed (GFLOP/s)")
    telemetry = models.JSONField(default=dict, blank=True)
    recent = models.JSONField(
        default=list,
        blank=True,
        help_text="the last heartbeats' batching and prefill points, for the fleet page's plots (bounded)",
    )
    passkey_generation = models.PositiveIntegerField(
        default=0, help_text="bumped to rotate the tracker passkey (every earlier one is refused)"
    )
    dataplane_problem = models.CharField(
        max_length=300,
        blank=True,
        default="",
        help_text="why the reported data-plane URL is not routed to (empty: it passed the checks)",
    )
    dataplane_rtt_ms = models.FloatField(null=True, blank=True, help_text="health probe round trip at hello")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"


class EnrollmentToken(models.Model):
    """A one-time, expiring token an admin hands to a new node; only its hash is stored."""

    token_hash = models.CharField(max_length=64, unique=True)
    note = models.CharField(max_length=100, blank=True, default="")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"enrollment token {self.pk} ({'used' if self.used_at else 'unused'})"


class NodeCredential(models.Model):
    """The secret a node authenticates with, stored hashed; revoked when the node is removed."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="credentials")
    secret_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"credential {self.pk} of {self.node_id}"


class ShardAssignment(models.Model):
    """Layers [layer_start, layer_end) of one artifact placed on one node, with load progress."""

    class State(models.TextChoices):
        ASSIGNED = "assigned"
        FETCHING = "fetching"
        LOADING = "loading"
        READY = "ready"
        FAILED = "failed"
        DRAINING = "draining"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="shards")
    artifact = models.ForeignKey("catalog.ModelArtifact", on_delete=models.CASCADE, related_name="shards")
    layer_start = models.IntegerField()
    layer_end = models.IntegerField()
    backend = models.CharField(max_length=20, default=defaults.DEFAULT_BACKEND)
    state = models.CharField(max_length=16, choices=State.choices, default=State.ASSIGNED)
    progress = models.FloatField(default=0.0)
    transfer = models.JSONField(
        default=dict, blank=True, help_text="latest download report: bytes done/needed, rate, peers, sources"
    )
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["artifact_id", "layer_start", "node_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["node", "artifact", "layer_start", "layer_end"], name="unique_shard"
            ),
            models.CheckConstraint(
                condition=models.Q(layer_start__lt=models.F("layer_end")), name="shard_range"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.artifact_id}[{self.layer_start}:{self.layer_end}) on {self.node_id} ({self.state})"
