"""Placement planner: pure functions from nodes + a model's shape to contiguous layer ranges.

No database, no I/O. The Celery task in `webapp.fleet.tasks` feeds it plain values and applies the
result. Rationale for the choices:

* A node's share of a chain is proportional to its speed (so hops finish their layers in about the same
  time), capped by its memory; the cap always leaves room for the nodes after it. Speed probes are
  noisy, so within a chain no node counts as more than MAX_SPEED_RATIO times slower than the fastest.
* That speed is one the control plane can vouch for (`trusted_speeds`, issue 17): a node's own report
  may lower its share, never raise it, since a node claiming speed 1e6 once got the largest share and
  layer 0, which sees every prompt.
* A chain is a set of nodes that together cover [0, n_layers). Replicas are disjoint chains; a model gets
  as many as the fleet can hold, up to the requested number, and never fewer than one (else the error
  says how much memory is missing). A replica chain with as many nodes as the first takes the first's
  ranges when they fit (its fastest node the largest): the route client replaces a failed hop only
  with a shard of exactly the same layers, so a replica with other boundaries is no spare for it.
* A lost node is replaced by planning only the layers no surviving shard covers, onto the memory still
  free, so routes keep their existing boundaries.
* Bytes per layer are the manifest's real ones (a MoE layer's experts included); the last shard also
  holds the output head and any multi-token-prediction block (the manifest's "last" role).
* A boundary never falls inside an unsplittable layer group (glm-dsa: a shared-indexer layer needs
  the top-k indices of its group's full-indexer layer, which the seam does not carry).
* Leading dense layers (GLM's first 3, a MoE model's dense prefix) stay with the first shard together
  with at least the first MoE layer: no boundary sits at or before `leading_dense`. They are a few
  per cent of the model's bytes, so a shard of only dense layers would cost a whole network hop for
  almost no memory relief, and the shard holding the embedding has room for them.
* A layer's bytes can include the per-session state it keeps (`shape_from_manifest(context_tokens=,
  sessions=)`): each state kind at that context (KV and compressed caches grow with it, recurrent and
  compressor states are fixed), times the sessions the shard is expected to hold at once.
* An architecture this agent cannot serve is refused before any planning, with the manifest's reason.
* A model whose architecture has no layer windows but that llama.cpp runs (agent.artifacts.routing,
  WHOLE) is placed whole: each copy is one shard of every layer on one node with the llamacpp backend
  (`PlannerNode.whole_model`), the fastest such nodes that hold it first; it is never split, since the
  llamacpp backend runs nothing but layers 0:n.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median, median_low
from typing import Any

from agent.artifacts.manifest import Manifest
from agent.artifacts.routing import WHOLE, WHOLE_MODEL_BACKEND
from agent.wire.ids import NodeId

MAX_SPEED_RATIO = 4.0


class PlacementError(Exception):
    """The fleet cannot hold the model (or the missing range); the message says by how much."""


@dataclass(frozen=True)
class PlannerNode:
    """A node as the planner sees it: memory it may fill and the speed the control plane trusts."""

    node_id: NodeId
    capacity_bytes: int
    speed: float = 1.0
    whole_model: bool = False  # has the llamacpp backend: may hold a model that runs only whole


@dataclass(frozen=True)
class ModelShape:
    """Bytes per layer plus the non-layer tensors the first / last / every shard must also hold."""

    layer_bytes: tuple[int, ...]
    tensor_bytes: dict[str, int] = field(default_factory=dict)
    first: frozenset[str] = frozenset()
    last: frozenset[str] = frozenset()
    always: frozenset[str] = frozenset()
    groups: tuple[tuple[int, int], ...] = ()  # [start, end) layer ranges a boundary may not split
    refusal: str = ""  # non-empty: the model cannot be served, and this says why
    leading_dense: int = 0  # dense layers before the first MoE layer: kept with the first shard
    whole: str = ""  # non-empty: the model runs only whole on one llamacpp node, and this says why

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    def cut_ok(self, layer: int) -> bool:
        """May a shard boundary sit right before `layer`?"""
        if 0 < layer <= min(self.leading_dense, self.n_layers - 1):
            return False
        return not any(s < layer < e for s, e in self.groups)

    def bytes_for(self, start: int, end: int) -> int:
        """Bytes a shard holding [start, end) loads (a tied embedding shared by both ends counts once)."""
        names = set(self.always)
        if start == 0:
            names |= self.first
        if end == self.n_layers:
            names |= self.last
        return sum(self.layer_bytes[start:end]) + sum(self.tensor_bytes.get(n, 0) for n in names)

    @property
    def total_bytes(self) -> int:
        return self.bytes_for(0, self.n_layers)


def shape_from_manifest(
    m: Manifest, context_tokens: int = 0, kv_bytes: float = 2.0, sessions: int = 1
) -> ModelShape:
    """The planner's view of a manifest; with `context_tokens`, each layer also counts the state
    `sessions` sessions of that many tokens keep there (KV of `kv_bytes` per element, recurrent and
    compressor state in f32)."""
    if sessions < 1:
        raise PlacementError(f"expected sessions must be at least 1, not {sessions}")
    roles = {k: frozenset(v) for k, v in m.roles.items()}
    routing = m.routing
    needed = roles.get("first", frozenset()) | roles.get("last", frozenset()) | roles.get("all", frozenset())
    return ModelShape(
        layer_bytes=tuple(
            layer.nbytes + (sessions * layer.state_bytes(context_tokens, kv_bytes) if context_tokens else 0)
            for layer in m.layers
        ),
        tensor_bytes={t.name: t.nbytes for t in m.tensors if t.name in needed},
        first=roles.get("first", frozenset()),
        last=roles.get("last", frozenset()),
        always=roles.get("all", frozenset()),
        groups=tuple(m.layer_groups),
        refusal="" if routing.servable else routing.reason,
        leading_dense=m.leading_dense_layers,
        whole=routing.reason if routing.mode == WHOLE else "",
    )


@dataclass(frozen=True)
class Placement:
    """One shard of a plan: layers [layer_start, layer_end) on `node_id`, in chain `chain`."""

    node_id: NodeId
    layer_start: int
    layer_end: int
    chain: int = 0


@dataclass(frozen=True)
class Plan:
    """The planner's answer: placements grouped into chains, and notes for the admin."""

    placements: tuple[Placement, ...]
    replicas: int
    notes: tuple[str, ...] = ()


