"""Frames over a WebSocket per hop pair: the data plane's fast transport (docs/protocol.md, "Transport").

A hop serves `GET /v1/stream` beside `POST /v1/frame`. On a stream each binary message is one request
frame, answered in order by one binary message (the response frame) or one text message holding the
error JSON `{"status", "error", "message"}` that `POST /v1/frame` would have answered with that status.
One exchange at a time per socket; `FrameStreams` pools sockets per hop so concurrent sessions each
take their own. Frames over STREAM_MAX_FRAME (big prefill chunks, logits) and hops without the
endpoint (an older node: 404 on the upgrade) go over `POST /v1/frame` as before: `exchange` answers
None and the caller posts. GGSWARM_TRANSPORT=http turns streams off (measurement, a broken proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
from typing import Any

from aiohttp import ClientSession, ClientWebSocketResponse, WSMsgType, WSServerHandshakeError

STREAM_PATH = "/v1/stream"
# Largest request frame sent over a stream: a decode step or a prefill chunk of a few hundred tokens.
# A stream message is buffered whole before its route token is checked, so this bounds what a forged
# frame costs a hop (POST /v1/frame checks the token before reading a body of up to 64 MiB).
STREAM_MAX_FRAME = 1 << 20
# Largest answer read from a stream: a hop's answer is bounded by the frame format (hidden states of
# at most 8,192 positions, at most 32 MiB of logits); callers check their own tighter bound after.
STREAM_MAX_ANSWER = 64 << 20
# A chain hop reads its next hop's answers over a stream only up to this (a decode step's or a
# prefill chunk's hidden states); an answer that may be bigger (logits) goes over POST, read in chunks
# against its exact bound (docs/security.md, "bounded answers from the next hop").
CHAIN_MAX_ANSWER = 4 << 20
TRANSPORT_ENV = "GGSWARM_TRANSPORT"
_IDLE_PER_HOP = 16  # sockets kept open per hop once their exchange is done


def streams_enabled() -> bool:
    return os.environ.get(TRANSPORT_ENV, "stream") != "http"


def error_message(status: int, code: str, message: str) -> str:
    """The text message a stream answers a refused frame with."""
    return json.dumps({"status": status, "error": code, "message": message})


class FrameStreams:
    """Pooled WebSockets to hops' /v1/stream, keyed by URL and the TLS name the peer must prove."""

    def __init__(self, http: ClientSession, max_answer: int = STREAM_MAX_ANSWER) -> None:
        self._http = http
        self.max_answer = max_answer  # a longer answer ends the stream (the exchange fails)
        self._idle: dict[tuple[str, str | None], list[ClientWebSocketResponse]] = {}
        self._no_stream: set[str] = set()  # hops that answered the upgrade with 404/405: POST only
        self.enabled = streams_enabled()

    async def exchange(
        self,
        url: str,
        body: bytes,
        timeout_s: float | None,
        ssl_ctx: ssl.SSLContext | bool = True,
        server_hostname: str | None = None,
        answer_limit: int | None = None,
    ) -> tuple[int, bytes] | None:
        """(HTTP-equivalent status, answer bytes) for `body` sent to the hop at `url` (no path), or
        None when it must go over POST /v1/frame (too big, an answer that may exceed `max_answer`,
        streams off, or no stream endpoint).
        Raises TimeoutError, aiohttp.ClientError or OSError as a POST would."""
        base = url.rstrip("/")
        if not self.enabled or len(body) > STREAM_MAX_FRAME or base in self._no_stream:
            return None
        if answer_limit is not None and answer_limit > self.max_answer:
            return None
        key = (base, server_hostname)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        idle = self._idle.get(key)
        ws = idle.pop() if idle else None
        if ws is None or ws.closed:
            try:
                # the step's deadline covers the handshake too (a hung hop must not hold it longer)
                async with asyncio.timeout_at(deadline):
                    ws = await self._http.ws_connect(
                        base + STREAM_PATH,
                        ssl=ssl_ctx,
                        server_hostname=server_hostname,
                        max_msg_size=self.max_answer,
                        autoping=True,
                        compress=0,
                    )
            except WSServerHandshakeError as e:
                if e.status in (404, 405):
                    self._no_stream.add(base)
                    return None
                raise
        done = False
        try:
            await ws.send_bytes(body)
            msg = await ws.receive(timeout=None if deadline is None else max(0.001, deadline - loop.time()))
            if msg.type == WSMsgType.BINARY:
                answer: tuple[int, bytes] = (200, msg.data)
            elif msg.type == WSMsgType.TEXT:
                answer = (_status_of(msg.data), msg.data.encode())
            else:  # closed, or a protocol error: as broken as a reset connection
                raise ConnectionResetError(f"stream to {base} ended ({msg.type.name}: {msg.extra})")
            done = True
            return answer
        finally:
            if done and not ws.closed and len(self._idle.setdefault(key, [])) < _IDLE_PER_HOP:
                self._idle[key].append(ws)
            else:
                # A socket whose answer never came (timeout, cancel) may still deliver it later:
                # never reuse it. Closed in the background so a cancelled caller is not held up.
                _close_later(ws)

    async def close(self) -> None:
        socks = [ws for pool in self._idle.values() for ws in pool]
        self._idle.clear()
        # at once and bounded: a hop that stopped answering must not hold the caller's close
        await asyncio.gather(*(_close(ws) for ws in socks))


def _status_of(text: str) -> int:
    try:
        status = int(json.loads(text)["status"])
    except (ValueError, TypeError, KeyError):
        return 502
    return status if 400 <= status <= 599 else 502


_closing: set[asyncio.Task[Any]] = set()


async def _close(ws: ClientWebSocketResponse) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(), 2.0)


def _close_later(ws: ClientWebSocketResponse) -> None:
    try:
        task = asyncio.get_running_loop().create_task(_close(ws))
    except RuntimeError:  # no loop running (interpreter shutdown): the socket dies with the process
        return
    _closing.add(task)
    task.add_done_callback(_closing.discard)
