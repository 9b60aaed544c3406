"""Data-plane frame admission: per-address and per-token slots, buffered bytes, the token, before the body."""

from __future__ import annotations

from typing import Any

from aiohttp import web

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


class FrameAdmission:
    """The limits every frame passes before it is buffered, POST and stream alike, and the route-token
    check for this node's id."""

    def __init__(self, node_id: str, verifier: TokenVerifier) -> None:
        self.node_id = node_id
        self.verifier = verifier
        self._per_ip: dict[str, int] = {}
        self._per_token: dict[bytes, int] = {}
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

    async def admit_post(self, request: web.Request) -> tuple[bytes, int, bytes]:
        """Check length, header and token from the frame's first bytes; reserve its buffer. Returns the
        token (its concurrency slot taken), the frame length (reserved in inflight bytes) and the
        bytes read so far."""
        n = request.content_length
        if n is None:
            raise DataPlaneError(411, "length_required", "a frame needs a Content-Length")
        if n > MAX_FRAME_BYTES:
            raise DataPlaneError(413, "too_large", f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
        if n < REQ_HEADER.size:
            raise DataPlaneError(
                400, "bad_frame", f"truncated frame: {n} bytes, header needs {REQ_HEADER.size}"
            )
        head = await request.content.readexactly(REQ_HEADER.size)
        try:
            token_len, promised = check_request_header(head)
        except FrameError as e:
            raise DataPlaneError(e.status, "bad_frame", str(e)) from None
        if not promised <= n <= promised + MAX_TAIL_BYTES:
            raise DataPlaneError(
                400,
                "bad_frame",
                f"Content-Length {n} does not fit the {promised}-byte frame its header describes",
            )
        head += await request.content.readexactly(token_len)
        try:
            session, token, _ = peek_request(head)
        except FrameError as e:
            raise DataPlaneError(e.status, "bad_frame", str(e)) from None
        self.reserve_frame(session, token, n)
        return token, n, head

    def take_ip_slot(self, ip: str) -> None:
        """One of the PER_IP_CONCURRENCY frames a peer address may have in flight (POST and stream
        alike); release_frame gives it back."""
        if self._per_ip.get(ip, 0) >= PER_IP_CONCURRENCY:
            raise DataPlaneError(
                429, "too_many_requests", f"more than {PER_IP_CONCURRENCY} frames at once from {ip}"
            )
        self._per_ip[ip] = self._per_ip.get(ip, 0) + 1

    def release_frame(self, ip: str, token: bytes, reserved: int) -> None:
        """Give back what take_ip_slot and reserve_frame took for one frame (token b"": none)."""
        release_slot(self._per_ip, ip)
        if token:
            release_slot(self._per_token, token)
        self.inflight_bytes -= reserved

    def reserve_frame(self, session: bytes, token: bytes, n: int) -> None:
        """Authorise a frame's token and take its slots (POST and stream alike): one of the token's
        PER_TOKEN_CONCURRENCY frames and `n` of the node's INFLIGHT_BYTES; the caller gives both back
        when the frame is answered."""
        self.authorise(session, token)
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
