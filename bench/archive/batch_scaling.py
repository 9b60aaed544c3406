"""What a batch of rows costs against one row, native executor vs llama.cpp (prints JSON last).

    python bench/archive/batch_scaling.py [--threads 2] [--steps 30]

Native: SmolLM2 window 10:20 (a middle hop), k sessions each stepping one position in one
`forward_batch` call (continuous batching), and one session stepping k positions at once. llama.cpp:
the whole model in one llama-cpp-python process, k positions per `eval` (with its output head on the
last row). Both after a 32-position prefill, `--threads` threads. The ratios say how much a batch of 8
saves per row on this CPU: the bound on what batching sessions can add to a served route's aggregate
(docs/native.md, "What batching buys on a CPU"; issue 13).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.artifacts.manifest import build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.backends import load_backend  # noqa: E402
from agent.backends.base import ShardSpec, StepInput  # noqa: E402

KS = (1, 2, 4, 8)
PREFILL = 32


def native(path: str, threads: int, steps: int) -> dict[str, float]:
    be = load_backend(
        "native", ShardSpec(path, 10, 20, build_manifest(path, hash_tensors=False), n_threads=threads)
    )
    rng = np.random.default_rng(0)
    d = be.boundary_dim
    out: dict[str, float] = {}
    try:
        for k in KS:
            sids = [bytes([k, i]) * 8 for i in range(k)]
            for s in sids:
                be.open_session(s, 1024)
                be.forward(StepInput(s, 0, hidden=rng.standard_normal((PREFILL, d)).astype(np.float32)))
            t0 = time.perf_counter()
            for j in range(steps):
                batch = [
                    StepInput(s, PREFILL + j, hidden=rng.standard_normal((1, d)).astype(np.float32))
                    for s in sids
                ]
                if k == 1:
                    be.forward(batch[0])
                else:
                    be.forward_batch(batch)
            out[f"native_ms_{k}_sessions"] = round((time.perf_counter() - t0) / steps * 1e3, 3)
            s = sids[0]
            pos = PREFILL + steps
            t0 = time.perf_counter()
            for _ in range(steps):
                be.forward(StepInput(s, pos, hidden=rng.standard_normal((k, d)).astype(np.float32)))
                pos += k
            out[f"native_ms_1_session_{k}_rows"] = round((time.perf_counter() - t0) / steps * 1e3, 3)
            for s in sids:
                be.close_session(s)
    finally:
        be.close()
    return out


ROUTE = ((0, 10), (10, 20), (20, 30))  # bench/served.py's hops


def route_windows(path: str, threads: int, steps: int) -> dict[str, float]:
    """Each hop window of bench/served.py's route stepping 1 and 8 sessions (ids into the first, the
    last sampling greedily): the compute a served round costs when the hops take turns on one box, so
    `route_ceiling_tok_s_8` is the most 8 sessions could get there with no overhead at all."""
    manifest = build_manifest(path, hash_tensors=False)
    rng = np.random.default_rng(1)
    out: dict[str, float] = {}
    for a, b in ROUTE:
        be = load_backend("native", ShardSpec(path, a, b, manifest, n_threads=threads))
        d = be.boundary_dim

        def step(s: bytes, pos: int, n: int, first: bool = a == 0, d: int = d) -> StepInput:
            if first:
                return StepInput(s, pos, token_ids=rng.integers(300, 30000, n).astype(np.int32))
            return StepInput(s, pos, hidden=rng.standard_normal((n, d)).astype(np.float32))

        try:
            for k in (1, 8):
                sids = [bytes([a, k, i]) + bytes(13) for i in range(k)]
                for s in sids:
                    be.open_session(s, 1024)
                    be.forward(step(s, 0, PREFILL))
                t0 = time.perf_counter()
                for j in range(steps):
                    batch = [step(s, PREFILL + j, 1) for s in sids]
                    be.forward(batch[0]) if k == 1 else be.forward_batch(batch)
                out[f"window_{a}_{b}_ms_{k}_sessions"] = round((time.perf_counter() - t0) / steps * 1e3, 3)
                for s in sids:
                    be.close_session(s)
        finally:
            be.close()
    for k in (1, 8):
        total = sum(out[f"window_{a}_{b}_ms_{k}_sessions"] for a, b in ROUTE)
        out[f"route_ms_{k}_sessions"] = round(total, 3)
        out[f"route_ceiling_tok_s_{k}"] = round(k / total * 1e3, 2)
    return out


def llamacpp(path: str, threads: int, steps: int) -> dict[str, float]:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=path, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    out: dict[str, float] = {}
    try:
        for k in KS:
            llm.reset()
            llm.eval(list(range(100, 100 + PREFILL)))
            t0 = time.perf_counter()
            for j in range(steps):
                llm.eval(list(range(300 + j * k, 300 + (j + 1) * k)))
            out[f"llamacpp_ms_{k}_rows"] = round((time.perf_counter() - t0) / steps * 1e3, 3)
    finally:
        llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    path = str(packaged_model_path())
    res: dict[str, float] = {}
    res.update(native(path, args.threads, args.steps))
    res.update(route_windows(path, args.threads, args.steps))
    res.update(llamacpp(path, args.threads, args.steps))
    k = KS[-1]
    res[f"native_{k}_sessions_over_1"] = round(
        res[f"native_ms_{k}_sessions"] / res["native_ms_1_sessions"], 3
    )
    res[f"native_{k}_rows_over_1"] = round(
        res[f"native_ms_1_session_{k}_rows"] / res["native_ms_1_session_1_rows"], 3
    )
    res[f"llamacpp_{k}_rows_over_1"] = round(res[f"llamacpp_ms_{k}_rows"] / res["llamacpp_ms_1_rows"], 3)
    # what served.py's ratio_served8_vs_llamacpp8 could reach if the route cost nothing but its compute
    res["route_ceiling_8_vs_llamacpp_8_rows"] = round(
        res["route_ceiling_tok_s_8"] / (k / res[f"llamacpp_ms_{k}_rows"] * 1e3), 3
    )
    print(json.dumps({"threads": args.threads, "steps": args.steps, **res}))


if __name__ == "__main__":
    main()
