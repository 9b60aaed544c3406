"""The placement simulator against real routes on 127.0.0.1 with link delay injected (prints JSON last).

    python bench/simulator.py [--tokens 24] [--rounds 3] [--backend native] [--threads 1] [--topologies 2:5,3:20]

SmolLM2 is placed by the real planner on 2 and 3 equal loopback nodes; each hop runs as its own
`agent serve` process behind a TCP relay that holds every forwarded chunk for the injected one-way
delay (0, 5 or 20 ms, both directions; agent/dev/relay.py, the relay bench/links.py also puts between
network namespaces). Each topology's per-layer and head step times are measured in
its own run (the hops' reported compute times, as the control plane sees them); one route (2 hops,
0 ms) calibrates the per-call overhead (webapp.fleet.simulate.calibrate). The decode step of every
other topology is predicted from those figures (webapp.fleet.simulate.predict_route: the real
planner's placement, links, overhead) and measured (median step, the route client's star mode). `simulator_max_rel_error` is the worst |predicted - measured| / measured
decode tok/s over the predicted topologies (target <= 0.20).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.artifacts.manifest import Manifest, build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.backends import available_backends  # noqa: E402
from agent.client.recovery import minted_hops  # noqa: E402
from agent.client.route import RouteClient  # noqa: E402
from agent.dev.relay import RelayProcess  # noqa: E402
from agent.procs import Process, stop  # noqa: E402
from agent.wire.ids import SessionId  # noqa: E402
from agent.wire.routetoken import RouteHop, generate_key, public_key_b64  # noqa: E402
from agent.wire.sampling import SamplingParams  # noqa: E402
from bench._common import cpu_kind, start_serve  # noqa: E402
from webapp.fleet.placement import Placement, plan_placement  # noqa: E402
from webapp.fleet.simulate import (  # noqa: E402
    Calibration,
    calibrate,
    loopback_fleet,
    planner_nodes,
    predict_route,
    spec_from_manifest,
)

PROMPT = list(range(1000, 1064))  # 64 ordinary token ids: the prompt's content does not matter here
CALIBRATION = (2, 0.0)  # (hops, one-way delay ms) of the route that calibrates the others
TOPOLOGIES = ((2, 0.0), (2, 5.0), (2, 20.0), (3, 0.0), (3, 5.0), (3, 20.0))


@dataclass
class Route:
    """One topology's serve processes, each behind its relay."""

    placements: list[Placement]
    upstream: list[tuple[int, int, int, str]] = field(default_factory=list)  # (hop port, start, end, node)
    hops: list[tuple[str, int, int, str]] = field(default_factory=list)  # (relay url, start, end, node)


@dataclass
class Measured:
    """Median decode step and the per-hop compute of one topology."""

    step_ms: float
    hop_compute_ms: list[float]


async def measure(route: Route, key: Any, sha256: str, tokens: int) -> Measured:  # noqa: ANN401
    """Prefill PROMPT, then decode `tokens` greedy steps; medians of the per-step times."""
    session = os.urandom(16)
    plan = [RouteHop(n, u, a, b) for u, a, b, n in route.hops]
    client = RouteClient(minted_hops(key, SessionId(session), sha256, plan), session_id=session)
    try:
        tok = (await client.forward(PROMPT, SamplingParams())).token
        for _ in range(2):  # warm the connections and the executor's decode path
            tok = (await client.forward([tok], SamplingParams())).token
        steps, computes = [], []
        for _ in range(tokens):
            before = [s.compute_ms for s in client.hop_stats]
            t0 = time.perf_counter()
            tok = (await client.forward([tok], SamplingParams())).token
            steps.append((time.perf_counter() - t0) * 1e3)
            computes.append([s.compute_ms - b for s, b in zip(client.hop_stats, before, strict=True)])
    finally:
        await client.close()
    per_hop = [statistics.median(c[i] for c in computes) for i in range(len(route.hops))]
    return Measured(statistics.median(steps), per_hop)


def plan_loopback(manifest: Manifest, n_hops: int) -> list[Placement]:
    """The real planner's placement of the model on `n_hops` equal loopback nodes."""
    spec = spec_from_manifest(manifest)
    cal = Calibration(1.0, 0.0, 0.0)  # equal nodes: only the ratio of speeds matters to the planner
    nodes = planner_nodes(spec, loopback_fleet(cal, n_hops, 0.0), 0)
    return sorted(plan_placement(nodes, spec.shape()).placements, key=lambda p: p.layer_start)


def predict(manifest: Manifest, cal: Calibration, route: Route, delay_ms: float) -> float:
    """Predicted decode step (ms) of `route` with `delay_ms` injected each way."""
    spec = spec_from_manifest(manifest)
    fleet = loopback_fleet(cal, len(route.placements), delay_ms)
    _, step, _ = predict_route(spec, fleet, route.placements, context=len(PROMPT))
    return step


