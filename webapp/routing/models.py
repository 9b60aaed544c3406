"""Routing models: sticky route sessions (ordered hops that keep a conversation's KV cache)."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class RouteSession(models.Model):
    """A conversation's sticky route: model, user, ordered hops, state, positions and last use."""

    class State(models.TextChoices):
        OPEN = "open"
        CLOSED = "closed"
        BROKEN = "broken"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    artifact = models.ForeignKey("catalog.ModelArtifact", on_delete=models.CASCADE, related_name="sessions")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    hops = models.JSONField(default=list, help_text="[{node, url, layer_start, layer_end}] in route order")
    state = models.CharField(max_length=16, choices=State.choices, default=State.OPEN)
    n_positions = models.IntegerField(default=0, help_text="tokens held in the KV cache of every hop")
    n_turns = models.IntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-last_used"]

    def __str__(self) -> str:
        return f"route session {self.id} ({self.state}, {len(self.hops)} hops)"
