"""Shaping fleet data for templates: placement bars (one per node across the layer axis)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