async def run(
    manifest: Manifest,
    path: str,
    backend: str,
    threads: int,
    tokens: int,
    rounds: int,
    topologies: tuple[tuple[int, float], ...] = TOPOLOGIES,
) -> dict[str, Any]:
    """Start the routes, calibrate on CALIBRATION, measure and predict every topology; the JSON figures."""
    key = generate_key()
    logdir = Path(tempfile.mkdtemp(prefix="bench-simulator-"))
    procs: list[Process] = []
    routes: dict[int, Route] = {}
    relay: RelayProcess | None = None
    try:
        for n in sorted({h for h, _ in (CALIBRATION, *topologies)}):
            route = Route(plan_loopback(manifest, n))
            for p in route.placements:
                window = f"{p.layer_start}:{p.layer_end}"
                proc, url, node = start_serve(
                    path, window, backend, public_key_b64(key.public_key()), threads, logdir
                )
                procs.append(proc)
                route.upstream.append((int(url.rsplit(":", 1)[1]), p.layer_start, p.layer_end, node))
            routes[n] = route
        # one relay per hop, all in one process (agent/dev/relay.py), sharing the delay under test
        ups = [u for r in routes.values() for u in r.upstream]
        relay = RelayProcess([(("127.0.0.1", 0), ("127.0.0.1", u[0])) for u in ups], logdir / "relay.log")
        at = iter(relay.addresses)
        for route in routes.values():
            for _, a, b, node in route.upstream:
                host, port = next(at)
                route.hops.append((f"http://{host}:{port}", a, b, node))
        samples: dict[tuple[int, float], list[Measured]] = {}
        for _ in range(rounds):  # interleaved rounds: the machine is shared and its load drifts
            for n, delay in dict.fromkeys((CALIBRATION, *topologies)):
                relay.set_delay(delay)
                samples.setdefault((n, delay), []).append(
                    await measure(routes[n], key, manifest.sha256, tokens)
                )
    finally:
        if relay is not None:
            relay.close()
        stop(procs)

    def median(n: int, delay: float) -> Measured:
        ms = samples[(n, delay)]
        k = len(ms[0].hop_compute_ms)
        return Measured(
            statistics.median(m.step_ms for m in ms),
            [statistics.median(m.hop_compute_ms[i] for m in ms) for i in range(k)],
        )

    c = median(*CALIBRATION)
    route = routes[CALIBRATION[0]]
    cal = calibrate(
        [p.layer_end - p.layer_start for p in route.placements], c.hop_compute_ms, c.step_ms, CALIBRATION[1]
    )
    out: dict[str, Any] = {
        "cpu": cpu_kind(),
        "model": manifest.name,
        "backend": backend,
        "threads": threads,
        "tokens": tokens,
        "rounds": rounds,
        "calibration": f"{CALIBRATION[0]} hops, {CALIBRATION[1]:g} ms",
        "layer_step_ms": round(cal.layer_step_ms, 4),
        "head_step_ms": round(cal.head_step_ms, 3),
        "hop_overhead_ms": round(cal.hop_overhead_ms, 3),
    }
    errors = []
    for n, delay in topologies:
        m = median(n, delay)
        # the nodes' step times as measured in this run (the control plane sees them in the hops'
        # reported timings); the links and the per-call overhead are what the simulator predicts
        layers = [p.layer_end - p.layer_start for p in routes[n].placements]
        own = calibrate(layers, m.hop_compute_ms, m.step_ms, delay)
        pred_ms = predict(
            manifest, Calibration(own.layer_step_ms, own.head_step_ms, cal.hop_overhead_ms), routes[n], delay
        )
        err = abs(1e3 / pred_ms - 1e3 / m.step_ms) / (1e3 / m.step_ms)
        tag = f"{n}hop_{delay:g}ms"
        out[f"placement_{tag}"] = " ".join(f"{p.layer_start}:{p.layer_end}" for p in routes[n].placements)
        out[f"measured_tok_s_{tag}"] = round(1e3 / m.step_ms, 2)
        out[f"measured_hop_compute_ms_{tag}"] = [round(x, 2) for x in m.hop_compute_ms]
        out[f"predicted_tok_s_{tag}"] = round(1e3 / pred_ms, 2)
        out[f"rel_error_{tag}"] = round(err, 3)
        if (n, delay) != CALIBRATION:
            errors.append(err)
    out["simulator_topologies_predicted"] = len(errors)
    out["simulator_max_rel_error"] = round(max(errors), 3) if errors else None
    return out


def topologies_arg(text: str) -> tuple[tuple[int, float], ...]:
    """ "2:5,3:20" -> ((2, 5.0), (3, 20.0))."""
    out = []
    for item in text.split(","):
        hops, delay = item.split(":")
        out.append((int(hops), float(delay)))
    return tuple(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    default = "native" if "native" in available_backends() else "torch"
    ap.add_argument("--backend", default=default)
    ap.add_argument(
        "--topologies",
        type=topologies_arg,
        default=TOPOLOGIES,
        help="HOPS:DELAY_MS,... measured and predicted (default: all six); the calibration route always runs",
    )
    args = ap.parse_args()
    path = str(packaged_model_path())
    manifest = build_manifest(path, hash_tensors=False)
    out = asyncio.run(
        run(manifest, path, args.backend, args.threads, args.tokens, args.rounds, args.topologies)
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
