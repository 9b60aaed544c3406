"""The decode lane's frames (docs/lane.md): sealing a step for a hop's lane and opening its answer.

libggswarm serves lanes on its own threads (native/src/lane.cpp); this module is the same format in
Python for the side that starts a step (the route client, tests, benches). Every size is checked
against the header's limits before a payload byte is read.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"GGL1"
HEADER = 40  # bytes the tag covers as associated data
TAG = 16
FRAME_HEAD = HEADER + TAG
KIND_IDS, KIND_F16, KIND_F32, KIND_SUBSCRIBE = 1, 2, 3, 4
KIND_ANSWER, KIND_ERROR, KIND_REFUSAL, KIND_SUBSCRIBED = 16, 17, 18, 19
KIND_BUNDLE, KIND_BUNDLE_ANSWER = 5, 20  # v8: several sessions' steps in one frame, and their answers
DIR_REQUEST, DIR_ANSWER = 0, 1
MAX_TOKENS = 64  # GGSWARM_LANE_MAX_TOKENS
MAX_HOPS = 64  # GGSWARM_LANE_MAX_HOPS
MAX_BUNDLE = 32  # GGSWARM_LANE_MAX_BUNDLE
KEY_BYTES = 32
ANSWER_FIXED = 24
MESSAGE_MAX = 480
REFUSAL_MAX = 256

# magic, kind, timing pairs, reserved, lane id, step, position, positions, payload bytes, reserved
_HEAD = struct.Struct("<4sBBHQQiiII")
_ANSWER = struct.Struct("<iidiI")  # token, session_len, logprob, n_hops, reserved


class LaneError(Exception):
    """A step the lane did not run: refused before its key was checked, or failed at `hop` (0: the
    first hop) with libggswarm's `status`. The route's sessions stayed at their previous length
    unless `status` says the connection broke mid-step."""

    def __init__(self, message: str, status: int = 0, hop: int = 0, refused: bool = False) -> None:
        super().__init__(message)
        self.status, self.hop, self.refused = status, hop, refused


@dataclass(frozen=True)
class LaneAnswer:
    """A step's answer: the sampled token, the route's length after it, and each hop's timings in
    route order as (compute_us, handler_us)."""

    token: int
    session_len: int
    logprob: float
    timings: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Head:
    kind: int
    lane_id: int
    step: int
    pos_start: int
    n_tokens: int
    payload_len: int
    n_timings: int = 0


def _nonce(direction: int, step: int) -> bytes:
    return struct.pack("<IQ", direction, step)


def pack_head(h: Head) -> bytes:
    return _HEAD.pack(
        MAGIC, h.kind, h.n_timings, 0, h.lane_id, h.step, h.pos_start, h.n_tokens, h.payload_len, 0
    )


def unpack_head(b: bytes) -> Head:
    """The header of a frame, or LaneError when the fixed fields are not a lane's."""
    magic, kind, n_timings, res, lane_id, step, pos, n, plen, res2 = _HEAD.unpack_from(b)
    if magic != MAGIC or n_timings >= MAX_HOPS or res or res2:
        raise LaneError("not a lane frame")
    return Head(kind, lane_id, step, pos, n, plen, n_timings)


def seal_request(
    key: bytes, lane_id: int, step: int, pos_start: int, ids: np.ndarray, rows: np.ndarray | None = None
) -> bytes:
    """A request frame: ids (int32) and, for a window after the first, their boundary rows (f16/f32)."""
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    n = int(ids.shape[0])
    if not 1 <= n <= MAX_TOKENS:
        raise ValueError(f"a lane step carries 1..{MAX_TOKENS} positions, not {n}")
    kind = KIND_IDS
    body = ids.tobytes()
    if rows is not None:
        kind = KIND_F16 if rows.dtype == np.float16 else KIND_F32
        body += np.ascontiguousarray(rows, dtype=np.float16 if kind == KIND_F16 else np.float32).tobytes()
    head = pack_head(Head(kind, lane_id, step, pos_start, n, len(body)))
    sealed = AESGCM(key).encrypt(_nonce(DIR_REQUEST, step), body, head)
    return head + sealed[-TAG:] + sealed[:-TAG]


def seal_subscribe(key: bytes, lane_id: int, step: int) -> bytes:
    """Direct mode: ask a hop to send this session's answers (last hop) and errors on this connection."""
    head = pack_head(Head(KIND_SUBSCRIBE, lane_id, step, 0, 0, 0))
    return head + AESGCM(key).encrypt(_nonce(DIR_REQUEST, step), b"", head)


