"""The node's binary HTTP data plane: verifies route tokens, runs shards, keeps sessions (docs/protocol.md)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import ssl
import time
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent import __version__, defaults
from agent.artifacts.manifest import Manifest
from agent.backends import load_backend
from agent.backends.base import AdmissionError, Backend, BackendError, ForwardResult, ShardSpec
from agent.eventloop import running_loop_name
from agent.node.admission import HEAD_TIMEOUT_S, FrameAdmission, Held
from agent.node.chain import NextHops
from agent.node.errors import DataPlaneError, error_response
from agent.node.handoff import Handoff
from agent.node.lanes import NodeLane
from agent.node.metrics import NodeMetrics
from agent.node.prefixes import PrefixOps, PrefixStore, cache_bytes_from_env
from agent.node.scheduler import CHUNK_TOKENS, MAX_BATCH_TOKENS, ShardScheduler
from agent.node.sessions import SessionState, SessionTable
from agent.node.shard import Shard, Shards, evictable
from agent.node.steps import draft_start, frame_step, local_answer, run_step, sample_positions
from agent.node.stream import StreamView
from agent.node.verify import can_cut_into, rewind, run_rows, settle
from agent.wire.frames import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameError,
    Kind,
    Op,
    Request,
    Response,
    decode_request,
    encode_response,
)
from agent.wire.ids import SessionId
from agent.wire.routetoken import RouteClaims, TokenError, TokenVerifier, normalise_url
from agent.wire.tls import is_loopback

log = logging.getLogger("agent.node.dataplane")
_SWEEPER: web.AppKey[asyncio.Task[None]] = web.AppKey("sweeper", asyncio.Task)
# A retried step is answered from its stored response only when that is small (a token, one decode
# step's hidden states); a bigger one (a prefill's hidden states, logits) is recomputed instead.
RETRY_CACHE_MAX = 64 << 10


class DataPlane:
    """All shards and sessions of one node, behind one aiohttp application. It owns the shards, the
    session table and the counters, and hands them to its parts: the frame limits (`admission`,
    admission.py), the client side towards next hops (`hops`, chain.py), the native decode lane
    (`lane`, lanes.py), the WebSocket endpoint (stream.py) and the hand-off endpoints (handoff.py)."""

    def __init__(
        self,
        node_id: str,
        public_key: Ed25519PublicKey,
        kv_budget_bytes: int = defaults.KV_BUDGET_BYTES,
        session_ttl_s: float = defaults.SESSION_TTL_S,
        client_ssl: ssl.SSLContext | None = None,
        batching: bool | None = None,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        chunk_tokens: int = CHUNK_TOKENS,
        cache_type: str = defaults.CACHE_TYPE,
        flash_attn: str = defaults.FLASH_ATTN,
        mtp: bool = False,
    ) -> None:
        self.node_id = node_id
        # native shards' attention caches and flash-attention switch (defaults.CACHE_TYPES, FLASH_ATTN_MODES)
        self.cache_type, self.flash_attn = cache_type, flash_attn
        # native last shards attach the model's MTP head where the file has one (docs/speculative.md)
        self.mtp = mtp
        # per-shard step batching (agent/node/scheduler.py): None = where the backend batches sessions
        self.batching, self.max_batch_tokens, self.chunk_tokens = batching, max_batch_tokens, chunk_tokens
        self.public_key = public_key  # also verifies hand-off tokens (agent/node/handoff.py)
        self.verifier = TokenVerifier(public_key)
        # per-address, per-token and buffered-bytes limits, checked before a frame's body is read
        self.admission = FrameAdmission(node_id, self.verifier)
        # set by a drain in move mode: existing sessions answer 503 draining so clients move them
        self.move_sessions = False
        self.sessions = SessionTable(kv_budget_bytes, session_ttl_s)
        self.shards: Shards = {}
        self.counters = {
            "frames": 0,
            "bundles": 0,  # stream messages carrying several sessions' frames (agent/wire/bundle.py)
            "errors": 0,
            "tokens_in": 0,
            "tokens_out": 0,
            "bytes_in": 0,
            "bytes_out": 0,
        }
        self.started = time.time()
        # GET /metrics (agent/node/metrics.py); the lane's batches are taken in before each scrape (the
        # lane, made next, counts its batches into these metrics)
        self.metrics = NodeMetrics(self.stats, before_read=lambda: self.lane.take_batches())
        self.hops = NextHops(client_ssl, self.sessions)  # next hops: mutual TLS, pooled streams
        self.lane = NodeLane(self.metrics, self.counters, self.hops)  # opened on first use
        # prefix snapshots (prefixes.py): shared prompt prefixes' state, bounded apart from sessions' KV
        self.prefixes = PrefixStore(cache_bytes_from_env(kv_budget_bytes))
        self.prefix_ops = PrefixOps(self.prefixes, self.sessions, lambda v, sh: evictable(self.shards, v, sh))

    # -- shard management (called by the CLI or the control agent) --------------------------------
    def load_shard(
        self,
        path: str,
        manifest: Manifest,
        layer_start: int,
        layer_end: int,
        backend: str = defaults.DEFAULT_BACKEND,
        n_threads: int = defaults.N_THREADS,
    ) -> Shard:
        """Load layers [layer_start, layer_end) of `path`; blocking, so call it from a thread."""
        spec = ShardSpec(
            path=str(path),
            layer_start=layer_start,
            layer_end=layer_end,
            manifest=manifest,
            n_threads=n_threads,
        )
        # native shards share the node budget inside libggswarm; the others are counted by the table
        budget: dict[str, object] = {"kv_budget_bytes": self.sessions.budget_bytes}
        if backend == "native":
            try:
                budget = {
                    "kv_budget": self.sessions.native_budget(),
                    "cache_type": self.cache_type,
                    "flash_attn": self.flash_attn,
                    "mtp": self.mtp,
                }
            except OSError as e:  # the library is not built or has another API version
                raise BackendError(f"native backend unavailable: {e}") from None
        be = load_backend(backend, spec, **budget)
        lock = asyncio.Lock()
        shard = Shard(spec, backend, be, lock, self._scheduler(be, lock))
        self.shards[shard.key] = shard
        log.info("loaded %s layers %d:%d with %s", manifest.sha256[:12], layer_start, layer_end, backend)
        return shard

    def _scheduler(self, backend: Backend, lock: asyncio.Lock) -> ShardScheduler:
        def admit(s: SessionState, extra: int) -> None:
            self.sessions.admit(s, extra, lambda v: evictable(self.shards, v, shard_of(s)))

        def shard_of(s: SessionState) -> Shard | None:
            return self.shards.get(s.shard_key)

        return ShardScheduler(
            backend,
            lock,
            admit=admit,
            observer=self.metrics,
            batching=self.batching,
            max_batch_tokens=self.max_batch_tokens,
            chunk_tokens=self.chunk_tokens,
            # sessions on the node's lane decode outside this queue: a prompt beside them runs in
            # chunks the lane's pacer sizes and times, so their steps wait for one chunk at most
            decoding_elsewhere=self.lane.decoding,
            pacer=self.lane.pacer,
        )

    def unload_shard(self, model_sha256: str, layer_start: int, layer_end: int) -> bool:
        shard = self.shards.pop((model_sha256, layer_start, layer_end), None)
        if shard is None:
            return False
        shard.scheduler.drop_all("the shard was unloaded while the step was queued")
        self.prefixes.drop_range(model_sha256, layer_start, layer_end)
        for key in self.sessions.for_shard(shard.key):
            self.sessions.close(key)
        shard.backend.close()
        return True

    def drain(self) -> None:
        """Refuse new sessions on every shard (an update, the control plane)."""
        for s in self.shards.values():
            s.draining = True

    def drain_and_move(self) -> None:
        """Drain, and answer existing sessions' next step 503 draining, so their clients move them
        (POST /v1/drain, handoff.py)."""
        self.drain()
        self.move_sessions = True

    def stats(self) -> dict[str, Any]:
        self.lane.take_batches()  # the lane's own steps count in the figures below
        return {
            "node_id": self.node_id,
            "version": __version__,
            "protocol_version": PROTOCOL_VERSION,
            "sessions": len(self.sessions),
            "kv_bytes": self.sessions.used_bytes(),
            "kv_budget_bytes": self.sessions.budget_bytes,
            "kv_remaining_bytes": self.sessions.remaining_bytes(),
            # every byte the node holds for its sessions: KV plus the stored answers retries get
            "retry_cache_bytes": self.sessions.retry_bytes(),
            "held_bytes": self.sessions.used_bytes() + self.sessions.retry_bytes(),
            "inflight_bytes": self.admission.inflight_bytes,
            # requests and streams that have not shown a valid route token yet, and those cut for a
            # newer one of their address (admission.py)
            "anonymous": self.admission.anonymous.total(),
            "anonymous_cut": self.admission.anonymous.cut,
            "evictions": self.sessions.evictions,
            # checkpoints given back to admit work before any session was evicted (sessions.py)
            "checkpoints_reclaimed_bytes": self.sessions.checkpoints_reclaimed,
            "expirations": self.sessions.expirations,
            # time prefill chunks waited for decoding sessions to ride with (scheduler._hold_chunks)
            "chunk_hold_s": round(sum(s.scheduler.held_s for s in self.shards.values()), 3),
            # batch size, queue wait and compute per backend call over the last minute (metrics.py)
            "batching": self.metrics.batch_stats(),
            # the native decode lane (lanes.py): its port once open, sessions on it now, its counters
            **self.lane.stats(),
            # prefix snapshots (prefixes.py): entries, bytes, hits, misses, saves, evictions
            **self.prefixes.stats(),
            "shards": [
                {
                    "model_sha256": s.spec.manifest.sha256,
                    "layer_start": s.spec.layer_start,
                    "layer_end": s.spec.layer_end,
                    "n_layers": s.spec.manifest.n_layers,
                    "backend": s.backend_name,
                    "boundary_dim": s.spec.manifest.boundary_dim,
                    "draining": s.draining,
                    "sessions": len(self.sessions.for_shard(s.key)),
                    "batching": s.scheduler.batching,
                    "queued": s.scheduler.pending(),
                    "chunk_hold_s": round(s.scheduler.held_s, 3),
                }
                for s in self.shards.values()
            ],
            **self.counters,
        }

    # -- request handling -------------------------------------------------------------------------
    def _authorise(self, req: Request) -> tuple[RouteClaims, Shard]:
        claims = self.admission.authorise(req.session, req.token)
        shard = self.shards.get((claims.model_sha256, claims.layer_start, claims.layer_end))
        if shard is None:
            raise DataPlaneError(
                403,
                "wrong_range",
                f"this node holds no shard {claims.model_sha256[:12]} "
                f"{claims.layer_start}:{claims.layer_end}",
            )
        if req.chain:
            self._check_chain(req, claims)
        return claims, shard

    def _check_chain(self, req: Request, claims: RouteClaims) -> None:
        """Chain mode forwards only along the route the control plane signed: each hop's token names
        the next hop's node and URL, so the chain beside the token must be exactly that route."""
        want_node, want_url = claims.next_node, claims.next_url
        for i, hop in enumerate(req.chain):
            if not want_url or normalise_url(hop.url) != want_url:
                raise DataPlaneError(
                    403,
                    "chain_not_granted",
                    f"chain hop {i} ({hop.url[:80]}) is not the next hop the route token grants"
                    + (f" ({want_url})" if want_url else " (none: this is the route's last hop)"),
                )
            try:
                nxt = self.verifier.verify(hop.token)
            except TokenError as e:
                raise DataPlaneError(403, "chain_not_granted", f"chain hop {i}: {e}") from None
            if nxt.node != want_node or nxt.session != req.session:
                raise DataPlaneError(
                    403, "chain_not_granted", f"chain hop {i}'s token is for another node or session"
                )
            want_node, want_url = nxt.next_node, nxt.next_url

    def _session(self, req: Request, shard: Shard) -> SessionState:
        s = self.sessions.get((SessionId(req.session), shard.key))
        if s is None:
            raise DataPlaneError(404, "unknown_session", "unknown session (expired, evicted or never opened)")
        return s

    async def handle(self, body: bytes) -> bytes:
        self.counters["frames"] += 1
        self.counters["bytes_in"] += len(body)
        try:
            req = decode_request(body)
        except FrameError as e:
            raise DataPlaneError(e.status, "bad_frame", str(e)) from None
        claims, shard = self._authorise(req)
        # Every call into a shard's backend holds its lock: a big batch computes in a worker thread,
        # and a backend handle must not be used from two threads at once.
        if req.op == Op.OPEN:
            async with shard.lock:
                return self._open(req, shard)
        if req.op == Op.CLOSE:
            closing = self.sessions.get((SessionId(req.session), shard.key))
            if closing is not None:  # off the lane first, its step in flight waited for off the loop
                await self.lane.leave(closing)
            async with shard.lock:  # between batches: none of the session's steps is running
                key = (SessionId(req.session), shard.key)
                shard.scheduler.drop_session(key, "the session was closed while its step was queued")
                self.lane.drop(key)
                self.sessions.close(key)
            return encode_response(Response(step=req.step, kind=Kind.NONE))
        s = self._session(req, shard)
        if req.op == Op.LANE:
            # its steps on the lane follow what stood of a verification: none can cut back into it
            await settle(s, shard.lock)
            return await self.lane.admit(req, shard, s)
        if s.lane is not None:
            # a frame on the Python path takes its session off the lane (its history comes back);
            # other sessions stay on theirs, and their steps run beside this one (lanes.py); its step
            # in flight is waited for off the event loop (a hung next hop must not stop this node)
            await self.lane.leave(s)
        if req.op == Op.TRUNCATE:
            return await self._truncate(req, shard, s)
        if req.op in (Op.PREFIX_SAVE, Op.PREFIX_LOAD):
            return await self.prefix_ops.handle(req, shard, s)
        return await self._forward(req, body, shard, s)

    def _open(self, req: Request, shard: Shard) -> bytes:
        sid = SessionId(req.session)
        if shard.draining:
            raise DataPlaneError(
                503, "draining", "this shard is draining; ask the control plane for another route"
            )
        if (sid, shard.key) in self.sessions:
            existing = self.sessions.get((sid, shard.key))
            assert existing is not None
            return encode_response(
                Response(
                    step=existing.last_step, kind=Kind.NONE, session_len=existing.backend.session_len(sid)
                )
            )
        cap = shard.max_positions
        capacity = req.capacity or cap
        if capacity > cap:
            raise DataPlaneError(400, "context_cap", f"capacity {capacity} exceeds the context cap of {cap}")
        state = SessionState(sid=sid, shard_key=shard.key, backend=shard.backend, capacity=capacity)
        if shard.spec.is_last and shard.backend.mtp:  # the model's MTP head drafts after each step
            state.mtp_draft = req.mtp_draft
        try:
            self.sessions.admit(
                state, shard.backend.kv_open_bytes(capacity), lambda v: evictable(self.shards, v, shard)
            )
            shard.backend.open_session(sid, capacity)
        except AdmissionError as e:
            raise DataPlaneError(503, "kv_budget", str(e)) from None
        except BackendError as e:
            raise DataPlaneError(400, "backend", str(e)) from None
        self.sessions.add(state)
        return encode_response(Response(step=0, kind=Kind.NONE, session_len=0))

    async def _truncate(self, req: Request, shard: Shard, s: SessionState) -> bytes:
        cur = s.backend.session_len(s.sid)
        if req.pos_start > cur:
            raise DataPlaneError(
                409, "bad_position", f"cannot truncate to {req.pos_start}: session holds {cur}"
            )
        # a backend keeping recurrent state goes back to its newest checkpoint at or before the
        # position (or to 0): session_len says where, and the route re-prefills from there
        held, how = await rewind(s, req.pos_start, shard.lock)
        if how != "exact":
            self.counters[f"truncate_{how}"] = self.counters.get(f"truncate_{how}", 0) + 1
            log.info("truncate to %d: %s, session holds %d", req.pos_start, how, held)
        s.last_step = max(s.last_step, req.step)
        s.last_digest, s.last_output = b"", b""
        return encode_response(Response(step=req.step, kind=Kind.NONE, session_len=held))

    async def _forward(self, req: Request, body: bytes, shard: Shard, s: SessionState) -> bytes:
        t_start = time.perf_counter()
        if shard.draining and self.move_sessions:
            raise DataPlaneError(503, "draining", "this node is draining: move the session to a replica")
        if s.busy:
            # one step per session at a time: a retry racing its original asks again once it is done
            raise DataPlaneError(409, "step_in_progress", "this session's previous step is still running")
        digest = hashlib.blake2b(body, digest_size=16).digest()
        if req.step <= s.last_step:
            retry = req.step == s.last_step and digest == s.last_digest
            if retry and s.last_output:
                # A retry of the step we already applied: answer again, never append KV twice.
                local = s.last_output
                return await self.hops.continue_chain(req, s, self.shards.get(s.shard_key), local, t_start, 0)
            if retry and s.retry_pos == req.pos_start:
                # Its answer was too big to keep: roll the KV back to where the step began, apply again.
                async with shard.lock:
                    s.backend.truncate(s.sid, req.pos_start)
                    held = s.backend.session_len(s.sid)
                if held != req.pos_start:  # recurrent state rolls back to a checkpoint, not a position
                    raise DataPlaneError(
                        409,
                        "retry_unavailable",
                        f"step {req.step} cannot be recomputed: re-prefill from {held}",
                    )
                del s.history[s.retry_history :]
                s.last_step, s.last_digest, s.retry_pos = req.step - 1, b"", -1
        if req.step <= s.last_step:
            raise DataPlaneError(
                409, "replayed_step", f"step {req.step} was already applied (last step {s.last_step})"
            )
        if req.chain:
            s.chain = list(req.chain)
        elif req.chain_cached and not s.chain:
            raise DataPlaneError(
                409, "no_chain", "cached-chain frame but this session never received a chain"
            )
        if can_cut_into(s, req.pos_start) and req.pos_start < s.backend.session_len(s.sid):
            # the step after a speculative verification starts where its drafts stopped standing
            _held, how = await rewind(s, req.pos_start, shard.lock)
            self.counters[f"verify_cut_{how}"] = self.counters.get(f"verify_cut_{how}", 0) + 1
        history_len = len(s.history)
        step = frame_step(req, shard.spec, shard.backend.boundary_dim, s)
        if req.sample_all:  # one position at a time, as plain decode steps (agent/node/verify.py)
            res = await run_rows(shard.scheduler, s, step, history_len)
        else:
            # queued with other sessions' steps when the backend batches (agent/node/scheduler.py)
            res = await run_step(shard.scheduler, s, step, history_len)
            await settle(s, shard.lock)
        self.counters["tokens_in"] += req.n_tokens
        if res.token is not None:
            self.counters["tokens_out"] += 1
        sampled = None
        if req.sample_all and res.token is not None and res.logits is not None:
            sampled = await asyncio.to_thread(sample_positions, s, req, res.logits)
        drafts = await self._mtp_drafts(req, s, shard, res, sampled) if s.mtp_draft else None
        local = local_answer(req, res, req.pos_start + req.n_tokens, sampled, drafts)
        # The stored answer is bounded (and counted in held_bytes); a bigger one is recomputed on retry.
        s.last_step, s.last_digest = req.step, digest
        s.last_output = local if len(local) <= RETRY_CACHE_MAX else b""
        s.retry_pos, s.retry_history = req.pos_start, history_len
        self.metrics.step(req.n_tokens, time.perf_counter() - t_start)
        compute_us = int(res.compute_s * 1e6)
        return await self.hops.continue_chain(
            req, s, self.shards.get(s.shard_key), local, t_start, compute_us
        )

    async def _mtp_drafts(
        self,
        req: Request,
        s: SessionState,
        shard: Shard,
        res: ForwardResult,
        sampled: tuple[list[int], list[float]] | None,
    ) -> list[int]:
        """The MTP head's drafts after the token this last shard just sampled (docs/speculative.md): up
        to the session's ask, none where the head cannot draft (the backend says so with [])."""
        if res.token is None or req.want_logits:
            return []
        pos, token = draft_start(req, s, res, sampled)
        if pos + s.mtp_draft > s.capacity:
            return []
        async with shard.lock:
            return await asyncio.to_thread(s.backend.mtp_draft, s.sid, pos, token, s.mtp_draft)

    # -- aiohttp wiring -----------------------------------------------------------------------------
    async def _frame_view(self, request: web.Request) -> web.StreamResponse:
        """Limits first, in the order admission.py gives: the frame's length, its header and route token
        (anonymous until then, against a deadline), its token's slot and buffered bytes, its body
        (against a deadline), then its address's slot; a client too slow for a deadline is cut off."""
        held = Held()
        try:
            try:
                body = await self.admission.receive_post(request, held)
            except DataPlaneError as e:
                return self._refused(e)
            except TimeoutError:
                return await self._cut(request, "the frame did not arrive in time (a stalled client)")
            except (asyncio.IncompleteReadError, ConnectionError):
                return self._refused(
                    DataPlaneError(400, "bad_frame", "the frame ended before its Content-Length")
                )
            return await self._frame_response(body)
        finally:
            self.admission.release(held)

    async def _cut(self, request: web.Request, why: str) -> web.StreamResponse:
        """Answer 408 and close the connection at once: its unread bytes are not waited for."""
        resp = self._refused(DataPlaneError(408, "too_slow", why))
        resp.force_close()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.prepare(request)
            await resp.write_eof()
        request.protocol.force_close()  # no lingering read of a body that is not coming
        return resp

    async def answer_frame(self, body: bytes) -> bytes:
        """The response frame to a request frame whose limits were checked (POST and stream alike);
        DataPlaneError otherwise, a 500 for anything unexpected."""
        try:
            return await self.handle(body)
        except DataPlaneError:
            raise
        except Exception:  # noqa: BLE001 - one bad request must never take the node down
            log.exception("unexpected error handling a frame")
            raise DataPlaneError(500, "internal", "internal error while handling the frame") from None

    async def _frame_response(self, body: bytes) -> web.StreamResponse:
        try:
            out = await self.answer_frame(body)
        except DataPlaneError as e:
            return self._refused(e)
        self.counters["bytes_out"] += len(out)
        return web.Response(body=out, content_type="application/octet-stream")

    def _refused(self, e: DataPlaneError) -> web.Response:
        """A refused POST, counted (the stream endpoint counts its own the same way)."""
        self.counters["errors"] += 1
        self.metrics.error(e.code)
        return error_response(e.status, e.code, e.message)

    async def _health_view(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "event_loop": running_loop_name(), **self.stats()})

    async def _sweeper(self, app: web.Application) -> None:  # noqa: ARG002
        while True:
            await asyncio.sleep(5.0)
            n = self.sessions.expire(evictable=lambda v: evictable(self.shards, v))
            if n:
                log.info("expired %d idle sessions", n)
            self.lane.take_batches()

    async def _on_startup(self, app: web.Application) -> None:
        app[_SWEEPER] = asyncio.create_task(self._sweeper(app))

    async def _on_cleanup(self, app: web.Application) -> None:
        app[_SWEEPER].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await app[_SWEEPER]
        await self.hops.close()
        self.lane.close()

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_FRAME_BYTES)
        app.router.add_post("/v1/frame", self._frame_view)
        app.router.add_get("/v1/health", self._health_view)
        app.router.add_get("/metrics", self.metrics.view)
        # the same frames over a WebSocket (agent/node/stream.py)
        StreamView(self.admission, self.answer_frame, self.counters, self.metrics, self.hops).register(app)
        Handoff(
            node_id=self.node_id,
            public_key=self.public_key,
            shards=self.shards,
            sessions=self.sessions,
            lane=self.lane,
            hops=self.hops,
            drain=self.drain_and_move,
        ).register(app)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app


