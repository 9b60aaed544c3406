"""Round-trip cost of the candidate hop transports, no compute (prints JSON last).

    python bench/archive/transport.py [--n 2000] [--bytes 1400] [--gap-ms 0]

A server process on 127.0.0.1 answers every message with a message of the same size, over: HTTP/1.1
keep-alive POST (aiohttp client and server, as the data plane is now), a WebSocket (aiohttp, binary
messages) and a raw TCP stream (asyncio, 4-byte length prefix). The client is this process, one
request in flight, like one session's decode step to one hop. Figures are microseconds per round trip
(median of 5 blocks); what a decode step pays per hop on top of the hop's compute.

`blocking_tcp_us` is the floor under all of them: a second server process echoing over a plain
blocking socket, and a blocking client, no event loop on either side (what a data path written in C
would pay at best: the system calls and the wake-ups). With `--gap-ms G` the client sleeps G ms
before each round trip, as a hop of a route waits while the other hops compute: the server has gone
to sleep by then, and the round trip pays for waking it (and the client) from idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.procs import free_port, stop, wait_port  # noqa: E402

LEN = struct.Struct("<I")


async def serve(http_port: int, tcp_port: int) -> None:
    from aiohttp import WSMsgType, web

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.Response(body=body, content_type="application/octet-stream")

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse(max_msg_size=64 << 20)
        await sock.prepare(request)
        async for msg in sock:
            if msg.type == WSMsgType.BINARY:
                await sock.send_bytes(msg.data)
        return sock

    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (n,) = LEN.unpack(await reader.readexactly(4))
                body = await reader.readexactly(n)
                writer.write(LEN.pack(len(body)) + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/echo", echo)
    app.router.add_get("/ws", ws)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    await asyncio.start_server(raw, "127.0.0.1", tcp_port)
    await asyncio.Event().wait()


def serve_blocking(port: int) -> None:
    """Echo over a blocking socket, one client at a time, no event loop."""
    with socket.create_server(("127.0.0.1", port)) as srv:
        while True:
            conn, _ = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                try:
                    while True:
                        (m,) = LEN.unpack(_recv_exactly(conn, 4))
                        conn.sendall(LEN.pack(m) + _recv_exactly(conn, m))
                except ConnectionError:
                    pass


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("peer closed")
        buf += chunk
    return bytes(buf)


async def measure(
    http_port: int, tcp_port: int, blocking_port: int, n: int, size: int, gap_s: float
) -> dict[str, float]:
    from aiohttp import ClientSession, TCPConnector

    payload = bytes(size)
    out: dict[str, list[float]] = {
        "http_keepalive_us": [],
        "websocket_us": [],
        "raw_tcp_us": [],
        "blocking_tcp_us": [],
    }
    async with ClientSession(connector=TCPConnector(limit=16)) as http:
        url = f"http://127.0.0.1:{http_port}/echo"
        ws = await http.ws_connect(f"http://127.0.0.1:{http_port}/ws", max_msg_size=64 << 20)
        reader, writer = await asyncio.open_connection("127.0.0.1", tcp_port)
        plain = socket.create_connection(("127.0.0.1", blocking_port))
        plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        async def one_http() -> None:
            async with http.post(url, data=payload) as r:
                await r.read()

        async def one_ws() -> None:
            await ws.send_bytes(payload)
            await ws.receive_bytes()

        async def one_raw() -> None:
            writer.write(LEN.pack(size) + payload)
            (m,) = LEN.unpack(await reader.readexactly(4))
            await reader.readexactly(m)

        async def one_blocking() -> None:
            plain.sendall(LEN.pack(size) + payload)
            (m,) = LEN.unpack(_recv_exactly(plain, 4))
            _recv_exactly(plain, m)

        kinds = {
            "http_keepalive_us": one_http,
            "websocket_us": one_ws,
            "raw_tcp_us": one_raw,
            "blocking_tcp_us": one_blocking,
        }
        for fn in kinds.values():  # warm-up
            for _ in range(50):
                await fn()
        for _ in range(5):  # interleaved blocks: the machine is shared
            for name, fn in kinds.items():
                spent = 0.0
                for _ in range(n // 5):
                    if gap_s:
                        await asyncio.sleep(gap_s)
                    t0 = time.perf_counter()
                    await fn()
                    spent += time.perf_counter() - t0
                out[name].append(spent / (n // 5) * 1e6)
        await ws.close()
        writer.close()
        plain.close()
    return {k: round(statistics.median(v), 1) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="round trips per transport")
    ap.add_argument("--bytes", type=int, default=1400, help="message size (a decode frame: ~1,400)")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each round trip")
    ap.add_argument("--serve", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-blocking", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(*args.serve))
        return
    if args.serve_blocking:
        serve_blocking(args.serve_blocking)
        return
    http_port, tcp_port, blocking_port = free_port(), free_port(), free_port()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--serve", str(http_port), str(tcp_port)]),
        subprocess.Popen([sys.executable, __file__, "--serve-blocking", str(blocking_port)]),
    ]
    try:
        for port in (tcp_port, http_port, blocking_port):
            wait_port("127.0.0.1", port, 30, procs=procs)
        res = asyncio.run(measure(http_port, tcp_port, blocking_port, args.n, args.bytes, args.gap_ms / 1e3))
    finally:
        stop(procs)
    print(json.dumps({"bytes": args.bytes, "round_trips": args.n, "gap_ms": args.gap_ms, **res}))


if __name__ == "__main__":
    main()
