"""`GET /v1/stream`: request frames over one WebSocket per client (docs/protocol.md, "Transport").

The same frames, limits and answers as `POST /v1/frame` (agent/node/dataplane.py), without an HTTP
request per frame: on this machine an aiohttp POST round trip costs ~650 us, a WebSocket message
~90 us (bench/archive/transport.py), and a decode step pays one per hop. A message is at most
STREAM_MAX_FRAME bytes (bigger frames go over POST, which checks the token before reading the body);
its header, length and route token are checked before anything is decoded, and the per-address,
per-token and node-wide buffered-bytes limits count it exactly as they count a POST; a stream is
anonymous until one of its frames carries a valid route token, and must be within HEAD_TIMEOUT_S
(admission.py: one more than its address's ANON_PER_IP cuts the oldest). Messages on one
socket are answered one at a time, in order. A client that agreed to BUNDLE_PROTOCOL at the upgrade may
send a bundle (agent/wire/bundle.py): its frames are admitted one by one as above, run together and
answered in one message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import WSCloseCode, WSMsgType, web

from agent.node.admission import HEAD_TIMEOUT_S, Anonymous, FrameAdmission, Held, cutter, release_slot
from agent.node.errors import DataPlaneError, error_response
from agent.wire.bundle import BUNDLE_PROTOCOL, BUNDLE_STEP_TOKENS, decode_bundle, encode_answers, is_bundle
from agent.wire.frames import REQ_HEADER, Flag, FrameError, check_request_header, peek_request
from agent.wire.stream import STREAM_MAX_FRAME, STREAM_PATH, error_message

if TYPE_CHECKING:
    from agent.node.chain import NextHops
    from agent.node.metrics import NodeMetrics

log = logging.getLogger("agent.node.stream")
# Open streams per client address: each buffers at most one STREAM_MAX_FRAME message, so this bounds
# what one address can make a node hold (the control plane's route clients share one address).
MAX_STREAMS_PER_IP = 256


@dataclass
class Stream:
    """One client's stream: its address and, until a frame on it shows a valid route token, its place
    among its address's anonymous requests (`key`) and the deadline for that frame."""

    ip: str
    anonymous: Anonymous
    deadline: asyncio.Timeout | None = None
    key: int = 0

    def trust(self) -> None:
        """A frame on it carried a valid route token: no deadline from now on (before the frame runs,
        so a long first step is not cut)."""
        if self.key:
            self.anonymous.leave(self.ip, self.key)
            self.key = 0
        if self.deadline is not None:
            with contextlib.suppress(RuntimeError):  # expiring already: the stream is being cut
                self.deadline.reschedule(None)
            self.deadline = None


