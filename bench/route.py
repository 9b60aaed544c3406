"""Benchmark of the runtime core: 3-hop torch route vs one process vs llama-cpp-python (prints JSON last).

    python bench/route.py [--tokens 64] [--threads 2] [--rounds 3]

All figures come from one run on one machine; compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.artifacts.manifest import build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.backends import available_backends, load_backend  # noqa: E402
from agent.backends.base import ShardSpec, StepInput  # noqa: E402
from agent.client.recovery import minted_hops  # noqa: E402
from agent.client.route import Hop, RouteClient  # noqa: E402
from agent.dev.cluster import health  # noqa: E402
from agent.procs import stop  # noqa: E402
from agent.wire.ids import SessionId  # noqa: E402
from agent.wire.routetoken import RouteHop, generate_key, public_key_b64  # noqa: E402
from agent.wire.sampling import SamplingParams  # noqa: E402
from bench._common import cpu_kind, start_serve  # noqa: E402

PROMPT_TEXT = "Write a long story about a lighthouse keeper who kept a log of every ship."


def bound_hops(key, session: bytes, sha256: str, hops: list[tuple[str, int, int, str]]) -> list[Hop]:  # noqa: ANN001
    """One token per hop, each naming the next (chain mode forwards only there)."""
    plan = [RouteHop(n, u, a, b) for u, a, b, n in hops]
    return minted_hops(key, session, sha256, plan)


def decode_tok_s(backend, prompt: list[int], n: int) -> float:  # noqa: ANN001
    sid = SessionId(os.urandom(16))
    backend.open_session(sid, 4096)
    r = backend.forward(StepInput(sid, 0, token_ids=np.array(prompt), sampling=SamplingParams()))
    tok, pos = r.token, len(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        r = backend.forward(StepInput(sid, pos, token_ids=np.array([tok]), sampling=SamplingParams()))
        tok, pos = r.token, pos + 1
    dt = time.perf_counter() - t0
    backend.close_session(sid)
    return n / dt


async def route_decode(hops_for, prompt: list[int], n: int, mode: str) -> tuple[float, RouteClient]:  # noqa: ANN001
    session = os.urandom(16)
    client = RouteClient(hops_for(session), session_id=session, mode=mode)
    resp = await client.forward(prompt, SamplingParams())
    t0 = time.perf_counter()
    tok = resp.token
    for _ in range(n):
        tok = (await client.forward([tok], SamplingParams())).token
    return n / (time.perf_counter() - t0), client


async def step_ms_at(hops_for, ctx: int, steps: int = 16) -> float:  # noqa: ANN001
    """Median decode step time once `ctx` positions are in every hop's KV."""
    session = os.urandom(16)
    client = RouteClient(hops_for(session), session_id=session, mode="chain", capacity=ctx + steps + 1)
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 40000, size=ctx).tolist()
    for off in range(0, ctx, 512):
        resp = await client.forward(ids[off : off + 512], SamplingParams())
    times = []
    tok = resp.token
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = (await client.forward([tok], SamplingParams())).token
        times.append(time.perf_counter() - t0)
    await client.close()
    return float(np.median(times) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = str(packaged_model_path())
    manifest = build_manifest(path, hash_tensors=False)
    from agent.client.tokenizer import ChatTokenizer

    prompt = ChatTokenizer(path).encode_chat([{"role": "user", "content": PROMPT_TEXT}])
    out: dict[str, float | int | str] = {
        "cpu": cpu_kind(),
        "model": manifest.name,
        "threads": args.threads,
        "tokens": args.tokens,
    }

    llama = load_backend("llamacpp", ShardSpec(path, 0, 30, manifest, n_threads=args.threads))
    single = load_backend("torch", ShardSpec(path, 0, 30, manifest, n_threads=args.threads))
    # The no-KV baseline: without a cache every new token re-runs the whole 2,048-token sequence.
    sid = SessionId(os.urandom(16))
    single.open_session(sid, 4096)
    ids = np.random.default_rng(1).integers(100, 40000, size=2048)
    t0 = time.perf_counter()
    single.forward(StepInput(sid, 0, token_ids=ids, sampling=SamplingParams()))
    out["recompute_step_ms_ctx2048"] = round((time.perf_counter() - t0) * 1e3, 1)
    single.close_session(sid)

    key = generate_key()
    logdir = Path(tempfile.mkdtemp(prefix="bench-route-"))
    procs, hops = [], []
    samples: dict[str, list[float]] = {
        "llamacpp": [],
        "torch_single": [],
        "torch_3hop_star": [],
        "torch_3hop_chain": [],
        "native_3hop_http": [],
    }
    try:
        for a, b in ((0, 10), (10, 20), (20, 30)):
            # torch's OpenMP workers spin after each op; with three torch processes on two cores that
            # steals the core the active hop needs, so they wait passively (ggml's pool is unaffected).
            proc, url, node = start_serve(
                path,
                f"{a}:{b}",
                "torch",
                public_key_b64(key.public_key()),
                args.threads,
                logdir,
                extra_env={"OMP_WAIT_POLICY": "PASSIVE"},
            )
            procs.append(proc)
            hops.append((url, a, b, node))

        def hops_for(session: bytes) -> list[Hop]:
            return bound_hops(key, session, manifest.sha256, hops)

        # The same route on the native (ggml) backend, when built: the P1 figure of the brief.
        native_hops: list[tuple[str, int, int, str]] = []
        if "native" in available_backends():
            for a, b in ((0, 10), (10, 20), (20, 30)):
                proc, url, node = start_serve(
                    path, f"{a}:{b}", "native", public_key_b64(key.public_key()), args.threads, logdir
                )
                procs.append(proc)
                native_hops.append((url, a, b, node))

        def native_hops_for(session: bytes) -> list[Hop]:
            return bound_hops(key, session, manifest.sha256, native_hops)

        async def run() -> None:
            decode_tok_s(llama, prompt, 8)  # warm-ups
            decode_tok_s(single, prompt, 4)
            for mode in ("star", "chain"):
                _, c = await route_decode(hops_for, prompt, 4, mode)
                await c.close()
            if native_hops:
                _, c = await route_decode(native_hops_for, prompt, 4, "star")
                await c.close()
            # Interleaved rounds, medians reported: the machine is shared and noisy.
            for _ in range(args.rounds):
                samples["llamacpp"].append(decode_tok_s(llama, prompt, args.tokens))
                samples["torch_single"].append(decode_tok_s(single, prompt, args.tokens))
                for mode in ("star", "chain"):
                    tps, c = await route_decode(hops_for, prompt, args.tokens, mode)
                    await c.close()
                    samples[f"torch_3hop_{mode}"].append(tps)
                if native_hops:
                    tps, c = await route_decode(native_hops_for, prompt, args.tokens, "star")
                    await c.close()
                    samples["native_3hop_http"].append(tps)
            # Per-step wire bytes: decode 32 steps and divide each hop's received frame bytes by the steps.
            # The budget keys (P4, wire_budget_bytes) are about f16 seams, so those frames are f16
            # explicitly; the route's default seam (f32 since bench/seam.py) is measured beside them.
            for mode, dtype in (("star", "f16"), ("chain", "f16"), ("star", "f32")):
                session = os.urandom(16)
                c = RouteClient(hops_for(session), session_id=session, mode=mode, hidden_dtype=dtype)
                tok = (await c.forward(prompt, SamplingParams())).token
                before = [health(u)["bytes_in"] for u, *_ in hops]
                for _ in range(32):
                    tok = (await c.forward([tok], SamplingParams())).token
                after = [health(u)["bytes_in"] for u, *_ in hops]
                await c.close()
                per_hop = [(a - b) / 32 for a, b in zip(after, before, strict=True)]
                # Hop 1 receives token ids; hops 2 and 3 receive the boundary state (the seam frames).
                if dtype == "f32":
                    out[f"wire_bytes_per_decode_step_per_hop_f32_{mode}"] = round(max(per_hop[1:]), 1)
                    continue
                out[f"wire_bytes_per_decode_step_per_hop_{mode}"] = round(max(per_hop[1:]), 1)
                out[f"wire_bytes_per_decode_step_hop1_ids_{mode}"] = round(per_hop[0], 1)
            out["step_ms_ctx64"] = round(await step_ms_at(hops_for, 64), 2)
            out["step_ms_ctx2048"] = round(await step_ms_at(hops_for, 2048), 2)

        asyncio.run(run())
    finally:
        stop(procs)
    for name, xs in samples.items():
        if xs:
            out[f"decode_tok_s_{name}"] = round(float(np.median(xs)), 2)
    if samples["native_3hop_http"]:
        out["ratio_native_3hop_http_vs_llamacpp"] = round(
            out["decode_tok_s_native_3hop_http"] / out["decode_tok_s_llamacpp"], 3
        )
    # The headline figures are for the client's default mode (star; docs/protocol.md says why).
    default_mode = inspect.signature(RouteClient).parameters["mode"].default
    out["route_mode_default"] = default_mode
    out["decode_tok_s_torch_3hop"] = out[f"decode_tok_s_torch_3hop_{default_mode}"]
    out["ratio_3hop_vs_single"] = round(out["decode_tok_s_torch_3hop"] / out["decode_tok_s_torch_single"], 3)
    out["wire_bytes_per_decode_step_per_hop"] = out[f"wire_bytes_per_decode_step_per_hop_{default_mode}"]
    out["ctx_ratio"] = round(out["step_ms_ctx2048"] / out["step_ms_ctx64"], 3)
    out["recompute_vs_cached_ctx2048"] = round(out["recompute_step_ms_ctx2048"] / out["step_ms_ctx2048"], 1)
    out["wire_budget_bytes"] = manifest.boundary_dim * 2 + 256
    print(json.dumps(out))


if __name__ == "__main__":
    main()
