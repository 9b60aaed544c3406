"""Failover benchmark: kill -9 a hop at random moments, recover at long context, fuzz a live `serve`.

    python bench/failover.py [--runs 20] [--tokens 128] [--context 2000] [--recoveries 5]
                             [--fuzz-frames 10000] [--threads 1] [--seed 0]
                             [--checkpoint-tokens 256] [--fast-replay] [--mode chain|star]

Three native SmolLM2 ranges with one spare each (six `serve` processes). Prints one JSON object last:
runs / identical_runs (answers equal to an undisturbed run after a kill -9 at a random token of a
random hop); at --context tokens, recovery_ms_p50 / _p95 of what the default policy does (kill -9
with a warm copy on a spare, and drain), recovery_ms_p95_snapshot (drain: KV handed off),
recovery_ms_p95_standby (kill -9: the spare's copy plus the steps since) and recovery_ms_p95_reprefill
(kill -9 with no copy: re-prefill from position 0); fuzz_frames, fuzz_5xx, fuzz_rss_growth_mb and
fuzz_other_session_exact (mutated frames against one live node while another session on it decodes).
Route clients run in the control plane's mode (chain) unless --mode says star. All figures come from
one run on one (shared) machine."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
from aiohttp import ClientError, ClientSession, ClientTimeout  # noqa: E402

from agent.artifacts.manifest import build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.client.recovery import RecoveryPolicy, ReplicaProvider, minted_hops  # noqa: E402
from agent.client.route import RouteClient  # noqa: E402
from agent.client.tokenizer import ChatTokenizer  # noqa: E402
from agent.defaults import CONTROL_PLANE_ROUTE_MODE, ROUTE_MODES  # noqa: E402
from agent.procs import Process, stop  # noqa: E402
from agent.wire.frames import Kind, Op, Request, encode_request  # noqa: E402
from agent.wire.routetoken import RouteHop, generate_key, mint, public_key_b64  # noqa: E402
from agent.wire.sampling import SamplingParams  # noqa: E402
from bench._common import cpu_kind, start_serve  # noqa: E402

RANGES = [(0, 10), (10, 20), (20, 30)]
POLICY = RecoveryPolicy(deadline_floor_s=2.0, give_up_s=120.0)  # main() applies the flags
MODE = CONTROL_PLANE_ROUTE_MODE  # the route clients' mode (--mode)


class Fleet:
    """Six serve processes, two per range; a killed or drained one is started again."""

    def __init__(self, model: str, key: Any, threads: int, logdir: Path) -> None:
        self.model, self.key, self.threads, self.logdir = model, key, threads, logdir
        self.pub = public_key_b64(key.public_key())
        self.nodes: dict[tuple[int, int], list[tuple[Process, str, str]]] = {}
        for r in RANGES:
            self.nodes[r] = [self._start(r) for _ in range(2)]

    def _start(self, r: tuple[int, int]) -> tuple[Process, str, str]:
        return start_serve(self.model, f"{r[0]}:{r[1]}", "native", self.pub, self.threads, self.logdir)

    def urls(self) -> list[str]:
        return [u for pair in self.nodes.values() for _, u, _ in pair]

    def route(self) -> list[tuple[str, str]]:
        return [(self.nodes[r][0][1], self.nodes[r][0][2]) for r in RANGES]

    def process(self, url: str) -> Process:
        return next(p for pair in self.nodes.values() for p, u, _ in pair if u == url)

    def replace_dead(self) -> None:
        """Start a new node for every one that exited, and put the live one first in its pair."""
        for r, pair in self.nodes.items():
            alive = [n for n in pair if n[0].poll() is None]
            for n in pair:
                if n[0].poll() is not None:
                    stop([n[0]])
            while len(alive) < 2:
                alive.append(self._start(r))
            self.nodes[r] = alive

    def rotate(self) -> None:
        """Use the other replica of every range next (so both serve as primary and spare)."""
        for r in RANGES:
            self.nodes[r].reverse()

    def close(self) -> None:
        stop([p for pair in self.nodes.values() for p, _, _ in pair])


def client_for(
    fleet: Fleet, sha: str, key: Any, capacity: int = 8192, policy: RecoveryPolicy | None = None
) -> RouteClient:
    session = os.urandom(16)
    plan = [RouteHop(node, url, a, b) for (url, node), (a, b) in zip(fleet.route(), RANGES, strict=True)]
    hops = minted_hops(key, session, sha, plan)  # each names the next hop (chain mode forwards there)
    provider = ReplicaProvider(fleet.urls(), key, session, probe_timeout_s=1.0)
    return RouteClient(
        hops,
        session_id=session,
        replacements=provider,
        recovery=policy or POLICY,
        capacity=capacity,
        mode=MODE,
    )


async def answer(
    client: RouteClient, prompt: list[int], n: int, at: int = -1, disturb: Any = None
) -> list[int]:
    out: list[int] = []
    try:
        async for tok, _ in client.generate(prompt, SamplingParams(), n):
            out.append(tok)
            if len(out) == at:
                disturb()
    finally:
        await client.close()
    return out


def _drain(url: str) -> None:
    req = urllib.request.Request(
        url + "/v1/drain",
        data=json.dumps({"deadline_s": 60, "exit": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        r.read()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(round(q * (len(s) - 1))))], 1)


async def kill_runs(
    fleet: Fleet, sha: str, key: Any, prompt: list[int], n: int, runs: int, rng: random.Random
) -> dict[str, Any]:
    reference = await answer(client_for(fleet, sha, key), prompt, n)
    identical, ms = 0, []
    for i in range(runs):
        client = client_for(fleet, sha, key)
        hop = rng.randrange(len(RANGES))
        at = rng.randrange(1, n - 1)
        victim = fleet.process(client.hops[hop].url)
        got = await answer(client, prompt, n, at, lambda v=victim: os.kill(v.pid, signal.SIGKILL))
        identical += got == reference
        ms += [r["ms"] for r in client.recoveries]
        print(
            f"kill run {i + 1}/{runs}: hop {hop} at token {at}: identical={got == reference} "
            f"recoveries={[(r['methods'], r['ms'], r['provider_ms']) for r in client.recoveries]}",
            file=sys.stderr,
            flush=True,
        )
        fleet.replace_dead()
        fleet.rotate()
    return {"runs": runs, "identical_runs": identical, "kill_recovery_ms_p50": pct(ms, 0.5)}


async def context_recoveries(
    fleet: Fleet, sha: str, key: Any, tok: ChatTokenizer, context: int, count: int, rng: random.Random
) -> dict[str, Any]:
    text = (
        Path(__file__).resolve().parent.parent.joinpath("tests", "data", "teacher_forcing_en.txt").read_text()
    )
    ids = tok.encode(text * (1 + context // 100), add_bos=True)[:context]
    out: dict[str, list[float]] = {"snapshot": [], "standby": [], "reprefill": []}
    for i in range(count):
        # kill -9 without a warm copy (re-prefill from 0), kill -9 with one, and a drain (hand-off)
        for method in ("reprefill", "standby", "snapshot"):
            policy = replace(POLICY, checkpoint_tokens=0) if method == "reprefill" else POLICY
            client = client_for(fleet, sha, key, capacity=context + 64, policy=policy)
            hop = rng.randrange(len(RANGES))
            url = client.hops[hop].url
            victim = fleet.process(url)
            if method != "snapshot":
                disturb = lambda v=victim: os.kill(v.pid, signal.SIGKILL)  # noqa: E731
            else:
                disturb = lambda u=url: _drain(u)  # noqa: E731
            # the kill comes after 10 decoded tokens: the warm copy of the prompt's KV has had time
            await answer(client, ids, 16, 10, disturb)
            for r in client.recoveries:
                out[r["methods"][0] if r["methods"][0] in out else "reprefill"].append(r["ms"])
            print(
                f"context run {i + 1}/{count} {method}: hop {hop}: "
                f"{[(r['methods'], r['ms'], r['provider_ms']) for r in client.recoveries]}",
                file=sys.stderr,
                flush=True,
            )
            if method == "snapshot":
                victim.wait(60)  # the drained node stops by itself once its session moved
            fleet.replace_dead()
            fleet.rotate()
    both = out["snapshot"] + out["standby"]  # what the default policy does: kill -9 and drain
    return {
        "context_tokens": len(ids),
        "recovery_ms_p50": pct(both, 0.5),
        "recovery_ms_p95": pct(both, 0.95),
        "recovery_ms_p95_snapshot": pct(out["snapshot"], 0.95),
        "recovery_ms_p95_standby": pct(out["standby"], 0.95),
        "recovery_ms_p95_reprefill": pct(out["reprefill"], 0.95),
        "recovery_samples": {k: len(v) for k, v in out.items()},
    }


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    buf = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        how = rng.choice(("flip", "set", "truncate", "insert", "delete", "dup"))
        if not buf:
            buf += os.urandom(rng.randint(1, 8))
            continue
        at = rng.randrange(len(buf))
        if how == "flip":
            buf[at] ^= 1 << rng.randrange(8)
        elif how == "set":
            buf[at] = rng.choice((0, 1, 0x7F, 0x80, 0xFF))
        elif how == "truncate":
            del buf[at:]
        elif how == "insert":
            buf[at:at] = os.urandom(rng.randint(1, 16))
        elif how == "delete":
            del buf[at : at + rng.randint(1, 16)]
        else:
            buf += buf[at : at + rng.randint(1, 64)]
    return bytes(buf)


async def fuzz(
    fleet: Fleet, sha: str, key: Any, prompt: list[int], frames: int, rng: random.Random
) -> dict[str, Any]:
    """Mutated frames from valid ones against the first hop of the route while another session decodes."""
    url, node = fleet.route()[0]
    proc = psutil.Process(fleet.process(url).pid)
    reference = await answer(client_for(fleet, sha, key), prompt, 64)
    fsession = os.urandom(16)
    token = mint(key, fsession, sha, 0, 10, node)
    valid = [
        encode_request(Request(op=Op.OPEN, session=fsession, token=token, pos_start=256)),
        encode_request(
            Request(
                op=Op.FORWARD,
                session=fsession,
                token=token,
                step=1,
                pos_start=0,
                n_tokens=len(prompt[:8]),
                kind=Kind.IDS,
                sampling=SamplingParams(),
                history=prompt[:8],
                payload=b"".join(int(t).to_bytes(4, "little") for t in prompt[:8]),
            )
        ),
        encode_request(Request(op=Op.TRUNCATE, session=fsession, token=token, step=2, pos_start=0)),
        encode_request(Request(op=Op.CLOSE, session=fsession, token=token)),
    ]
    statuses: dict[int, int] = {}
    # warm up: the first frames allocate caches that are not growth
    async with ClientSession(timeout=ClientTimeout(total=30)) as http:
        for body in valid:
            async with http.post(url + "/v1/frame", data=body) as r:
                await r.read()
        rss0 = proc.memory_info().rss

        async def fire() -> None:
            for i in range(frames):
                body = _mutate(valid[i % len(valid)], rng) if i % 10 else valid[i % len(valid)]
                try:
                    async with http.post(url + "/v1/frame", data=body) as r:
                        await r.read()
                        statuses[r.status] = statuses.get(r.status, 0) + 1
                except (ClientError, OSError, TimeoutError):
                    statuses[0] = statuses.get(0, 0) + 1

        other = asyncio.create_task(answer(client_for(fleet, sha, key), prompt, 64))
        t0 = time.perf_counter()
        await fire()
        fuzz_s = time.perf_counter() - t0
        got = await other
        rss1 = proc.memory_info().rss
    return {
        "fuzz_frames": frames,
        "fuzz_5xx": sum(n for s, n in statuses.items() if s >= 500 or s == 0),
        "fuzz_status_counts": {str(k): v for k, v in sorted(statuses.items())},
        "fuzz_rss_growth_mb": round((rss1 - rss0) / (1 << 20), 2),
        "fuzz_other_session_exact": got == reference,
        "fuzz_s": round(fuzz_s, 1),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = str(packaged_model_path("smollm2"))
    sha = build_manifest(model, hash_tensors=False).sha256
    tok = ChatTokenizer(model)
    key = generate_key()
    rng = random.Random(args.seed)
    prompt = tok.encode_chat(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
    )
    logdir = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    fleet = Fleet(model, key, args.threads, logdir)
    out: dict[str, Any] = {
        "cpu": cpu_kind(),
        "tokens": args.tokens,
        "threads": args.threads,
        "checkpoint_tokens": POLICY.checkpoint_tokens,
        "exact_replay": POLICY.exact_replay,
        "mode": MODE,
    }
    try:
        t0 = time.perf_counter()
        if args.fuzz_frames:
            out.update(await fuzz(fleet, sha, key, prompt, args.fuzz_frames, rng))
        if args.runs:
            out.update(await kill_runs(fleet, sha, key, prompt, args.tokens, args.runs, rng))
        if args.recoveries:
            out.update(await context_recoveries(fleet, sha, key, tok, args.context, args.recoveries, rng))
        out["wall_s"] = round(time.perf_counter() - t0, 1)
    finally:
        fleet.close()
    return out


def main() -> None:
    global POLICY, MODE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--recoveries", type=int, default=5, help="kill -9 and drain runs each at --context")
    ap.add_argument("--fuzz-frames", type=int, default=10000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-tokens", type=int, default=RecoveryPolicy.checkpoint_tokens)
    ap.add_argument("--fast-replay", action="store_true", help="re-prefill in merged batches (not exact)")
    ap.add_argument(
        "--mode", default=MODE, choices=list(ROUTE_MODES), help="route mode (default: the control plane's)"
    )
    args = ap.parse_args()
    MODE = args.mode
    POLICY = replace(POLICY, checkpoint_tokens=args.checkpoint_tokens, exact_replay=not args.fast_replay)
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
