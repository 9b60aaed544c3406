"""Hostile clients of issue 33, as the tests and bench/abuse.py make them (docs/security.md's sections of
issue 33): raw sockets that send a request's headers and push a body the server should never read, a
probe timing `/healthz` back to back, stalled connections to a hop (headers only, a trickling body,
headers that never end, a stream that never sends a frame) and the tracker's announce query.

Standard library (numpy for a frame's ids) and agent.wire only: the integration tests and the bench
both import it, and neither imports the other (.importlinter, bench/_common.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.wire.frames import REQ_HEADER, Kind, Op, Request, encode_request
from agent.wire.stream import STREAM_PATH

GIB = 1 << 30
MIB = 1 << 20
DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested 100k levels: a RecursionError for json.loads

# -- the web server: bodies it must not read, and what everyone else sees meanwhile --------------------


def address(base_url: str) -> tuple[str, int]:
    """(host, port) of an http:// base URL."""
    u = urllib.parse.urlsplit(base_url)
    return u.hostname or "127.0.0.1", u.port or 80


def rss_mb(pid: int) -> float:
    """A process's resident memory now, in MB (/proc/PID/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@contextlib.contextmanager
def rss_peak(pid: int, every_s: float = 0.01) -> Iterator[dict[str, float]]:
    """Samples a process's RSS while the block runs: {"before", "peak"} in MB (peak: after it too)."""
    got, done = {"before": rss_mb(pid), "peak": 0.0}, threading.Event()

    def sample() -> None:
        while not done.is_set():
            got["peak"] = max(got["peak"], rss_mb(pid))
            time.sleep(every_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield got
    finally:
        done.set()
        sampler.join()
        got["peak"] = max(got["peak"], rss_mb(pid))


def head(path: str, *headers: str) -> bytes:
    """A POST's request line and headers (an octet-stream body, whatever its framing headers say)."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/octet-stream", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def send_headers_only(
    addr: tuple[str, int], raw: bytes, timeout: float = 10
) -> tuple[bytes, float, socket.socket]:
    """Send a request's headers and no body; the server's first answer and how long it took."""
    sock = socket.create_connection(addr, timeout=timeout)
    sock.sendall(raw)
    t = time.perf_counter()
    reply = sock.recv(4096)  # a timeout here is the old behaviour: waiting for the body
    return reply, time.perf_counter() - t, sock


def push(sock: socket.socket, total: int, chunk: bytes) -> int:
    """Send up to `total` bytes of `chunk`s; how many went before the server's close stopped them."""
    sent = 0
    try:
        while sent < total:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:  # reset, broken pipe or a timeout: the server stopped reading, as it should
        pass
    return sent


class HealthProbe(threading.Thread):
    """Times GET /healthz back to back, as every other user of the web would see it."""

    def __init__(self, addr: tuple[str, int]) -> None:
        super().__init__(daemon=True)
        self.addr, self.stop, self.ms = addr, threading.Event(), list[float]()

    def run(self) -> None:
        import http.client

        while not self.stop.is_set():
            c = http.client.HTTPConnection(*self.addr, timeout=60)
            t = time.perf_counter()
            c.request("GET", "/healthz")
            c.getresponse().read()
            self.ms.append((time.perf_counter() - t) * 1000)
            c.close()
            time.sleep(0.02)

    def p99(self) -> float:
        return statistics.quantiles(self.ms, n=100)[98] if len(self.ms) >= 2 else max(self.ms)


# -- a hop: stalled clients ------------------------------------------------------------------------------

STALL_KINDS = ("headers only", "slow body", "slow headers", "silent stream")


def open_frame(token: bytes, session: bytes) -> bytes:
    return encode_request(Request(op=Op.OPEN, session=session, token=token))


def ids_frame(token: bytes, session: bytes, ids: list[int]) -> bytes:
    import numpy as np

    payload = np.asarray(ids, dtype="<i4").tobytes()
    return encode_request(
        Request(
            op=Op.FORWARD,
            session=session,
            token=token,
            step=1,
            n_tokens=len(ids),
            kind=Kind.IDS,
            payload=payload,
        )
    )


@dataclass
class Stalled:
    """One stalled connection: what it sent, when it opened, when the hop closed it."""

    kind: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    opened: float
    closed: float = 0.0

    async def wait_closed(self, timeout_s: float) -> None:
        """Read until the hop closes the connection (whatever it answered first)."""
        with contextlib.suppress(ConnectionError, TimeoutError):
            await asyncio.wait_for(_drain(self.reader), timeout_s)
        self.closed = time.monotonic()


async def _drain(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass


async def stall(url: str, kind: str, frame: bytes) -> Stalled:
    """Open a connection to the hop at `url` and send the start of a request that never finishes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.monotonic()
    head = f"POST /v1/frame HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(frame)}\r\n\r\n".encode()
    if kind == "headers only":
        writer.write(head)
    elif kind == "slow body":
        writer.write(head + frame[: REQ_HEADER.size // 2])  # then a byte now and then (trickle below)
    elif kind == "slow headers":
        writer.write(f"POST /v1/frame HTTP/1.1\r\nHost: {host}\r\n".encode())
    elif kind == "silent stream":
        key = "dGhlIHNhbXBsZSBub25jZQ=="
        writer.write(
            f"GET {STREAM_PATH} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
    await writer.drain()
    return Stalled(kind, reader, writer, t0)


async def trickle(stalled: list[Stalled], frame: bytes) -> None:
    """Send the slow bodies one more byte a second (each still far from its Content-Length)."""
    sent = REQ_HEADER.size // 2
    while True:
        await asyncio.sleep(1.0)
        for s in stalled:
            if s.kind == "slow body" and not s.writer.is_closing():
                s.writer.write(frame[sent : sent + 1])
        sent += 1


# -- the tracker ------------------------------------------------------------------------------------------


def announce_query(info_hash: bytes, peer_id: bytes, port: int, numwant: int = 50) -> str:
    """A BitTorrent announce's query string (compact peers, still downloading)."""
    q = f"info_hash={urllib.parse.quote_from_bytes(info_hash)}&peer_id={urllib.parse.quote_from_bytes(peer_id)}"
    return q + f"&port={port}&uploaded=0&downloaded=0&left=1000&compact=1&numwant={numwant}"


def compact_peers(body: dict[bytes, Any]) -> list[tuple[str, int]]:
    """(address, port) of an announce answer's compact peer list."""
    raw = body.get(b"peers", b"")
    return [
        (".".join(str(b) for b in raw[i : i + 4]), int.from_bytes(raw[i + 4 : i + 6], "big"))
        for i in range(0, len(raw), 6)
    ]