INSECURE_ENV = "GGSWARM_INSECURE_PLAIN_HTTP"


async def start_dataplane(
    dp: DataPlane, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> web.AppRunner:
    """Serve `dp` on host:port: mutual TLS with `ssl_context` (tls.server_context), or plain HTTP on
    loopback only (development); plain HTTP elsewhere needs GGSWARM_INSECURE_PLAIN_HTTP=1."""
    if ssl_context is None:
        if not is_loopback(host) and os.environ.get(INSECURE_ENV) != "1":
            raise DataPlaneError(
                400,
                "insecure",
                f"refusing to serve the data plane as plain HTTP on {host}: prompts, hidden states and "
                f"route tokens would cross the network in the clear. Enroll for a certificate, bind "
                f"127.0.0.1, or set {INSECURE_ENV}=1 (development only)",
            )
        log.warning(
            "DATA PLANE IS PLAIN HTTP on %s:%d (no TLS): development only; prompts, hidden states and "
            "route tokens are readable by anyone who can see this traffic",
            host,
            port,
        )
    dp.lane.host = host  # a lane opened later listens where the data plane does
    # keepalive_timeout: a connection that has not sent a whole request's headers HEAD_TIMEOUT_S after
    # it opened or after its last answer is closed (aiohttp's idle timer; no other header deadline), and
    # a refused body is drained for at most as long (admission.py; hop clients drop idle connections
    # sooner: defaults.HOP_CLIENT_IDLE_S)
    runner = web.AppRunner(
        dp.make_app(), access_log=None, keepalive_timeout=HEAD_TIMEOUT_S, lingering_time=HEAD_TIMEOUT_S
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, ssl_context=ssl_context)
    await site.start()
    return runner
