"""The node's client side: chain mode pushes a hop's output to the next hop its token names, relays the answer."""

from __future__ import annotations

import ssl
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector

from agent import defaults
from agent.node.errors import DataPlaneError
from agent.node.sessions import SessionState, SessionTable
from agent.node.steps import needs_ids
from agent.wire.bundle import BUNDLE_STEP_TOKENS
from agent.wire.frames import (
    ChainHop,
    FrameError,
    Kind,
    Op,
    Request,
    Timing,
    decode_response,
    encode_request,
    response_limit,
    response_step,
    with_prepended_timing,
)
from agent.wire.jsonlimits import JsonLimitError, loads_bounded
from agent.wire.routetoken import TokenError, decode_unverified
from agent.wire.stream import CHAIN_MAX_ANSWER, FrameStreams
from agent.wire.tls import node_dns_name

if TYPE_CHECKING:
    from agent.node.shard import Shard

_ERROR_BODY_MAX = 4096  # of a next hop's error answer, read to relay its code and message


class NextHops:
    """The node's client side: next hops in chain mode (pooled streams, POST behind them), and the one
    outgoing HTTP session that KV hand-offs use too. The session table says whether other sessions'
    small steps may travel with a step as one bundle."""

    def __init__(self, client_ssl: ssl.SSLContext | None, sessions: SessionTable) -> None:
        # mutual TLS towards next hops (chain mode): the swarm CA only, and the node id the token names
        self.client_ssl = client_ssl
        self.sessions = sessions
        self._client: ClientSession | None = None
        self._streams: FrameStreams | None = None  # chain mode: pooled streams to next hops

    async def continue_chain(
        self,
        req: Request,
        s: SessionState,
        shard: Shard | None,
        local: bytes,
        t_start: float,
        compute_us: int,
    ) -> bytes:
        """Chain mode: push this hop's output to the next hop and relay its answer back. `shard` (the
        session's, None once unloaded) says whether a later layer needs the token ids."""
        chain = s.chain if (req.chain or req.chain_cached) else None
        if not chain:
            handler_us = int((time.perf_counter() - t_start) * 1e6)
            return with_prepended_timing(local, Timing(compute_us, handler_us))
        out = decode_response(local)
        nxt, rest = chain[0], chain[1:]
        fwd = Request(
            op=Op.FORWARD,
            session=req.session,
            step=req.step,
            pos_start=req.pos_start,
            n_tokens=out.n_tokens,
            kind=out.kind,
            dim=out.dim,
            token=nxt.token,
            sampling=req.sampling,
            history=req.ids().tolist() if req.kind == Kind.IDS else req.history,
            # layers further down that route by token id get the ids with the hidden states
            token_ids=_ids_for_next(req, shard) if out.kind in (Kind.F16, Kind.F32) else None,
            want_logits=req.want_logits,
            sample_all=req.sample_all,
            f16_out=req.f16_out,
            # The full chain travels once per route; later steps only say "as before".
            chain=rest if req.chain else [],
            chain_cached=bool(rest) and not req.chain,
            payload=out.payload,
        )
        handler_us = int((time.perf_counter() - t_start) * 1e6)
        # A valid answer is at most the next hop's hidden states or (capped) logits plus timings;
        # anything longer is cut off at the limit, never buffered whole.
        limit = response_limit(out.n_tokens, max(out.dim, 1), req.want_logits)
        # Small steps of sessions this hop answered together go on together, as one bundle (their
        # next hop batches them as it came); a node holding one session sends it alone, at once.
        bundle = out.n_tokens <= BUNDLE_STEP_TOKENS and not req.want_logits and len(self.sessions) > 1
        data = await self.exchange(nxt, encode_request(fwd), limit, bundle)
        try:
            step = response_step(data)
        except FrameError as e:
            raise DataPlaneError(502, "downstream", f"next hop {nxt.url} answered a bad frame: {e}") from None
        if step != req.step:
            raise DataPlaneError(502, "downstream", f"next hop {nxt.url} answered step {step}")
        # Checked whole (header, timings, payload, not a byte more): only what the frame format says
        # travels back up the route, as it came, with this hop's timing in front.
        return with_prepended_timing(data, Timing(compute_us, handler_us))

    async def exchange(self, nxt: ChainHop, body: bytes, limit: int, bundle: bool = False) -> bytes:
        """Send `body` to the next hop and return its answer (status 200, at most `limit` bytes), or
        DataPlaneError (502, or the next hop's own refusal)."""
        client = await self.http()
        url = nxt.url.rstrip("/") + "/v1/frame"
        try:
            # Pinned: the swarm CA only, and the certificate must name the node the next token is for
            # (its node id as a host name; a token sniffed or replayed elsewhere cannot redirect it).
            # (Verified when the chain arrived; its expiry is the next hop's to check.)
            tls_name = (
                node_dns_name(decode_unverified(nxt.token).node) if nxt.url.startswith("https://") else None
            )
            ssl_ctx = self.ssl_for(nxt.url)
            if self._streams is None:
                self._streams = FrameStreams(client, max_answer=CHAIN_MAX_ANSWER, bundling=True)
            got = await self._streams.exchange(
                nxt.url, body, 300.0, ssl_ctx, tls_name, answer_limit=limit, bundle=bundle
            )
            data: bytes | None
            if got is not None:  # over the pooled stream (agent/wire/stream.py)
                status, answer = got
                if status != 200:
                    raise _downstream_error(status, answer[:_ERROR_BODY_MAX], nxt.url)
                data = answer if len(answer) <= limit else None
            else:
                async with client.post(url, data=body, ssl=ssl_ctx, server_hostname=tls_name) as r:
                    if r.status != 200:
                        raise _downstream_error(r.status, await _read_bounded(r, _ERROR_BODY_MAX), nxt.url)
                    data = await _read_bounded(r, limit)
        except (TimeoutError, OSError, ClientError, ValueError, TokenError) as e:
            # ValueError: a URL the HTTP library cannot dial (checked already, but never a 500)
            raise DataPlaneError(502, "downstream", f"next hop {nxt.url} unreachable: {e}") from None
        if data is None:
            raise DataPlaneError(502, "downstream", f"next hop {nxt.url} answered more than {limit} bytes")
        return data

    def ssl_for(self, url: str) -> ssl.SSLContext | bool:
        """The TLS context this node dials `url` with (its certificate, the swarm CA only; also the
        hand-off's push to another node); DataPlaneError when `url` is https and this node has none."""
        if url.startswith("https://"):
            if self.client_ssl is None:
                raise DataPlaneError(
                    502, "downstream", "next hop speaks TLS but this node has no certificate"
                )
            return self.client_ssl
        return True  # plain http: aiohttp ignores it

    async def http(self) -> ClientSession:
        """The node's one outgoing HTTP session (next hops here, KV hand-offs in handoff.py)."""
        if self._client is None or self._client.closed:
            self._client = ClientSession(
                # idle connections dropped before the next hop's idle timer closes them (defaults.py)
                connector=TCPConnector(limit=64, keepalive_timeout=defaults.HOP_CLIENT_IDLE_S),
                timeout=ClientTimeout(total=300),
                skip_auto_headers=("User-Agent",),
            )
        return self._client

    async def close_streams(self) -> None:
        """Close the pooled streams to next hops: a chain through this node ends here too."""
        if self._streams is not None:
            await self._streams.close()

    async def close(self) -> None:
        """Close the streams, then the HTTP session (the data plane's cleanup)."""
        await self.close_streams()
        if self._client is not None:
            await self._client.close()


