"""Telemetry models: what each answer cost, and downsampled node samples for the dashboard plots."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class GenerationRecord(models.Model):
    """The telemetry of one answer: TTFT, tokens/s, token counts, route and per-hop timings."""

    session = models.ForeignKey(
        "routing.RouteSession", null=True, on_delete=models.SET_NULL, related_name="records"
    )
    artifact = models.ForeignKey("catalog.ModelArtifact", null=True, on_delete=models.SET_NULL)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    ttft_ms = models.FloatField(default=0.0)
    tok_s = models.FloatField(default=0.0)
    n_prompt = models.IntegerField(default=0)
    n_generated = models.IntegerField(default=0)
    wire_bytes = models.BigIntegerField(default=0)
    # the shared prefix (a system prompt) the answer asked its hops for, and whether they restored it
    prefix_shared_tokens = models.IntegerField(default=0)
    prefix_hit = models.BooleanField(default=False)
    # speculative decoding: tokens the answer got per round trip of its route (0: it did not speculate)
    tokens_per_round_trip = models.FloatField(default=0.0)
    hops = models.JSONField(default=list, help_text="[{url, layers, compute_ms, network_ms}]")
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"generation {self.pk}: {self.n_generated} tokens at {self.tok_s:.1f} tok/s"


class NodeTelemetrySample(models.Model):
    """A node's telemetry at one instant, kept at most once per TELEMETRY_SAMPLE_EVERY_S per node."""

    node = models.ForeignKey("fleet.Node", on_delete=models.CASCADE, related_name="samples")
    ts = models.DateTimeField(db_index=True)
    sessions = models.IntegerField(default=0)
    kv_bytes = models.BigIntegerField(default=0)
    kv_budget_bytes = models.BigIntegerField(default=0)
    tokens_served = models.BigIntegerField(default=0)
    tok_s = models.FloatField(default=0.0)
    cpu_percent = models.FloatField(default=0.0)
    mem_used_bytes = models.BigIntegerField(default=0)
    # per-hop batching over the agent's last minute (agent/wire/control.py Telemetry): steps of distinct
    # sessions per backend call, the wait for a batch and the compute per call; 0 when idle
    batch_steps = models.FloatField(default=0.0)
    queue_wait_ms = models.FloatField(default=0.0)
    batch_compute_ms = models.FloatField(default=0.0)

    class Meta:
        ordering = ["node_id", "ts"]
        indexes = [models.Index(fields=["node", "ts"])]

    def __str__(self) -> str:
        return f"{self.node_id} @ {self.ts:%H:%M:%S}"
