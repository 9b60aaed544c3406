"""What the control plane itself knows about each node's load and speed, for the route chooser.

Nodes report `sessions` and `speed` about themselves; none of that is believed for routing (issue 17).
Load is the number of open route sessions the control plane assigned to the node; speed is the step
time observed by the route client (in this process, not on the node) on recent answers whose route
went through the node, spread over the route's layers. The node cannot make either look better: the
timings are wall-clock times measured here, and the per-route split by layers leaves nothing for a
node's own compute report to shift.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from datetime import timedelta
from statistics import median
from typing import Any

from django.conf import settings
from django.utils import timezone

from webapp.routing.models import RouteSession
from webapp.telemetry.models import GenerationRecord

OBSERVE_WINDOW = timedelta(hours=1)
MAX_RECORDS = 500  # the most recent answers looked at
MAX_OPEN_SESSIONS = 20_000


def _num(x: Any) -> float:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and x == x else 0.0


def assigned_sessions(node_ids: Iterable[str]) -> dict[str, int]:
    """Open, recently used route sessions per node, as the control plane opened them."""
    wanted = set(node_ids)
    cutoff = timezone.now() - timedelta(seconds=settings.ROUTE_SESSION_IDLE_S)
    counts: Counter[str] = Counter()
    routes = RouteSession.objects.filter(state=RouteSession.State.OPEN, last_used__gte=cutoff).values_list(
        "hops", flat=True
    )[:MAX_OPEN_SESSIONS]
    for hops in routes:
        nodes = {h.get("node") for h in hops if isinstance(h, dict)} if isinstance(hops, list) else set()
        counts.update(n for n in nodes if n in wanted)
    return {n: counts.get(n, 0) for n in wanted}


def route_layer_ms(hops: Any, n_generated: Any) -> float | None:
    """ms per layer per step of one answer: its hops' wall time as the route client timed it (each
    round trip on this side's clock), over layers and steps. The hops' own compute and handler reports
    are not used: a node answering "0 ms compute, all of the round trip was my handler" would
    otherwise look free. Answers recorded without `wall_ms` count as not observed."""
    if not isinstance(hops, list):
        return None
    total_ms = 0.0
    layers = 0
    for h in hops:
        if not isinstance(h, dict):
            continue
        if "wall_ms" not in h:
            return None
        total_ms += max(0.0, _num(h.get("wall_ms")))
        span = h.get("layers")
        if isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span):
            layers += max(0, span[1] - span[0])
    steps = max(1, int(_num(n_generated)))
    if total_ms <= 0.0 or layers <= 0:
        return None
    return total_ms / layers / steps


def observed_layer_ms(node_ids: Iterable[str]) -> dict[str, float]:
    """Median observed ms per layer per step of recent answers through each node (absent: none yet)."""
    wanted = set(node_ids)
    rows = (
        GenerationRecord.objects.filter(
            created_at__gte=timezone.now() - OBSERVE_WINDOW, error="", session__isnull=False
        )
        .order_by("-created_at")
        .values_list("hops", "n_generated", "session__hops")[:MAX_RECORDS]
    )
    samples: defaultdict[str, list[float]] = defaultdict(list)
    for hops, n_generated, route in rows:
        per = route_layer_ms(hops, n_generated)
        if per is None or not isinstance(route, list):
            continue
        for node in {h.get("node") for h in route if isinstance(h, dict)}:
            if node in wanted:
                samples[str(node)].append(per)
    return {n: float(median(v)) for n, v in samples.items()}
