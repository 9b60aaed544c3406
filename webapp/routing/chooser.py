"""Route choice: a pure function picking the chain of ready shards with the lowest estimated cost.

Shards are edges of a DAG over layer boundaries 0..n_layers; a route is a path from 0 to n_layers.
The cost of a hop is a fixed network overhead, plus its layers' compute time at the node's measured
speed, plus a penalty per session the node already serves (load). Dynamic programming over the
boundaries finds the cheapest path exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.wire.ids import NodeId

HOP_OVERHEAD_MS = 1.0  # one loopback/LAN round trip plus framing
LAYER_MS_AT_UNIT_SPEED = 10.0  # compute per layer per token at speed 1.0 (GFLOP/s scale; relative only)
LOAD_PENALTY_MS = 0.5  # per session already open on the node


class NoRoute(Exception):
    """No chain of ready shards covers every layer; the message names the first gap."""


@dataclass(frozen=True)
class ShardCandidate:
    """A ready shard a route may use."""

    node_id: NodeId
    url: str
    layer_start: int
    layer_end: int
    speed: float = 1.0
    sessions: int = 0


def hop_cost_ms(s: ShardCandidate) -> float:
    compute = (s.layer_end - s.layer_start) * LAYER_MS_AT_UNIT_SPEED / max(s.speed, 1e-6)
    return HOP_OVERHEAD_MS + compute + LOAD_PENALTY_MS * s.sessions


def choose_route(shards: Sequence[ShardCandidate], n_layers: int) -> list[ShardCandidate]:
    """Cheapest ordered chain covering [0, n_layers); ties go to fewer hops, then node id order."""
    if n_layers <= 0:
        raise NoRoute("the model has no layers")
    inf = (float("inf"), 0, "")
    best: list[tuple[float, int, str]] = [inf] * (n_layers + 1)
    prev: list[ShardCandidate | None] = [None] * (n_layers + 1)
    best[0] = (0.0, 0, "")
    by_start: dict[int, list[ShardCandidate]] = {}
    for s in shards:
        if 0 <= s.layer_start < s.layer_end <= n_layers:
            by_start.setdefault(s.layer_start, []).append(s)
    for pos in range(n_layers):
        if best[pos] == inf:
            continue
        cost, hops, key = best[pos]
        for s in sorted(by_start.get(pos, []), key=lambda s: s.node_id):
            cand = (cost + hop_cost_ms(s), hops + 1, key + s.node_id)
            if cand < best[s.layer_end]:
                best[s.layer_end] = cand
                prev[s.layer_end] = s
    if best[n_layers] == inf:
        reach = max(i for i in range(n_layers + 1) if best[i] != inf)
        raise NoRoute(f"no ready shard starts at layer {reach} (model has {n_layers} layers)")
    route: list[ShardCandidate] = []
    pos = n_layers
    while pos > 0:
        hop = prev[pos]
        assert hop is not None
        route.append(hop)
        pos = hop.layer_start
    return route[::-1]


def route_cost_ms(route: Sequence[ShardCandidate]) -> float:
    return sum(hop_cost_ms(s) for s in route)
