"""The served route's measurements for bench/served.py: a route of `agent serve` hops and the route
clients that time one session, k sessions at once, and inter-token latency while a long prompt arrives."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.client.recovery import minted_hops
from agent.client.route import RouteClient
from agent.client.transport import HopTransport
from agent.wire.routetoken import RouteHop
from agent.wire.sampling import SamplingParams
from bench import hop_floor

ITL_SESSIONS = 4
LONG_PROMPT = 2000
GREEDY = SamplingParams()


# -- the served route -----------------------------------------------------------------------------------
class Route:
    """Three serve processes and a factory of route clients over them (fresh session each)."""

    def __init__(
        self,
        key: Any,
        sha256: str,
        hops: list[tuple[str, int, int, str]],
        mode: str,
        http_only: bool = False,
        bundling: bool = True,
    ) -> None:
        self.key, self.sha256, self.hops, self.mode = key, sha256, hops, mode
        self.http_only = http_only  # the client posts every frame (no streams): the transport before
        self.pids: list[int] = []  # the hops' processes, for their CPU time
        # one transport for all of the route's clients, as the control plane's processes share one
        # (agent/client/transport.py); bundling=False: every frame travels alone (--ab-no-bundles)
        self.bundling = bundling
        self.transport: HopTransport | None = None

    def cpu_s(self) -> float:
        """CPU seconds the hops' processes have used (all their threads), from /proc."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    def client(self, capacity: int = 4096) -> RouteClient:
        session = os.urandom(16)
        plan = [RouteHop(n, u, a, b) for u, a, b, n in self.hops]
        hops = minted_hops(self.key, session, self.sha256, plan)
        if self.transport is None or self.transport.closed:
            self.transport = HopTransport(bundling=self.bundling)
            if self.http_only:
                self.transport.streams.enabled = False
        return RouteClient(
            hops, session_id=session, mode=self.mode, capacity=capacity, transport=self.transport
        )

    async def close(self) -> None:
        if self.transport is not None:
            await self.transport.close()
            self.transport = None


@dataclass
class Decode:
    """One session's decode through the route: speed, and where each hop step's time went (ms, per
    hop and step): overhead = wire + hop_python + client; wire = round trips less the hops' handlers
    (sends, wake-ups, the WebSocket on both ends; in chain mode also the hops' forwarding),
    hop_python = the handlers less their compute, client = the route client's own work between them."""

    tok_s: float
    overhead_ms: float
    compute_ms: float
    cpu_ms: float  # the hops' CPU per step, all their threads
    wire_ms: float
    hop_python_ms: float
    client_ms: float


async def decode_once(route: Route, prompt: list[int], n: int) -> Decode:
    """One session decoding `n` tokens after `prompt`."""
    c = route.client()
    try:
        tok = (await c.forward(prompt, GREEDY)).token
        for st in c.hop_stats:
            st.compute_ms = st.network_ms = st.wall_ms = 0.0
        cpu0 = route.cpu_s()
        t0 = time.perf_counter()
        for _ in range(n):
            tok = (await c.forward([tok], GREEDY)).token
        wall_ms = (time.perf_counter() - t0) * 1e3
        cpu_ms = (route.cpu_s() - cpu0) * 1e3 / n
        compute_ms = sum(st.compute_ms for st in c.hop_stats)
        network_ms = sum(st.network_ms for st in c.hop_stats)
        rtt_ms = sum(st.wall_ms for st in c.hop_stats)
    finally:
        await c.close()
    per = n * len(c.hops)
    return Decode(
        tok_s=n / (wall_ms / 1e3),
        overhead_ms=(wall_ms - compute_ms) / per,
        compute_ms=compute_ms / per,
        cpu_ms=cpu_ms,
        wire_ms=network_ms / per,
        hop_python_ms=(rtt_ms - network_ms - compute_ms) / per,
        client_ms=(wall_ms - rtt_ms) / per,
    )


FLOORS = ("ws", "blocking")  # the bare relays --floor times (bench/hop_floor.py)
_FLOOR_SIDS = itertools.count(1000)  # each floor decode is a new session on its relay's hops


async def floor_decode(transport: str, port: int, n: int) -> tuple[float, float]:
    """(tok/s, per-hop overhead ms) of one session decoding `n` tokens through a bare relay."""
    wall, compute, _ = await hop_floor.drive(transport, port, next(_FLOOR_SIDS), n)
    return n / wall, hop_floor.per_hop_ms(wall, compute, n)


