"""What a served hop's overhead could be at best, per transport, with the real compute between messages.

    python bench/hop_floor.py [--tokens 64] [--rounds 3] [--threads 2] [--transports ws,tcp,blocking]

Three processes hold SmolLM2's layers 0:10 / 10:20 / 20:30 (native backend, as bench/served.py), one
session, greedy. A client in this process sends each decode step to hop 0; each hop computes, sends its
hidden state on to the next, waits for its answer and relays it back (chain mode), adding its compute
time. Nothing else: no route tokens, admission, sessions table, scheduler, retry cache or metrics. So
per_hop_overhead_ms = (step wall time - the hops' compute) / 3 is the floor a transport of that kind
leaves to our code, measured as bench/served.py measures the route:
- `ws`: aiohttp WebSockets, the handler in a task (today's transport, without our code);
- `tcp`: asyncio over raw TCP, length-prefixed messages, handled in the protocol's callback (no task,
  no WebSocket framing);
- `blocking`: plain blocking sockets, one thread per hop, no event loop;
- `lane`: libggswarm's decode lane (docs/lane.md): the hops' own C threads on blocking sockets,
  AES-256-GCM sealed frames; the client is agent/wire/lane.py's LaneClient;
- `lanedirect`: the lane in direct mode: hops send rows on without waiting and the last hop answers
  the client itself (4 messages per token instead of 6; DirectLaneClient).
Figures are medians of interleaved rounds (the machine is shared: compare within one run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.procs import Process, free_port, spawn, stop, wait_port  # noqa: E402
from bench._common import cpu_kind, serve_forever  # noqa: E402

RANGES = [(0, 10), (10, 20), (20, 30)]
REQ = struct.Struct("<IIi")  # session, position, token (hop 0) ; hidden f32 bytes follow for the others
ANS = struct.Struct("<id")  # token, the hops' compute so far (s)
LEN = struct.Struct("<I")


class Hop:
    """One layer range and what it does with a message (the same for every transport)."""

    def __init__(self, model: str, a: int, b: int, threads: int) -> None:
        from agent.artifacts.manifest import build_manifest
        from agent.backends.base import ShardSpec
        from agent.backends.native import NativeBackend

        self.manifest = build_manifest(model)
        self.backend = NativeBackend(ShardSpec(model, a, b, self.manifest, n_threads=threads))
        self.first, self.last = a == 0, b == self.manifest.n_layers
        self.sid = -1

    def compute(self, msg: bytes | memoryview) -> tuple[bytes | None, int, float]:
        """(the message for the next hop or None, the token on the last hop, compute seconds)."""
        from agent.backends.base import StepInput
        from agent.wire.ids import SessionId

        sid, pos, tok = REQ.unpack_from(msg, 0)
        if sid != self.sid:
            if self.sid >= 0:
                self.backend.close_session(SessionId(str(self.sid)))
            self.backend.open_session(SessionId(str(sid)), 1024)
            self.sid = sid
        hidden = None
        if not self.first:
            hidden = np.frombuffer(msg, dtype=np.float32, offset=REQ.size).reshape(1, -1)
        res = self.backend.forward(
            StepInput(SessionId(str(sid)), pos, token_ids=np.array([tok], dtype=np.int32), hidden=hidden)
        )
        if self.last:
            assert res.token is not None
            return None, res.token, res.compute_s
        assert res.hidden is not None
        return REQ.pack(sid, pos, tok) + res.hidden.astype(np.float32).tobytes(), 0, res.compute_s


# -- hops, one per transport ------------------------------------------------------------------------
def serve_blocking(hop: Hop, port: int, next_port: int | None) -> None:
    ls = socket.create_server(("127.0.0.1", port))
    down = None
    if next_port is not None:
        down = socket.create_connection(("127.0.0.1", next_port))
        down.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:  # one upstream at a time (readiness probes connect and leave)
        up, _ = ls.accept()
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _serve_conn(hop, up, down)
        up.close()


def _serve_conn(hop: Hop, up: socket.socket, down: socket.socket | None) -> None:
    while True:
        msg = _recv_msg(up)
        if msg is None:
            return
        out, tok, secs = hop.compute(msg)
        if down is None:
            up.sendall(LEN.pack(ANS.size) + ANS.pack(tok, secs))
            continue
        assert out is not None
        down.sendall(LEN.pack(len(out)) + out)
        ans = _recv_msg(down)
        assert ans is not None
        tok, before = ANS.unpack(ans)
        up.sendall(LEN.pack(ANS.size) + ANS.pack(tok, before + secs))


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv_msg(s: socket.socket) -> bytes | None:
    head = _recv_exact(s, LEN.size)
    if head is None:
        return None
    return _recv_exact(s, LEN.unpack(head)[0])


class _Framed(asyncio.Protocol):
    """Length-prefixed messages on a TCP connection, each handed to `on_message` as it completes."""

    def __init__(self, on_message) -> None:  # type: ignore[no-untyped-def]  # why: a bench's callback
        self.on_message = on_message
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]  # why: asyncio's signature
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= LEN.size:
            (n,) = LEN.unpack_from(self.buf, 0)
            if len(self.buf) < LEN.size + n:
                return
            msg = bytes(self.buf[LEN.size : LEN.size + n])
            del self.buf[: LEN.size + n]
            self.on_message(self, msg)

    def send(self, msg: bytes) -> None:
        assert self.transport is not None
        self.transport.write(LEN.pack(len(msg)) + msg)


async def serve_tcp(hop: Hop, port: int, next_port: int | None) -> None:
    loop = asyncio.get_running_loop()
    waiting: list[tuple[_Framed, float]] = []

    def on_answer(_: _Framed, ans: bytes) -> None:
        up, secs = waiting.pop()
        tok, before = ANS.unpack(ans)
        up.send(ANS.pack(tok, before + secs))

    down: _Framed | None = None
    if next_port is not None:
        _, down = await loop.create_connection(lambda: _Framed(on_answer), "127.0.0.1", next_port)

    def on_request(up: _Framed, msg: bytes) -> None:
        out, tok, secs = hop.compute(msg)
        if down is None:
            up.send(ANS.pack(tok, secs))
            return
        assert out is not None
        waiting.append((up, secs))
        down.send(out)

    server = await loop.create_server(lambda: _Framed(on_request), "127.0.0.1", port)
    await server.serve_forever()


async def serve_tcp_task(hop: Hop, port: int, next_port: int | None) -> None:
    """As serve_tcp, but each message is handled in a task that awaits the next hop's answer (the
    shape of our data plane's async handlers), not in the protocol's callbacks."""
    loop = asyncio.get_running_loop()
    answers: asyncio.Queue[bytes] = asyncio.Queue()
    down: _Framed | None = None
    if next_port is not None:
        _, down = await loop.create_connection(
            lambda: _Framed(lambda _, m: answers.put_nowait(m)), "127.0.0.1", next_port
        )

    async def handle(up: _Framed, msg: bytes) -> None:
        out, tok, secs = hop.compute(msg)
        if down is None:
            up.send(ANS.pack(tok, secs))
            return
        assert out is not None
        down.send(out)
        tok, before = ANS.unpack(await answers.get())
        up.send(ANS.pack(tok, before + secs))

    tasks: set[asyncio.Task[None]] = set()

    def on_request(up: _Framed, msg: bytes) -> None:
        t = loop.create_task(handle(up, msg))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    server = await loop.create_server(lambda: _Framed(on_request), "127.0.0.1", port)
    await server.serve_forever()


async def serve_ws(hop: Hop, port: int, next_port: int | None) -> None:
    from aiohttp import ClientSession, WSMsgType, web

    http = ClientSession()
    down = None if next_port is None else await http.ws_connect(f"http://127.0.0.1:{next_port}/s", compress=0)

    async def handle(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=1 << 20, compress=False)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != WSMsgType.BINARY:
                break
            out, tok, secs = hop.compute(msg.data)
            if down is None:
                await ws.send_bytes(ANS.pack(tok, secs))
                continue
            await down.send_bytes(out)
            ans = await down.receive_bytes()
            tok, before = ANS.unpack(ans)
            await ws.send_bytes(ANS.pack(tok, before + secs))
        return ws

    await serve_forever("/s", handle, port)


ROUTE_PORTS: dict[int, list[int]] = {}  # a route's first port -> every hop's (the direct lane dials all)
LANE_SESSIONS = 64  # lane ids 1..64, admitted at start (one per round and transport at most)


def lane_key(hop: int, lane_id: int) -> bytes:
    """A bench's keys: known to both sides by construction (the product derives them per route)."""
    import hashlib

    return hashlib.sha256(f"hop-floor/{hop}/{lane_id}".encode()).digest()


