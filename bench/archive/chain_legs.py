"""Where a chain route's per-token overhead goes: the bare transport vs our code (prints JSON last).

    python bench/archive/chain_legs.py [--tokens 400] [--rounds 3] [--compute-ms 0]

Three figures per round, all ms per decode token over 3 hops on 127.0.0.1, one session:
- `bare_relay_ms_per_token`: a client and three relay processes over aiohttp WebSockets, nothing but
  the messages (2,400 bytes each, a 576-wide f32 hidden state plus a token): the client sends to hop 0,
  each hop sends on to the next and waits for its answer, the last answers back along the chain. Six
  messages per token, as chain mode is today.
- `bare_direct_ms_per_token`: the same processes, but each hop sends on without waiting and the last hop
  pushes its answer straight to the client over a socket the client opened to it. Four messages per
  token: what a chain whose last hop answers the client directly would pay at best.
- `route_tiny_ms_per_token`: our stack, 3 real `agent serve` processes (native backend) holding one
  layer each of a tiny random-weight llama driven by the route client in chain mode, as the control plane
  drives it. `route_tiny_compute_ms_per_token` is what the hops report as their native calls (the last
  one's output head and sampling over SmolLM2's 49,152-token vocabulary is most of it), and
  `route_tiny_overhead_ms_per_token` the rest: the route's overhead, as bench/served.py counts it.

With `--compute-ms C` each bare hop spins C ms per message, so the hops go idle and wake as in a route
that computes; `bare_relay_overhead_ms_per_token` is bare_relay less those 3 x C ms. `ours_ms_per_token`
= route_tiny_overhead - bare_relay_overhead (our code's share of the overhead: frame codec, admission,
scheduler, chain forwarding, the route client; without --compute-ms only), `direct_saves_ms_per_token` = bare_relay - bare_direct
(what a last hop answering the client directly could save).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from agent.procs import free_port, stop, wait_port  # noqa: E402
from bench._common import serve_forever  # noqa: E402

MESSAGE_BYTES = 2400
RELAY, DIRECT, SUBSCRIBE = b"R", b"D", b"S"


def _spin(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


async def bare_hop(port: int, next_port: int | None, compute_s: float) -> None:
    """One bare hop: compute (spin), then relay (send on, wait, answer back) or direct (send on; the
    last hop pushes to the client's subscribed socket)."""
    from aiohttp import ClientSession, ClientWebSocketResponse, WSMsgType, web

    http = ClientSession()
    nxt: ClientWebSocketResponse | None = None
    subscriber: list[web.WebSocketResponse] = []

    async def handle(request: web.Request) -> web.WebSocketResponse:
        nonlocal nxt
        ws = web.WebSocketResponse(max_msg_size=1 << 20, compress=False)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != WSMsgType.BINARY:
                break
            data = msg.data
            if data[:1] == SUBSCRIBE:
                subscriber[:] = [ws]
                continue
            _spin(compute_s)
            if next_port is None:
                await (ws if data[:1] == RELAY else subscriber[0]).send_bytes(data)
                continue
            if nxt is None:
                nxt = await http.ws_connect(f"http://127.0.0.1:{next_port}/s", compress=0)
            await nxt.send_bytes(data)
            if data[:1] == RELAY:
                await ws.send_bytes((await nxt.receive()).data)
        return ws

    await serve_forever("/s", handle, port)


async def bare_route(ports: list[int], mode: bytes, tokens: int) -> float:
    """ms per token of one client driving the bare hops in `mode`."""
    from aiohttp import ClientSession

    async with ClientSession() as http:
        first = await http.ws_connect(f"http://127.0.0.1:{ports[0]}/s", compress=0)
        last = await http.ws_connect(f"http://127.0.0.1:{ports[-1]}/s", compress=0)
        await last.send_bytes(SUBSCRIBE)
        body = mode + bytes(MESSAGE_BYTES - 1)
        for _ in range(50):  # warm-up: every hop's next socket is open
            await first.send_bytes(body)
            await (first if mode == RELAY else last).receive()
        t0 = time.perf_counter()
        for _ in range(tokens):
            await first.send_bytes(body)
            await (first if mode == RELAY else last).receive()
        ms = (time.perf_counter() - t0) * 1e3 / tokens
        await first.close()
        await last.close()
    return ms


def start_bare(compute_ms: float) -> tuple[list[subprocess.Popen[bytes]], list[int]]:
    ports = [free_port() for _ in range(3)]
    procs = []
    for i, port in enumerate(ports):
        nxt = str(ports[i + 1]) if i + 1 < len(ports) else "0"
        procs.append(
            subprocess.Popen([sys.executable, __file__, "--bare-hop", str(port), nxt, str(compute_ms)])
        )
    for port in ports:
        wait_port("127.0.0.1", port, 30, procs=procs)
    return procs, ports


async def route_tiny(tokens: int, rounds: int) -> list[tuple[float, float]]:
    """(ms per token, of which the hops' native calls) of the route client in chain mode over 3 serve
    processes of a tiny llama."""
    from agent.artifacts.manifest import build_manifest
    from agent.artifacts.tiny import write_tiny_gguf
    from agent.defaults import CONTROL_PLANE_ROUTE_MODE
    from agent.wire.routetoken import generate_key, public_key_b64
    from bench._common import start_serve
    from bench.served import Route, decode_once

    tmp = Path(tempfile.mkdtemp(prefix="bench-legs-"))
    path = str(write_tiny_gguf("llama", tmp / "tiny.gguf", n_layers=3))
    manifest = build_manifest(path, hash_tensors=False)
    key = generate_key()
    procs, hops = [], []
    try:
        for a in range(3):
            proc, url, node = start_serve(
                path, f"{a}:{a + 1}", "native", public_key_b64(key.public_key()), 1, tmp
            )
            procs.append(proc)
            hops.append((url, a, a + 1, node))
        route = Route(key, manifest.sha256, hops, CONTROL_PLANE_ROUTE_MODE)
        prompt = list(range(100, 130))
        await decode_once(route, prompt, 50)  # warm-up: streams open, token caches filled
        out = []
        for _ in range(rounds):
            d = await decode_once(route, prompt, tokens)
            out.append((1e3 / d.tok_s, d.compute_ms * len(hops)))
        await route.close()
        return out
    finally:
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=400, help="decode tokens per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians reported)")
    ap.add_argument("--compute-ms", type=float, default=0.0, help="spin per bare hop and message")
    ap.add_argument("--bare-hop", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_hop:
        port, nxt, compute_ms = int(args.bare_hop[0]), int(args.bare_hop[1]), float(args.bare_hop[2])
        asyncio.run(bare_hop(port, nxt or None, compute_ms / 1e3))
        return
    relay, direct = [], []
    procs, ports = start_bare(args.compute_ms)
    try:
        for _ in range(args.rounds):
            relay.append(asyncio.run(bare_route(ports, RELAY, args.tokens)))
            direct.append(asyncio.run(bare_route(ports, DIRECT, args.tokens)))
    finally:
        stop(procs)
    tiny = asyncio.run(route_tiny(args.tokens, args.rounds))
    r, d = statistics.median(relay), statistics.median(direct)
    t, c = statistics.median(x[0] for x in tiny), statistics.median(x[1] for x in tiny)
    r_overhead = r - 3 * args.compute_ms
    print(
        json.dumps(
            {
                "tokens": args.tokens,
                "rounds": args.rounds,
                "compute_ms": args.compute_ms,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "bare_relay_ms_per_token": round(r, 3),
                "bare_direct_ms_per_token": round(d, 3),
                "bare_relay_overhead_ms_per_token": round(r_overhead, 3),
                "route_tiny_ms_per_token": round(t, 3),
                "route_tiny_compute_ms_per_token": round(c, 3),
                "route_tiny_overhead_ms_per_token": round(t - c, 3),
                # the tiny route has no compute to idle through: its overhead compares with the
                # bare one only without --compute-ms
                "ours_ms_per_token": round(t - c - r_overhead, 3) if not args.compute_ms else None,
                "direct_saves_ms_per_token": round(r - d, 3),
                "bare_relay_rounds": [round(x, 3) for x in relay],
                "bare_direct_rounds": [round(x, 3) for x in direct],
                "route_tiny_rounds": [round(x[0], 3) for x in tiny],
                "route_tiny_compute_rounds": [round(x[1], 3) for x in tiny],
            }
        )
    )


if __name__ == "__main__":
    main()
