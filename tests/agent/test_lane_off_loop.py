"""A hop's event loop never waits for a lane session's step in flight (in relay mode that step waits for
the later hops, up to the lane's downstream timeout when one hangs): NodeLane.decoding(), asked before
every chunk of a prompt, answers from the lane's batch log while the lane computes (the loop was held
14-29 ms a chunk), and the sweep reads lane sessions' idle times in a worker thread."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from agent.backends.lane import LaneBatch, LaneStats
from agent.node.dataplane import DataPlane
from agent.node.lanes import LANE_ACTIVE_S, LaneSlot, NodeLane
from agent.node.metrics import NodeMetrics
from agent.node.sessions import SessionState
from agent.wire.ids import SessionId


class LoggedLane:
    """A lane whose batch log holds `batches` and whose sessions' stats count every ask (in the library
    an ask waits while the session's step is in flight)."""

    def __init__(self, batches: list[LaneBatch], busy: bool) -> None:
        self.batches, self.busy, self.stats_asked = batches, busy, 0

    def take_batches(self) -> tuple[list[LaneBatch], int]:
        out, self.batches = self.batches, []
        return out, 0

    def stats(self, lane_id: int) -> LaneStats:
        self.stats_asked += 1
        return LaneStats(steps=4, next_step=5, idle_s=0.0 if self.busy else 60.0, busy=self.busy)


def _node_lane(lane: LoggedLane, sessions: int = 2) -> NodeLane:
    nl = NodeLane(NodeMetrics(dict), {"tokens_in": 0, "tokens_out": 0}, hops=None)  # type: ignore[arg-type]
    nl._lane = lane  # type: ignore[assignment]
    for i in range(sessions):
        s = SessionState(sid=i, shard_key=("m", 0, 30), backend=None, capacity=64)  # type: ignore[arg-type]
        s.lane = LaneSlot(lane, i, nl)  # type: ignore[arg-type]
        nl._laned[s.key] = s
    return nl


def _batch(ago_s: float) -> LaneBatch:
    return LaneBatch(time.monotonic() - ago_s, wait_s=0.0, compute_s=0.01, steps=2, positions=2, sampled=2)


def test_a_lane_that_computed_lately_is_decoding_without_asking_its_sessions() -> None:
    lane = LoggedLane([_batch(0.2), _batch(0.05)], busy=True)
    nl = _node_lane(lane)
    assert nl.decoding() and nl.decoding()  # the second ask finds the log empty: the batch seen counts
    assert lane.stats_asked == 0
    assert nl.counters["lane_steps"] == 4  # the batches read were counted, not lost


def test_a_lane_that_computed_nothing_lately_asks_its_sessions_for_a_step_still_in_flight() -> None:
    busy = LoggedLane([_batch(LANE_ACTIVE_S + 1)], busy=True)
    assert _node_lane(busy).decoding() and busy.stats_asked == 1  # one long step: it still decodes
    idle = LoggedLane([_batch(LANE_ACTIVE_S + 1)], busy=False)
    assert not _node_lane(idle).decoding() and idle.stats_asked == 2  # both sat there: not decoding


def test_a_lane_with_nobody_on_it_is_not_decoding_whatever_it_computed() -> None:
    lane: Any = LoggedLane([_batch(0.01)], busy=True)
    assert not _node_lane(lane, sessions=0).decoding()


class InFlightSeat:
    """A session's lane seat whose step is in flight: its idle time comes once the step is let go."""

    def __init__(self) -> None:
        self.asked_from: list[int] = []
        self.go = threading.Event()

    def idle_s(self) -> float:
        self.asked_from.append(threading.get_ident())
        self.go.wait(10)
        return 0.0

    def take_off(self, s: SessionState) -> None:
        raise AssertionError("a session that just stepped on the lane was expired")


async def test_the_sweep_reads_a_lane_sessions_idle_time_off_the_event_loop(signing_key: Any) -> None:
    dp = DataPlane("node-a", signing_key.public_key())
    s = SessionState(sid=SessionId(b"a" * 16), shard_key=("m", 0, 30), backend=None, capacity=8)  # type: ignore[arg-type]
    s.last_used = time.monotonic() - dp.sessions.ttl_s - 5  # idle on the Python path, stepping on the lane
    s.lane = seat = InFlightSeat()
    dp.sessions.add(s)
    sweep = asyncio.ensure_future(dp.sweep())
    deadline = time.monotonic() + 10
    while not seat.asked_from:  # this loop runs meanwhile: nothing holds it
        assert time.monotonic() < deadline, "the sweep never asked the lane"
        await asyncio.sleep(0.01)
    assert seat.asked_from == [seat.asked_from[0]] and seat.asked_from[0] != threading.get_ident()
    seat.go.set()
    assert await sweep == 0
    assert dp.sessions.get(s.key) is s and time.monotonic() - s.last_used < 5  # its lane steps counted
