"""Route tokens: Ed25519-signed grants naming session, model, layer range, node, next hop and expiry.

The control plane (or, in development, a local key) signs; every hop verifies offline against the
public key it was configured with. Binary layout (all integers little-endian):

    u8 version | 16B session | 32B model sha256 | u16 layer_start | u16 layer_end |
    u8 node_len | node id (utf-8) | u8 next_node_len | next node id | u8 next_url_len | next url |
    u64 expiry (unix s) | 64B Ed25519 signature

The next hop (node id and data-plane URL; both empty on a route's last hop) binds the route into the
token: in chain mode a hop forwards only to the hop its own token names (docs/security.md).
"""

from __future__ import annotations

import base64
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.wire.ids import NodeId, SessionId

TOKEN_VERSION = 2
_FIXED = struct.Struct("<B16s32sHHB")
_EXPIRY = struct.Struct("<Q")
SIG_LEN = 64
MAX_TOKEN_LEN = _FIXED.size + 255 + 1 + 255 + 1 + 255 + _EXPIRY.size + SIG_LEN


class TokenError(Exception):
    """The route token is missing, malformed, forged, expired or names something else."""


@dataclass(frozen=True)
class RouteClaims:
    """What a verified route token grants."""

    session: SessionId
    model_sha256: str
    layer_start: int
    layer_end: int
    node: NodeId
    expiry: int
    next_node: str = ""  # the hop this one may forward to in chain mode ("" = none: last hop)
    next_url: str = ""


def _short(field: str, value: str) -> bytes:
    raw = value.encode()
    if len(raw) > 255:
        raise TokenError(f"{field} longer than 255 bytes")
    return struct.pack("<B", len(raw)) + raw


def encode_claims(c: RouteClaims) -> bytes:
    node = c.node.encode()
    if len(node) > 255:
        raise TokenError("node id longer than 255 bytes")
    if len(c.session) != 16:
        raise TokenError("session id must be 16 bytes")
    return (
        _FIXED.pack(
            TOKEN_VERSION, c.session, bytes.fromhex(c.model_sha256), c.layer_start, c.layer_end, len(node)
        )
        + node
        + _short("next node id", c.next_node)
        + _short("next hop url", c.next_url)
        + _EXPIRY.pack(c.expiry)
    )


def sign(key: Ed25519PrivateKey, claims: RouteClaims) -> bytes:
    body = encode_claims(claims)
    return body + key.sign(body)


def mint(
    key: Ed25519PrivateKey,
    session: SessionId,
    model_sha256: str,
    layer_start: int,
    layer_end: int,
    node: str,
    ttl_s: int = 3600,
    next_node: str = "",
    next_url: str = "",
) -> bytes:
    """Sign a token for one hop of a route, valid for `ttl_s` seconds; it may forward to `next_url`."""
    return sign(
        key,
        RouteClaims(
            session,
            model_sha256,
            layer_start,
            layer_end,
            NodeId(node),
            int(time.time()) + ttl_s,
            next_node,
            normalise_url(next_url) if next_url else "",
        ),
    )


@dataclass(frozen=True)
class RouteHop:
    """One hop of a route to mint for: node id, data-plane URL and layer range."""

    node: str
    url: str
    layer_start: int
    layer_end: int


def mint_hop(
    key: Ed25519PrivateKey,
    session: SessionId,
    model_sha256: str,
    route: Sequence[RouteHop],
    index: int,
    ttl_s: int = 3600,
) -> bytes:
    """The token of `route[index]`, naming the hop after it: the only place chain mode may forward to
    (none after the last hop). Every route token a route or a replacement needs is minted here."""
    h = route[index]
    nxt = route[index + 1] if index + 1 < len(route) else None
    return mint(
        key,
        session,
        model_sha256,
        h.layer_start,
        h.layer_end,
        h.node,
        ttl_s,
        nxt.node if nxt else "",
        nxt.url if nxt else "",
    )


