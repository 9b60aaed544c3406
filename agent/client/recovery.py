"""Route recovery: what a route client asks for when a hop fails, how long it waits, where replicas come from.

`RouteClient` (agent/client/route.py) recovers inside itself, so every caller gets it: on a connection
error, a 5xx, a lost session, or a step slower than that hop's own deadline, it calls the caller's
`ReplacementProvider` for a hop covering the same layers, moves the session's KV there (a snapshot
hand-off when the old hop still answers, else a re-prefill of what the old hop held) and goes on.
The webapp's provider asks the routing services; the command line's is `ReplicaProvider` over a list
of node URLs and a local signing key.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.wire.handofftoken import mint_handoff
from agent.wire.httpjson import read_json
from agent.wire.ids import SessionId
from agent.wire.routetoken import RouteHop, TokenError, decode_unverified, mint_replacement, mint_route


@dataclass(frozen=True)
class Hop:
    """One hop of a route: the node's data-plane URL, its layer range and its route token."""

    url: str
    layer_start: int
    layer_end: int
    token: bytes


def minted_hops(
    key: Ed25519PrivateKey, session: SessionId, model_sha256: str, plan: list[RouteHop], ttl_s: int = 3600
) -> list[Hop]:
    """The route's hops, each with its token naming the hop after it (chain mode forwards only there)."""
    tokens = mint_route(key, session, model_sha256, plan, ttl_s)
    return [Hop(h.url, h.layer_start, h.layer_end, t) for h, t in zip(plan, tokens, strict=True)]


@dataclass(frozen=True)
class Replacement:
    """A hop taking over a failed hop's layers, and (optionally) the grant to move the KV to it."""

    hop: Hop
    # A hand-off token naming the old node and the new one (agent/wire/handofftoken.py): when the old
    # hop still answers, it exports the session's snapshot to the new one instead of a re-prefill.
    handoff_token: bytes = b""
    # The previous hop's token minted again to name the new hop as its next one: chain mode forwards
    # only to the node and URL a token names (issue 17). b"": keep the old token (star mode, hop 0).
    previous_token: bytes = b""


# (hop index, the route as the client holds it, why) -> a replacement for route[index]'s layers, or
# None when there is none. With why == STANDBY the hop is healthy: the client wants a warm spare to
# copy its KV to, and the route itself does not change.
ReplacementProvider = Callable[[int, list[Hop], str], Awaitable[Replacement | None]]
STANDBY = "standby"


@dataclass(frozen=True)
class RecoveryPolicy:
    """How a route client notices a failed hop and how long it tries before it gives up.

    A step of up to `small_step_tokens` tokens (a decode step) is late after
    max(deadline_floor_s, deadline_factor x the hop's p95 step time over its last steps) once the hop
    has `deadline_samples` measured steps; larger steps and the first few wait `timeout_s` of the
    client. A step fails for good after `attempts` replacements in a row or `give_up_s` seconds,
    whichever comes first, with a RouteFailed naming every failure.
    """

    attempts: int = 3
    deadline_floor_s: float = 2.0
    deadline_factor: float = 10.0
    deadline_samples: int = 4
    small_step_tokens: int = 16
    give_up_s: float = 60.0
    # An export from a hop that answered but failed (draining, overloaded) gets this long.
    handoff_timeout_s: float = 10.0
    # Chain mode cannot tell which hop failed: each is asked for its health this fast.
    probe_timeout_s: float = 1.0
    # Every this many new positions on a hop, its KV is copied to a spare in the background (a
    # hand-off that keeps the session where it is); a hop that dies then costs a re-prefill of only the
    # steps after the copy. 0: never (a dead hop is re-prefilled from position 0).
    checkpoint_tokens: int = 256
    # A re-prefill takes the recorded steps exactly as they were taken (bit-identical KV, one step per
    # decoded token), or (False) merged into batches of up to 512 positions: much faster after a long
    # answer, and the KV can differ from the original in the last bits.
    exact_replay: bool = True
    # The client keeps every seam's inputs (what it sent each hop) so one hop re-prefills alone;
    # past this many bytes it drops them and a recovery re-prefills the whole route instead.
    seam_cache_bytes: int = 512 << 20


