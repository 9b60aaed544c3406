"""The node's step scheduler (agent/node/scheduler.py) over HTTP: batching on vs off, in one run.

One in-process DataPlane serving the whole SmolLM2 model with the native backend; RouteClients on
loopback. Two measurements, each with the scheduler batching (native batches sessions) and with it off
(one step at a time under the shard lock, the serial path), in alternating rounds:

- throughput: N sessions generating T tokens each at once, aggregate tokens/s;
- stall: N-1 sessions decoding while one more sends a long prompt as one frame (RouteClient.generate
  would send it in 512-token frames; the node must not rely on that); each decoder's longest gap
  between two tokens while that prefill runs (chunked by the scheduler when batching, whole when serial).

Prints lines, then one JSON object last. Usage:

    .venv/bin/python bench/scheduler.py [--threads 2] [--sessions 8] [--tokens 32] [--prefill 2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.artifacts.manifest import build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.client.route import Hop, RouteClient  # noqa: E402
from agent.node.dataplane import DataPlane, start_dataplane  # noqa: E402
from agent.procs import free_port  # noqa: E402
from agent.wire.routetoken import generate_key, mint  # noqa: E402
from agent.wire.sampling import SamplingParams  # noqa: E402
from bench._common import cpu_kind  # noqa: E402


def prompt(i: int, n: int = 32) -> list[int]:
    return [(131 * i + 17 * k) % 40000 + 300 for k in range(n)]


class Node:
    """A DataPlane with the whole model on one native shard, served on loopback."""

    def __init__(self, path: str, threads: int, batching: bool | None) -> None:
        self.key = generate_key()
        self.manifest = build_manifest(path)
        self.n_layers = self.manifest.n_layers
        self.dp = DataPlane("bench-node", self.key.public_key(), batching=batching)
        self.dp.load_shard(path, self.manifest, 0, self.n_layers, backend="native", n_threads=threads)
        self.url = ""
        self.runner: object = None

    async def start(self) -> None:
        port = free_port()
        self.runner = await start_dataplane(self.dp, "127.0.0.1", port)
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.runner.cleanup()  # type: ignore[attr-defined]

    def client(self) -> RouteClient:
        session = os.urandom(16)
        tok = mint(self.key, session, self.manifest.sha256, 0, self.n_layers, "bench-node")
        return RouteClient([Hop(self.url, 0, self.n_layers, tok)], session_id=session)


async def generate(node: Node, ids: list[int], n: int, stamps: list[float] | None = None) -> list[int]:
    c = node.client()
    out: list[int] = []
    try:
        async for t, _ in c.generate(ids, SamplingParams(), n):
            out.append(t)
            if stamps is not None:
                stamps.append(time.perf_counter())
    finally:
        await c.close()
    return out


async def throughput(node: Node, sessions: int, tokens: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(generate(node, prompt(i), tokens) for i in range(sessions)))
    return sessions * tokens / (time.perf_counter() - t0), outs


async def stall(node: Node, sessions: int, prefill: int) -> tuple[float, float]:
    """(median of the decoders' longest gap during the prefill, the prefill's own time), seconds."""
    stamps: list[list[float]] = [[] for _ in range(sessions - 1)]
    decoding = [
        asyncio.ensure_future(generate(node, prompt(i), 10_000 // sessions, stamps[i]))
        for i in range(sessions - 1)
    ]
    while min(len(s) for s in stamps) < 3:  # every decoder past its prefill
        await asyncio.sleep(0.01)
    c = node.client()
    t0 = time.perf_counter()
    try:
        # one frame for the whole prompt (RouteClient.generate would send it in 512-token frames)
        await c.forward(prompt(99, prefill), SamplingParams())
    finally:
        t1 = time.perf_counter()
        await c.close()
    for d in decoding:
        d.cancel()
    await asyncio.gather(*decoding, return_exceptions=True)
    gaps = []
    for s in stamps:
        during = [b - a for a, b in zip(s, s[1:], strict=False) if b >= t0 and a <= t1]
        gaps.append(max(during) if during else t1 - t0)
    return statistics.median(gaps), t1 - t0


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    path = str(packaged_model_path("smollm2"))
    nodes = {"batched": Node(path, a.threads, None), "serial": Node(path, a.threads, False)}
    for n in nodes.values():
        await n.start()
    res: dict[str, dict[str, list[float]]] = {k: {"tok_s": [], "stall_s": [], "prefill_s": []} for k in nodes}
    same = True
    try:
        for r in range(a.rounds):
            outs = {}
            for name, node in nodes.items():
                tok_s, outs[name] = await throughput(node, a.sessions, a.tokens)
                gap, pre = await stall(node, a.sessions, a.prefill)
                res[name]["tok_s"].append(tok_s)
                res[name]["stall_s"].append(gap)
                res[name]["prefill_s"].append(pre)
                print(
                    f"round {r} {name}: {tok_s:.1f} tok/s, decode gap during prefill {gap * 1e3:.0f} ms, prefill {pre:.2f} s"
                )
            same = same and outs["batched"] == outs["serial"]
        batch_stats = nodes["batched"].dp.stats()["batching"]
    finally:
        for n in nodes.values():
            await n.stop()
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in res.items()}
    out = {
        "cpu": cpu_kind(),
        "backend": "native",
        "threads": a.threads,
        "sessions": a.sessions,
        "tokens": a.tokens,
        "prefill": a.prefill,
        "rounds": a.rounds,
        "batched": med["batched"],
        "serial": med["serial"],
        "tok_s_ratio": med["batched"]["tok_s"] / med["serial"]["tok_s"],
        "stall_ratio": med["batched"]["stall_s"] / med["serial"]["stall_s"],
        "same_tokens": same,
        "batching_last_minute": batch_stats,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