def serve_lane(
    model: str, a: int, b: int, threads: int, port: int, next_port: int | None, direct: bool = False
) -> None:
    """A hop whose steps run on libggswarm's lane threads; this thread only admits the sessions."""
    import signal

    from agent.backends.lane import NativeLane, NextHop
    from agent.backends.libggswarm import NativeModel

    m = NativeModel(model, a, b, n_threads=threads)
    lane = NativeLane("127.0.0.1", port)
    hop = RANGES.index((a, b))
    for lane_id in range(1, LANE_SESSIONS + 1):
        nxt = None
        if next_port is not None:
            nxt = NextHop("127.0.0.1", next_port, lane_id, lane_key(hop + 1, lane_id))
        lane.add(m, m.open_session(1024), lane_id, lane_key(hop, lane_id), nxt, direct=direct)
    signal.pause()


def _drive_lane(port: int, sid: int, n: int, direct: bool) -> tuple[float, float, list[int]]:
    from agent.wire.lane import DirectLaneClient, LaneClient, LaneHop

    c: LaneClient | DirectLaneClient
    if direct:
        hops = [LaneHop("127.0.0.1", p, sid, lane_key(i, sid)) for i, p in enumerate(ROUTE_PORTS[port])]
        c = DirectLaneClient(hops)
    else:
        c = LaneClient("127.0.0.1", port, sid, lane_key(0, sid))
    try:
        toks = [c.run(0, np.asarray([1])).token]  # the first step is not timed
        compute = 0.0
        t0 = time.perf_counter()
        for pos in range(1, n + 1):
            ans = c.run(pos, np.asarray([toks[-1]]))
            toks.append(ans.token)
            compute += sum(c_us for c_us, _ in ans.timings) / 1e6
        return time.perf_counter() - t0, compute, toks
    finally:
        c.close()