def mint_route(
    key: Ed25519PrivateKey, session: SessionId, model_sha256: str, hops: list[RouteHop], ttl_s: int = 3600
) -> list[bytes]:
    """One token per hop, each naming the hop after it."""
    return [mint_hop(key, session, model_sha256, hops, i, ttl_s) for i in range(len(hops))]


def mint_replacement(
    key: Ed25519PrivateKey,
    session: SessionId,
    model_sha256: str,
    route: Sequence[RouteHop],
    index: int,
    ttl_s: int = 3600,
) -> tuple[bytes, bytes]:
    """`route[index]` has just replaced a failed hop (or is a warm spare for it): its token, and the
    hop before's token minted again to name it (b"" at index 0), as a hop forwards only to the hop
    its own token names. The rest of `route` keeps its tokens."""
    token = mint_hop(key, session, model_sha256, route, index, ttl_s)
    previous = mint_hop(key, session, model_sha256, route, index - 1, ttl_s) if index > 0 else b""
    return token, previous


def normalise_url(url: str) -> str:
    """The form a next-hop URL is signed and compared in: no trailing slash."""
    return url.strip().rstrip("/")


def decode_unverified(token: bytes) -> RouteClaims:
    if len(token) < _FIXED.size + _EXPIRY.size + SIG_LEN:
        raise TokenError("route token is truncated")
    if len(token) > MAX_TOKEN_LEN:
        raise TokenError("route token is too long")
    version, session, model, a, b, node_len = _FIXED.unpack_from(token, 0)
    if version != TOKEN_VERSION:
        raise TokenError(f"route token version {version} is not supported")
    off = _FIXED.size
    fields: list[str] = []
    for what, n in (("node id", node_len), ("next node id", -1), ("next hop url", -1)):
        if n < 0:
            if off >= len(token):
                raise TokenError(f"route token is truncated before its {what}")
            n = token[off]
            off += 1
        raw = token[off : off + n]
        off += n
        if len(raw) != n:
            raise TokenError(f"route token is truncated in its {what}")
        try:
            fields.append(raw.decode())
        except UnicodeDecodeError:
            raise TokenError(f"route token {what} is not utf-8") from None
    if len(token) != off + _EXPIRY.size + SIG_LEN:
        raise TokenError("route token length does not match its field lengths")
    (expiry,) = _EXPIRY.unpack_from(token, off)
    return RouteClaims(SessionId(session), model.hex(), a, b, NodeId(fields[0]), expiry, fields[1], fields[2])


class TokenVerifier:
    """Verifies tokens offline; remembers recent good signatures so a decode step pays no crypto."""

    def __init__(self, public_key: Ed25519PublicKey, cache_size: int = 4096) -> None:
        self._key = public_key
        self._cache: OrderedDict[bytes, RouteClaims] = OrderedDict()
        self._cache_size = cache_size

    def verify(self, token: bytes, now: float | None = None) -> RouteClaims:
        if not token:
            raise TokenError("route token missing")
        claims = self._cache.get(token)
        if claims is None:
            claims = decode_unverified(token)
            body, sig = token[:-SIG_LEN], token[-SIG_LEN:]
            try:
                self._key.verify(sig, body)
            except InvalidSignature:
                raise TokenError("route token signature is invalid") from None
            self._cache[token] = claims
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        if claims.expiry < (time.time() if now is None else now):
            raise TokenError("route token has expired")
        return claims


def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def public_key_b64(key: Ed25519PublicKey) -> str:
    """Raw 32-byte public key, base64: short enough for config files and JSON."""
    return base64.b64encode(
        key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()


def load_public_key(text: str) -> Ed25519PublicKey:
    """Accepts base64 raw (32 bytes) or PEM."""
    text = text.strip()
    try:
        if text.startswith("-----BEGIN"):
            key = serialization.load_pem_public_key(text.encode())
            if not isinstance(key, Ed25519PublicKey):
                raise TokenError("public key is not Ed25519")
            return key
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError) as e:
        raise TokenError(f"cannot parse Ed25519 public key: {e}") from None


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise TokenError(f"{path}: not an Ed25519 private key")
    return key
