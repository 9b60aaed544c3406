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
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import ClientSession, ClientWebSocketResponse, WSMessage, WSMsgType, WSServerHandshakeError

from agent.wire.bundle import BUNDLE_MAX_FRAMES, BUNDLE_PROTOCOL, HEAD, ITEM, decode_answers, encode_bundle
from agent.wire.frames import FrameError
from agent.wire.jsonlimits import loads_bounded

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
# "http": every frame is POSTed. Not only for measurements: a proxy in front of a hop that does not
# pass WebSockets answers the upgrade with a status other than 404/405, which fails the frame instead
# of falling back to POST.
TRANSPORT_ENV = "GGSWARM_TRANSPORT"
_IDLE_PER_HOP = 16  # sockets kept open per hop once their exchange is done
# A frame bigger than this goes alone (a decode step with f32 hidden states is ~2.5 KB at 576 wide).
BUNDLE_ITEM_MAX = 64 << 10


def streams_enabled() -> bool:
    return os.environ.get(TRANSPORT_ENV, "stream") != "http"


def error_message(status: int, code: str, message: str) -> str:
    """The text message a stream answers a refused frame with."""
    return json.dumps({"status": status, "error": code, "message": message})


class FrameStreams:
    """Pooled WebSockets to hops' /v1/stream, keyed by URL and the TLS name the peer must prove.

    With `bundling`, small steps sent to one hop in the same loop turn travel as one bundle message
    (agent/wire/bundle.py) over a socket whose hop agreed to BUNDLE_PROTOCOL, and come back as one: the
    route clients of a process share one FrameStreams (agent/client/transport.py), so the next steps of
    sessions a hop answered together reach the next hop together and are batched together there."""

    def __init__(
        self, http: ClientSession, max_answer: int = STREAM_MAX_ANSWER, bundling: bool = False
    ) -> None:
        self._http = http
        self.max_answer = max_answer  # a longer answer ends the stream (the exchange fails)
        self._idle: dict[tuple[str, str | None], list[ClientWebSocketResponse]] = {}
        self._no_stream: set[str] = set()  # hops that answered the upgrade with 404/405: POST only
        self.enabled = streams_enabled()
        self.bundling = bundling
        self._no_bundle: set[str] = set()  # hops whose sockets did not agree to BUNDLE_PROTOCOL
        self._waiting: dict[tuple[str, str | None], _Turn] = {}  # frames of this loop turn, per hop
        self._flushing: set[asyncio.Task[None]] = set()
        self.bundles_sent = 0  # bundle messages of two frames or more (telemetry, tests)

    async def exchange(
        self,
        url: str,
        body: bytes,
        timeout_s: float | None,
        ssl_ctx: ssl.SSLContext | bool = True,
        server_hostname: str | None = None,
        answer_limit: int | None = None,
        bundle: bool = False,
    ) -> tuple[int, bytes] | None:
        """(HTTP-equivalent status, answer bytes) for `body` sent to the hop at `url` (no path), or
        None when it must go over POST /v1/frame (too big, an answer that may exceed `max_answer`,
        streams off, or no stream endpoint). `bundle`: a small step that may share a message with
        other sessions' (the caller says so: a bundle's answer waits for its slowest frame).
        Raises TimeoutError, aiohttp.ClientError or OSError as a POST would."""
        base = url.rstrip("/")
        if not self.enabled or len(body) > STREAM_MAX_FRAME or base in self._no_stream:
            return None
        if answer_limit is not None and answer_limit > self.max_answer:
            return None
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        key = (base, server_hostname)
        if bundle and self.bundling and base not in self._no_bundle and len(body) <= BUNDLE_ITEM_MAX:
            return await self._bundled(key, body, deadline, ssl_ctx)
        return await self._exchange(key, body, deadline, ssl_ctx)

    async def _exchange(
        self, key: tuple[str, str | None], body: bytes, deadline: float | None, ssl_ctx: ssl.SSLContext | bool
    ) -> tuple[int, bytes] | None:
        ws = await self._socket(key, deadline, ssl_ctx)
        if ws is None:
            return None
        msg = await self._roundtrip(key, ws, body, deadline)
        if msg.type == WSMsgType.BINARY:
            return 200, msg.data
        return _status_of(msg.data), msg.data.encode()

    async def _socket(
        self, key: tuple[str, str | None], deadline: float | None, ssl_ctx: ssl.SSLContext | bool
    ) -> ClientWebSocketResponse | None:
        """An idle pooled socket to the hop, or a new one; None when the hop has no stream endpoint."""
        base, server_hostname = key
        idle = self._idle.get(key)
        ws = idle.pop() if idle else None
        if ws is not None and not ws.closed:
            return ws
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
                    protocols=(BUNDLE_PROTOCOL,) if self.bundling else (),
                )
        except WSServerHandshakeError as e:
            if e.status in (404, 405):
                self._no_stream.add(base)
                return None
            raise
        if self.bundling and ws.protocol != BUNDLE_PROTOCOL:
            self._no_bundle.add(base)  # an older hop: it takes lone frames only
        return ws

    async def _roundtrip(
        self, key: tuple[str, str | None], ws: ClientWebSocketResponse, body: bytes, deadline: float | None
    ) -> WSMessage:
        """Send one message and read its answer (binary or text); the socket goes back to the pool."""
        loop = asyncio.get_running_loop()
        done = False
        try:
            await ws.send_bytes(body)
            msg = await ws.receive(timeout=None if deadline is None else max(0.001, deadline - loop.time()))
            if msg.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
                # closed, or a protocol error: as broken as a reset connection
                raise ConnectionResetError(f"stream to {key[0]} ended ({msg.type.name}: {msg.extra})")
            done = True
            return msg
        finally:
            if done and not ws.closed and len(self._idle.setdefault(key, [])) < _IDLE_PER_HOP:
                self._idle[key].append(ws)
            else:
                # A socket whose answer never came (timeout, cancel) may still deliver it later:
                # never reuse it. Closed in the background so a cancelled caller is not held up.
                _close_later(ws)

    # -- bundles ------------------------------------------------------------------------------------
    async def _bundled(
        self, key: tuple[str, str | None], body: bytes, deadline: float | None, ssl_ctx: ssl.SSLContext | bool
    ) -> tuple[int, bytes] | None:
        """Send `body` with the other frames for its hop made in this loop turn, and wait for its own
        answer until its own deadline (a caller that gives up leaves the others theirs). The turn's
        first frame waits for the turn to end; alone then, it goes as a plain frame (no task, no
        bundle), else a task sends the bundle."""
        loop = asyncio.get_running_loop()
        item = _Item(body, loop.create_future(), deadline)
        turn = self._waiting.get(key)
        if turn is not None and turn.size + ITEM.size + len(body) > STREAM_MAX_FRAME:
            self._flush(key, ssl_ctx)  # a hop reads at most STREAM_MAX_FRAME per message
            turn = None
        if turn is not None:
            turn.add(item)
            if len(turn.items) >= BUNDLE_MAX_FRAMES:
                self._flush(key, ssl_ctx)
        else:
            turn = self._waiting[key] = _Turn()
            turn.add(item)
            try:
                await asyncio.sleep(0)  # the turn's other callbacks run: steps made in it join
            except asyncio.CancelledError:
                if self._waiting.get(key) is turn:
                    turn.items.remove(item)
                    self._flush(key, ssl_ctx)  # the others still go
                raise
            if self._waiting.get(key) is turn:  # not sent early (full): send it now
                if len(turn.items) == 1:
                    del self._waiting[key]
                    return await self._exchange(key, body, deadline, ssl_ctx)
                self._flush(key, ssl_ctx)
        async with asyncio.timeout_at(deadline):
            return await item.future

    def _flush(self, key: tuple[str, str | None], ssl_ctx: ssl.SSLContext | bool) -> None:
        turn = self._waiting.pop(key, None)
        items = [i for i in turn.items if not i.future.done()] if turn else []  # a cancelled caller's goes
        if not items:
            return
        task = asyncio.get_running_loop().create_task(self._send_bundle(key, items, ssl_ctx))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _send_bundle(
        self, key: tuple[str, str | None], items: list[_Item], ssl_ctx: ssl.SSLContext | bool
    ) -> None:
        try:
            # the bundle waits as long as its most patient frame; each caller still gives up at its own
            deadlines = [i.deadline for i in items if i.deadline is not None]
            deadline = max(deadlines) if len(deadlines) == len(items) else None
            ws = None
            if len(items) > 1 and key[0] not in self._no_bundle:
                ws = await self._socket(key, deadline, ssl_ctx)
                if ws is not None and key[0] in self._no_bundle:  # it just said it takes lone frames
                    self._idle.setdefault(key, []).append(ws)
                    ws = None
            if ws is None:  # one frame, a hop without bundles, or none without streams (None: POST)
                answers = await asyncio.gather(
                    *(self._exchange(key, i.body, i.deadline, ssl_ctx) for i in items), return_exceptions=True
                )
                for i, a in zip(items, answers, strict=True):
                    settle(i.future, a)
                return
            msg = await self._roundtrip(key, ws, encode_bundle([i.body for i in items]), deadline)
            self.bundles_sent += 1
            if msg.type == WSMsgType.TEXT:  # the whole bundle refused: each frame gets that refusal
                for i in items:
                    settle(i.future, (_status_of(msg.data), msg.data.encode()))
                return
            try:
                answers_ = decode_answers(msg.data, len(items))
            except FrameError as e:
                raise ConnectionResetError(f"stream to {key[0]} answered a bad bundle: {e}") from None
            for i, (status, data) in zip(items, answers_, strict=True):
                settle(i.future, (status, bytes(data)))
        except Exception as e:  # noqa: BLE001 - every waiting caller gets the failure, as a lone frame would
            for i in items:
                settle(i.future, e)
        except asyncio.CancelledError:  # the transport is closing: nobody is left waiting for nothing
            for i in items:
                settle(i.future, ConnectionResetError(f"stream to {key[0]} closed before its answer"))
            raise

    async def close(self) -> None:
        for task in list(self._flushing):
            task.cancel()
        await asyncio.gather(*self._flushing, return_exceptions=True)
        socks = [ws for pool in self._idle.values() for ws in pool]
        self._idle.clear()
        # at once and bounded: a hop that stopped answering must not hold the caller's close
        await asyncio.gather(*(_close(ws) for ws in socks))


@dataclass(eq=False)
class _Item:
    """A frame waiting for its hop's next bundle, and where its answer goes."""

    body: bytes
    future: asyncio.Future[tuple[int, bytes] | None]
    deadline: float | None


@dataclass(eq=False)
class _Turn:
    """The frames for one hop made in this loop turn, and the size of the bundle they make."""

    items: list[_Item] = field(default_factory=list)
    size: int = HEAD.size

    def add(self, item: _Item) -> None:
        self.items.append(item)
        self.size += ITEM.size + len(item.body)


T = TypeVar("T")


def settle(future: asyncio.Future[T], outcome: T | BaseException) -> None:
    """Give a waiting caller its outcome, unless it gave up (deadline, cancel) already."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
        future.exception()  # nobody may be awaiting any more: no "never retrieved" warning
    else:
        future.set_result(outcome)


# An error message is a short JSON object (error_message): a longer or deeper text is not one of ours.
ERROR_TEXT_MAX = 4096


def _status_of(text: str) -> int:
    """The status a hop's error text names; 502 for anything else (bounded: never a RecursionError)."""
    try:
        status = int(loads_bounded(text, max_bytes=ERROR_TEXT_MAX)["status"])
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
