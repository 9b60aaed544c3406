"""The simulator against routes over emulated links: hops in network namespaces, delayed and rate-limited (prints JSON last).

    .venv/bin/python bench/links.py [--tokens 8] [--rounds 5] [--hops 2,3,4] [--delays 0.5,5,25] \\
        [--rates 1000,100,20] [--modes star,chain] [--jitter 0.1] [--no-tls]        # as root

About 9 minutes on a shared 2-core machine.

Every route runs in the link harness (agent/dev/links.py): SmolLM2, each hop an `agent serve` (native
backend, one thread) in a network namespace of its own, placed by the real planner on equal nodes,
mutual TLS between hops and to the client, every link through a relay adding the one-way delay (plus
uniform jitter of `--jitter` x the delay) and shaped by tbf to the rate each way.

The simulator is calibrated on ONE hop holding the whole model, in the harness with no delay and no
rate limit (webapp.fleet.simulate.calibrate_one_hop, once per route mode: star's and chain's per-call
overheads differ); it then predicts the decode step of every 2-, 3- and 4-hop route at every delay,
rate and mode (predict_route: the real planner's placement, each hop's round trip, serialization at
the link's rate beyond tbf's bucket, the calibrated overhead per hop), none of which it measured. Each
topology is measured over `--tokens` greedy decode steps after a 64-token prompt in each of `--rounds`
rounds that interleave every topology and the calibration (all the routes stay up meanwhile: 10
hops), its figure the lower quartile of those steps: the machine is shared, and other work only ever
adds to a step (each row also gives the median and the error against it).
`simulator_max_rel_error_unseen` is the worst |predicted - measured| / measured decode tok/s over them
(target <= 0.15). Progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from agent.client.recovery import minted_hops  # noqa: E402
from agent.client.route import RouteClient  # noqa: E402
from agent.dev.links import TBF_BURST_BYTES, LinkLab, unusable  # noqa: E402
from agent.wire.ids import SessionId  # noqa: E402
from agent.wire.routetoken import RouteHop, generate_key, public_key_b64  # noqa: E402
from agent.wire.sampling import SamplingParams  # noqa: E402
from bench._common import KV_BUDGET_MB, cpu_kind  # noqa: E402
from bench.simulator import PROMPT, plan_loopback  # noqa: E402
from webapp.fleet.simulate import (  # noqa: E402
    Calibration,
    calibrate_one_hop,
    loopback_fleet,
    predict_route,
    spec_from_manifest,
)

MODES = ("star", "chain")


@dataclass
class Measured:
    """Per decode step: its wall time, the hops' summed reported compute, and the step less that."""

    step_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    beyond_ms: list[float] = field(default_factory=list)  # links, relays, software overhead

    def extend(self, other: Measured) -> None:
        self.step_ms += other.step_ms
        self.compute_ms += other.compute_ms
        self.beyond_ms += other.beyond_ms


def low(xs: list[float]) -> float:
    """The lower quartile: the machine is shared, and other work only ever adds to a step."""
    return statistics.quantiles(xs, n=4)[0] if len(xs) > 1 else xs[0]


async def measure(lab: LinkLab, key: Any, sha256: str, mode: str, tokens: int) -> Measured:  # noqa: ANN401
    """Prefill PROMPT, then `tokens` greedy decode steps in `mode`, each timed."""
    session = os.urandom(16)
    plan = [RouteHop(n, u, a, b) for n, u, a, b in lab.plan()]
    hops = minted_hops(key, SessionId(session), sha256, plan)
    client = RouteClient(hops, session_id=session, mode=mode, ssl_context=lab.client_ssl())
    out = Measured()
    try:
        tok = (await client.forward(PROMPT, SamplingParams())).token
        for _ in range(2):  # warm the connections (and the lane, in chain mode)
            tok = (await client.forward([tok], SamplingParams())).token
        for _ in range(tokens):
            before = sum(s.compute_ms for s in client.hop_stats)
            t0 = time.perf_counter()
            tok = (await client.forward([tok], SamplingParams())).token
            out.step_ms.append((time.perf_counter() - t0) * 1e3)
            out.compute_ms.append(sum(s.compute_ms for s in client.hop_stats) - before)
            out.beyond_ms.append(out.step_ms[-1] - out.compute_ms[-1])
    finally:
        await client.close()
    return out