async def decode_sessions(route: Route, prompt: list[int], n: int, k: int) -> float:
    """Aggregate tok/s of `k` sessions decoding `n` tokens each at once (prefills not timed)."""
    clients = [route.client() for _ in range(k)]
    try:
        first = await asyncio.gather(*(c.forward(prompt, GREEDY) for c in clients))
        ready = asyncio.Event()

        async def run(c: RouteClient, tok: int) -> None:
            await ready.wait()
            for _ in range(n):
                tok = (await c.forward([tok], GREEDY)).token

        tasks = [asyncio.ensure_future(run(c, r.token)) for c, r in zip(clients, first, strict=True)]
        t0 = time.perf_counter()
        ready.set()
        await asyncio.gather(*tasks)
        return k * n / (time.perf_counter() - t0)
    finally:
        for c in clients:
            await c.close()


async def itl_under_prefill(route: Route, prompt: list[int], n: int) -> dict[str, float]:
    """Inter-token latency of 4 decoding sessions: idle (p50), then while a 2,000-token prompt is
    prefilled on the same hops (p95 of the gaps that overlap the prefill)."""
    rng = np.random.default_rng(0)
    long_ids = rng.integers(100, 40000, size=LONG_PROMPT).tolist()
    clients = [route.client() for _ in range(ITL_SESSIONS)]
    big = route.client(capacity=LONG_PROMPT + 64)
    try:
        toks = [r.token for r in await asyncio.gather(*(c.forward(prompt, GREEDY) for c in clients))]
        await big.open()

        async def decode(i: int, stop_evt: asyncio.Event, gaps: list[tuple[float, float]]) -> None:
            last = time.perf_counter()
            count = 0
            while not stop_evt.is_set() or count < 4:
                toks[i] = (await clients[i].forward([toks[i]], GREEDY)).token
                now = time.perf_counter()
                gaps.append((last, now))
                last, count = now, count + 1

        async def window(with_prefill: bool) -> tuple[list[tuple[float, float]], tuple[float, float]]:
            stop_evt = asyncio.Event()
            gaps: list[tuple[float, float]] = []
            tasks = [asyncio.ensure_future(decode(i, stop_evt, gaps)) for i in range(ITL_SESSIONS)]
            await asyncio.sleep(0)
            t0 = time.perf_counter()
            if with_prefill:
                await big.forward(long_ids, GREEDY)
            else:
                while len(gaps) < ITL_SESSIONS * n:
                    await asyncio.sleep(0.005)
            t1 = time.perf_counter()
            stop_evt.set()
            await asyncio.gather(*tasks)
            return gaps, (t0, t1)

        idle, _ = await window(False)
        before = await pacer_figures(route)
        busy, (t0, t1) = await window(True)
        paced = pacer_chunks(before, await pacer_figures(route))
    finally:
        for c in [*clients, big]:
            await c.close()
    # the same prompt on the same hops with nothing else open (issue 32's reference)
    alone_client = route.client(capacity=LONG_PROMPT + 64)
    try:
        await alone_client.open()
        a0 = time.perf_counter()
        await alone_client.forward(long_ids, GREEDY)
        alone_ms = (time.perf_counter() - a0) * 1e3
    finally:
        await alone_client.close()
    idle_ms = [(b - a) * 1e3 for a, b in idle]
    # the gaps that overlap the prefill's time on the route
    during = [(b - a) * 1e3 for a, b in busy if b > t0 and a < t1]
    p50 = float(np.percentile(idle_ms, 50))
    p95 = float(np.percentile(during, 95)) if during else float("nan")
    return {
        "itl_p50_ms_idle": round(p50, 2),
        "itl_p95_ms_while_prefill": round(p95, 2),
        "itl_ratio": round(p95 / p50, 2),
        "prefill_ms_2000_while_decoding": round((t1 - t0) * 1e3, 1),
        "prefill_ms_2000_alone": round(alone_ms, 1),
        "prefill_ratio_while_decoding": round((t1 - t0) * 1e3 / alone_ms, 2),
        "itl_gaps_during_prefill": len(during),
        **paced,
    }


PACER_COUNTS = ("prefill_mixed_chunks", "prefill_quiet_chunks", "prefill_unheld_chunks")


async def pacer_figures(route: Route) -> list[dict[str, Any]]:
    """Each hop's /v1/health (its pacer's counts among them); {} for a hop that did not answer."""
    import aiohttp

    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for url, _a, _b, _node in route.hops:
            try:
                async with http.get(f"{url}/v1/health", ssl=False) as r:
                    out.append(await r.json())
            except (aiohttp.ClientError, TimeoutError, ValueError):
                out.append({})
    return out


def pacer_chunks(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, list[int | None]]:
    """How each hop's chunks of the long prompt ran (held a step, found the lane quiet, ran beside
    the decoders after a wait ran out): the counts' growth between the two reads, per hop."""
    out: dict[str, list[int | None]] = {}
    for key in PACER_COUNTS:
        short = key.removeprefix("prefill_")
        out[f"{short}_by_hop"] = [
            a[key] - b[key] if key in a and key in b else None for b, a in zip(before, after, strict=True)
        ]
    return out