def device_free_bytes(
    host_free_bytes: int,
    hardware: Mapping[str, Any],
    telemetry: Mapping[str, Any],
    backends: Sequence[str] = (),
) -> int:
    """Memory a node's shards may fill: when they run on `native` (in `backends`) and that runs on a
    GPU (`hardware.compute_gpu` from hello), that GPU's free memory from the latest heartbeat (else its
    size from hello); otherwise the host's free memory. Weights and KV live on that device, so host RAM
    says nothing about what fits there (and a GPU's free memory says nothing about host RAM)."""
    index = hardware.get("compute_gpu")
    if "native" not in backends or not isinstance(index, int) or isinstance(index, bool):
        return host_free_bytes
    for source, key in ((telemetry, "memory_free_bytes"), (hardware, "memory_bytes")):
        for gpu in source.get("gpus") or []:
            if isinstance(gpu, Mapping) and gpu.get("index", -1) == index:
                free = gpu.get(key)
                if isinstance(free, int) and not isinstance(free, bool) and free >= 0:
                    return free
    return host_free_bytes  # the GPU is not reported (NVML missing): the host's figure is all we know


def trusted_speeds(claimed: Mapping[str, float], layer_ms: Mapping[str, float]) -> dict[str, float]:
    """The speed placement may use for each node of `claimed` (its self-reported speed), given
    `layer_ms`, the ms per layer per step the control plane observed on routes through it (none yet:
    absent). Only ratios matter to the planner, so the scale is free.

    A node that has served is measured: 1 / its observed layer time. One that has not gets the neutral
    figure (the median measured speed, 1.0 when no node is measured), lowered, never raised, by its own
    claim against the fleet's lower-median claim: an honest slow node gets a smaller share before it has
    served, while a node claiming 1e6 gets exactly what an unmeasured node claiming the median does.
    Shifting that reference up takes half the fleet lying together."""
    measured = {
        n: 1.0 / ms
        for n, ms in layer_ms.items()
        if n in claimed and isinstance(ms, int | float) and math.isfinite(ms) and ms > 0
    }
    neutral = median(measured.values()) if measured else 1.0
    claims = [c for c in claimed.values() if math.isfinite(c) and c > 0]
    reference = median_low(claims) if claims else 1.0
    out: dict[str, float] = {}
    for n, claim in claimed.items():
        if n in measured:
            out[n] = measured[n]
        else:
            relative = claim / reference if math.isfinite(claim) and claim > 0 else 1.0
            out[n] = neutral * min(1.0, relative)
    return out


