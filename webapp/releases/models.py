"""Release models: a signed agent wheel, a rollout of it, and each node's place in that rollout."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.db import models

from webapp.releases import rollout


class Release(models.Model):
    """A wheel of the agent with its Ed25519 signature by the release key (agent.wire.release)."""

    version = models.CharField(max_length=40, unique=True)
    filename = models.CharField(max_length=160)
    sha256 = models.CharField(max_length=64)
    size = models.BigIntegerField()
    signature = models.CharField(max_length=120)
    notes = models.CharField(max_length=200, blank=True, default="")
    signed_on_server = models.BooleanField(default=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"release {self.version}"

    @property
    def path(self) -> Path:
        return Path(settings.RELEASE_DIR) / self.sha256 / self.filename


class Rollout(models.Model):
    """Sending one release to a set of nodes, one at a time (webapp.releases.rollout)."""

    class State(models.TextChoices):
        RUNNING = rollout.RUNNING
        PAUSED = rollout.PAUSED
        DONE = rollout.DONE
        FAILED = rollout.FAILED
        CANCELLED = rollout.CANCELLED

    release = models.ForeignKey(Release, on_delete=models.PROTECT, related_name="rollouts")
    state = models.CharField(max_length=16, choices=State.choices, default=State.RUNNING)
    rollback_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL)
    error = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"rollout {self.pk} of {self.release.version} ({self.state})"

    @property
    def active(self) -> bool:
        return self.state in rollout.ACTIVE


class RolloutNode(models.Model):
    """One node's progress through a rollout."""

    class State(models.TextChoices):
        PENDING = rollout.PENDING
        SENT = rollout.SENT
        UPDATED = rollout.UPDATED
        SKIPPED = rollout.SKIPPED
        REFUSED = rollout.REFUSED
        FAILED = rollout.NODE_FAILED
        ROLLED_BACK = rollout.ROLLED_BACK

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="nodes")
    node = models.ForeignKey("fleet.Node", on_delete=models.CASCADE, related_name="rollouts")
    position = models.IntegerField(default=0)
    from_version = models.CharField(max_length=40, blank=True, default="")
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    step = models.CharField(max_length=16, blank=True, default="", help_text="the agent's last reported step")
    error = models.TextField(blank=True, default="")
    sent_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["rollout_id", "position"]
        constraints = [models.UniqueConstraint(fields=["rollout", "node"], name="unique_rollout_node")]

    def __str__(self) -> str:
        return f"{self.node_id} in rollout {self.rollout_id} ({self.state})"