def _ids_for_next(req: Request, shard: Shard | None) -> np.ndarray | None:
    """The ids a chain hop passes on with its hidden states: only when a later layer reads them."""
    if shard is None or not needs_ids(
        shard.spec.manifest, shard.spec.layer_end, shard.spec.manifest.n_layers
    ):
        return None
    return req.ids() if req.kind == Kind.IDS else req.token_ids


async def _read_bounded(r: Any, limit: int) -> bytes | None:
    """A response body of at most `limit` bytes, or None: read in chunks, never more than limit + 64K."""
    if r.content_length is not None and r.content_length > limit:
        return None
    buf = bytearray()
    async for chunk in r.content.iter_chunked(1 << 16):
        buf += chunk
        if len(buf) > limit:
            return None
    return bytes(buf)


def _downstream_error(status: int, body: bytes | None, url: str) -> DataPlaneError:
    """A next hop's refusal, relayed as its code and message when it is one of ours, else a 502 naming
    the next hop (JSON nested too deep, malformed or not ours included: parsed bounded, never a 500)."""
    try:
        err = loads_bounded(body or b"", max_bytes=_ERROR_BODY_MAX)
        code, message = str(err["error"])[:64], str(err["message"])[:400]
    except (ValueError, TypeError, KeyError) as e:
        why = f" ({e})" if isinstance(e, JsonLimitError) else ""
        return DataPlaneError(502, "downstream", f"next hop {url} answered {status}{why}")
    if not 400 <= status <= 599 or status == 500:
        status = 502
    return DataPlaneError(status, code, f"next hop {url}: {message}")
