"""Hand-off tokens: Ed25519-signed grants to move one session's KV from one node to another.

A route token names one node; a hand-off names two (the node giving the snapshot and the node taking
it), so neither can be talked into sending or accepting a session by a token meant for a third.
The control plane (or, in development, the local route key) signs with the route-token key; both
nodes verify offline. Binary layout (all integers little-endian):

    4B magic "GSHO" | u8 version | 16B session | 32B model sha256 | u16 layer_start | u16 layer_end |
    u8 src_len | src node id | u8 dst_len | dst node id | u64 expiry (unix s) | 64B Ed25519 signature
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.wire.ids import NodeId, SessionId

HANDOFF_MAGIC = b"GSHO"
HANDOFF_VERSION = 1
_HEAD = struct.Struct("<4sB16s32sHH")
_EXPIRY = struct.Struct("<Q")
SIG_LEN = 64
MAX_HANDOFF_TOKEN_LEN = _HEAD.size + 2 * 256 + _EXPIRY.size + SIG_LEN
# A hand-off is used within seconds of being minted: a short life limits a leaked token's use.
HANDOFF_TTL_S = 120


class HandoffTokenError(Exception):
    """The hand-off token is missing, malformed, forged, expired or names other nodes."""


@dataclass(frozen=True)
class HandoffClaims:
    """What a verified hand-off token grants: move `session`'s KV of one range from `src` to `dst`."""

    session: SessionId
    model_sha256: str
    layer_start: int
    layer_end: int
    src: NodeId
    dst: NodeId
    expiry: int


def _node(name: str) -> bytes:
    raw = name.encode()
    if not raw or len(raw) > 255:
        raise HandoffTokenError("node id must be 1 to 255 bytes")
    return struct.pack("<B", len(raw)) + raw


def encode_handoff_claims(c: HandoffClaims) -> bytes:
    if len(c.session) != 16:
        raise HandoffTokenError("session id must be 16 bytes")
    try:
        model = bytes.fromhex(c.model_sha256)
    except ValueError:
        raise HandoffTokenError("model sha256 must be hex") from None
    if len(model) != 32:
        raise HandoffTokenError("model sha256 must be 32 bytes")
    if not (0 <= c.layer_start < c.layer_end <= 0xFFFF):
        raise HandoffTokenError("layer range out of bounds")
    return (
        _HEAD.pack(HANDOFF_MAGIC, HANDOFF_VERSION, c.session, model, c.layer_start, c.layer_end)
        + _node(c.src)
        + _node(c.dst)
        + _EXPIRY.pack(c.expiry)
    )


def mint_handoff(
    key: Ed25519PrivateKey,
    session: bytes,
    model_sha256: str,
    layer_start: int,
    layer_end: int,
    src: str,
    dst: str,
    ttl_s: int = HANDOFF_TTL_S,
) -> bytes:
    """Sign a hand-off of `session`'s layers [layer_start, layer_end) from node `src` to node `dst`."""
    body = encode_handoff_claims(
        HandoffClaims(
            SessionId(session),
            model_sha256,
            layer_start,
            layer_end,
            NodeId(src),
            NodeId(dst),
            int(time.time()) + ttl_s,
        )
    )
    return body + key.sign(body)


def decode_handoff_unverified(token: bytes) -> HandoffClaims:
    if len(token) > MAX_HANDOFF_TOKEN_LEN:
        raise HandoffTokenError("hand-off token is too long")
    if len(token) < _HEAD.size + 2 + _EXPIRY.size + SIG_LEN:
        raise HandoffTokenError("hand-off token is truncated")
    magic, version, session, model, a, b = _HEAD.unpack_from(token, 0)
    if magic != HANDOFF_MAGIC:
        raise HandoffTokenError("not a hand-off token")
    if version != HANDOFF_VERSION:
        raise HandoffTokenError(f"hand-off token version {version} is not supported")
    off = _HEAD.size
    names: list[str] = []
    for _ in range(2):
        if off >= len(token):
            raise HandoffTokenError("hand-off token is truncated")
        n = token[off]
        raw = token[off + 1 : off + 1 + n]
        if n == 0 or len(raw) != n:
            raise HandoffTokenError("hand-off token node id is empty or truncated")
        try:
            names.append(raw.decode())
        except UnicodeDecodeError:
            raise HandoffTokenError("hand-off token node id is not utf-8") from None
        off += 1 + n
    if len(token) != off + _EXPIRY.size + SIG_LEN:
        raise HandoffTokenError("hand-off token length does not match its node ids")
    if a >= b:
        raise HandoffTokenError("hand-off token layer range is empty")
    (expiry,) = _EXPIRY.unpack_from(token, off)
    return HandoffClaims(SessionId(session), model.hex(), a, b, NodeId(names[0]), NodeId(names[1]), expiry)


def verify_handoff(key: Ed25519PublicKey, token: bytes, now: float | None = None) -> HandoffClaims:
    """The claims of a genuine, unexpired token; HandoffTokenError otherwise."""
    if not token:
        raise HandoffTokenError("hand-off token missing")
    claims = decode_handoff_unverified(token)
    try:
        key.verify(token[-SIG_LEN:], token[:-SIG_LEN])
    except InvalidSignature:
        raise HandoffTokenError("hand-off token signature is invalid") from None
    if claims.expiry < (time.time() if now is None else now):
        raise HandoffTokenError("hand-off token has expired")
    return claims
