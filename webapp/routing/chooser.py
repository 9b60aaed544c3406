"""Route choice: a pure function picking the chain of ready shards with the lowest estimated cost.

Shards are edges of a DAG over layer boundaries 0..n_layers; a route is a path from 0 to n_layers.
The cost of a hop is a fixed network overhead, plus its layers' compute time, plus a penalty per
session the node already serves (load). Dynamic programming over the boundaries finds the cheapest
path exactly.

Every figure here is the control plane's own (issue 17: a node that reported speed 1e300 and negative
sessions drew every route): `layer_ms` is the step time observed on routes through the node, `sessions`
the routes the control plane opened on it (webapp.routing.services). A node not yet observed is priced
at the median of those that were, so it is neither shunned nor preferred; and the inputs are clamped,
so no value can make a hop free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.wire.ids import NodeId

HOP_OVERHEAD_MS = 1.0  # one loopback/LAN round trip plus framing
LAYER_MS_AT_UNIT_SPEED = 10.0  # compute per layer per token at speed 1.0 (GFLOP/s scale; relative only)
LOAD_PENALTY_MS = 0.5  # per session already open on the node
MIN_SPEED, MAX_SPEED = 1e-3, 1e3  # a relative speed outside this band says nothing more
MIN_LAYER_MS = 1e-3  # no layer is free


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
    layer_ms: float | None = None  # observed ms per layer per step; None: not observed yet


def _finite(x: float, lo: float, hi: float) -> float:
    return lo if x != x else min(max(x, lo), hi)  # NaN -> lo


def hop_cost_ms(s: ShardCandidate, unobserved_layer_ms: float | None = None) -> float:
    """The hop's estimated cost: observed step time if any, else `unobserved_layer_ms`, else speed."""
    per_layer = s.layer_ms if s.layer_ms is not None else unobserved_layer_ms
    if per_layer is None:
        per_layer = LAYER_MS_AT_UNIT_SPEED / _finite(s.speed, MIN_SPEED, MAX_SPEED)
    compute = (s.layer_end - s.layer_start) * _finite(per_layer, MIN_LAYER_MS, 1e9)
    return HOP_OVERHEAD_MS + compute + LOAD_PENALTY_MS * max(0, s.sessions)


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def choose_route(shards: Sequence[ShardCandidate], n_layers: int) -> list[ShardCandidate]:
    """Cheapest ordered chain covering [0, n_layers); ties go to fewer hops, then node id order."""
    if n_layers <= 0:
        raise NoRoute("the model has no layers")
    inf = (float("inf"), 0, "")
    best: list[tuple[float, int, str]] = [inf] * (n_layers + 1)
    prev: list[ShardCandidate | None] = [None] * (n_layers + 1)
    best[0] = (0.0, 0, "")
    unobserved = _median([s.layer_ms for s in shards if s.layer_ms is not None])
    by_start: dict[int, list[ShardCandidate]] = {}
    for s in shards:
        if 0 <= s.layer_start < s.layer_end <= n_layers:
            by_start.setdefault(s.layer_start, []).append(s)
    for pos in range(n_layers):
        if best[pos] == inf:
            continue
        cost, hops, key = best[pos]
        for s in sorted(by_start.get(pos, []), key=lambda s: s.node_id):
            cand = (cost + hop_cost_ms(s, unobserved), hops + 1, key + s.node_id)
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
