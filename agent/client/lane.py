"""A route client's decode steps over the hops' native lanes (docs/lane.md), with the Python path behind.

RouteClient.forward asks `LaneRoute.step` first for a decode step in chain mode. The first such step of
a turn asks hop 0 for the lane (Op.LANE over the usual frame channel: the hops admit the session one
after another and hop 0 answers its lane's id, port and key); later steps go over one TCP connection to
hop 0's lane as sealed frames. Anything the lane refuses or fails is answered None: the step then runs
on the Python path, which takes the session off every lane it reaches, and the lane is not asked again
until the next turn. A connection that breaks mid-step may have left the hops a step ahead: they are
truncated back first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from typing import TYPE_CHECKING

import numpy as np

from agent.wire.frames import LANE_INFO, Kind, Response, Timing
from agent.wire.lane import (
    FRAME_HEAD,
    MAX_TOKENS,
    LaneAnswer,
    LaneError,
    answer_head,
    ipv4_of,
    open_answer,
    seal_request,
)

if TYPE_CHECKING:
    from agent.client.failover import Step
    from agent.client.route import RouteClient

LANE_ENV = "GGSWARM_LANE"  # 0: route clients never ask for a lane


def lanes_wanted(env: dict[str, str] | None = None) -> bool:
    return (env if env is not None else os.environ).get(LANE_ENV, "1") != "0"


class LaneConnection:
    """One session's sealed steps to its first hop's lane, on an asyncio stream."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lane_id: int, key: bytes
    ) -> None:
        self.reader, self.writer = reader, writer
        self.lane_id, self.key, self.next_step = lane_id, key, 1

    @classmethod
    async def open(cls, host: str, port: int, lane_id: int, key: bytes) -> LaneConnection:
        reader, writer = await asyncio.open_connection(host, port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, lane_id, key)

    async def run(self, pos: int, ids: np.ndarray) -> LaneAnswer:
        step = self.next_step
        self.next_step += 1  # spent whatever the answer: a sealed frame never runs twice
        self.writer.write(seal_request(self.key, self.lane_id, step, pos, ids))
        try:
            head_b = await self.reader.readexactly(FRAME_HEAD)
            head = answer_head(head_b)
            payload = await self.reader.readexactly(head.payload_len)
        except asyncio.IncompleteReadError:
            raise LaneError("the lane closed the connection mid-step") from None
        return open_answer(self.key, head_b, payload, self.lane_id, step)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await self.writer.wait_closed()


class LaneRoute:
    """The lane state of one RouteClient: the connection, and whether to ask for one this turn."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.conn: LaneConnection | None = None
        self.blocked = False  # refused or failed this turn: the Python path until the next turn
        self.hops_key: tuple[tuple[str, bytes], ...] = ()  # the route the lane was opened along
        self.steps = 0
        self.fallbacks = 0

    def new_turn(self) -> None:
        self.blocked = False

    async def drop(self) -> None:
        if self.conn is not None:
            await self.conn.close()
            self.conn = None

    async def step(
        self, rc: RouteClient, inp: Step, ids: list[int], send: bool, want_logits: bool
    ) -> Response | None:
        """Run a decode step over the lane; None: run it on the Python path."""
        if not self.enabled or self.blocked or want_logits or send or not 1 <= inp.n <= MAX_TOKENS:
            return None
        if len(rc.hops) > 1 and not (rc.mode == "chain" and rc._chain_sent):  # noqa: SLF001
            return None  # the hops learn the chain from a Python chain step first
        route = tuple((h.url, h.token) for h in rc.hops)
        if self.conn is not None and route != self.hops_key:  # a hop was replaced: the old lane is stale
            await self.drop()
        if self.conn is None:
            self.conn = await self._admit(rc)
            if self.conn is None:
                self.blocked = True
                return None
            self.hops_key = route
        t0 = time.perf_counter()
        try:
            ans = await asyncio.wait_for(
                self.conn.run(inp.pos, np.asarray(ids, dtype=np.int32)),
                rc._deadline(0, inp.n),  # noqa: SLF001 - a failing hop is judged by its recent steps
            )
        except (LaneError, OSError, TimeoutError) as e:
            await self.drop()
            self.blocked = True
            self.fallbacks += 1
            clean = isinstance(e, LaneError) and (e.refused or e.status != 0)
            if not clean:  # the step may have run on some hops: bring every hop back to the client's length
                await rc.realign(inp.pos)
            return None
        self.steps += 1
        rc.step += 1
        rc._rtt[0].append(time.perf_counter() - t0)  # noqa: SLF001
        return Response(
            step=rc.step,
            kind=Kind.TOKEN,
            session_len=ans.session_len,
            token=ans.token,
            logprob=ans.logprob,
            timings=[Timing(c, h) for c, h in ans.timings],
        )

    async def _admit(self, rc: RouteClient) -> LaneConnection | None:
        from agent.client.route import RouteError

        try:
            resp = await rc._post(0, rc._lane_frame())  # noqa: SLF001
        except RouteError:
            return None
        if resp.kind != Kind.LANE:
            return None
        lane_id, port, key = LANE_INFO.unpack(resp.payload)
        try:
            host = await ipv4_of(rc.hops[0].url)
        except LaneError:
            return None
        try:
            return await LaneConnection.open(host, port, lane_id, key)
        except OSError:
            return None