def _max_end(shape: ModelShape, start: int, capacity: int) -> int:
    """Furthest allowed end such that [start, end) fits in `capacity` (start if nothing fits)."""
    end = best = start
    while end < shape.n_layers and shape.bytes_for(start, end + 1) <= capacity:
        end += 1
        if shape.cut_ok(end):
            best = end
    return best


def _fits(shape: ModelShape, start: int, nodes: Sequence[PlannerNode]) -> bool:
    """Can `nodes`, in order, cover [start, n)? Filling each node greedily is optimal for a chain."""
    pos = start
    for n in nodes:
        if pos == shape.n_layers:
            return True
        pos = _max_end(shape, pos, n.capacity_bytes)
    return pos == shape.n_layers


def split_chain(
    shape: ModelShape, nodes: Sequence[PlannerNode], start: int = 0, end: int | None = None, chain: int = 0
) -> list[Placement]:
    """Cover [start, end) with contiguous ranges on `nodes` (in order), shares proportional to speed."""
    stop = shape.n_layers if end is None else end
    sub = ModelShape(
        shape.layer_bytes[:stop],
        shape.tensor_bytes,
        shape.first,
        shape.last if stop == shape.n_layers else frozenset(),
        shape.always,
        tuple((s, min(e, stop)) for s, e in shape.groups if s < stop),
        leading_dense=shape.leading_dense,
    )
    if not _fits(sub, start, nodes):
        need = sub.bytes_for(start, stop)
        have = sum(n.capacity_bytes for n in nodes)
        groups = [f"{s}:{e}" for s, e in sub.groups if start <= s and e - s > 1]
        raise PlacementError(
            f"layers {start}:{stop} need {need / 1e6:.1f} MB but {len(nodes)} node(s) can hold only "
            f"{have / 1e6:.1f} MB in contiguous ranges"
            + (f" (layer groups {', '.join(groups)} are never split)" if groups else "")
            + (
                f" (the {sub.leading_dense} leading dense layers stay with the first shard and its first "
                "MoE layer)"
                if start == 0 and sub.leading_dense
                else ""
            )
            + "; add nodes or free memory"
        )
    floor = max((n.speed for n in nodes), default=1.0) / MAX_SPEED_RATIO
    speeds = [max(n.speed, floor, 1e-9) for n in nodes]
    total_speed = sum(speeds)
    out: list[Placement] = []
    pos, done_speed = start, 0.0
    for i, n in enumerate(nodes):
        if pos == stop:
            break
        done_speed += speeds[i]
        rest = nodes[i + 1 :]
        hi = _max_end(sub, pos, n.capacity_bytes)
        if not rest:
            cut = stop
        else:
            target = start + round((stop - start) * done_speed / total_speed)
            allowed = [e for e in range(pos, hi + 1) if e == pos or sub.cut_ok(e)]
            lo = next((e for e in allowed if _fits(sub, e, rest)), hi)
            # the allowed cut nearest the speed-proportional target, within what memory permits
            cut = min((e for e in allowed if e >= lo), key=lambda e: (abs(e - target), e))
        if cut > pos:
            out.append(Placement(n.node_id, pos, cut, chain))
            pos = cut
    return out


def _deal(nodes: Sequence[PlannerNode], groups: int) -> list[list[PlannerNode]]:
    """Deal nodes (fastest first) into `groups` chains in snake order, so chains get similar speed."""
    ordered = sorted(nodes, key=lambda n: (-n.speed, -n.capacity_bytes, n.node_id))
    out: list[list[PlannerNode]] = [[] for _ in range(groups)]
    for i, n in enumerate(ordered):
        rnd, k = divmod(i, groups)
        out[k if rnd % 2 == 0 else groups - 1 - k].append(n)
    return out