class ReplicaProvider:
    """Replacement hops from a fixed list of node URLs (the CLI's `--replicas`): each is asked what it
    holds (GET /v1/health; https nodes with `ssl_context`, the route client's), and a route token (and
    a hand-off token) is minted with a local key."""

    def __init__(
        self,
        urls: Sequence[str],
        signing_key: Ed25519PrivateKey,
        session: bytes,
        ttl_s: int = 3600,
        probe_timeout_s: float = 2.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.key = signing_key
        self.session = session
        self.ttl_s = ttl_s
        self.probe_timeout_s = probe_timeout_s
        self.ssl_context = ssl_context
        self.failed: set[str] = set()

    async def _health(self, http: ClientSession, url: str) -> dict[str, object] | None:
        try:
            async with http.get(url + "/v1/health") as r:
                if r.status != 200:
                    return None
                info = await read_json(r)  # bounded: size and nesting (a node may be hostile)
                return info if isinstance(info, dict) else None
        except (ClientError, OSError, TimeoutError, ValueError):
            return None

    async def __call__(self, index: int, route: list[Hop], reason: str) -> Replacement | None:
        hop = route[index]
        try:
            claims = decode_unverified(hop.token)
            before = decode_unverified(route[index - 1].token) if index > 0 else None
            after = decode_unverified(route[index + 1].token) if index + 1 < len(route) else None
        except TokenError:
            return None
        if reason != STANDBY:
            self.failed.add(hop.url.rstrip("/"))
        # the failing URL last: a node that restarted and lost the session may still serve the range
        order = [u for u in self.urls if u not in self.failed] + [u for u in self.urls if u in self.failed]
        if reason == STANDBY:
            order = [u for u in order if u not in self.failed and u != hop.url.rstrip("/")]
        connector = TCPConnector(ssl=self.ssl_context) if self.ssl_context is not None else None
        async with ClientSession(
            connector=connector, timeout=ClientTimeout(total=self.probe_timeout_s)
        ) as http:
            infos = await asyncio.gather(*(self._health(http, u) for u in order))
        for url, info in zip(order, infos, strict=True):
            if info is None:
                continue
            shards = info.get("shards")
            node = str(info.get("node_id", ""))
            if not isinstance(shards, list) or not node:
                continue
            if not any(
                isinstance(s, dict)
                and s.get("model_sha256") == claims.model_sha256
                and s.get("layer_start") == hop.layer_start
                and s.get("layer_end") == hop.layer_end
                and not s.get("draining")
                for s in shards
            ):
                continue
            # the replacement's token names the hop after it, and the hop before's is minted again to
            # name the replacement (chain mode forwards only there); a warm spare gets both too
            new = RouteHop(node, url, hop.layer_start, hop.layer_end)
            window = [new]  # with its neighbours: what its token and the hop before's name
            if before is not None:
                prev = route[index - 1]
                window.insert(0, RouteHop(before.node, prev.url, prev.layer_start, prev.layer_end))
            if after is not None:
                nxt = route[index + 1]
                window.append(RouteHop(after.node, nxt.url, nxt.layer_start, nxt.layer_end))
            token, previous = mint_replacement(
                self.key, claims.session, claims.model_sha256, window, window.index(new), self.ttl_s
            )
            handoff = b""
            if node != claims.node:
                handoff = mint_handoff(
                    self.key,
                    claims.session,
                    claims.model_sha256,
                    hop.layer_start,
                    hop.layer_end,
                    claims.node,
                    node,
                )
            if reason != STANDBY:
                self.failed.discard(url)
            return Replacement(Hop(url, hop.layer_start, hop.layer_end, token), handoff, previous)
        return None