# -- the client ---------------------------------------------------------------------------------------
def per_hop_ms(wall_s: float, compute_s: float, n: int) -> float:
    """Step wall time less the hops' compute, per hop and step (as bench/served.py counts it)."""
    return (wall_s - compute_s) * 1e3 / (n * len(RANGES))


async def drive(transport: str, port: int, sid: int, n: int) -> tuple[float, float, list[int]]:
    """(wall s, the hops' compute s, tokens) of session `sid` decoding `n` steps after an untimed
    first one, through the route of `transport` (as start_route was given it) whose first hop is on
    `port`."""
    kind = transport.partition("+")[0]
    if kind in ("lane", "lanedirect"):
        return _drive_lane(port, sid, n, kind == "lanedirect")
    if kind == "blocking":
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        async def call_blocking(m: bytes) -> bytes:
            s.sendall(LEN.pack(len(m)) + m)
            ans = _recv_msg(s)
            assert ans is not None
            return ans

        try:
            return await _steps(call_blocking, sid, n)
        finally:
            s.close()
    if kind == "ws":
        from aiohttp import ClientSession

        async with ClientSession() as http, http.ws_connect(f"http://127.0.0.1:{port}/s", compress=0) as ws:

            async def call_ws(m: bytes) -> bytes:
                await ws.send_bytes(m)
                return await ws.receive_bytes()

            return await _steps(call_ws, sid, n)
    loop = asyncio.get_running_loop()
    answers: asyncio.Queue[bytes] = asyncio.Queue()
    tr, proto = await loop.create_connection(
        lambda: _Framed(lambda _, m: answers.put_nowait(m)), "127.0.0.1", port
    )

    async def call_tcp(m: bytes) -> bytes:
        proto.send(m)
        return await answers.get()

    try:
        return await _steps(call_tcp, sid, n)
    finally:
        tr.close()


