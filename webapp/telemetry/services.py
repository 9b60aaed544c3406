"""Telemetry storage: downsampled node samples and generation records."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings

from webapp.telemetry.models import GenerationRecord, NodeTelemetrySample

if TYPE_CHECKING:
    from agent.wire.control import Telemetry


def should_sample(last: datetime | None, now: datetime, every_s: int) -> bool:
    """Keep one sample per `every_s` seconds per node."""
    return last is None or (now - last) >= timedelta(seconds=every_s)


# The wire already refuses negative, NaN and infinite figures (NonNegative) but sets no ceiling; one
# node reporting 1e300 would flatten every other series on the fleet page's plot. Beyond these a figure
# is a lie, so it is stored at the ceiling (the rest of the sample is still worth keeping).
MAX_BATCH_STEPS = 4096.0  # distinct sessions in one backend call; a data plane batches far fewer
MAX_BATCH_MS = 3_600_000.0  # an hour waiting for, or computing, one batch


def bounded(value: object, hi: float) -> float:
    """`value` as a finite float in [0, hi]; anything else (NaN, a string, a bool) is 0."""
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        return 0.0
    return min(max(float(value), 0.0), hi)


def maybe_store_sample(node_id: str, t: Telemetry, now: datetime) -> bool:
    """Store `t` as the node's sample unless it already has one from the last TELEMETRY_SAMPLE_EVERY_S."""
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
        batch_steps=bounded(t.batch_steps, MAX_BATCH_STEPS),
        queue_wait_ms=bounded(t.queue_wait_ms, MAX_BATCH_MS),
        batch_compute_ms=bounded(t.batch_compute_ms, MAX_BATCH_MS),
    )
    return True


HISTORY_FIELDS = ("node_id", "ts", "tok_s", "batch_steps", "queue_wait_ms", "batch_compute_ms")


def samples_since(since: datetime) -> list[tuple[Any, ...]]:
    """Every node's samples from `since` on, oldest first, as tuples in HISTORY_FIELDS order."""
    rows = NodeTelemetrySample.objects.filter(ts__gte=since).order_by("node_id", "ts")
    return list(rows.values_list(*HISTORY_FIELDS))


def spec_rate(speculation: Any) -> float:
    """Tokens per round trip of an answer that speculated, 0.0 otherwise or when malformed."""
    if not isinstance(speculation, dict) or not speculation.get("verify_steps"):
        return 0.0
    v = speculation.get("tokens_per_round_trip")
    if not isinstance(v, int | float) or isinstance(v, bool) or v != v:
        return 0.0
    return min(max(float(v), 0.0), 16.0)  # a verification yields at most MAX_SAMPLE_ALL_TOKENS


def record_generation(
    session_id: Any, artifact_id: int, user: Any, telemetry: dict[str, Any], error: str = ""
) -> GenerationRecord:
    """Store one answer's figures, each bounded to its column's range. The callers ping the dashboards
    (notify_fleet_async) once back on the event loop, never from the database thread."""

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
        prefix_shared_tokens=int(num("prefix_shared_tokens", 2**31 - 1)),
        prefix_hit=telemetry.get("prefix_hit") is True,
        tokens_per_round_trip=spec_rate(telemetry.get("speculation")),
        hops=hops if isinstance(hops, list) else [],
        error=error[:2000],
    )
    return record
