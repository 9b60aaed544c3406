"""A process's connections to hops, shared by its route clients so that sessions' steps travel together.

One `HopTransport` per event loop and TLS context (`shared_transport`): an HTTP session for POSTs and
health checks, and pooled streams that bundle the small steps sent to one hop in the same loop turn
(agent/wire/stream.py, agent/wire/bundle.py). The control plane's playground and API route clients take
it: when a hop answers a bundle, the sessions' next steps are sent in the same turn, so they reach the
next hop as one message and run there as one batch, and sessions that started together stay together
without anyone waiting for anyone. A route client made without one owns a private transport.
"""

from __future__ import annotations

import asyncio
import ssl
import weakref

from aiohttp import ClientSession, ClientTimeout, TCPConnector

from agent import defaults
from agent.client.lane import LaneStreams
from agent.wire.stream import FrameStreams

# Connections to one hop: the node admits 64 frames at once per address (PER_IP_CONCURRENCY), and
# bundled steps of any number of sessions share a socket or two.
PER_HOP_CONNECTIONS = 64
TOTAL_CONNECTIONS = 512


class HopTransport:
    """An HTTP session and bundling streams to hops, for the route clients of one loop.

    Route clients `acquire` it and `release` it when they close; with `close_when_unused` (the shared
    ones, a client's private one) the last release closes it, so no connection outlives the clients that
    use it. A caller that made one for its own clients (a benchmark) closes it itself."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = 120.0,
        bundling: bool = True,
        close_when_unused: bool = False,
    ) -> None:
        self.ssl_context = ssl_context  # held: shared_transport keys transports by its id
        self.close_when_unused = close_when_unused
        self.users = 0
        self.http = ClientSession(
            # https hops: mutual TLS with the swarm CA only (agent.wire.tls.client_context)
            connector=TCPConnector(
                limit=TOTAL_CONNECTIONS,
                limit_per_host=PER_HOP_CONNECTIONS,
                # idle connections dropped before the hop's idle timer closes them (defaults.py)
                keepalive_timeout=defaults.HOP_CLIENT_IDLE_S,
                ssl=ssl_context if ssl_context is not None else True,
            ),
            timeout=ClientTimeout(total=timeout_s),
            skip_auto_headers=("User-Agent",),
        )
        self.streams = FrameStreams(self.http, bundling=bundling)
        self.lanes = LaneStreams()  # decode steps to hops' native lanes, bundled per turn like streams

    @property
    def closed(self) -> bool:
        return self.http.closed

    def acquire(self) -> None:
        self.users += 1

    async def release(self) -> None:
        self.users -= 1
        if self.users <= 0 and self.close_when_unused:
            await self.close()

    async def close(self) -> None:
        try:
            await self.lanes.close()
            await self.streams.close()
        finally:
            await self.http.close()


# Held weakly: a transport lives as long as a route client holds it, never longer.
_shared: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, weakref.WeakValueDictionary[int, HopTransport]
] = weakref.WeakKeyDictionary()


def shared_transport(ssl_context: ssl.SSLContext | None = None) -> HopTransport:
    """The running loop's transport for hops reached with `ssl_context` (None: plain loopback hops)."""
    per_loop = _shared.setdefault(asyncio.get_running_loop(), weakref.WeakValueDictionary())
    key = id(ssl_context)
    t = per_loop.get(key)
    if t is None or t.closed:
        t = per_loop[key] = HopTransport(ssl_context, close_when_unused=True)
    return t
