"""Shaping fleet data for templates: placement bars (one per node across the layer axis) and the
per-node series the fleet page plots (throughput, batching per hop)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

Series = dict[str, list[list[float]]]  # node id -> [[unix time, figure, ...], ...], oldest first


@dataclass
class Segment:
    """One shard drawn on a node's bar, in percent of the layer axis."""

    layer_start: int
    layer_end: int
    left_pct: float
    width_pct: float
    state: str
    progress_pct: int


@dataclass
class NodeBar:
    """A node's row in a model's placement view."""

    node_id: str
    node_name: str
    node_state: str
    segments: list[Segment] = field(default_factory=list)


@dataclass
class ModelPlacement:
    """A model with one bar per node holding any of its layers."""

    artifact: Any
    n_layers: int
    bars: list[NodeBar]


def placement_bars(artifacts: list[Any], shards: list[Any]) -> list[ModelPlacement]:
    out = []
    for a in artifacts:
        n = max(a.n_layers, 1)
        bars: dict[str, NodeBar] = {}
        for s in shards:
            if s.artifact_id != a.pk:
                continue
            bar = bars.setdefault(s.node_id, NodeBar(s.node_id, s.node.name, s.node.state))
            bar.segments.append(
                Segment(
                    s.layer_start,
                    s.layer_end,
                    100.0 * s.layer_start / n,
                    100.0 * (s.layer_end - s.layer_start) / n,
                    s.state,
                    int(s.progress * 100),
                )
            )
        out.append(ModelPlacement(a, a.n_layers, sorted(bars.values(), key=lambda b: b.node_name)))
    return out


def history_series(rows: Iterable[tuple[Any, ...]]) -> dict[str, Series]:
    """Samples (node id, ts, tok/s, batch steps, queue wait ms, batch compute ms) as the plots' series:
    `throughput` per node [t, tok/s] and `batching` per node [t, batch steps, wait ms, compute ms]."""
    throughput: Series = {}
    batching: Series = {}
    for node_id, ts, tok_s, steps, wait_ms, compute_ms in rows:
        t = ts.timestamp() if isinstance(ts, datetime) else float(ts)
        throughput.setdefault(node_id, []).append([t, tok_s])
        # three decimals: a thousandth of a step or millisecond is below what the plot can show
        batching.setdefault(node_id, []).append([t, round(steps, 3), round(wait_ms, 3), round(compute_ms, 3)])
    return {"throughput": throughput, "batching": batching}


def history_hours(raw: str | None, keep_hours: int) -> int | None:
    """The `hours` a history request asks for: 1 when absent, None unless a whole number from 1 to
    `keep_hours` (older samples are pruned, so asking for more could only mislead)."""
    if raw is None or raw == "":
        return 1
    # ASCII digits only: "²".isdigit() is true but int() refuses it
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 4):
        return None
    hours = int(raw)
    return hours if 1 <= hours <= keep_hours else None
