"""A route client's decode steps over the hops' native lanes (docs/lane.md), with the Python path behind.

RouteClient.forward asks `LaneRoute.step` first for a decode step in chain mode. The first such step of
a turn asks hop 0 for the lane (Op.LANE over the usual frame channel: the hops admit the session one
after another and hop 0 answers its lane's id, port and key); later steps go to hop 0's lane as sealed
frames over the transport's pooled connections (`LaneStreams`). Steps that sessions sharing a transport
make in the same loop turn for the same lane travel as one bundle and run on every hop as one batch.
Anything the lane refuses or fails is answered None: the step then runs on the Python path, which takes
the session off every lane it reaches, and the lane is asked again after LANE_RETRY_STEPS more steps
(what refused it, another session's prompt say, is usually over by then). A connection that breaks
mid-step may have left the hops a step ahead: they are truncated back first.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from agent.client.errors import RouteError
from agent.client.link import RouteLink, Step
from agent.wire.frames import LANE_INFO, Kind, Op, Response, Timing
from agent.wire.lane import (
    FRAME_HEAD,
    MAX_BUNDLE,
    MAX_TOKENS,
    BundleMember,
    Head,
    LaneAnswer,
    LaneError,
    answer_head,
    bundle_answer_head,
    ipv4_of,
    open_answer,
    open_bundle_answer,
    seal_bundle,
)
from agent.wire.stream import settle

LANE_ENV = "GGSWARM_LANE"  # 0: route clients never ask for a lane
# Python-path decode steps after a refusal before the lane is asked again (one Op.LANE round trip)
LANE_RETRY_STEPS = 2
# After a bundle's answer, how long the lane's next bundle waits for its members' next steps: they come
# back within a few loop turns, unless their answer ended (then this is what its last step costs others)
REGROUP_S = 0.002


def lanes_wanted(env: dict[str, str] | None = None) -> bool:
    return (env if env is not None else os.environ).get(LANE_ENV, "1") != "0"


Address = tuple[str, int]
T = TypeVar("T")


class _Conn:
    """One pooled connection to a lane: a request at a time, answered in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, addr: Address) -> _Conn:
        reader, writer = await asyncio.open_connection(*addr)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def read(self, head_of: Callable[[bytes], Head]) -> tuple[bytes, Head, bytes]:
        """An answer: its head's bytes, the head (`head_of` checks it before the payload is read), payload."""
        try:
            head_b = await self.reader.readexactly(FRAME_HEAD)
            head = head_of(head_b)
            return head_b, head, await self.reader.readexactly(head.payload_len)
        except asyncio.IncompleteReadError:
            raise LaneError("the lane closed the connection mid-step") from None

    def close(self) -> None:
        self.writer.close()


@dataclass(eq=False)
class _Waiting:
    """A step waiting for its lane's next send, and where its outcome goes."""

    member: BundleMember
    future: asyncio.Future[LaneAnswer]


@dataclass(eq=False)
class _LaneState:
    """One lane's steps waiting to be sent, its bundles in flight, and who is expected back."""

    pending: list[_Waiting] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 1
    expected: set[int] = field(default_factory=set)  # lane ids of the last answered bundle's members
    flush_soon: asyncio.Handle | None = None
    give_up: asyncio.TimerHandle | None = None


