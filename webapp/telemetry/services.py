"""Telemetry storage: downsampled node samples and generation records."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings

from webapp.core.channels import notify_fleet
from webapp.telemetry.models import GenerationRecord, NodeTelemetrySample

if TYPE_CHECKING:
    from agent.wire.control import Telemetry


def should_sample(last: datetime | None, now: datetime, every_s: int) -> bool:
    """Keep one sample per `every_s` seconds per node."""
    return last is None or (now - last) >= timedelta(seconds=every_s)


def maybe_store_sample(node_id: str, t: Telemetry, now: datetime) -> bool:
    last = (
        NodeTelemetrySample.objects.filter(node_id=node_id)
        .order_by("-ts")
        .values_list("ts", flat=True)
        .first()
    )
    if not should_sample(last, now, settings.TELEMETRY_SAMPLE_EVERY_S):
        return False
    tok_s = float(t.raw.get("tok_s", 0.0) or 0.0) if isinstance(t.raw.get("tok_s", 0.0), int | float) else 0.0
    NodeTelemetrySample.objects.create(
        node_id=node_id,
        ts=now,
        sessions=t.sessions,
        kv_bytes=t.kv_bytes,
        kv_budget_bytes=t.kv_budget_bytes,
        tokens_served=t.tokens_served,
        tok_s=tok_s,
        cpu_percent=t.cpu_percent,
        mem_used_bytes=t.mem_used_bytes,
    )
    return True


def record_generation(
    session_id: Any, artifact_id: int, user: Any, telemetry: dict[str, Any], error: str = ""
) -> GenerationRecord:
    def num(key: str, hi: float = 1e12) -> float:
        """A figure from the telemetry, finite and within the columns' range (never a 500 on insert)."""
        v = telemetry.get(key, 0)
        if not isinstance(v, int | float) or isinstance(v, bool) or v != v:
            return 0.0
        return min(max(float(v), 0.0), hi)

    hops = telemetry.get("hops", [])
    record = GenerationRecord.objects.create(
        session_id=session_id,
        artifact_id=artifact_id,
        user=user if getattr(user, "is_authenticated", False) else None,
        ttft_ms=num("ttft_ms"),
        tok_s=num("tok_s"),
        n_prompt=int(num("n_prompt", 2**31 - 1)),
        n_generated=int(num("n_generated", 2**31 - 1)),
        wire_bytes=int(num("wire_bytes", 2**62)),
        hops=hops if isinstance(hops, list) else [],
        error=error[:2000],
    )
    notify_fleet(kind="generations")
    return record