def check_subscribed(key: bytes, frame_head: bytes, lane_id: int, step: int) -> None:
    """The hop's acknowledgement of a subscription, or LaneError."""
    head = unpack_head(frame_head)
    if head.kind != KIND_SUBSCRIBED or head.lane_id != lane_id or head.step != step or head.payload_len:
        raise LaneError(f"subscription to lane {lane_id} not acknowledged (kind {head.kind})", refused=True)
    try:
        AESGCM(key).decrypt(_nonce(DIR_ANSWER, step), frame_head[HEADER:FRAME_HEAD], frame_head[:HEADER])
    except Exception:  # InvalidTag
        raise LaneError("subscription acknowledgement does not open with the key") from None


def answer_limit(head: Head) -> int:
    """The largest payload an answer of this kind may carry (checked before it is read)."""
    if head.kind == KIND_ANSWER:
        return ANSWER_FIXED + 8 * MAX_HOPS
    if head.kind == KIND_ERROR:
        return 8 + MESSAGE_MAX
    if head.kind == KIND_REFUSAL:
        return REFUSAL_MAX
    raise LaneError(f"answer of unknown kind {head.kind}")


def answer_head(head_b: bytes) -> Head:
    """An answer's head, its payload size checked against the kind's limit before it is read."""
    head = unpack_head(head_b)
    if head.payload_len > answer_limit(head):
        raise LaneError(f"answer of {head.payload_len} bytes is over its limit")
    return head


async def ipv4_of(url: str) -> str:
    """The numeric IPv4 address a hop's URL names (lanes dial numbers, not names); LaneError if none."""
    import asyncio
    import ipaddress
    import urllib.parse

    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        if ipaddress.ip_address(host).version == 4:
            return host
        raise LaneError(f"{url} is not on IPv4")
    except ValueError:
        pass  # a name: resolve it
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, family=socket.AF_INET)
    except OSError as e:
        raise LaneError(f"{url}: {e}") from None
    if not infos:
        raise LaneError(f"{url} has no IPv4 address")
    return str(infos[0][4][0])


def open_answer(key: bytes, frame_head: bytes, payload: bytes, lane_id: int, step: int) -> LaneAnswer:
    """The answer to step `step`, or LaneError for a refusal, an error answer or a frame that does
    not open with the key."""
    head = unpack_head(frame_head)
    if head.lane_id != lane_id or head.step != step:
        raise LaneError(f"answer for lane {head.lane_id} step {head.step}, expected {lane_id} step {step}")
    if head.kind == KIND_REFUSAL:
        raise LaneError("lane refused: " + payload.decode("utf-8", "replace"), refused=True)
    try:
        plain = AESGCM(key).decrypt(
            _nonce(DIR_ANSWER, step), payload + frame_head[HEADER:FRAME_HEAD], frame_head[:HEADER]
        )
    except Exception:  # cryptography's InvalidTag: the frame is not the hop's
        raise LaneError("answer does not open with the session's key") from None
    if head.kind == KIND_ERROR:
        status, hop = struct.unpack_from("<iI", plain)
        raise LaneError(plain[8:].decode("utf-8", "replace"), status=status, hop=hop)
    token, session_len, logprob, n_hops, _ = _ANSWER.unpack_from(plain)
    if not 1 <= n_hops <= MAX_HOPS or len(plain) != ANSWER_FIXED + 8 * n_hops:
        raise LaneError("answer has a bad hop count")
    t = struct.unpack_from(f"<{2 * n_hops}I", plain, ANSWER_FIXED)
    return LaneAnswer(token, session_len, logprob, tuple(zip(t[0::2], t[1::2], strict=True)))


@dataclass(frozen=True)
class BundleMember:
    """One session's step in a bundle: its key and lane id at the hop, the step number and the ids."""

    key: bytes
    lane_id: int
    step: int
    pos_start: int
    ids: np.ndarray

    def seal(self) -> bytes:
        return seal_request(self.key, self.lane_id, self.step, self.pos_start, self.ids)


def seal_bundle(members: list[BundleMember]) -> bytes:
    """A bundle frame: an unsealed head counting the members, then each member's own sealed request."""
    if not 1 <= len(members) <= MAX_BUNDLE:
        raise ValueError(f"a bundle carries 1..{MAX_BUNDLE} steps, not {len(members)}")
    body = b"".join(m.seal() for m in members)
    return pack_head(Head(KIND_BUNDLE, 0, 0, 0, len(members), len(body))) + bytes(TAG) + body


def bundle_answer_head(head_b: bytes, count: int) -> Head:
    """A bundle's answer head (or refusal), its size checked against `count` members before it is read."""
    head = unpack_head(head_b)
    if head.kind == KIND_REFUSAL:
        limit = REFUSAL_MAX
    elif head.kind == KIND_BUNDLE_ANSWER and head.n_tokens == count and not head.lane_id and not head.step:
        limit = count * (FRAME_HEAD + max(ANSWER_FIXED + 8 * MAX_HOPS, 8 + MESSAGE_MAX))
    else:
        raise LaneError(f"not an answer to a bundle of {count} (kind {head.kind}, {head.n_tokens} members)")
    if head.payload_len > limit:
        raise LaneError(f"bundle answer of {head.payload_len} bytes is over its limit")
    return head


