"""Django admin registrations for telemetry."""

from __future__ import annotations

from django.contrib import admin

from webapp.telemetry.models import GenerationRecord, NodeTelemetrySample


@admin.register(GenerationRecord)
class GenerationRecordAdmin(admin.ModelAdmin):
    """Answers."""

    list_display = ("created_at", "user", "artifact", "ttft_ms", "tok_s", "n_prompt", "n_generated")


@admin.register(NodeTelemetrySample)
class NodeTelemetrySampleAdmin(admin.ModelAdmin):
    """Node samples."""

    list_display = (
        "node",
        "ts",
        "sessions",
        "kv_bytes",
        "tok_s",
        "cpu_percent",
        "batch_steps",
        "queue_wait_ms",
    )