def _aligned(
    shape: ModelShape, first: Sequence[Placement], group: Sequence[PlannerNode], chain: int
) -> list[Placement] | None:
    """The first chain's ranges on `group`'s nodes, one range a node, the largest range on the fastest
    node that can hold it; None when the group has another number of nodes or a range fits nowhere."""
    if len(group) != len(first):
        return None
    free = sorted(group, key=lambda n: (-n.speed, -n.capacity_bytes, n.node_id))
    out: list[Placement] = []
    for p in sorted(first, key=lambda p: (-(p.layer_end - p.layer_start), p.layer_start)):
        need = shape.bytes_for(p.layer_start, p.layer_end)
        n = next((n for n in free if n.capacity_bytes >= need), None)
        if n is None:
            return None
        free.remove(n)
        out.append(Placement(n.node_id, p.layer_start, p.layer_end, chain))
    return sorted(out, key=lambda p: p.layer_start)


def _whole_nodes(nodes: Sequence[PlannerNode], shape: ModelShape) -> list[PlannerNode]:
    """The nodes that can hold the whole model by themselves, fastest first; the error says why none can."""
    able = [n for n in nodes if n.whole_model]
    if not able:
        raise PlacementError(
            f"{shape.whole}; no online node has the {WHOLE_MODEL_BACKEND} backend (install the agent "
            f"with its [{WHOLE_MODEL_BACKEND}] extra on a node with the memory for the whole model)"
        )
    need = shape.total_bytes
    fits = [n for n in able if n.capacity_bytes >= need]
    if not fits:
        largest = max(n.capacity_bytes for n in able)
        raise PlacementError(
            f"{shape.whole}; it needs {need / 1e6:.1f} MB on one node, but the largest of the {len(able)} "
            f"node(s) with the {WHOLE_MODEL_BACKEND} backend has {largest / 1e6:.1f} MB usable; free memory "
            "there or add a node that holds the whole model"
        )
    return sorted(fits, key=lambda n: (-n.speed, -n.capacity_bytes, n.node_id))


def plan_whole(nodes: Sequence[PlannerNode], shape: ModelShape, replicas: int = 1) -> Plan:
    """Place a model that runs only whole: up to `replicas` copies, each every layer on one node."""
    fits = _whole_nodes(nodes, shape)
    r = min(max(replicas, 1), len(fits))
    notes = [f"whole model on one node per copy: {shape.whole}"]
    if r < replicas:
        notes.append(f"only {r} of {replicas} requested replicas fit: each needs one node that holds it all")
    placements = tuple(Placement(n.node_id, 0, shape.n_layers, chain=c) for c, n in enumerate(fits[:r]))
    return Plan(placements, r, tuple(notes))


def plan_placement(nodes: Sequence[PlannerNode], shape: ModelShape, replicas: int = 1) -> Plan:
    """Place the whole model: up to `replicas` disjoint chains, as many as memory allows (at least one);
    replica chains share the first chain's boundaries where their nodes can hold its ranges. A model
    that runs only whole (`shape.whole`) goes to `plan_whole` instead."""
    if shape.refusal:
        raise PlacementError(shape.refusal)
    if shape.n_layers == 0:
        raise PlacementError("the model has no layers")
    if shape.whole:
        return plan_whole(nodes, shape, replicas)
    usable = [n for n in nodes if n.capacity_bytes > 0]
    if not usable:
        raise PlacementError(f"no node has free memory; the model needs {shape.total_bytes / 1e6:.1f} MB")
    notes: list[str] = []
    last_error: PlacementError | None = None
    for r in range(min(max(replicas, 1), len(usable)), 0, -1):
        groups = _deal(usable, r)
        try:
            chains = [split_chain(shape, groups[0], chain=0)]
            for c, group in enumerate(groups[1:], 1):
                chains.append(_aligned(shape, chains[0], group, c) or split_chain(shape, group, chain=c))
        except PlacementError as e:
            last_error = e
            continue
        if r < replicas:
            notes.append(f"only {r} of {replicas} requested replicas fit in the fleet's memory")
        first = {(p.layer_start, p.layer_end) for p in chains[0]}
        if any({(p.layer_start, p.layer_end) for p in ch} != first for ch in chains[1:]):
            notes.append(
                "the replicas do not share their layer boundaries (the fleet's nodes differ in number or "
                "memory): a failed hop is recovered on another copy only where the ranges match"
            )
        return Plan(tuple(p for ch in chains for p in ch), r, tuple(notes))
    free = sum(n.capacity_bytes for n in usable)
    raise PlacementError(
        f"the fleet cannot hold the model: it needs {shape.total_bytes / 1e6:.1f} MB, "
        f"{len(usable)} node(s) have {free / 1e6:.1f} MB usable ({last_error})"
    )


