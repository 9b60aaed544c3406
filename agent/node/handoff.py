"""KV hand-off between nodes holding the same layer range: export a session's snapshot, import it, drain.

A route client recovering from a hop that still answers (draining, or failing in a way that left it
up) asks that hop to export the session to a replacement (`POST /v1/handoff/export`); the hop
snapshots the session's KV under its shard lock and pushes it to the replacement
(`POST /v1/handoff/import`), which opens the session from it. Both sides verify one hand-off token
naming both nodes (agent/wire/handofftoken.py). The import body is size-checked against what the
range can hold at the declared length before any of it is read, and hashed (sha256) before use.

`POST /v1/drain` (loopback only) marks every shard draining in "move" mode: new sessions are refused
and existing ones answer their next step with 503 `draining`, so their clients move them here, and the
node stops (if asked to) once no session is left or the deadline passes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import ipaddress
import logging
import os
import signal
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import ClientError, ClientTimeout, web

from agent.backends.base import AdmissionError, BackendError
from agent.node.errors import DataPlaneError, error_response
from agent.node.sessions import SessionState, SessionTable
from agent.node.shard import Shard, Shards, evictable
from agent.wire.frames import MAX_DRAFT_TOKENS
from agent.wire.handofftoken import HandoffClaims, HandoffTokenError, verify_handoff
from agent.wire.httpjson import read_json
from agent.wire.ids import SessionId
from agent.wire.jsonlimits import loads_bounded
from agent.wire.tls import node_dns_name

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from agent.artifacts.manifest import Manifest
    from agent.node.chain import NextHops
    from agent.node.lanes import NodeLane

log = logging.getLogger("agent.node.handoff")

TOKEN_HEADER = "X-Handoff-Token"
# magic, capacity, n_history, snapshot bytes, sha256 of the snapshot, then (GSK2) the MTP drafts the
# session asked of the last hop at OPEN, which go on after the move (the head's state is in the snapshot)
IMPORT_HEAD_V1 = struct.Struct("<4sIIQ32s")
IMPORT_MAGIC_V1 = b"GSKV"  # a node of an earlier release: no drafts field (0)
IMPORT_HEAD = struct.Struct("<4sIIQ32sI")
IMPORT_MAGIC = b"GSK2"
# Room for a snapshot's own headers above the state rows the range holds (native: 200 bytes, and the
# same again for an MTP block's snapshot inside the trailer).
SNAPSHOT_HEADER_SLACK = 4096
# The trunk rows a last window keeps per session for its MTP block's drafts (native mtp.cpp, kKeepRows)
MTP_ROWS_KEPT = 64
EXPORT_TIMEOUT_S = 30.0


class HandoffError(DataPlaneError):
    """A hand-off refused or failed; `status` and `code` go back to the caller as JSON."""


def snapshot_bound(shard: Shard, n_positions: int) -> int:
    """Most bytes a snapshot of `n_positions` of this shard's range can take (range_snapshot_bound)."""
    spec = shard.spec
    return range_snapshot_bound(
        spec.manifest, spec.layer_start, spec.layer_end, shard.backend.mtp, n_positions
    )


def range_snapshot_bound(manifest: Manifest, start: int, end: int, mtp: bool, n_positions: int) -> int:
    """Most bytes a snapshot of `n_positions` of layers [start, end) can take: their f16 state plus the
    headers; with `mtp` (a last window drafting with its MTP head) also the block's trailer: its state,
    one layer's (at most the range's largest), and the trunk rows its drafts read (docs/native.md)."""
    per_layer = [layer.state_bytes(n_positions) for layer in manifest.layers[start:end]]
    bound = SNAPSHOT_HEADER_SLACK + sum(per_layer)
    if mtp:
        bound += 16 + max(per_layer, default=0) + MTP_ROWS_KEPT * (4 + 4 * manifest.boundary_dim)
    return bound


def encode_import(capacity: int, history: list[int], snapshot: bytes, mtp_draft: int = 0) -> bytes:
    digest = hashlib.sha256(snapshot).digest()
    hist = np.asarray(history, dtype="<i4").tobytes()
    head = IMPORT_HEAD.pack(IMPORT_MAGIC, capacity, len(history), len(snapshot), digest, mtp_draft)
    return head + hist + snapshot