async def _steps(
    call: Callable[[bytes], Awaitable[bytes]], sid: int, n: int
) -> tuple[float, float, list[int]]:
    tok, _ = ANS.unpack(await call(REQ.pack(sid, 0, 1)))  # the first step is not timed
    toks, compute = [tok], 0.0
    t0 = time.perf_counter()
    for pos in range(1, n + 1):
        tok, secs = ANS.unpack(await call(REQ.pack(sid, pos, tok)))
        toks.append(tok)
        compute += secs
    return time.perf_counter() - t0, compute, toks


def start_route(transport: str, model: str, threads: int, logdir: Path) -> tuple[list[Process], int]:
    ports = [free_port() for _ in RANGES]
    procs = []
    for i in reversed(range(len(RANGES))):  # the last hop first: each hop connects to its next at start
        a, b = RANGES[i]
        cmd = [sys.executable, __file__, "--hop", transport, "--model", model, "--layers", f"{a}:{b}"]
        cmd += ["--port", str(ports[i]), "--threads", str(threads)]
        if i + 1 < len(RANGES):
            cmd += ["--next", str(ports[i + 1])]
        procs.append(spawn(cmd, logdir / f"hop-{transport}-{i}.log", env=None, cwd=REPO))
        wait_port("127.0.0.1", ports[i], 120, procs=procs)
    ROUTE_PORTS[ports[0]] = ports
    return procs, ports[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--transports", default="ws,tcp,blocking")
    ap.add_argument("--model", default="")
    ap.add_argument("--hop", default="")  # internal: run one hop of this transport
    ap.add_argument("--layers", default="")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--next", type=int, default=None)
    args = ap.parse_args()
    if not args.model:
        from agent.artifacts.packaged import packaged_model_path

        args.model = str(packaged_model_path())
    if args.hop:
        a, b = (int(x) for x in args.layers.split(":"))
        if args.hop in ("lane", "lanedirect"):
            serve_lane(args.model, a, b, args.threads, args.port, args.next, args.hop == "lanedirect")
            return
        hop = Hop(args.model, a, b, args.threads)
        if args.hop == "blocking":
            serve_blocking(hop, args.port, args.next)
            return
        kind, _, loop = args.hop.partition("+")
        if loop == "uvloop":
            import uvloop

            uvloop.install()
        serve = {"tcp": serve_tcp, "tcptask": serve_tcp_task, "ws": serve_ws}[kind]
        asyncio.run(serve(hop, args.port, args.next))
        return
    transports = args.transports.split(",")
    logdir = Path(tempfile.mkdtemp(prefix="hop-floor-"))
    if "lane" in transports and args.rounds * len(transports) > LANE_SESSIONS:
        sys.exit(f"--rounds x transports is at most {LANE_SESSIONS} with the lane transport")
    routes = {t: start_route(t, args.model, args.threads, logdir) for t in transports}
    samples: dict[str, list[tuple[float, float]]] = {t: [] for t in transports}
    tokens: dict[str, list[int]] = {}
    try:
        sid = 1
        for _ in range(args.rounds):
            for t in transports:
                wall, comp, toks = asyncio.run(drive(t, routes[t][1], sid, args.tokens))
                sid += 1
                tokens[t] = toks
                samples[t].append((args.tokens / wall, per_hop_ms(wall, comp, args.tokens)))
                print(t, f"{samples[t][-1][0]:.2f} tok/s", f"{samples[t][-1][1]:.3f} ms/hop", file=sys.stderr)
    finally:
        for procs, _ in routes.values():
            stop(procs)
    same = len({tuple(v) for v in tokens.values()}) == 1
    out: dict[str, object] = {
        "cpu": cpu_kind(),
        "tokens": args.tokens,
        "rounds": args.rounds,
        "same_tokens": same,
    }
    for t in transports:
        out[f"decode_tok_s_{t}"] = round(statistics.median(s[0] for s in samples[t]), 2)
        out[f"per_hop_overhead_ms_{t}"] = round(statistics.median(s[1] for s in samples[t]), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