class StreamView:
    """The WebSocket endpoint of one data plane: frames pass its `admission` as POSTs do, `answer_frame`
    answers them, and they count in its `counters` and `metrics`. Its own chain streams (`hops`) close
    first when the node stops."""

    def __init__(
        self,
        admission: FrameAdmission,
        answer_frame: Callable[[bytes], Awaitable[bytes]],
        counters: dict[str, int],
        metrics: NodeMetrics,
        hops: NextHops,
    ) -> None:
        self.admission, self.answer_frame = admission, answer_frame
        self.counters, self.metrics, self.hops = counters, metrics, hops
        self.streams: dict[str, int] = {}
        self.open: set[web.WebSocketResponse] = set()

    def register(self, app: web.Application) -> None:
        app.router.add_get(STREAM_PATH, self.view)
        app.on_shutdown.append(self.shutdown)

    async def shutdown(self, app: web.Application) -> None:  # noqa: ARG002
        """Before the server waits for its handlers: a stream's handler only ends when its socket does.
        This node's own chain streams close first (a chain through this node ends here too), then
        every client's, at once; a client that does not answer the close is cut after 1 s."""
        await self.hops.close_streams()
        socks = list(self.open)
        await asyncio.gather(
            *(ws.close(code=WSCloseCode.GOING_AWAY, message=b"node shutting down") for ws in socks),
            return_exceptions=True,
        )

    async def view(self, request: web.Request) -> web.StreamResponse:
        ip = request.remote or "?"
        if self.streams.get(ip, 0) >= MAX_STREAMS_PER_IP:
            return error_response(
                429, "too_many_requests", f"more than {MAX_STREAMS_PER_IP} streams from {ip}"
            )
        ws = web.WebSocketResponse(
            max_msg_size=STREAM_MAX_FRAME,
            compress=False,
            autoping=True,
            timeout=1.0,
            protocols=(BUNDLE_PROTOCOL,),  # a client that asks may send bundles (agent/wire/bundle.py)
        )
        await ws.prepare(request)
        self.streams[ip] = self.streams.get(ip, 0) + 1
        self.open.add(ws)
        stream = Stream(ip, self.admission.anonymous)
        try:
            # Anonymous until a frame's route token verifies: it must within HEAD_TIMEOUT_S, and counts
            # with its address's anonymous requests (admission.py: one too many cuts the oldest)
            async with asyncio.timeout(HEAD_TIMEOUT_S) as stream.deadline:
                stream.key = self.admission.anonymous.enter(ip, cutter(stream.deadline))
                try:
                    async for msg in ws:
                        if msg.type != WSMsgType.BINARY:
                            await ws.close(code=WSCloseCode.UNSUPPORTED_DATA, message=b"binary frames only")
                            break
                        if is_bundle(msg.data):
                            status, answer = await self.answer_bundle(stream, msg.data)
                        else:
                            status, answer = await self.answer(stream, msg.data)
                        if status == 200:
                            await ws.send_bytes(answer)
                        else:
                            await ws.send_str(answer.decode())
                finally:
                    stream.trust()  # gone: its anonymous place too
        except TimeoutError:
            self.counters["errors"] += 1
            self.metrics.error("too_slow")
            await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"no valid frame in time")
        finally:
            release_slot(self.streams, ip)
            self.open.discard(ws)
        return ws

    async def answer_bundle(self, stream: Stream, data: bytes) -> tuple[int, bytes]:
        """(200, the answers) for a bundle's frames, each admitted and answered as if it had come alone
        and all submitted in this loop turn (so the shard's scheduler batches them together); (400,
        error JSON) for a malformed bundle, none of whose frames is run."""
        try:
            frames = decode_bundle(data)
        except FrameError as e:
            return self._refuse(DataPlaneError(e.status, "bad_frame", str(e)))
        self.counters["bundles"] += 1
        answers = await asyncio.gather(*(self._answer_in_bundle(stream, bytes(f)) for f in frames))
        return 200, encode_answers(answers)

    async def _answer_in_bundle(self, stream: Stream, body: bytes) -> tuple[int, bytes]:
        """A bundle's answer is held until its last frame is done, so it carries small steps only: a
        frame of more than BUNDLE_STEP_TOKENS positions or asking for logits is refused in its slot
        (a client sends those alone), which bounds what one bundle's answers can make a node hold."""
        head = REQ_HEADER.unpack_from(body, 0)  # decode_bundle took frames of at least a header
        flags, n_tokens = head[3], head[7]
        if n_tokens > BUNDLE_STEP_TOKENS or flags & Flag.WANT_LOGITS:
            return self._refuse(
                DataPlaneError(
                    413,
                    "bundle_step_too_big",
                    f"a bundled frame carries at most {BUNDLE_STEP_TOKENS} positions and no logits request: "
                    "send it alone",
                )
            )
        return await self.answer(stream, body)

    async def answer(self, stream: Stream, body: bytes) -> tuple[int, bytes]:
        """(200, response frame) or (status, error JSON) for one message of `stream`, limits first: its
        header, length and token, its token's slot and bytes, then its address's slot (a whole message
        is in: nothing here waits for a client)."""
        held = Held()
        try:
            try:
                held.token = self._admit(body, stream)
                held.reserved = len(body)
                self.admission.take_ip_slot(stream.ip)
                held.ip = stream.ip
                out = await self.answer_frame(body)
            except DataPlaneError as e:
                return self._refuse(e)
            self.counters["bytes_out"] += len(out)
            return 200, out
        finally:
            self.admission.release(held)

    def _admit(self, body: bytes, stream: Stream) -> bytes:
        """Header, length and route token of a whole message (a valid one: the stream is trusted from
        now on), then its token's slot and bytes."""
        n = len(body)
        try:
            token_len, promised = check_request_header(body[: REQ_HEADER.size])
            if n < promised:
                raise FrameError(f"truncated frame: {n} bytes, its header promises {promised}")
            session, token, _ = peek_request(body[: REQ_HEADER.size + token_len])
        except FrameError as e:
            raise DataPlaneError(e.status, "bad_frame", str(e)) from None
        self.admission.authorise(session, token)
        stream.trust()
        self.admission.reserve(token, n)
        return token

    def _refuse(self, e: DataPlaneError) -> tuple[int, bytes]:
        self.counters["errors"] += 1
        self.metrics.error(e.code)
        return e.status, error_message(e.status, e.code, e.message).encode()