class LaneStreams:
    """A transport's connections to hops' lanes, and the bundles of steps sent to one lane.

    Steps `run` with `bundle` wait for the loop turn to end; the steps other sessions sent to the same
    lane in that turn go with them as one bundle (native/src/lane_bundle.cpp runs them as one batch on
    every hop). At most `max_in_flight` bundles travel a lane at once (the route's machines: on one
    machine a second group only competes for the cores the first computes on), and when a bundle is
    answered the next waits for its members' next steps (at most REGROUP_S), so sessions admitted at
    different moments end up stepping as one group. A refused bundle spends no step, so its members
    go again alone: one session's refusal never costs the others their lane."""

    def __init__(self) -> None:
        self._idle: dict[Address, list[_Conn]] = {}
        self._lanes: dict[Address, _LaneState] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.bundles_sent = 0  # bundles of two steps or more (telemetry, tests)
        self.closed = False

    async def run(
        self, addr: Address, member: BundleMember, bundle: bool, max_in_flight: int = 1
    ) -> LaneAnswer:
        if not bundle:
            return await self._lone(addr, member)
        st = self._lanes.setdefault(addr, _LaneState())
        st.max_in_flight = max(1, max_in_flight)
        item = _Waiting(member, asyncio.get_running_loop().create_future())
        st.pending.append(item)
        self._consider(addr, st)
        try:
            return await item.future
        except asyncio.CancelledError:
            if item in st.pending:  # not sent: the others go without it
                st.pending.remove(item)
            raise

    def _consider(self, addr: Address, st: _LaneState) -> None:
        """Send the waiting steps now, at the end of this turn, or once the expected ones are back."""
        if not st.pending or st.in_flight >= st.max_in_flight:
            return  # an answer will bring it back here
        loop = asyncio.get_running_loop()
        if len(st.pending) >= MAX_BUNDLE:
            self._flush(addr, st)
        elif st.expected and not st.expected <= {i.member.lane_id for i in st.pending}:
            if st.give_up is None:  # a member that finished its answer is not coming back
                st.give_up = loop.call_later(REGROUP_S, self._flush, addr, st)
        elif st.flush_soon is None:
            # callbacks run after every task the current turn woke: their steps join this bundle
            st.flush_soon = loop.call_soon(self._flush, addr, st)

    def _flush(self, addr: Address, st: _LaneState) -> None:
        for h in (st.flush_soon, st.give_up):
            if h is not None:
                h.cancel()
        st.flush_soon = st.give_up = None
        items = st.pending[:MAX_BUNDLE]  # a caller that gave up meanwhile is left out when it is sent
        del st.pending[:MAX_BUNDLE]
        st.expected = set()
        if not items:
            return
        st.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._send(addr, st, items))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, addr: Address, st: _LaneState, items: list[_Waiting]) -> None:
        try:
            await self._send_bundle(addr, items)
        finally:
            st.in_flight -= 1
            st.expected = {i.member.lane_id for i in items if i.future.done() and not i.future.cancelled()}
            if not self.closed:
                self._consider(addr, st)

    async def _with_conn(self, addr: Address, use: Callable[[_Conn], Awaitable[T]]) -> T:
        """`use` a pooled connection (or a new one); back to the pool only when it finished cleanly."""
        pool = self._idle.setdefault(addr, [])
        conn = pool.pop() if pool else await _Conn.open(addr)
        try:
            out = await use(conn)
        except BaseException:
            conn.close()  # mid-exchange or refused: its stream is not in step any more
            raise
        if self.closed:
            conn.close()
        else:
            pool.append(conn)
        return out

    async def _lone(self, addr: Address, m: BundleMember) -> LaneAnswer:
        async def use(conn: _Conn) -> LaneAnswer:
            conn.writer.write(m.seal())
            head_b, _, payload = await conn.read(answer_head)
            return open_answer(m.key, head_b, payload, m.lane_id, m.step)

        return await self._with_conn(addr, use)

    async def _send_bundle(self, addr: Address, items: list[_Waiting]) -> None:
        items = [i for i in items if not i.future.done()]  # a caller that gave up leaves the others
        members = [i.member for i in items]

        async def use(conn: _Conn) -> list[LaneAnswer | LaneError]:
            conn.writer.write(seal_bundle(members))
            _, head, payload = await conn.read(lambda b: bundle_answer_head(b, len(members)))
            return open_bundle_answer(head, payload, members)

        try:
            if len(items) == 1:
                settle(items[0].future, await self._lone(addr, members[0]))
                return
            if not items:
                return
            outcomes: list[LaneAnswer | BaseException]
            try:
                outcomes = list(await self._with_conn(addr, use))
                self.bundles_sent += 1
            except LaneError as e:
                if not e.refused:
                    raise
                # refused whole, nothing spent: each goes alone, and only the one at fault fails
                lone = await asyncio.gather(*(self._lone(addr, m) for m in members), return_exceptions=True)
                outcomes = list(lone)
            for i, o in zip(items, outcomes, strict=True):
                settle(i.future, o)
        except Exception as e:  # noqa: BLE001 - every waiting step gets the failure, as a lone one would
            for i in items:
                settle(i.future, e)
        except asyncio.CancelledError:
            for i in items:
                settle(i.future, ConnectionResetError(f"lane {addr[0]}:{addr[1]} closed before its answer"))
            raise

    async def close(self) -> None:
        self.closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for st in self._lanes.values():
            for h in (st.flush_soon, st.give_up):
                if h is not None:
                    h.cancel()
        for pool in self._idle.values():
            for conn in pool:
                conn.close()
        self._idle.clear()


@dataclass
class LaneTicket:
    """A session's admission at its first hop's lane: where it is, its id and key, the next step."""

    addr: Address
    lane_id: int
    key: bytes
    next_step: int = 1