class Handoff:
    """The hand-off and drain endpoints of one data plane, handed its node's id and route-token key,
    shards, sessions, lane (a session leaves it before its snapshot), client side (the push to the
    replacement) and `drain` (every shard draining, sessions told to move)."""

    def __init__(
        self,
        *,
        node_id: str,
        public_key: Ed25519PublicKey,
        shards: Shards,
        sessions: SessionTable,
        lane: NodeLane,
        hops: NextHops,
        drain: Callable[[], None],
    ) -> None:
        self.node_id, self.public_key = node_id, public_key
        self.shards, self.sessions, self.lane, self.hops = shards, sessions, lane, hops
        self._drain_shards = drain
        # the task stopping the node once drained: held here, as the loop keeps only a weak reference
        self._drain_task: asyncio.Task[None] | None = None

    def _claims(self, token_b64: str) -> HandoffClaims:
        try:
            token = base64.b64decode(token_b64, validate=True)
        except ValueError:
            raise HandoffError(401, "bad_token", "hand-off token is not base64") from None
        try:
            return verify_handoff(self.public_key, token)
        except HandoffTokenError as e:
            raise HandoffError(401, "bad_token", str(e)) from None

    def _shard(self, c: HandoffClaims) -> Shard:
        shard = self.shards.get((c.model_sha256, c.layer_start, c.layer_end))
        if shard is None:
            raise HandoffError(
                403,
                "wrong_range",
                f"this node holds no shard {c.model_sha256[:12]} {c.layer_start}:{c.layer_end}",
            )
        return shard

    # -- export: this node gives a session away -----------------------------------------------------
    async def export(self, token_b64: str, target: str, keep: bool = False) -> dict[str, Any]:
        """Push the session's snapshot to `target`; then free it here, unless `keep` (a warm copy for
        the route client's recovery, this node goes on serving the session)."""
        c = self._claims(token_b64)
        if c.src != self.node_id:
            raise HandoffError(403, "wrong_node", f"hand-off token is from node {c.src!r}, not this node")
        if not target.startswith(("http://", "https://")) or len(target) > 512:
            raise HandoffError(400, "bad_target", "target must be an http(s) URL")
        shard = self._shard(c)
        key = (SessionId(c.session), shard.key)
        t0 = time.perf_counter()
        async with shard.lock:  # no step of this session (or any other on the shard) runs meanwhile
            s = self.sessions.get(key)
            if s is None:
                raise HandoffError(404, "unknown_session", "unknown session (expired, evicted or moved)")
            await self.lane.leave(s)  # a snapshot of a session the lane may step meanwhile would be torn
            try:
                snap = shard.backend.snapshot(s.sid)
            except BackendError as e:
                raise HandoffError(409, "no_snapshot", str(e)) from None
            body = encode_import(s.capacity, list(s.history), snap, s.mtp_draft)
        http = await self.hops.http()
        url = target.rstrip("/") + "/v1/handoff/import"
        try:
            # https: mutual TLS as towards a next hop, pinned like it: the swarm CA only, and the
            # certificate must name the node the hand-off token names as the destination
            ssl_ctx = self.hops.ssl_for(url)
        except DataPlaneError as e:
            raise HandoffError(502, "target_unreachable", e.message) from None
        tls_name = node_dns_name(c.dst) if url.startswith("https://") else None
        try:
            async with http.post(
                url,
                data=body,
                headers={TOKEN_HEADER: token_b64},
                timeout=ClientTimeout(total=EXPORT_TIMEOUT_S),
                ssl=ssl_ctx,
                server_hostname=tls_name,
            ) as r:
                if r.status != 200:
                    text = (await r.content.read(300)).decode("utf-8", "replace")
                    raise HandoffError(502, "target_refused", f"{url} answered {r.status}: {text}")
                try:
                    out = await read_json(r)  # the target's answer: small, bounded in size and depth
                except ValueError as e:
                    raise HandoffError(
                        502, "target_refused", f"{url} answered a malformed body: {e}"
                    ) from None
        except (ClientError, OSError, TimeoutError) as e:
            raise HandoffError(502, "target_unreachable", f"{url} unreachable: {e}") from None
        if not keep:  # the replacement holds it now: free ours (its client no longer steps here)
            async with shard.lock:
                self.sessions.close(key)
        if not isinstance(out, dict):
            raise HandoffError(502, "target_refused", f"{url} answered {type(out).__name__}, not an object")
        out["export_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        return out

    # -- import: this node takes a session ------------------------------------------------------------
    async def import_(self, request: web.Request) -> dict[str, Any]:
        c = self._claims(request.headers.get(TOKEN_HEADER, ""))
        if c.dst != self.node_id:
            raise HandoffError(403, "wrong_node", f"hand-off token is for node {c.dst!r}, not this node")
        shard = self._shard(c)
        if shard.draining:
            raise HandoffError(503, "draining", "this shard is draining")
        try:
            head = await request.content.readexactly(IMPORT_HEAD_V1.size)
            magic, capacity, n_hist, snap_len, digest = IMPORT_HEAD_V1.unpack(head)
            mtp_draft = 0
            if magic == IMPORT_MAGIC:
                (mtp_draft,) = struct.unpack("<I", await request.content.readexactly(4))
                head_size = IMPORT_HEAD.size
            elif magic == IMPORT_MAGIC_V1:
                head_size = IMPORT_HEAD_V1.size
            else:
                raise HandoffError(400, "bad_frame", "not a hand-off body")
        except asyncio.IncompleteReadError:
            raise HandoffError(400, "bad_frame", "hand-off body shorter than its header") from None
        cap = shard.max_positions
        if not (0 < capacity <= cap) or n_hist > capacity:
            raise HandoffError(400, "context_cap", f"capacity {capacity} / history {n_hist} beyond {cap}")
        if mtp_draft > MAX_DRAFT_TOKENS:
            raise HandoffError(
                400, "bad_frame", f"{mtp_draft} MTP drafts per step; at most {MAX_DRAFT_TOKENS}"
            )
        bound = snapshot_bound(shard, capacity)
        if snap_len > bound:
            raise HandoffError(413, "too_large", f"snapshot of {snap_len} bytes exceeds this range's {bound}")
        expected = head_size + 4 * n_hist + snap_len
        if request.content_length is not None and request.content_length != expected:
            raise HandoffError(
                400, "bad_frame", f"body is {request.content_length} bytes, header says {expected}"
            )
        sid = SessionId(c.session)
        key = (sid, shard.key)
        state = SessionState(sid=sid, shard_key=shard.key, backend=shard.backend, capacity=capacity)
        if shard.spec.is_last and shard.backend.mtp:  # as at OPEN: the head drafts where the file has one
            state.mtp_draft = mtp_draft
        # Room is made (or refused) before the snapshot is read into memory.
        try:
            self.sessions.admit(state, snap_len, lambda v: evictable(self.shards, v, shard))
        except AdmissionError as e:
            raise HandoffError(503, "kv_budget", str(e)) from None
        try:
            hist_raw = await request.content.readexactly(4 * n_hist)
            snap = await request.content.readexactly(snap_len)
        except asyncio.IncompleteReadError:
            raise HandoffError(400, "bad_frame", "hand-off body truncated") from None
        if hashlib.sha256(snap).digest() != digest:
            raise HandoffError(400, "bad_hash", "snapshot sha256 does not match")
        async with shard.lock:
            held = self.sessions.get(key)
            if held is not None:
                if held.busy:
                    raise HandoffError(409, "session_busy", "this node is running a step of the session")
                self.sessions.close(key)  # an older copy (a warm spare's): the newer one replaces it
            try:
                shard.backend.open_session(sid, capacity)
            except AdmissionError as e:
                raise HandoffError(503, "kv_budget", str(e)) from None
            except BackendError as e:
                raise HandoffError(400, "backend", str(e)) from None
            try:
                shard.backend.restore(sid, snap)
                n = shard.backend.session_len(sid)
            except BackendError as e:
                shard.backend.close_session(sid)
                status = 503 if isinstance(e, AdmissionError) else 400
                raise HandoffError(status, "restore", str(e)) from None
            state.history = np.frombuffer(hist_raw, dtype="<i4").tolist()
            self.sessions.add(state)
        return {"session_len": n, "bytes": snap_len}

    # -- drain: move every session away, then stop ---------------------------------------------------
    async def drain(self, deadline_s: float, exit_when_empty: bool) -> dict[str, Any]:
        self._drain_shards()
        log.info("draining: %d sessions to move within %.0f s", len(self.sessions), deadline_s)
        if exit_when_empty:
            self._drain_task = asyncio.get_running_loop().create_task(self._stop_when_empty(deadline_s))
        return {"sessions": len(self.sessions), "deadline_s": deadline_s}

    async def _stop_when_empty(self, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while len(self.sessions) and time.monotonic() < end:
            await asyncio.sleep(0.1)
        log.info("drained (%d sessions left): stopping", len(self.sessions))
        os.kill(os.getpid(), signal.SIGTERM)  # `serve` stops on SIGTERM like on Ctrl-C

    # -- aiohttp wiring --------------------------------------------------------------------------------
    async def _export_view(self, request: web.Request) -> web.Response:
        if request.content_length is None or request.content_length > 4096:
            return error_response(413, "too_large", "export request must be a small JSON object")
        try:
            body = loads_bounded(await request.read(), max_bytes=4096)
            token, target, keep = str(body["token"]), str(body["target"]), bool(body.get("keep", False))
        except (ValueError, KeyError, TypeError, AttributeError):
            return error_response(
                400, "bad_request", 'expected {"token": base64, "target": url, "keep": bool}'
            )
        return await self._answer(self.export(token, target, keep))

    async def _import_view(self, request: web.Request) -> web.Response:
        return await self._answer(self.import_(request))

    async def _drain_view(self, request: web.Request) -> web.Response:
        if not _loopback(request.remote):
            return error_response(403, "forbidden", "drain is only accepted from this machine")
        try:
            body = loads_bounded(await request.read() or b"{}", max_bytes=4096)
            deadline_s = float(body.get("deadline_s", 60.0))
            exit_when_empty = bool(body.get("exit", False))
        except (ValueError, TypeError, AttributeError):
            return error_response(400, "bad_request", 'expected {"deadline_s": seconds, "exit": bool}')
        return await self._answer(self.drain(deadline_s, exit_when_empty))

    async def _answer(self, work: Any) -> web.Response:
        try:
            out = await work
        except HandoffError as e:
            log.info("hand-off refused: %s %s", e.code, e.message)
            return error_response(e.status, e.code, e.message)
        return web.json_response(out)

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/handoff/export", self._export_view)
        app.router.add_post("/v1/handoff/import", self._import_view)
        app.router.add_post("/v1/drain", self._drain_view)


def _loopback(remote: str | None) -> bool:
    with contextlib.suppress(ValueError):
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    return False
