"""The node's decode lane: chain sessions' decode steps handed to libggswarm's lane (docs/lane.md).

A route client asks for the lane (Op.LANE) after its prompt ran on the Python path. Each hop checks
the frame as any other (route token, session, chain), asks its next hop first, then admits the session
to its own lane with a fresh key and lane id and answers them (LANE_INFO) to the hop or client before
it, over the same authenticated channel frames use. From then on the session's small steps travel hop
to hop without Python, alone or bundled with other sessions' steps (one batch per hop). Any other
frame of the session, a close, an eviction or an expiry takes it off the lane again, syncing what the
lane appended to its history. Other sessions' steps run on the Python path beside the lane; a prompt
among them goes in chunks sized and timed by the node's `LanePacer` (prefill_budget.py, asked by the
shard's scheduler): each runs just before the lane's next step on this hop, which waits for it, and
costs a set share of the decoders' period: a mixed step.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.backends.libggswarm import NativeError
from agent.node.errors import DataPlaneError
from agent.node.prefill_budget import PACE_MAX_S, LanePacer, running_mean
from agent.node.sessions import SessionKey, SessionState
from agent.wire.frames import (
    LANE_INFO,
    FrameError,
    Kind,
    Op,
    Request,
    Response,
    decode_response,
    encode_request,
    encode_response,
    response_limit,
)
from agent.wire.lane import LaneError, ipv4_of
from agent.wire.sampling import SamplingParams

if TYPE_CHECKING:
    from agent.backends.lane import LaneStats, NativeLane
    from agent.node.chain import NextHops
    from agent.node.metrics import NodeMetrics
    from agent.node.shard import Shard

log = logging.getLogger("agent.node.lanes")
LANE_ENV = "GGSWARM_LANE"  # 0: this node never opens a lane
LANE_PORT_ENV = "GGSWARM_LANE_PORT"  # the lane's TCP port (default 0: one the system picks)
# A session on the lane that ran a step this recently is decoding (the scheduler's BUSY_WINDOW_S);
# one that only sits there, a conversation between turns, is not.
LANE_ACTIVE_S = 1.0


@dataclass(eq=False)
class LaneSlot:
    """A session's place on the node's lane.

    Taking a session off waits for its step in flight, and a lane step waits for the next hop's answer
    (up to the library's downstream timeout when a next hop hangs): on the event loop that would stop
    the whole node, health checks included, and a route client would blame this hop for the one
    after it (issue 33, item 7). The loop uses `leave`, which waits in a worker thread."""

    lane: NativeLane
    lane_id: int
    owner: NodeLane
    _leaving: asyncio.Future[None] | None = field(default=None, init=False, repr=False)

    def take_off(self, s: SessionState) -> None:
        """Back to the Python path: off the lane (after its step in flight: this blocks until it is
        done), history synced. Outside a worker thread only where no step can be stuck (tests, close)."""
        try:
            st: LaneStats | None = self.lane.remove(self.lane_id)
        except (NativeError, ValueError):  # already gone (the lane was closed)
            st = None
        self._settle(s, st)

    async def leave(self, s: SessionState) -> None:
        """take_off without holding the event loop: the removal waits in a worker thread, and every
        caller meanwhile waits for the same one."""
        if self._leaving is None:
            self._leaving = asyncio.ensure_future(self._remove(s))
        await asyncio.shield(self._leaving)

    async def _remove(self, s: SessionState) -> None:
        try:
            st: LaneStats | None = await asyncio.to_thread(self.lane.remove, self.lane_id)
        except (NativeError, ValueError):
            st = None
        self._settle(s, st)

    def _settle(self, s: SessionState, st: LaneStats | None) -> None:
        if s.lane is not self:  # settled already (a close took it off meanwhile)
            return
        s.lane = None
        self.owner.forget(s)
        if st is not None:
            s.history.extend(st.appended)
            s.last_used = max(s.last_used, time.monotonic() - st.idle_s)

    def activity(self) -> tuple[float, bool]:
        """(seconds since the session's last lane step, whether one runs now), without waiting for a
        step in flight; a session the lane no longer knows is idle for ever."""
        try:
            return self.lane.activity(self.lane_id)
        except (NativeError, ValueError):
            return float("inf"), False


class NodeLane:
    """The node's one decode lane (opened on first use), who is on it, and Op.LANE's admission. Its
    batches count into the node's `metrics` and `node_counters` (tokens); through `hops` an admission
    asks the next hop's lane first."""

    def __init__(self, metrics: NodeMetrics, node_counters: dict[str, int], hops: NextHops) -> None:
        self.metrics, self.node_counters, self.hops = metrics, node_counters, hops
        self.host: str | None = None  # the data plane's bind address (start_dataplane sets it)
        self.enabled = os.environ.get(LANE_ENV, "1") != "0"
        self._lane: NativeLane | None = None
        # sizes and times the chunks of prompts beside the lane's decoders (the shards' schedulers ask)
        self.pacer = LanePacer(self._wait_turn, self._release, lane_gap=lambda: self.pass_gap_s)
        # the lane's gap between two passes on this hop while it decodes (a running mean over its
        # batch log; a gap longer than PACE_MAX_S is a pause, not a pass rate): the pacer's first wait
        self.pass_gap_s: float | None = None
        self._last_done: float | None = None
        self._laned: dict[SessionKey, SessionState] = {}
        # lane_steps: decode steps this node ran on its lane (they bypass the Python path's counters),
        # counted from its batches by take_batches
        self.counters = {
            "lane_admissions": 0,
            "lane_refusals": 0,
            "lane_take_offs": 0,
            "lane_steps": 0,
            "lane_batches_dropped": 0,  # batches the library's log overwrote before take_batches
        }

    def _node_lane(self) -> NativeLane:
        if self._lane is None:
            from agent.backends.lane import NativeLane

            host = self._bind_host()
            raw = os.environ.get(LANE_PORT_ENV, "0")
            if not raw.isdigit() or int(raw) > 65535:
                raise DataPlaneError(
                    409, "lane_unavailable", f"{LANE_PORT_ENV}={raw!r} is not a port (0..65535)"
                )
            try:
                self._lane = NativeLane(host, int(raw))
            except (NativeError, OSError) as e:
                raise DataPlaneError(409, "lane_unavailable", f"this node cannot open a lane: {e}") from None
            log.info("decode lane listening on %s:%d", host, self._lane.port)
        return self._lane

    def stats(self) -> dict[str, float | None]:
        """The lane's figures in the node's stats: its port once open, sessions on it now, steps (from
        the batches taken in: nothing here waits for a session's step in flight), the pacer's estimates."""
        return {
            "lane_port": self._lane.port if self._lane is not None else None,
            "lane_sessions": len(self._laned),
            **self.counters,
            **self.pacer.figures(),
        }

    def decoding(self) -> bool:
        """Whether a session on the lane is decoding: a step of it runs now or ran within LANE_ACTIVE_S
        (its steps decode outside the shards' schedulers). Sessions that only sit on the lane, a
        conversation between turns or a closed tab's route until it expires, do not count: counted,
        they made every prompt on the node prefill in paced chunks for as long as they
        stayed (bench/served.py: 2,000 tokens in 22 s instead of 16)."""
        if self._lane is None:
            return False
        self.take_batches()  # the pacer's first wait reads the lane's gap between passes from them
        for s in list(self._laned.values()):
            seat = s.lane
            if not isinstance(seat, LaneSlot):
                return True  # not one of ours to ask: assume it decodes
            # at once (not the session's stats, which wait for its step in flight: in relay mode for
            # the later hops, which held this loop 14-29 ms before every chunk of a paced prompt)
            idle_s, busy = seat.activity()
            if busy or idle_s < LANE_ACTIVE_S:
                return True
        return False

    def take_batches(self) -> None:
        """Count the batches the lane computed since the last call into the node's metrics and token
        counters, as the scheduler counts the Python path's: they ran on libggswarm's threads. Called
        before the figures are read (stats, a scrape) and by the sweeper, so the library's log never fills."""
        if self._lane is None:
            return
        batches, dropped = self._lane.take_batches()
        for b in batches:
            if self._last_done is not None and 0 < b.t_done - self._last_done <= PACE_MAX_S:
                self.pass_gap_s = running_mean(self.pass_gap_s, b.t_done - self._last_done)
            self._last_done = b.t_done
            self.metrics.batch(b.steps, b.positions, b.compute_s, at=b.t_done)
            self.metrics.queue_wait(b.wait_s, at=b.t_done)
            self.node_counters["tokens_in"] += b.positions
            self.node_counters["tokens_out"] += b.sampled
            self.counters["lane_steps"] += b.steps
        if dropped:
            self.counters["lane_batches_dropped"] += dropped
            log.warning("the lane's batch log overwrote %d batches before they were counted", dropped)

    def _bind_host(self) -> str:
        """Where the lane listens: the data plane's address, its any-address and name forms as IPv4."""
        host = self.host or "127.0.0.1"
        if host in ("", "::", "localhost"):
            return "0.0.0.0" if host == "::" else "127.0.0.1"  # noqa: S104 - where the data plane listens
        return host

    def _wait_turn(self, timeout_s: float) -> bool:
        """Block (in a worker thread) until the lane's next step arrives on this hop and is held before
        its compute (True: `_release` lets it go), or the timeout; False at once when the lane is quiet
        or not open."""
        lane = self._lane  # the scheduler asks only while sessions are on it
        return lane is not None and lane.gate(timeout_s)

    def _release(self) -> None:
        lane = self._lane
        if lane is not None:
            lane.gate_release()

    def take_off(self, s: SessionState) -> None:
        """Put `s` back on the Python path, if it is on the lane, waiting here for its step in flight
        (`leave` from the event loop)."""
        if s.lane is not None:
            s.lane.take_off(s)  # calls forget
        self._laned.pop(s.key, None)

    async def leave(self, s: SessionState) -> None:
        """Put `s` back on the Python path, if it is on the lane (a frame of it, a hand-off, a close),
        its step in flight waited for in a worker thread: the node goes on serving meanwhile."""
        if isinstance(s.lane, LaneSlot):
            await s.lane.leave(s)  # calls forget
        elif s.lane is not None:
            s.lane.take_off(s)
        self._laned.pop(s.key, None)

    def forget(self, s: SessionState) -> None:
        """A session left the lane (whoever took it off: a frame, a close, an eviction, an expiry)."""
        if self._laned.pop(s.key, None) is not None:
            self.counters["lane_take_offs"] += 1

    def drop(self, key: SessionKey) -> None:
        """Forget a session its caller is closing: the close takes it off the lane, no take-off is counted."""
        self._laned.pop(key, None)

    def close(self) -> None:
        for s in list(self._laned.values()):
            self.take_off(s)
        if self._lane is not None:
            self.take_batches()
            self._lane.close()
            self._lane = None

    async def admit(self, req: Request, shard: Shard, s: SessionState) -> bytes:
        """Op.LANE: the next hop's lane first, then this hop's; answers this hop's LANE_INFO."""
        why = self._refusal(req, shard, s)
        if why:
            self.counters["lane_refusals"] += 1
            raise DataPlaneError(409, "lane_unavailable", why)
        from agent.backends.lane import NextHop
        from agent.backends.libggswarm import sampling_struct
        from agent.backends.native import _penalised

        nxt_hop: NextHop | None = None
        if not shard.spec.is_last:
            chain = s.chain or []
            if not chain:
                raise DataPlaneError(
                    409, "no_chain", "a lane needs the session's chain (run a chain step first)"
                )
            nxt, rest = chain[0], chain[1:]
            fwd = Request(
                op=Op.LANE,
                session=req.session,
                step=req.step,
                token=nxt.token,
                chain_cached=bool(rest),
                f16_out=req.f16_out,
            )
            data = await self.hops.exchange(nxt, encode_request(fwd), response_limit(0, 1, False))
            try:
                resp = decode_response(data)
            except FrameError as e:
                raise DataPlaneError(
                    502, "downstream", f"next hop {nxt.url} answered a bad frame: {e}"
                ) from None
            if resp.kind != Kind.LANE:
                raise DataPlaneError(
                    502, "downstream", f"next hop {nxt.url} answered {resp.kind.name}, not a lane"
                )
            lane_id, port, key = LANE_INFO.unpack(resp.payload)
            try:
                host = await ipv4_of(nxt.url)  # the lane dials numbers
            except LaneError as e:
                raise DataPlaneError(409, "lane_unavailable", f"next hop {e}") from None
            nxt_hop = NextHop(host, port, lane_id, key, f16=req.f16_out)
        if s.busy or s.lane is not None:
            await self.leave(s)  # a fresh admission: new id and key
        lane = self._node_lane()
        lane_id, key = int.from_bytes(os.urandom(8), "little"), os.urandom(32)
        backend = shard.backend
        sampling, history = None, None
        if shard.spec.is_last:
            p = s.sampling or SamplingParams()
            sampling = sampling_struct(
                p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n, p.seed
            )
            history = _penalised(s.history, p)
        model, native_sid = backend.model, backend._sid(s.sid)  # type: ignore[attr-defined]  # why: _refusal checked it is a NativeBackend
        try:
            lane.add(model, native_sid, lane_id, key, nxt_hop, sampling=sampling, history=history)
        except NativeError as e:
            raise DataPlaneError(409, "lane_unavailable", f"lane admission failed: {e}") from None
        s.lane = LaneSlot(lane, lane_id, self)
        self._laned[s.key] = s
        self.counters["lane_admissions"] += 1
        return encode_response(
            Response(step=req.step, kind=Kind.LANE, payload=LANE_INFO.pack(lane_id, lane.port, key))
        )

    def _refusal(self, req: Request, shard: Shard, s: SessionState) -> str:
        """Why the session cannot go on the lane now ("" when it can)."""
        from agent.backends.native import NativeBackend

        if not self.enabled:
            return f"lanes are off on this node ({LANE_ENV}=0)"
        if not isinstance(shard.backend, NativeBackend):
            return f"the {shard.backend_name} backend has no lane"
        if s.busy:
            return "the session's step is still running"
        # other sessions' queued steps are no reason: they run beside the lane under the shard's lock,
        # and refusing here let sessions decoding in step refuse each other's admission for good
        try:
            if ipaddress.ip_address(self._bind_host()).version != 4:
                return "the lane listens on IPv4 only"
        except ValueError:
            return "the lane listens on numeric IPv4 addresses only"
        return ""