class LaneRoute:
    """The lane state of one RouteClient: its admission, and whether to ask for one now.

    It is handed the session's `link`, the transport's `streams`, the failover's `wait` for a lane step
    (against hop 0's deadline, judged by its recent steps: Failover.wait_lane) and the client's
    `realign`, which brings every hop back to a position after a step whose answer was lost."""

    def __init__(
        self,
        enabled: bool,
        link: RouteLink,
        streams: LaneStreams,
        wait: Callable[[Awaitable[LaneAnswer], int], Awaitable[LaneAnswer]],
        realign: Callable[[int], Awaitable[None]],
    ) -> None:
        self.enabled = enabled
        self.link = link
        self.streams = streams
        self.wait = wait
        self.realign = realign
        self.ticket: LaneTicket | None = None
        self.retry_in = 0  # refused or failed: Python-path steps until the lane is asked again
        self.hops_key: tuple[tuple[str, bytes], ...] = ()  # the route the lane was opened along
        self.machines = 1
        self.steps = 0
        self.fallbacks = 0

    def new_turn(self) -> None:
        self.retry_in = 0

    async def drop(self) -> None:
        """Forget the admission (the hops take the session off when its next frame reaches them)."""
        self.ticket = None

    def _blocked(self) -> bool:
        if self.retry_in > 0:
            self.retry_in -= 1
            return True
        return False

    async def step(
        self, inp: Step, ids: list[int], send: bool, want_logits: bool, bundle: bool
    ) -> Response | None:
        """Run a decode step over the lane; None: run it on the Python path. `bundle`: other route
        clients share the transport, so the step may travel with theirs. RouteError (code "timeout")
        when the step misses its deadline: the hops are brought back by the failover that handles it."""
        if not self.enabled or want_logits or send or not 1 <= inp.n <= MAX_TOKENS or self._blocked():
            return None
        link = self.link
        if len(link.hops) > 1 and not link.chain_sent:
            return None  # the hops learn the chain from a Python chain step first
        route = tuple((h.url, h.token) for h in link.hops)
        if self.ticket is not None and route != self.hops_key:  # a hop was replaced: the old lane is stale
            self.ticket = None
        if self.ticket is None:
            self.ticket = await self._admit()
            if self.ticket is None:
                self.retry_in = LANE_RETRY_STEPS
                return None
            self.hops_key = route
            # bundles in flight at once: one per machine the route crosses (they pipeline across them)
            self.machines = len({urllib.parse.urlsplit(h.url).hostname for h in link.hops})
        t = self.ticket
        member = BundleMember(t.key, t.lane_id, t.next_step, inp.pos, np.asarray(ids, dtype=np.int32))
        t.next_step += 1  # spent whatever the answer: a sealed frame never runs twice
        t0 = time.perf_counter()
        try:
            ans = await self.wait(
                self.streams.run(t.addr, member, bundle=bundle, max_in_flight=self.machines), inp.n
            )
        except RouteError:
            # late: a hop of the route hangs (the lane relays hop to hop, so any of them). That is a
            # failed hop as on the Python path, for the caller's failover to name and replace; trying
            # the step again first would only wait for the same hop twice over (issue 33, item 7)
            self.ticket = None
            self.retry_in = LANE_RETRY_STEPS
            self.fallbacks += 1
            raise
        except (LaneError, OSError) as e:
            self.ticket = None
            self.retry_in = LANE_RETRY_STEPS
            self.fallbacks += 1
            clean = isinstance(e, LaneError) and (e.refused or e.status != 0)
            if not clean:  # the step may have run on some hops: bring every hop back to the client's length
                await self.realign(inp.pos)
            return None
        self.steps += 1
        link.rtt[0].append(time.perf_counter() - t0)
        return Response(
            step=link.next_step(),
            kind=Kind.TOKEN,
            session_len=ans.session_len,
            token=ans.token,
            logprob=ans.logprob,
            timings=[Timing(c, h) for c, h in ans.timings],
        )

    def admit_frame(self) -> bytes:
        """Op.LANE to hop 0: the hops admit the session to their lanes along the cached chain."""
        link = self.link
        return link.frame(
            0, Op.LANE, step=link.next_step(), chain_cached=len(link.hops) > 1, f16_out=link.kind == Kind.F16
        )

    async def _admit(self) -> LaneTicket | None:
        try:
            resp = await self.link.post(0, self.admit_frame())
        except RouteError:
            return None
        if resp.kind != Kind.LANE:
            return None
        lane_id, port, key = LANE_INFO.unpack(resp.payload)
        try:
            host = await ipv4_of(self.link.hops[0].url)
        except LaneError:
            return None
        return LaneTicket((host, port), lane_id, key)