def predict(
    manifest: Manifest, cal: Calibration, n_hops: int, latency_ms: float, rate_mbit: float | None, mode: str
) -> float:
    """The simulator's decode step (ms) for `n_hops` equal nodes behind the harness's links."""
    spec = spec_from_manifest(manifest)
    placements = plan_loopback(manifest, n_hops)
    gbps = rate_mbit / 1e3 if rate_mbit is not None else 100.0
    fleet = loopback_fleet(cal, n_hops, latency_ms, bandwidth_gbps=gbps, burst_bytes=TBF_BURST_BYTES)
    _, step, _ = predict_route(spec, fleet, placements, context=len(PROMPT), mode=mode)
    return step


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def run(args: argparse.Namespace, manifest: Manifest, path: str) -> dict[str, Any]:
    key = generate_key()
    pub = public_key_b64(key.public_key())
    workdir = Path(tempfile.mkdtemp(prefix="bench-links-"))
    t_start = time.monotonic()
    spec = spec_from_manifest(manifest)
    calib: dict[str, Measured] = {}
    samples: dict[tuple[int, float, float, str], Measured] = {}
    windows: dict[int, list[tuple[int, int]]] = {
        n: [(p.layer_start, p.layer_end) for p in plan_loopback(manifest, n)] for n in args.hops
    }
    windows[1] = [(0, manifest.n_layers)]  # the calibration: one hop, the whole model
    with contextlib.ExitStack() as stack:
        labs: dict[int, LinkLab] = {}
        for n in sorted(windows):  # every route up at once: the rounds interleave them
            wd = workdir / f"{n}hop"
            wd.mkdir()
            labs[n] = stack.enter_context(LinkLab(n, wd, tls=not args.no_tls))
            labs[n].start_hops(path, windows[n], pub, backend=args.backend, threads=args.threads,
                               kv_budget_mb=KV_BUDGET_MB)  # fmt: skip
        log(f"{sum(len(w) for w in windows.values())} hops up in {time.monotonic() - t_start:.0f} s")
        # interleaved rounds (the calibration route in each): the machine is shared and its load drifts
        for r in range(args.rounds):
            labs[1].set_delay(0.0)  # no delay, no rate limit
            for mode in args.modes:
                calib.setdefault(mode, Measured()).extend(
                    await measure(labs[1], key, manifest.sha256, mode, args.tokens)
                )
            for n in args.hops:
                for rate in args.rates:
                    labs[n].shape(rate)
                    for delay in args.delays:
                        labs[n].set_delay(delay, delay * args.jitter)
                        for mode in args.modes:
                            m = await measure(labs[n], key, manifest.sha256, mode, args.tokens)
                            samples.setdefault((n, delay, rate, mode), Measured()).extend(m)
            log(f"round {r + 1}/{args.rounds} done at {time.monotonic() - t_start:.0f} s")

    # The layers and the head: the compute of the star route's hop (split by the bytes each reads).
    # Each mode's per-hop overhead: its steps less the compute its hop reported, step by step (a lone
    # hop in chain mode reports more compute than in star mode, the same work; a route of several
    # reports what star's hops do), so contention in one step moves neither figure much.
    compute = low((calib["star"] if "star" in calib else calib[args.modes[0]]).compute_ms)
    cal = {mode: calibrate_one_hop(spec, compute, compute + low(m.beyond_ms)) for mode, m in calib.items()}
    out: dict[str, Any] = {
        "model": manifest.name,
        "backend": args.backend,
        "threads": args.threads,
        "cpu": cpu_kind(),
        "tokens": args.tokens,
        "rounds": args.rounds,
        "tls": not args.no_tls,
        "jitter_fraction": args.jitter,
        "tbf_burst_bytes": TBF_BURST_BYTES,
        "calibration": "1 hop, 0 ms, unshaped",
        "calibration_compute_ms": round(compute, 3),
        "layer_step_ms": round(cal[args.modes[0]].layer_step_ms, 4),
        "head_step_ms": round(cal[args.modes[0]].head_step_ms, 3),
        **{f"hop_overhead_ms_{m}": round(c.hop_overhead_ms, 3) for m, c in cal.items()},
    }
    rows: list[dict[str, Any]] = []
    for (n, delay, rate, mode), m in samples.items():
        step = low(m.step_ms)
        jitter = delay * args.jitter
        # the relay's jitter is uniform per burst: on average half of it adds to each crossing
        pred = predict(manifest, cal[mode], n, delay + jitter / 2, rate, mode)
        measured, predicted = 1e3 / step, 1e3 / pred
        at_median = 1e3 / statistics.median(m.step_ms)
        rows.append({
            "hops": n,
            "delay_ms": delay,
            "jitter_ms": round(jitter, 3),
            "rate_mbit": rate,
            "mode": mode,
            "placement": " ".join(f"{a}:{b}" for a, b in windows[n]),
            "measured_step_ms": round(step, 2),
            "measured_step_ms_median": round(statistics.median(m.step_ms), 2),
            "measured_compute_ms": round(low(m.compute_ms), 2),
            "predicted_step_ms": round(pred, 2),
            "measured_tok_s": round(measured, 2),
            "predicted_tok_s": round(predicted, 2),
            "rel_error": round(abs(predicted - measured) / measured, 3),
            "rel_error_median": round(abs(predicted - at_median) / at_median, 3),
        })  # fmt: skip
        log(json.dumps(rows[-1]))
    errors = [r["rel_error"] for r in rows]
    out["topologies"] = rows
    out["simulator_topologies_unseen"] = len(rows)
    out["simulator_max_rel_error_unseen"] = max(errors) if errors else None
    out["simulator_median_rel_error_unseen"] = round(statistics.median(errors), 3) if errors else None
    # the same against each topology's median step (contention included)
    out["simulator_max_rel_error_unseen_vs_median_step"] = max(
        (r["rel_error_median"] for r in rows), default=None
    )
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8, help="decode steps per topology and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="native")
    ap.add_argument("--hops", type=lambda t: [int(x) for x in t.split(",")], default=[2, 3, 4])
    ap.add_argument("--delays", type=floats, default=[0.5, 5.0, 25.0], help="one-way ms")
    ap.add_argument("--rates", type=floats, default=[1000.0, 100.0, 20.0], help="Mbit/s each way")
    ap.add_argument("--modes", type=lambda t: t.split(","), default=list(MODES))
    ap.add_argument("--jitter", type=float, default=0.1, help="jitter as a fraction of the delay")
    ap.add_argument("--no-tls", action="store_true", help="plain HTTP between hops (default: mutual TLS)")
    args = ap.parse_args()
    if bad := [m for m in args.modes if m not in MODES]:
        ap.error(f"unknown modes {bad}")
    if reason := unusable():
        sys.exit(f"bench/links.py needs network namespaces: {reason}")
    path = str(packaged_model_path())
    manifest = build_manifest(path, hash_tensors=False)
    print(json.dumps(asyncio.run(run(args, manifest, path))))


if __name__ == "__main__":
    main()
