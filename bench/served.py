"""The served route against one llama.cpp process, measured in one run on one machine (prints JSON last).

    python bench/served.py [--threads 2] [--tokens 48] [--rounds 2] [--mode MODE] [--no-playground]
                           [--serve-env K=V ...]

llama-cpp-python runs in this process (one `Llama`, `--threads` threads; the batched figure drives 8
sequences through its low-level batch API). The served route is 3 real `agent serve` processes on
127.0.0.1 (native backend, layers 0:10 / 10:20 / 20:30, `--threads` each) driven by
`agent.client.route.RouteClient` with the arguments the control plane gives it (its route mode, chain,
and seam dtype). Decode figures are medians of interleaved rounds (the machine is shared: compare ratios).

Keys (issue 13): decode_tok_s_llamacpp, decode_tok_s_served_3hop, ratio_served_vs_llamacpp,
per_hop_overhead_ms (step wall time minus the hops' own compute, per hop; split into per_hop_wire_ms,
per_hop_hop_python_ms and per_hop_client_ms, see Decode), aggregate_tok_s_8_sessions_served,
ratio_8_vs_1_served, decode_tok_s_llamacpp_batched_8, ratio_served8_vs_llamacpp8,
itl_p50_ms_idle / itl_p95_ms_while_prefill / itl_ratio (4 sessions decoding while a 2,000-token prompt
arrives; prefill_ms_2000_while_decoding against prefill_ms_2000_alone, the same prompt on the same hops
with nothing else running: prefill_ratio_while_decoding), playground_tok_s /
route_client_tok_s_playground_route / ratio_playground_vs_route_client (an answer over the playground
websocket of a live control plane vs the route client on the same hops), and
default_seam_top1_agreement (bench/seam.py's figure, when that script exists). Issue 32's headline:
control_plane_tok_s (the playground's answer) and api_tok_s_control_plane (a streamed
/v1/chat/completions) over the agents the control plane enrolled and placed, and their ratios to the bare
serve route timed in the same rounds (bench_route_tok_s_same_rounds; ratio_control_plane_vs_bench_route,
ratio_api_vs_bench_route), since rounds minutes apart on these shared cores differ by up to 2x;
aggregate_tok_s_8_sessions_control_plane (8 route-client sessions at once on those agents' hops) and
ratio_served8_vs_llamacpp8_control_plane (against llama.cpp's 8 sequences). The control plane's own
cost: web_cpu_ms_per_token_playground / web_cpu_ms_per_token_api (the web process's CPU, all threads,
per token of an answer) and api_tok_s_control_plane_plain_http (the API's answer read with http.client
instead of the openai SDK, whose parsing shares the hops' cores in this bench).
Prefix snapshots (issue 32), on the same control plane's agents, each round with a new ~1,500-token
system prompt (shared_prefix_tokens: the tokens the control plane counts as shareable):
ttft_ms_no_prefix_reuse (user A's streamed /v1/chat/completions, the system prompt seen for the first
time anywhere) and ttft_ms_shared_prefix_new_user (user B, another user with a key of their own, the
same system prompt and another question: restored from the hops' snapshots), ttft_ratio_shared_prefix
(B over A, target <= 0.25), x_swarm's prefix_hit for both (prefix_hit_*_rounds), and as the miss's
reference ttft_ms_unshared_same_length (another such document as user A's message, never shared) and
ttft_ratio_prefix_miss_vs_unshared (what saving the prefix adds to the first sender's TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.artifacts.manifest import build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.backends.libggswarm import library_path  # noqa: E402
from agent.client.recovery import minted_hops  # noqa: E402
from agent.client.route import RouteClient  # noqa: E402
from agent.client.tokenizer import ChatTokenizer  # noqa: E402
from agent.defaults import CONTROL_PLANE_ROUTE_MODE, ROUTE_MODES  # noqa: E402
from agent.eventloop import loop_name  # noqa: E402
from agent.procs import stop  # noqa: E402
from agent.wire.routetoken import RouteHop, generate_key, public_key_b64  # noqa: E402
from bench._common import cpu_kind, start_serve  # noqa: E402
from bench._llamacpp import BATCH, LlamaCpp  # noqa: E402
from bench._prefix import api_user, shared_prefix_ttft  # noqa: E402
from bench._served_route import (  # noqa: E402
    FLOORS,
    GREEDY,
    Route,
    decode_once,
    decode_sessions,
    floor_decode,
    itl_under_prefill,
)
from bench.hop_floor import start_route as floor_route  # noqa: E402

RANGES = [(0, 10), (10, 20), (20, 30)]
STORY = [
    {"role": "user", "content": "Write a long story about a lighthouse keeper who kept a log of every ship."}
]
# the mode the control plane drives its routes in (webapp settings.ROUTE_MODE defaults to it)
DEFAULT_MODE = CONTROL_PLANE_ROUTE_MODE


# -- the playground, as the browser gets it ----------------------------------------------------------------
def playground(args: argparse.Namespace, tok: ChatTokenizer) -> dict[str, Any]:
    """tok/s of an answer over the playground websocket of a live control plane (3 agents), vs the route
    client's own tok/s on the same hops, interleaved, greedy, same messages."""
    import openai
    import psutil

    from agent.wire.routetoken import load_private_key
    from bench.api import api_stream, api_stream_raw, create_key, playground_stream
    from webapp.devcluster import control_plane

    async def ws_answer(s: Any, n: int) -> tuple[float, int, list[dict[str, Any]]]:
        return await playground_stream(
            s.base, s.admin.cookie("sessionid"), s.model["id"], STORY[0]["content"], n
        )

    async def route_answer(s: Any, route: list[dict[str, Any]], n: int, key: Any = None) -> float:
        key = key or load_private_key(s.data_dir / "route_key.pem")
        session = os.urandom(16)
        plan = [RouteHop(h["node"], h["url"], h["layer_start"], h["layer_end"]) for h in route]
        hops = minted_hops(key, session, s.model["sha256"], plan, 600)  # each names the next (chain)
        # the mode the playground drives the same hops in (the control plane's)
        c = RouteClient(hops, tok, session_id=session, mode=DEFAULT_MODE)
        first = last = 0.0
        count = 0
        try:
            async for ev in c.chat(STORY, GREEDY, n):
                if ev.text:
                    last = time.perf_counter()
                    first = first or last
                if ev.done:
                    count = int(ev.telemetry["n_generated"])
        finally:
            await c.close()
        return (count - 1) / (last - first) if last > first else 0.0

    path = str(packaged_model_path("smollm2"))
    bare_key = generate_key()
    bare: list[dict[str, Any]] = []
    procs = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-served-") as tmp,
        control_plane(Path(tmp), DEFAULT_BACKEND="native") as s,
    ):
        s.serve_smollm2(3, threads=args.threads)  # the serve route's threads per hop (issue 32)
        # the bare serve route again, beside the control plane's, so each round times both (issue 32)
        for a, b in RANGES:
            proc, url, node = start_serve(
                path, f"{a}:{b}", "native", public_key_b64(bare_key.public_key()), args.threads, Path(tmp)
            )
            procs.append(proc)
            bare.append({"node": node, "url": url, "layer_start": a, "layer_end": b})
        _, _, route = asyncio.run(ws_answer(s, 4))  # warm-up, and the route the playground uses
        if any("node" not in h for h in route):
            raise RuntimeError(f"the playground's start event names no node per hop: {route}")
        api_key = create_key(s.admin, "bench")
        api = openai.OpenAI(base_url=s.base + "/v1", api_key=api_key, max_retries=0, timeout=300)
        api_stream(api, s.model["name"], STORY, 4)  # warm-up
        api_stream_raw(s.base, api_key, s.model["name"], STORY, 4)
        web = psutil.Process(s.web.pid)

        def web_cpu_s() -> float:
            t = web.cpu_times()
            return float(t.user + t.system)

        pg, rc, ap, br, n_pg = [], [], [], [], 0
        raw: list[float] = []
        # the web process's CPU per token of each answer (all its threads; issue 32: its per-token work
        # shares the hops' cores here, and it is the same for the playground and the API)
        web_pg: list[float] = []
        web_api: list[float] = []
        agg8: list[float] = []  # 8 sessions at once on the control plane's agents (issue 32)
        cp_key = load_private_key(s.data_dir / "route_key.pem")
        ids = tok.encode_chat(STORY)

        async def eight_sessions(hops: list[dict[str, Any]], n: int) -> float:
            cp = Route(
                cp_key,
                s.model["sha256"],
                [(h["url"], h["layer_start"], h["layer_end"], h["node"]) for h in hops],
                DEFAULT_MODE,
            )
            try:
                return await decode_sessions(cp, ids, n, BATCH)
            finally:
                await cp.close()  # its transport belongs to this loop

        # users A and B, each with a key of their own, for the shared system prompt (issue 32)
        prefix_users = (api_user(s, "prefix-a"), api_user(s, "prefix-b"))
        prefix_rounds: list[dict[str, Any]] = []
        # warm-up, discarded: the hops' first long prefill, save and restore (buffers, first snapshot)
        shared_prefix_ttft(prefix_users, s.model["name"], tok)
        try:
            asyncio.run(route_answer(s, bare, 4, bare_key))  # warm-up
            for _ in range(args.rounds):
                c0 = web_cpu_s()
                rate, n_pg, route = asyncio.run(ws_answer(s, args.tokens))
                web_pg.append((web_cpu_s() - c0) * 1e3 / max(1, n_pg))
                pg.append(rate)
                rc.append(asyncio.run(route_answer(s, route, args.tokens)))
                c0 = web_cpu_s()
                _, api_rate, n_api = api_stream(api, s.model["name"], STORY, args.tokens)
                web_api.append((web_cpu_s() - c0) * 1e3 / max(1, n_api))
                ap.append(api_rate)
                raw.append(api_stream_raw(s.base, api_key, s.model["name"], STORY, args.tokens)[0])
                br.append(asyncio.run(route_answer(s, bare, args.tokens, bare_key)))
                prefix_rounds.append(shared_prefix_ttft(prefix_users, s.model["name"], tok))
                agg8.append(asyncio.run(eight_sessions(route, args.tokens // 2)))
        finally:
            stop(procs)
    p, r, a, b = (statistics.median(x) for x in (pg, rc, ap, br))
    miss = [x["no_reuse_ms"] for x in prefix_rounds]
    hit = [x["new_user_ms"] for x in prefix_rounds]
    plain = [x["no_sharing_ms"] for x in prefix_rounds]
    miss_ms, hit_ms, plain_ms = statistics.median(miss), statistics.median(hit), statistics.median(plain)
    return {
        "shared_prefix_tokens": int(statistics.median(x["shared_prefix_tokens"] for x in prefix_rounds)),
        "ttft_ms_no_prefix_reuse": round(miss_ms, 1),
        "ttft_ms_shared_prefix_new_user": round(hit_ms, 1),
        "ttft_ratio_shared_prefix": round(hit_ms / miss_ms, 3) if miss_ms else None,
        # the same length as a user message (never shared): what a miss's save of the prefix adds
        "ttft_ms_unshared_same_length": round(plain_ms, 1),
        "ttft_ratio_prefix_miss_vs_unshared": round(miss_ms / plain_ms, 3) if plain_ms else None,
        "ttft_ms_no_prefix_reuse_rounds": [round(x, 1) for x in miss],
        "ttft_ms_unshared_same_length_rounds": [round(x, 1) for x in plain],
        "ttft_ms_shared_prefix_new_user_rounds": [round(x, 1) for x in hit],
        # x_swarm's word for each: A must have missed (a new system prompt), B hit
        "prefix_hit_no_reuse_rounds": [x["hit_a"] for x in prefix_rounds],
        "prefix_hit_new_user_rounds": [x["hit_b"] for x in prefix_rounds],
        "prefix_shared_tokens_told_rounds": [x["told_a"] for x in prefix_rounds],
        "aggregate_tok_s_8_sessions_control_plane": round(statistics.median(agg8), 2),
        "aggregate_tok_s_8_sessions_control_plane_rounds": [round(x, 2) for x in agg8],
        "playground_hops": len(route),
        "playground_tokens": n_pg,
        "playground_tok_s": round(p, 2),
        "control_plane_tok_s": round(p, 2),
        "api_tok_s_control_plane": round(a, 2),
        # the same answers read without the openai SDK (its per-chunk parsing runs on these cores too)
        "api_tok_s_control_plane_plain_http": round(statistics.median(raw), 2),
        "api_tok_s_control_plane_plain_http_rounds": [round(x, 2) for x in raw],
        "web_cpu_ms_per_token_playground": round(statistics.median(web_pg), 3),
        "web_cpu_ms_per_token_api": round(statistics.median(web_api), 3),
        "route_client_tok_s_playground_route": round(r, 2),
        "ratio_playground_vs_route_client": round(p / r, 3) if r else None,
        "playground_tok_s_rounds": [round(x, 2) for x in pg],
        "api_tok_s_control_plane_rounds": [round(x, 2) for x in ap],
        "route_client_tok_s_playground_route_rounds": [round(x, 2) for x in rc],
        "bench_route_tok_s_same_rounds": round(b, 2),
        "bench_route_tok_s_same_rounds_rounds": [round(x, 2) for x in br],
        "ratio_control_plane_vs_bench_route": round(p / b, 3) if b else None,
        "ratio_api_vs_bench_route": round(a / b, 3) if b else None,
    }


def seam_agreement() -> tuple[float | None, str | None]:
    """bench/seam.py's default_seam_top1_agreement, run as a subprocess, when the script exists."""
    script = REPO / "bench" / "seam.py"
    if not script.is_file():
        return None, "bench/seam.py does not exist yet"
    r = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    try:
        value = json.loads(r.stdout.strip().splitlines()[-1])["default_seam_top1_agreement"]
    except (IndexError, ValueError, KeyError, TypeError):
        return None, f"bench/seam.py exited {r.returncode} without the key: {r.stderr.strip()[-300:]}"
    return (None if value is None else float(value)), None


def _median_rounds(samples: dict[str, list[float]], out: dict[str, Any], digits: int = 2) -> None:
    for name, xs in samples.items():
        if xs:
            out[name] = round(float(statistics.median(xs)), digits)
            out[name + "_rounds"] = [round(x, digits) for x in xs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="compute threads of llama.cpp and of every hop")
    ap.add_argument("--tokens", type=int, default=48, help="decode tokens per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians reported)")
    ap.add_argument("--mode", default=DEFAULT_MODE, choices=list(ROUTE_MODES), help="route mode measured")
    ap.add_argument(
        "--compare-modes", action="store_true", help="also time the other mode (1 and 8 sessions)"
    )
    ap.add_argument("--no-playground", action="store_true", help="skip the control plane (saves ~1 min)")
    ap.add_argument("--decode-only", action="store_true", help="1-session decode only (quick A/B runs)")
    ap.add_argument("--itl-only", action="store_true", help="only the ITL-under-prefill figures (A/B: both)")
    ap.add_argument("--no-seam", action="store_true", help="do not run bench/seam.py")
    ap.add_argument(
        "--no-itl", action="store_true", help="skip the ITL-under-prefill figures (quick A/B runs)"
    )
    ap.add_argument("--serve-env", action="append", default=[], metavar="K=V", help="extra env of the hops")
    ap.add_argument(
        "--ab-serve-env",
        action="append",
        metavar="K=V",
        help="also start a second route of 3 hops with this env; its 1-session decode is timed in the same "
        "rounds (keys ending _b): before/after in one run",
    )
    ap.add_argument(
        "--ab-checkout",
        type=Path,
        metavar="DIR",
        help="also start a second route whose hops run the agent of another checkout (e.g. a `git worktree` "
        "of the commit before a change; it loads this checkout's libggswarm unless --ab-serve-env names one)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also time bare relays of the same 3 shards (bench/hop_floor.py: WebSocket and blocking "
        "sockets, no protocol) in the same rounds: what the transport alone leaves of per_hop_overhead_ms",
    )
    ap.add_argument("--ab-http", action="store_true", help="route B's client posts every frame (no streams)")
    ap.add_argument(
        "--ab-no-bundles", action="store_true", help="route B's clients send every frame alone (no bundles)"
    )
    args = ap.parse_args()
    serve_env = dict(item.split("=", 1) for item in args.serve_env)
    # llama.cpp in this process runs with libgomp's defaults, as its users run it, unless --serve-env
    # names OpenMP settings for an A/B run (then both sides get them)
    omp = {k: v for k, v in serve_env.items() if k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if omp:
        os.environ.update(omp)
    ab_env = dict(item.split("=", 1) for item in args.ab_serve_env) if args.ab_serve_env is not None else None

    path = str(packaged_model_path())
    manifest = build_manifest(path, hash_tensors=False)
    tok = ChatTokenizer(path)
    prompt = tok.encode_chat(STORY)
    out: dict[str, Any] = {
        "model": manifest.name,
        "cpu": cpu_kind(),
        "threads": args.threads,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "mode": args.mode,
        "route_mode_default": DEFAULT_MODE,
        "serve_env": serve_env,
        "bench_omp_env": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ},
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    t_start = time.perf_counter()
    llama = LlamaCpp(path, args.threads)
    key = generate_key()
    logdir = Path(tempfile.mkdtemp(prefix="bench-served-"))
    procs, hops = [], []
    route_b = None
    samples: dict[str, list[float]] = {
        "decode_tok_s_llamacpp": [],
        "decode_tok_s_served_3hop": [],
        "per_hop_overhead_ms": [],
        "hop_compute_ms": [],
        "per_hop_wire_ms": [],
        "per_hop_hop_python_ms": [],
        "per_hop_client_ms": [],
        "hops_cpu_ms_per_step": [],
        "aggregate_tok_s_8_sessions_served": [],
        "decode_tok_s_llamacpp_batched_8": [],
    }
    other = "chain" if args.mode == "star" else "star"
    if args.compare_modes:
        samples[f"decode_tok_s_served_3hop_{other}"] = []
        samples[f"per_hop_overhead_ms_{other}"] = []
        samples[f"hop_compute_ms_{other}"] = []
        if not args.decode_only:
            samples[f"aggregate_tok_s_8_sessions_served_{other}"] = []
    if args.ab_checkout is not None:
        ab_env = {"GGSWARM_NATIVE_LIB": str(library_path()), **(ab_env or {})}
        out["ab_checkout"] = str(args.ab_checkout)
    ab = ab_env is not None or args.ab_http or args.ab_no_bundles
    if ab:
        samples["decode_tok_s_served_3hop_b"] = []
        samples["per_hop_overhead_ms_b"] = []
        samples["hop_compute_ms_b"] = []
        samples["hops_cpu_ms_per_step_b"] = []
        if not args.decode_only:
            samples["aggregate_tok_s_8_sessions_served_b"] = []
        out["ab_serve_env"], out["ab_http"], out["ab_no_bundles"] = (
            ab_env or {},
            args.ab_http,
            args.ab_no_bundles,
        )
    floors: dict[str, int] = {}
    if args.floor:
        for t in FLOORS:
            samples[f"per_hop_overhead_ms_floor_{t}"] = []
            samples[f"decode_tok_s_floor_{t}"] = []
    try:
        if args.floor:
            for t in FLOORS:
                # the hops' loop is the agent's (agent/eventloop.py); the blocking relay has none
                on_uvloop = t != "blocking" and loop_name() == "uvloop"
                fprocs, floors[t] = floor_route(
                    t + ("+uvloop" if on_uvloop else ""), path, args.threads, logdir
                )
                procs.extend(fprocs)
        for a, b in RANGES:
            proc, url, node = start_serve(
                path, f"{a}:{b}", "native", public_key_b64(key.public_key()), args.threads, logdir, serve_env
            )
            procs.append(proc)
            hops.append((url, a, b, node))
        route = Route(key, manifest.sha256, hops, args.mode)
        route.pids = [p.pid for p in procs]
        route_other = Route(key, manifest.sha256, hops, other)
        if ab:
            hops_b, pids_b = hops, [p.pid for p in procs]
            if ab_env is not None:
                pids_b = []
                hops_b = []
                for a, b in RANGES:
                    proc, url, node = start_serve(
                        path,
                        f"{a}:{b}",
                        "native",
                        public_key_b64(key.public_key()),
                        args.threads,
                        logdir,
                        {**serve_env, **ab_env},
                        repo=args.ab_checkout or REPO,
                    )
                    procs.append(proc)
                    pids_b.append(proc.pid)
                    hops_b.append((url, a, b, node))
            route_b = Route(
                key,
                manifest.sha256,
                hops_b,
                args.mode,
                http_only=args.ab_http,
                bundling=not args.ab_no_bundles,
            )
            route_b.pids = pids_b

        async def served_rounds() -> dict[str, float]:
            await decode_once(route, prompt, 4)  # warm-up: graphs built, connections open
            if route_b is not None:
                await decode_once(route_b, prompt, 4)
            await decode_sessions(route, prompt, 2, BATCH)
            if route_b is not None:
                await decode_sessions(route_b, prompt, 2, BATCH)
            for _ in range(0 if args.itl_only else args.rounds):
                samples["decode_tok_s_llamacpp"].append(llama.decode_tok_s(prompt, args.tokens))
                d = await decode_once(route, prompt, args.tokens)
                samples["hops_cpu_ms_per_step"].append(d.cpu_ms)
                samples["decode_tok_s_served_3hop"].append(d.tok_s)
                samples["per_hop_overhead_ms"].append(d.overhead_ms)
                samples["hop_compute_ms"].append(d.compute_ms)
                samples["per_hop_wire_ms"].append(d.wire_ms)
                samples["per_hop_hop_python_ms"].append(d.hop_python_ms)
                samples["per_hop_client_ms"].append(d.client_ms)
                for t, port in floors.items():
                    tok_s, overhead_ms = await floor_decode(t, port, args.tokens)
                    samples[f"decode_tok_s_floor_{t}"].append(tok_s)
                    samples[f"per_hop_overhead_ms_floor_{t}"].append(overhead_ms)
                if route_b is not None:
                    d = await decode_once(route_b, prompt, args.tokens)
                    samples["hops_cpu_ms_per_step_b"].append(d.cpu_ms)
                    samples["decode_tok_s_served_3hop_b"].append(d.tok_s)
                    samples["per_hop_overhead_ms_b"].append(d.overhead_ms)
                    samples["hop_compute_ms_b"].append(d.compute_ms)
                if args.compare_modes:
                    d = await decode_once(route_other, prompt, args.tokens)
                    samples[f"decode_tok_s_served_3hop_{other}"].append(d.tok_s)
                    samples[f"per_hop_overhead_ms_{other}"].append(d.overhead_ms)
                    samples[f"hop_compute_ms_{other}"].append(d.compute_ms)
                if args.decode_only:
                    continue
                samples["decode_tok_s_llamacpp_batched_8"].append(
                    llama.batched_tok_s(prompt, args.tokens // 2)
                )
                samples["aggregate_tok_s_8_sessions_served"].append(
                    await decode_sessions(route, prompt, args.tokens // 2, BATCH)
                )
                if route_b is not None:
                    samples["aggregate_tok_s_8_sessions_served_b"].append(
                        await decode_sessions(route_b, prompt, args.tokens // 2, BATCH)
                    )
                if args.compare_modes:
                    samples[f"aggregate_tok_s_8_sessions_served_{other}"].append(
                        await decode_sessions(route_other, prompt, args.tokens // 2, BATCH)
                    )
            if args.decode_only or args.no_itl:
                return {}
            itl = await itl_under_prefill(route, prompt, args.tokens // 2)
            if route_b is not None:  # the same measurement on route B, right after (keys ending _b)
                itl_b = await itl_under_prefill(route_b, prompt, args.tokens // 2)
                itl.update({f"{k}_b": v for k, v in itl_b.items()})
            return itl

        async def served() -> dict[str, float]:
            try:
                return await served_rounds()
            finally:
                for r in (route, route_b, route_other):
                    if r is not None:
                        await r.close()

        out.update(asyncio.run(served()))
    finally:
        stop(procs)
        with contextlib.suppress(Exception):
            llama.close()
    _median_rounds(samples, out)
    if args.itl_only:
        out["wall_s"] = round(time.perf_counter() - t_start, 1)
        print(json.dumps(out))
        return
    out["ratio_served_vs_llamacpp"] = round(out["decode_tok_s_served_3hop"] / out["decode_tok_s_llamacpp"], 3)
    if not args.decode_only:
        out["ratio_8_vs_1_served"] = round(
            out["aggregate_tok_s_8_sessions_served"] / out["decode_tok_s_served_3hop"], 3
        )
        out["ratio_served8_vs_llamacpp8"] = round(
            out["aggregate_tok_s_8_sessions_served"] / out["decode_tok_s_llamacpp_batched_8"], 3
        )
    if route_b is not None:
        out["ratio_served_vs_llamacpp_b"] = round(
            out["decode_tok_s_served_3hop_b"] / out["decode_tok_s_llamacpp"], 3
        )
        if not args.decode_only:
            out["ratio_8_vs_1_served_b"] = round(
                out["aggregate_tok_s_8_sessions_served_b"] / out["decode_tok_s_served_3hop_b"], 3
            )
            out["ratio_served8_vs_llamacpp8_b"] = round(
                out["aggregate_tok_s_8_sessions_served_b"] / out["decode_tok_s_llamacpp_batched_8"], 3
            )
    if args.compare_modes:
        out[f"ratio_served_vs_llamacpp_{other}"] = round(
            out[f"decode_tok_s_served_3hop_{other}"] / out["decode_tok_s_llamacpp"], 3
        )
        if not args.decode_only:
            out[f"ratio_served8_vs_llamacpp8_{other}"] = round(
                out[f"aggregate_tok_s_8_sessions_served_{other}"] / out["decode_tok_s_llamacpp_batched_8"], 3
            )
    if args.no_playground:
        out["playground_tok_s"] = None
        out["playground_reason"] = "skipped (--no-playground)"
    else:
        out.update(playground(args, tok))
        if out.get("decode_tok_s_llamacpp_batched_8"):
            # issue 32's figure: the 8 sessions on the agents the control plane enrolled and placed
            out["ratio_served8_vs_llamacpp8_control_plane"] = round(
                out["aggregate_tok_s_8_sessions_control_plane"] / out["decode_tok_s_llamacpp_batched_8"], 3
            )
    if args.no_seam:
        out["default_seam_top1_agreement"], out["default_seam_reason"] = None, "skipped (--no-seam)"
    else:
        value, reason = seam_agreement()
        out["default_seam_top1_agreement"] = value
        if reason:
            out["default_seam_reason"] = reason
    out["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