def open_bundle_answer(
    head: Head, payload: bytes, members: list[BundleMember]
) -> list[LaneAnswer | LaneError]:
    """Each member's answer, or the LaneError it failed with, in the bundle's order; LaneError
    (refused) when the whole bundle was refused (no member's step was spent: each may go again)."""
    if head.kind == KIND_REFUSAL:
        raise LaneError("lane refused the bundle: " + payload.decode("utf-8", "replace"), refused=True)
    out: list[LaneAnswer | LaneError] = []
    off = 0
    for m in members:
        if off + FRAME_HEAD > len(payload):
            raise LaneError("bundle answer is shorter than its members")
        h_b = payload[off : off + FRAME_HEAD]
        h = answer_head(h_b)
        end = off + FRAME_HEAD + h.payload_len
        if end > len(payload):
            raise LaneError("bundle answer member runs past the answer")
        try:
            out.append(open_answer(m.key, h_b, payload[off + FRAME_HEAD : end], m.lane_id, m.step))
        except LaneError as e:
            out.append(e)
        off = end
    if off != len(payload):
        raise LaneError("bundle answer is longer than its members")
    return out


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:])
        if r == 0:
            raise LaneError("lane closed the connection")
        got += r
    return bytes(buf)


class LaneClient:
    """One session's steps over a blocking connection to its first hop's lane (no event loop)."""

    def __init__(
        self, host: str, port: int, lane_id: int, key: bytes, first_step: int = 1, timeout_s: float = 120.0
    ) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a lane key is {KEY_BYTES} bytes")
        self.lane_id, self.key, self.step = lane_id, key, first_step
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def run(self, pos_start: int, ids: np.ndarray, rows: np.ndarray | None = None) -> LaneAnswer:
        """Send one step and wait for the route's answer."""
        step = self.step
        self.step += 1  # a step number is used once, whatever the answer
        self.sock.sendall(seal_request(self.key, self.lane_id, step, pos_start, ids, rows))
        head_b = _recv_exact(self.sock, FRAME_HEAD)
        head = answer_head(head_b)
        return open_answer(self.key, head_b, _recv_exact(self.sock, head.payload_len), self.lane_id, step)

    def close(self) -> None:
        self.sock.close()


def run_bundle(sock: socket.socket, members: list[BundleMember]) -> list[LaneAnswer | LaneError]:
    """Send one bundle on a blocking connection to a lane and read each member's outcome."""
    sock.sendall(seal_bundle(members))
    head_b = _recv_exact(sock, FRAME_HEAD)
    head = bundle_answer_head(head_b, len(members))
    return open_bundle_answer(head, _recv_exact(sock, head.payload_len), members)


@dataclass(frozen=True)
class LaneHop:
    """One hop's lane as a direct-mode client reaches it: address, the session's lane id and key."""

    host: str
    port: int
    lane_id: int
    key: bytes


class DirectLaneClient:
    """Direct mode, blocking: steps go to the first hop, the last hop answers on its own connection,
    and any hop's error arrives on that hop's connection (the client then truncates the route back)."""

    def __init__(self, hops: list[LaneHop], timeout_s: float = 120.0, first_step: int = 1) -> None:
        self.hops = hops
        self.socks = [socket.create_connection((h.host, h.port), timeout=timeout_s) for h in hops]
        for sock, h in zip(self.socks, hops, strict=True):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(seal_subscribe(h.key, h.lane_id, first_step))
            head_b = _recv_exact(sock, FRAME_HEAD)
            head = unpack_head(head_b)
            if head.kind == KIND_REFUSAL:
                why = _recv_exact(sock, min(head.payload_len, REFUSAL_MAX)).decode("utf-8", "replace")
                raise LaneError(f"lane {h.host}:{h.port} refused the subscription: {why}", refused=True)
            check_subscribed(h.key, head_b, h.lane_id, first_step)
        self.step = first_step + 1

    def run(self, pos_start: int, ids: np.ndarray) -> LaneAnswer:
        import select

        step = self.step
        self.step += 1
        first = self.hops[0]
        self.socks[0].sendall(seal_request(first.key, first.lane_id, step, pos_start, ids))
        while True:  # the first frame for this step from any hop decides it
            ready, _, _ = select.select(self.socks, [], [], self.socks[0].gettimeout())
            if not ready:
                raise LaneError("no answer within the timeout")
            i = self.socks.index(ready[0])
            head_b = _recv_exact(self.socks[i], FRAME_HEAD)
            head = answer_head(head_b)
            payload = _recv_exact(self.socks[i], head.payload_len)
            if head.step != step:
                continue  # a late error of an earlier step
            h = self.hops[i]
            return open_answer(h.key, head_b, payload, h.lane_id, step)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