def uncovered_ranges(n_layers: int, placements: Sequence[Placement]) -> list[tuple[int, int]]:
    """Maximal layer ranges that no placement covers."""
    covered = [False] * n_layers
    for p in placements:
        for i in range(p.layer_start, p.layer_end):
            covered[i] = True
    out: list[tuple[int, int]] = []
    i = 0
    while i < n_layers:
        if covered[i]:
            i += 1
            continue
        j = i
        while j < n_layers and not covered[j]:
            j += 1
        out.append((i, j))
        i = j
    return out


def below_target(n_layers: int, placements: Sequence[Placement], target: int) -> list[tuple[int, int]]:
    """Maximal layer ranges held by fewer than `target` placements (uncovered ones included)."""
    count = [0] * n_layers
    for p in placements:
        for i in range(p.layer_start, p.layer_end):
            count[i] += 1
    short = [Placement(NodeId(""), i, i + 1) for i in range(n_layers) if count[i] >= max(target, 1)]
    return uncovered_ranges(n_layers, short)


def replan_lost(
    nodes: Sequence[PlannerNode],
    shape: ModelShape,
    current: Sequence[Placement],
    lost: NodeId,
    target: int = 1,
) -> list[Placement]:
    """New placements for the layers that fall below `target` copies without `lost` (with the default 1:
    the layers only `lost` held); `nodes[i].capacity_bytes` is what is still free.

    Each missing range goes to the fastest single node that can hold it and holds none of it already
    (a second copy on the same node survives nothing); otherwise it is split over the survivors. Raises
    PlacementError when the survivors cannot hold a range no survivor covers at all; a range that is
    only short of its replica count is skipped when nothing can take it (routes still work).
    """
    if shape.refusal:
        raise PlacementError(shape.refusal)
    if shape.whole:
        return _replace_whole(nodes, shape, current, lost, target)
    survivors = [p for p in current if p.node_id != lost]
    uncovered = set(uncovered_ranges(shape.n_layers, survivors))
    holes = below_target(shape.n_layers, survivors, target)
    free = {n.node_id: n.capacity_bytes for n in nodes if n.node_id != lost}
    speed = {n.node_id: n.speed for n in nodes}
    chain = max((p.chain for p in current), default=0)
    out: list[Placement] = []
    for a, b in holes:
        need = shape.bytes_for(a, b)
        holders = {p.node_id for p in survivors if p.layer_start < b and a < p.layer_end}
        single = [nid for nid, cap in free.items() if cap >= need and nid not in holders]
        if single:
            best = max(single, key=lambda nid: (speed[nid], free[nid], nid))
            out.append(Placement(best, a, b, chain))
            free[best] -= need
            continue
        pool = sorted(
            (
                PlannerNode(nid, cap, speed[nid])
                for nid, cap in free.items()
                if cap > 0 and nid not in holders
            ),
            key=lambda n: (-n.speed, n.node_id),
        )
        try:
            parts = split_chain(shape, pool, a, b, chain)
        except PlacementError as e:
            if not any(u < b and a < v for u, v in uncovered):
                continue  # still served by a surviving copy: one replica short is not an outage
            raise PlacementError(f"cannot replace lost node {lost}: {e}") from None
        for p in parts:
            free[p.node_id] -= shape.bytes_for(p.layer_start, p.layer_end)
        out.extend(parts)
    return out


def _replace_whole(
    nodes: Sequence[PlannerNode], shape: ModelShape, current: Sequence[Placement], lost: NodeId, target: int
) -> list[Placement]:
    """replan_lost for a model that runs only whole: one more copy on the fastest node that holds it all
    and holds no copy yet, when the survivors keep fewer than `target`; none needed while a copy survives
    and nothing fits (routes still work), an error when no copy is left."""
    survivors = [p for p in current if p.node_id != lost]
    if len(survivors) >= max(target, 1):
        return []
    holders = {p.node_id for p in survivors}
    try:
        fits = _whole_nodes([n for n in nodes if n.node_id != lost and n.node_id not in holders], shape)
    except PlacementError as e:
        if survivors:
            return []
        raise PlacementError(f"cannot replace lost node {lost}: {e}") from None
    chain = max((p.chain for p in current), default=0)
    return [Placement(fits[0].node_id, 0, shape.n_layers, chain)]
