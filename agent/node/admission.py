"""Data-plane frame admission: who may make a node wait, for how long, and what a frame holds while it does.

The order (docs/security.md, "Stalled clients"): a request holds nothing of the node's until it has
shown a valid route token, and its per-address slot only once its whole body is in.

1. The HTTP headers: aiohttp's keep-alive timer closes a connection that has not sent a whole request's
   headers HEAD_TIMEOUT_S after it opened or after its last answer (start_dataplane).
2. The frame's header and route token, within HEAD_TIMEOUT_S of the handler starting. Until then the
   request is *anonymous*: each address may have ANON_PER_IP anonymous requests and streams at once, and
   one more cuts its oldest (a route client's header and token arrive with its HTTP headers, so it is
   anonymous for microseconds; a stalled client is always the oldest). Nothing else is counted yet.
3. The token verified: one of the token's PER_TOKEN_CONCURRENCY slots and the frame's bytes of the
   node's INFLIGHT_BYTES are reserved, then the body is read within BODY_TIMEOUT_S plus its length at
   BODY_MIN_RATE.
4. The whole frame in: one of its address's PER_IP_CONCURRENCY slots while it is answered.

A request that misses a deadline is answered 408 and its connection closed; whatever it held is given
back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agent import defaults
from agent.node.errors import DataPlaneError
from agent.wire.frames import (
    MAX_FRAME_BYTES,
    MAX_TAIL_BYTES,
    REQ_HEADER,
    FrameError,
    check_request_header,
    peek_request,
)
from agent.wire.routetoken import RouteClaims, TokenError, TokenVerifier

# Requests handled at once, per client address and per route token (429 beyond), and frame bytes
# buffered at once on the whole node (503 beyond): a flood waits in nobody's memory.
PER_IP_CONCURRENCY = 64  # the control plane's route clients all come from one address
PER_TOKEN_CONCURRENCY = 4
INFLIGHT_BYTES = 256 << 20
# Anonymous requests and streams (no valid route token shown yet) per address; one more cuts the oldest.
ANON_PER_IP = 64
# How long a client may take to send a request's headers, then the frame's header and route token
# (also how long a stream may stay open before its first valid frame).
HEAD_TIMEOUT_S = defaults.HOP_HEAD_TIMEOUT_S
# A frame's body, once its token is verified: this long plus its length at BODY_MIN_RATE.
BODY_TIMEOUT_S = 5.0
BODY_MIN_RATE = 256 << 10  # bytes per second


@dataclass
class Held:
    """What one frame holds while it is answered; FrameAdmission.release gives back what is set."""

    ip: str = ""  # its address's PER_IP_CONCURRENCY slot
    token: bytes = b""  # its token's PER_TOKEN_CONCURRENCY slot
    reserved: int = 0  # its bytes of INFLIGHT_BYTES


class Anonymous:
    """The requests and streams of each address that have not yet shown a valid route token, oldest
    first. One more than `per_ip` cuts the oldest (its `cut` callback ends its wait at once): a stalled
    client can hold at most `per_ip` of them, and never keeps a new one of its address out."""

    def __init__(self, per_ip: int = ANON_PER_IP) -> None:
        self.per_ip = per_ip
        self._by_ip: dict[str, dict[int, Callable[[], None]]] = {}
        self._last = 0
        self.cut = 0  # cut for a newer one (telemetry, tests)

    def enter(self, ip: str, cut: Callable[[], None]) -> int:
        """Count one more for `ip`; the key `leave` takes."""
        waiting = self._by_ip.setdefault(ip, {})
        if len(waiting) >= self.per_ip:
            waiting.pop(next(iter(waiting)))()  # dicts keep insertion order: the oldest first
            self.cut += 1
        self._last += 1
        waiting[self._last] = cut
        return self._last

    def leave(self, ip: str, key: int) -> None:
        waiting = self._by_ip.get(ip)
        if waiting is not None:
            waiting.pop(key, None)
            if not waiting:
                del self._by_ip[ip]

    def total(self) -> int:
        return sum(len(w) for w in self._by_ip.values())


def cutter(deadline: asyncio.Timeout) -> Callable[[], None]:
    """A `cut` for Anonymous: expire `deadline` now (nothing if it has already fired)."""
    loop = asyncio.get_running_loop()

    def cut() -> None:
        with contextlib.suppress(RuntimeError):  # already expiring or left
            deadline.reschedule(loop.time())

    return cut


class FrameAdmission:
    """The limits every frame passes before it is buffered, POST and stream alike, and the route-token
    check for this node's id."""

    def __init__(self, node_id: str, verifier: TokenVerifier) -> None:
        self.node_id = node_id
        self.verifier = verifier
        self._per_ip: dict[str, int] = {}
        self._per_token: dict[bytes, int] = {}
        self.anonymous = Anonymous()  # requests and streams with no valid token yet, per address
        self.inflight_bytes = 0  # frame bytes reserved by frames not yet answered

    def authorise(self, session: bytes, token: bytes) -> RouteClaims:
        """The token check alone, also before a body is read: forged, expired or foreign tokens cost no
        buffer. The claims say which shard and next hop the token grants."""
        try:
            claims = self.verifier.verify(token)
        except TokenError as e:
            raise DataPlaneError(401, "bad_token", str(e)) from None
        if claims.node != self.node_id:
            raise DataPlaneError(403, "wrong_node", f"route token is for node {claims.node!r}, not this node")
        if claims.session != session:
            raise DataPlaneError(403, "wrong_session", "route token is for another session")
        return claims

    async def receive_post(self, request: web.Request, held: Held) -> bytes:
        """A POSTed frame, read in the order the module docstring gives, each part against its deadline
        (TimeoutError when one passes); `held` says what it holds, for `release`."""
        n = request.content_length
        if n is None:
            raise DataPlaneError(411, "length_required", "a frame needs a Content-Length")
        if n > MAX_FRAME_BYTES:
            raise DataPlaneError(413, "too_large", f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
        if n < REQ_HEADER.size:
            raise DataPlaneError(
                400, "bad_frame", f"truncated frame: {n} bytes, header needs {REQ_HEADER.size}"
            )
        ip = request.remote or "?"
        async with asyncio.timeout(HEAD_TIMEOUT_S) as deadline:
            key = self.anonymous.enter(ip, cutter(deadline))
            try:
                head = await self._read_head(request, n)
                session, token, _ = peek_request(head)
                self.authorise(session, token)
            except FrameError as e:
                raise DataPlaneError(e.status, "bad_frame", str(e)) from None
            finally:
                self.anonymous.leave(ip, key)
            self.reserve(token, n)
            held.token, held.reserved = token, n
            deadline.reschedule(asyncio.get_running_loop().time() + BODY_TIMEOUT_S + n / BODY_MIN_RATE)
            body = head + await request.content.readexactly(n - len(head))
        self.take_ip_slot(ip)
        held.ip = ip
        return body

    @staticmethod
    async def _read_head(request: web.Request, n: int) -> bytes:
        """The frame's header and route token (FrameError when they do not fit `n` bytes)."""
        head = await request.content.readexactly(REQ_HEADER.size)
        token_len, promised = check_request_header(head)
        if not promised <= n <= promised + MAX_TAIL_BYTES:
            raise FrameError(
                f"Content-Length {n} does not fit the {promised}-byte frame its header describes"
            )
        return head + await request.content.readexactly(token_len)

    def take_ip_slot(self, ip: str) -> None:
        """One of the PER_IP_CONCURRENCY frames a peer address may have answered at once (POST and
        stream alike, taken once the whole frame is in and its token verified)."""
        if self._per_ip.get(ip, 0) >= PER_IP_CONCURRENCY:
            raise DataPlaneError(
                429, "too_many_requests", f"more than {PER_IP_CONCURRENCY} frames at once from {ip}"
            )
        self._per_ip[ip] = self._per_ip.get(ip, 0) + 1

    def release(self, held: Held) -> None:
        """Give back what one frame held (take_ip_slot, reserve)."""
        if held.ip:
            release_slot(self._per_ip, held.ip)
        if held.token:
            release_slot(self._per_token, held.token)
        self.inflight_bytes -= held.reserved
        held.ip, held.token, held.reserved = "", b"", 0

    def reserve(self, token: bytes, n: int) -> None:
        """Take an authorised frame's slots (POST and stream alike): one of the token's
        PER_TOKEN_CONCURRENCY frames and `n` of the node's INFLIGHT_BYTES; `release` gives both back
        when the frame is answered."""
        if self._per_token.get(token, 0) >= PER_TOKEN_CONCURRENCY:
            raise DataPlaneError(
                429,
                "too_many_requests",
                f"more than {PER_TOKEN_CONCURRENCY} frames at once for one route token",
            )
        self._per_token[token] = self._per_token.get(token, 0) + 1
        if self.inflight_bytes + n > INFLIGHT_BYTES:
            release_slot(self._per_token, token)
            raise DataPlaneError(503, "busy", "this node is receiving too many frames at once; retry shortly")
        self.inflight_bytes += n


def release_slot(counts: dict[Any, int], key: object) -> None:
    """One fewer held for `key` (its entry gone at zero, so idle peers and tokens cost no memory)."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
