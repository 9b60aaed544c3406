"""What an idle hop costs the machine: CPU per decode step with OpenMP workers spinning vs sleeping.

    python bench/archive/idle_threads.py [--rounds 3] [--steps 60] [--gap-ms 30] [--worker-thread]

One native hop (SmolLM2 layers 10:20, 2 threads) decodes one position per step and then waits
`--gap-ms` (the other hops' turn in a 3-hop route), in a child process started with libgomp's default
(`GOMP_SPINCOUNT` 300,000 when nothing is set), with `OMP_WAIT_POLICY=PASSIVE`, or with the spin capped
at `GOMP_SPINCOUNT=10000` (what `agent serve` sets: passive waits also sleep at every op barrier of a
graph), alternately. The hop computes on the process's main thread (as the data plane's decode steps
did before its scheduler), or with --worker-thread in a thread pool (as agent/node/scheduler.py does
now: on 2 cores libgomp's spin does not show there). Reports, per setting, the median over rounds of the process's CPU ms per step
(all threads: what it takes from the other hops) and of the step's own compute ms. Prints JSON last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, resource, sys, time
import numpy as np
from agent.artifacts.manifest import build_manifest
from agent.artifacts.packaged import packaged_model_path
from agent.backends import load_backend
from agent.backends.base import ShardSpec, StepInput
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams

import concurrent.futures

steps, gap, in_thread = int(sys.argv[1]), float(sys.argv[2]) / 1e3, sys.argv[3] == "1"
pool = concurrent.futures.ThreadPoolExecutor(4)
path = str(packaged_model_path())
be = load_backend("native", ShardSpec(path, 10, 20, build_manifest(path, hash_tensors=False), n_threads=2))
sid = SessionId(os.urandom(16))
be.open_session(sid, 1024)
h = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float32)

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def step(p):
    if in_thread:
        return pool.submit(be.forward, StepInput(sid, p, hidden=h, sampling=SamplingParams())).result()
    return be.forward(StepInput(sid, p, hidden=h, sampling=SamplingParams()))

for p in range(8):
    step(p)
comp, c0 = 0.0, cpu()
for p in range(8, 8 + steps):
    t = time.perf_counter()
    step(p)
    comp += time.perf_counter() - t
    time.sleep(gap)
print(json.dumps({"cpu_ms": (cpu() - c0) / steps * 1e3, "compute_ms": comp / steps * 1e3}))
"""

SETTINGS = {
    "spinning": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "capped": {"GOMP_SPINCOUNT": "10000"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--gap-ms", type=float, default=30.0)
    ap.add_argument(
        "--worker-thread", action="store_true", help="compute in a thread pool, not the main thread"
    )
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    base["PYTHONPATH"] = str(REPO)
    got: dict[str, dict[str, list[float]]] = {s: {"cpu_ms": [], "compute_ms": []} for s in SETTINGS}
    for _ in range(args.rounds):
        for name, env in SETTINGS.items():
            r = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    CHILD,
                    str(args.steps),
                    str(args.gap_ms),
                    str(int(args.worker_thread)),
                ],
                env={**base, **env},
                cwd=REPO,
                capture_output=True,
                text=True,
                check=True,
            )
            for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items():
                got[name][k].append(v)
    out: dict[str, object] = {
        "steps": args.steps,
        "gap_ms": args.gap_ms,
        "worker_thread": args.worker_thread,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    for name, d in got.items():
        for k, xs in d.items():
            out[f"{k}_per_step_{name}"] = round(statistics.median(xs), 2)
            out[f"{k}_per_step_{name}_rounds"] = [round(x, 2) for x in xs]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
