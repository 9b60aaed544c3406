"""Placement simulator: model spec x fleet -> the real planner's placement, predicted decode tok/s and TTFT.

    python -m webapp.fleet.simulate plan MODEL.json FLEET.json [--quant Q4_K_M] [--context 8192]

(Audit pages built on it: `python -m webapp.fleet.audit`, webapp/fleet/audit.py.)

Pure functions underneath (no Django, no I/O but the CLI's). The model of one decode step is the route
client's default (star) mode: the client calls each hop in turn, so a step costs, per hop, a round trip
on that hop's link (2 x one-way latency + request and answer bytes / bandwidth), a fixed per-call
software overhead (HTTP, framing) and the hop's compute: the sum of its layers' step times, plus the
output head on the last hop (chain mode crosses the same links, hop to hop: predict_route). A layer's step time is measured (`layer_step_ms` on a fleet node) or,
for an audit, estimated as decode is on every fleet we plan for: memory-bound, the bytes the token
touches (non-expert weights, the used experts' share, the layer's state at the context) over the node's
memory bandwidth x efficiency. Prefill (TTFT) is compute-bound: 2 x active parameters x prompt tokens
over the node's FLOP/s x efficiency, unless measured (`layer_prefill_ms_per_token`). bench/simulator.py
validates the model against real routes on 127.0.0.1 with link delays injected; bench/links.py, calibrated
on one hop, against 2- to 4-hop routes in star and chain mode across network namespaces with delayed,
bandwidth-limited links (agent/dev/links.py).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent.artifacts.archs import StatePart, describe
from agent.wire.ids import NodeId
from webapp.fleet.placement import ModelShape, Placement, PlacementError, PlannerNode, plan_placement

GB = 1_000_000_000
# Average bits per weight of a llama.cpp file type over a model's matmul weights. Q8_0 is exact (34 bytes
# per 32 weights); Q4_K_M mixes Q4_K (4.5) with Q6_K (6.56) for some tensors: ~4.85 is an estimate.
BITS_PER_WEIGHT = {"Q4_K_M": 4.85, "Q8_0": 8.5, "F16": 16.0}
SEAM_DTYPE_BYTES = 4  # the route's default hidden dtype is f32 (agent.wire.frames.DEFAULT_HIDDEN_DTYPE)
FRAME_OVERHEAD_BYTES = 160  # request/response headers of one frame and its HTTP envelope (measured ~150)
SPECS = Path(__file__).resolve().parent / "specs"


@dataclass(frozen=True)
class ModelSpec:
    """A model as the simulator sees it: per-layer bytes and state, at one quantisation."""

    name: str
    layer_bytes: tuple[int, ...]  # weights of each trunk layer, routed experts included
    active_bytes: tuple[int, ...]  # weights one decode token reads there (used experts only)
    state: tuple[tuple[StatePart, ...], ...]  # per-session state parts of each layer
    first_bytes: int  # the embedding (first shard)
    last_bytes: int  # the output head, its norms and any MTP blocks (last shard)
    head_active_bytes: int  # what the head reads per token (the MTP blocks are not run here)
    boundary_dim: int
    token_id_layers: tuple[bool, ...] = ()  # layers that need the token ids with the seam state
    groups: tuple[tuple[int, int], ...] = ()
    leading_dense: int = 0
    bits_per_weight: float = 16.0
    kv_bytes: float = 2.0  # per KV element (f16 cache)

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    def state_bytes(self, layer: int, context: int) -> int:
        return sum(p.bytes_at(context, self.kv_bytes) for p in self.state[layer])

    def seam_bytes_per_token(self, layer: int) -> int:
        """What crosses a boundary before `layer` per token: the residual (and the ids where needed)."""
        ids = 4 if self.token_id_layers and any(self.token_id_layers[layer:]) else 0
        return self.boundary_dim * SEAM_DTYPE_BYTES + ids

    def shape(self, context: int = 0, sessions: int = 1) -> ModelShape:
        """The planner's input: weights plus `sessions` sessions' state at `context` tokens per layer."""
        return ModelShape(
            layer_bytes=tuple(
                b + (sessions * self.state_bytes(i, context) if context else 0)
                for i, b in enumerate(self.layer_bytes)
            ),
            tensor_bytes={"first": self.first_bytes, "last": self.last_bytes},
            first=frozenset({"first"}),
            last=frozenset({"last"}),
            groups=self.groups,
            leading_dense=self.leading_dense,
        )


def _signature(parts: Sequence[StatePart]) -> str:
    return ",".join(p.name for p in parts)


def spec_from_dict(d: dict[str, Any], quant: str) -> ModelSpec:
    """A model spec file (webapp/fleet/specs/models/*.json) at one llama.cpp file type."""
    if quant not in BITS_PER_WEIGHT:
        raise ValueError(f"unknown quantisation {quant!r} (known: {', '.join(BITS_PER_WEIGHT)})")
    bpw = BITS_PER_WEIGHT[quant]
    hp, p = d["hparams"], d["params"]
    mtp = int(hp.get("nextn_predict_layers", 0))
    names = [f"blk.{d['n_layers']}.nextn.eh_proj.weight"] if mtp else []
    desc = describe(d["architecture"], hp, d["n_layers"] + mtp, d["d_model"], names)
    if desc.n_layers != d["n_layers"]:
        raise ValueError(
            f"{d['name']}: the hparams describe {desc.n_layers} trunk layers, not {d['n_layers']}"
        )
    by_sig: dict[str, int] = p["attention"]
    layer_params, active_params = [], []
    for i, layer in enumerate(desc.layers):
        sig = _signature(layer.state)
        if sig not in by_sig:
            raise ValueError(f"{d['name']}: no attention parameter count for layer {i}'s state parts ({sig})")
        if i < desc.leading_dense_layers:
            ffn = active_ffn = int(p["dense_ffn"])
        else:
            ffn = int(p["moe_shared"]) + int(p["experts"]) * int(p["expert"])
            active_ffn = int(p["moe_shared"]) + int(p["experts_used"]) * int(p["expert"])
        layer_params.append(by_sig[sig] + ffn)
        active_params.append(by_sig[sig] + active_ffn)

    def size(n: float) -> int:
        return int(n * bpw / 8)

    return ModelSpec(
        name=d["name"],
        layer_bytes=tuple(size(n) for n in layer_params),
        active_bytes=tuple(size(n) for n in active_params),
        state=tuple(tuple(layer.state) for layer in desc.layers),
        first_bytes=size(p["embedding"]),
        last_bytes=size(p["head"] + mtp * p.get("mtp_block", 0)),
        head_active_bytes=size(p["head"]),
        boundary_dim=desc.boundary_dim,
        token_id_layers=tuple(layer.needs_token_ids for layer in desc.layers),
        groups=tuple(desc.groups),
        leading_dense=desc.leading_dense_layers,
        bits_per_weight=bpw,
    )


def spec_from_manifest(m: Any) -> ModelSpec:
    """A real file's spec (an agent.artifacts.manifest.Manifest): its bytes are all read per token."""
    roles = m.roles
    first = sum(t.nbytes for t in m.tensors if t.name in roles.get("first", []))
    last = sum(t.nbytes for t in m.tensors if t.name in roles.get("last", []))
    return ModelSpec(
        name=m.name,
        layer_bytes=tuple(layer.nbytes for layer in m.layers),
        active_bytes=tuple(layer.nbytes - layer.expert_bytes for layer in m.layers),
        state=tuple(tuple(layer.state) for layer in m.layers),
        first_bytes=first,
        last_bytes=last,
        head_active_bytes=last,
        boundary_dim=m.boundary_dim,
        token_id_layers=tuple(layer.needs_token_ids for layer in m.layers),
        groups=tuple(m.layer_groups),
        leading_dense=m.leading_dense_layers,
    )


@dataclass(frozen=True)
class SimNode:
    """A fleet node: memory, speed (measured or from bandwidth and FLOP/s) and its link to the client."""

    name: str
    memory_bytes: int
    reserve_bytes: int = 0
    mem_bandwidth_gbs: float = 50.0
    tflops: float = 1.0
    efficiency: float = 0.6
    latency_ms: float = 0.0  # one way, client <-> node
    bandwidth_gbps: float = 10.0
    # bytes a message crosses the link with no serialization time (a token bucket's burst: the link
    # harness's tbf, agent/dev/links.py); 0 on a real link, where every byte waits its turn
    burst_bytes: int = 0
    layer_step_ms: float | None = None  # measured decode time of one layer (overrides bandwidth)
    head_step_ms: float | None = None  # measured decode time of the output head
    layer_prefill_ms_per_token: float | None = None

    def layer_ms(self, spec: ModelSpec, layer: int, context: int) -> float:
        if self.layer_step_ms is not None:
            return self.layer_step_ms
        touched = spec.active_bytes[layer] + spec.state_bytes(layer, context)
        return touched / (self.mem_bandwidth_gbs * GB * self.efficiency) * 1e3

    def head_ms(self, spec: ModelSpec) -> float:
        if self.head_step_ms is not None:
            return self.head_step_ms
        return spec.head_active_bytes / (self.mem_bandwidth_gbs * GB * self.efficiency) * 1e3

    def prefill_ms(self, spec: ModelSpec, layer: int, tokens: int) -> float:
        if self.layer_prefill_ms_per_token is not None:
            return self.layer_prefill_ms_per_token * tokens
        flops = 2 * spec.active_bytes[layer] * 8 / spec.bits_per_weight * tokens
        # never faster than reading the weights once
        return max(flops / (self.tflops * 1e12 * self.efficiency), self.layer_ms(spec, layer, 0) / 1e3) * 1e3

    def link_ms(self, n_bytes: int) -> float:
        """One round trip carrying `n_bytes` in total (both directions)."""
        return 2 * self.latency_ms + n_bytes * 8 / (self.bandwidth_gbps * 1e9) * 1e3

    def transfer_ms(self, message_bytes: int) -> float:
        """Serialization time of one message on this node's link (beyond what its bucket lets through)."""
        return max(message_bytes - self.burst_bytes, 0) * 8 / (self.bandwidth_gbps * 1e9) * 1e3


@dataclass(frozen=True)
class Fleet:
    """Nodes plus the per-call software overhead of the route (HTTP, framing, the client's own work)."""

    name: str
    nodes: tuple[SimNode, ...]
    hop_overhead_ms: float = 1.0


def fleet_from_dict(d: dict[str, Any]) -> Fleet:
    """A fleet file (webapp/fleet/specs/fleets/*.json): node kinds with a count, defaults in `link`."""
    link = d.get("link", {})
    nodes: list[SimNode] = []
    for kind in d["nodes"]:
        fields = {**link, **{k: v for k, v in kind.items() if k not in ("count", "memory_gb", "reserve_gb")}}
        fields["memory_bytes"] = int(kind["memory_gb"] * GB)
        fields["reserve_bytes"] = int(kind.get("reserve_gb", 0) * GB)
        base = fields.pop("name")
        count = int(kind.get("count", 1))
        for i in range(count):
            nodes.append(SimNode(name=f"{base}-{i}" if count > 1 else base, **fields))
    return Fleet(d["name"], tuple(nodes), float(d.get("hop_overhead_ms", 1.0)))


@dataclass(frozen=True)
class HopPrediction:
    """One hop of the predicted route."""

    node: str
    layer_start: int
    layer_end: int
    bytes_held: int
    compute_ms: float
    network_ms: float


@dataclass(frozen=True)
class Prediction:
    """The simulator's answer for one model on one fleet."""

    model: str
    fleet: str
    context: int
    sessions: int
    hops: tuple[HopPrediction, ...] = ()
    step_ms: float = 0.0
    decode_tok_s: float = 0.0
    ttft_ms: float = 0.0
    error: str = ""  # the planner's refusal when the fleet cannot hold the model
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "fleet": self.fleet,
            "context": self.context,
            "sessions": self.sessions,
            "hops": [h.__dict__ for h in self.hops],
            "step_ms": round(self.step_ms, 3),
            "decode_tok_s": round(self.decode_tok_s, 3),
            "ttft_ms": round(self.ttft_ms, 1),
            "error": self.error,
        }


def planner_nodes(spec: ModelSpec, fleet: Fleet, context: int) -> list[PlannerNode]:
    """The fleet as the planner sees it: memory less the reserve, speed = layers per second."""
    out = []
    for n in fleet.nodes:
        mean_ms = sum(n.layer_ms(spec, i, context) for i in range(spec.n_layers)) / spec.n_layers
        out.append(
            PlannerNode(NodeId(n.name), max(n.memory_bytes - n.reserve_bytes, 0), 1e3 / max(mean_ms, 1e-9))
        )
    return out


def predict_route(
    spec: ModelSpec,
    fleet: Fleet,
    placements: Sequence[Placement],
    context: int = 8192,
    prompt_tokens: int = 512,
    mode: str = "star",
) -> tuple[tuple[HopPrediction, ...], float, float]:
    """(hops, decode step ms, TTFT ms) of one chain, hops in layer order.

    Each hop's link (its node's latency and bandwidth) is crossed by the frames to and from it. In star
    mode the client sends each hop its input and reads its output; in chain mode (`mode="chain"`) the
    input comes from the hop before and the output goes on to the next, whose answer (the token)
    comes back the same way; either way a step crosses each hop's link once each way, so costs it one
    round trip, and the seam between two hops crosses both their links. `fleet.hop_overhead_ms` is the
    mode's per-hop software overhead (calibrate it in the mode predicted)."""
    if mode not in ("star", "chain"):
        raise ValueError(f"mode must be 'star' or 'chain', not {mode!r}")
    by_name = {n.name: n for n in fleet.nodes}
    chain = sorted(placements, key=lambda p: p.layer_start)
    shape = spec.shape()
    hops: list[HopPrediction] = []
    step = ttft = 0.0
    for k, p in enumerate(chain):
        n = by_name[p.node_id]
        last = k == len(chain) - 1
        layers = range(p.layer_start, p.layer_end)
        compute = sum(n.layer_ms(spec, i, context) for i in layers) + (n.head_ms(spec) if last else 0.0)
        prefill = sum(n.prefill_ms(spec, i, prompt_tokens) for i in layers) + (
            n.head_ms(spec) if last else 0.0
        )
        seam_in = 4 if p.layer_start == 0 else spec.seam_bytes_per_token(p.layer_start)
        seam_out = 8 if last else spec.seam_bytes_per_token(p.layer_end)
        frames = [seam_in, seam_out]  # star: the client's request and the hop's answer
        if mode == "chain":  # the input in, the rows on to the next hop, the token back both ways
            frames = [seam_in, 8] if last else [seam_in, seam_out, 8, 8]
        transfer = sum(n.transfer_ms(f + FRAME_OVERHEAD_BYTES) for f in frames)
        net = 2 * n.latency_ms + transfer + fleet.hop_overhead_ms
        # the prompt's seam goes out whole; only the last position's state comes back from the last hop
        net_prefill = n.link_ms(prompt_tokens * (seam_in + (0 if last else seam_out))) + fleet.hop_overhead_ms
        hops.append(HopPrediction(p.node_id, p.layer_start, p.layer_end, shape.bytes_for(p.layer_start, p.layer_end),
                                  round(compute, 3), round(net, 3)))  # fmt: skip
        step += compute + net
        ttft += prefill + net_prefill
    return tuple(hops), step, ttft


def simulate(
    spec: ModelSpec,
    fleet: Fleet,
    context: int = 8192,
    sessions: int = 1,
    prompt_tokens: int = 512,
    replicas: int = 1,
) -> Prediction:
    """Plan with the real planner (memory for `sessions` sessions at `context`), then predict chain 0."""
    base = Prediction(spec.name, fleet.name, context, sessions)
    try:
        plan = plan_placement(planner_nodes(spec, fleet, context), spec.shape(context, sessions), replicas)
    except PlacementError as e:
        return replace(base, error=str(e))
    hops, step, ttft = predict_route(
        spec, fleet, [p for p in plan.placements if p.chain == 0], context, prompt_tokens
    )
    return replace(base, hops=hops, step_ms=step, decode_tok_s=1e3 / step, ttft_ms=ttft, notes=plan.notes)


@dataclass(frozen=True)
class Calibration:
    """What one measured route says about a node kind: per-layer and head step times, per-call overhead."""

    layer_step_ms: float
    head_step_ms: float
    hop_overhead_ms: float


def calibrate(
    hop_layers: Sequence[int], hop_compute_ms: Sequence[float], step_ms: float, latency_ms: float = 0.0
) -> Calibration:
    """From one route's measured decode step: every hop but the last gives the per-layer time (its
    compute over its layers); the last hop's excess over its layers is the head; what the step spends
    beyond compute and the links' latency, spread over the hops, is the per-call overhead."""
    if len(hop_layers) < 2 or len(hop_layers) != len(hop_compute_ms):
        raise ValueError("calibration needs at least two hops, each with its layer count and compute time")
    layer = sum(hop_compute_ms[:-1]) / sum(hop_layers[:-1])
    head = max(hop_compute_ms[-1] - hop_layers[-1] * layer, 0.0)
    n = len(hop_layers)
    overhead = (step_ms - sum(hop_compute_ms) - n * 2 * latency_ms) / n
    return Calibration(layer, head, max(overhead, 0.0))


def calibrate_one_hop(
    spec: ModelSpec, compute_ms: float, step_ms: float, latency_ms: float = 0.0
) -> Calibration:
    """From one hop holding the whole model: its compute splits into layers and head in proportion to
    the bytes each reads per token (decode is memory-bound; the split matters little, since a route's
    hops together run every layer and the head once); what the step spends beyond compute and the
    link's round trip is the per-call overhead (the client's, the hop's HTTP or lane, the relay's)."""
    layer_bytes = sum(spec.active_bytes)
    share = layer_bytes / (layer_bytes + spec.head_active_bytes)
    layer = compute_ms * share / spec.n_layers
    overhead = step_ms - compute_ms - 2 * latency_ms
    return Calibration(layer, compute_ms * (1 - share), max(overhead, 0.0))


def loopback_fleet(
    cal: Calibration,
    n_nodes: int,
    latency_ms: float,
    name: str = "loopback",
    bandwidth_gbps: float = 10.0,
    burst_bytes: int = 0,
) -> Fleet:
    """`n_nodes` equal nodes with `latency_ms` injected each way (and links of `bandwidth_gbps`, their
    bucket `burst_bytes`: the link harness), timed by `cal`."""
    nodes = tuple(
        SimNode(f"{name}-{i}", 64 * GB, latency_ms=latency_ms, bandwidth_gbps=bandwidth_gbps,
                burst_bytes=burst_bytes, layer_step_ms=cal.layer_step_ms, head_step_ms=cal.head_step_ms)
        for i in range(n_nodes)
    )  # fmt: skip
    return Fleet(f"{name} {n_nodes} hops {latency_ms:g} ms", nodes, cal.hop_overhead_ms)


def load_json(path: str | Path) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m webapp.fleet.simulate", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="place one model on one fleet and predict decode tok/s and TTFT (JSON)")
    pl.add_argument("model")
    pl.add_argument("fleet")
    pl.add_argument("--quant", default="Q4_K_M", choices=sorted(BITS_PER_WEIGHT))
    pl.add_argument("--context", type=int, default=8192)
    pl.add_argument("--sessions", type=int, default=1)
    pl.add_argument("--prompt", type=int, default=512)
    args = ap.parse_args(argv)
    spec = spec_from_dict(load_json(args.model), args.quant)
    fleet = fleet_from_dict(load_json(args.fleet))
    print(json.dumps(simulate(spec, fleet, args.context, args.sessions, args.prompt).to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
