"""Catalog models: GGUF artifacts registered with the control plane."""

from __future__ import annotations

from functools import cached_property

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q

from agent.artifacts.manifest import Manifest
from agent.artifacts.routing import Routing, routing_mode

DEFAULT_REPLICAS = 2
MAX_REPLICAS = 64


class ModelArtifact(models.Model):
    """A registered GGUF file, addressed by its sha256, with the manifest built from it."""

    class Source(models.TextChoices):
        PATH = "path", "path on the server"
        UPLOAD = "upload", "upload"
        PACKAGE = "package", "PyPI-shipped model"

    class State(models.TextChoices):
        PENDING = "pending"
        BUILDING = "building"
        READY = "ready"
        FAILED = "failed"

    name = models.CharField(max_length=200)
    source = models.CharField(max_length=16, choices=Source.choices)
    path = models.CharField(max_length=1024, help_text="absolute path of the GGUF on the control plane host")
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    error = models.TextField(blank=True, default="")
    sha256 = models.CharField(max_length=64, blank=True, default="")
    size_bytes = models.BigIntegerField(default=0)
    n_layers = models.IntegerField(default=0)
    architecture = models.CharField(max_length=64, blank=True, default="")
    manifest = models.JSONField(null=True, blank=True)
    torrent = models.BinaryField(
        null=True, blank=True, editable=False, help_text="bencoded v1 .torrent (empty without libtorrent)"
    )
    infohash = models.CharField(max_length=40, blank=True, default="", db_index=True, help_text="v1, hex")
    # Copies of each layer range placement keeps (as many as the fleet's memory allows, at least one);
    # two, so a hop that dies has a spare holding exactly its layers (docs/failover.md).
    desired_replicas = models.PositiveSmallIntegerField(
        default=DEFAULT_REPLICAS,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_REPLICAS)],
        help_text="copies of each layer range placement keeps when the fleet's memory allows",
    )
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["sha256"], condition=~Q(sha256=""), name="unique_artifact_sha256"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.sha256[:12] or self.state})"

    @property
    def routing(self) -> Routing:
        """Layer windows across nodes or whole on one llamacpp node, and why: derived on every read from
        the architecture and the executor's verdict on the file (kept in the manifest), so a model
        registered as whole-only routes across nodes once the executor learns its architecture."""
        problem = (self.manifest or {}).get("executor_problem", "")
        return routing_mode(self.architecture, str(problem))

    @cached_property
    def parsed_manifest(self) -> Manifest:
        if self.manifest is None:
            raise ValueError(f"artifact {self.pk} has no manifest yet (state {self.state})")
        return Manifest.from_dict(self.manifest)
