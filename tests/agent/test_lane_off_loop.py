"""A hop never waits for a lane session's step in flight on its event loop (in relay mode that step
waits for the later hops, up to the lane's downstream timeout when one hangs): NodeLane.decoding(), asked
before every chunk of a prompt, reads the sessions' activity (libggswarm v18), not their stats, which
held the loop 14-29 ms a chunk."""

from __future__ import annotations

import pytest

from agent.backends.lane import LaneBatch
from agent.node.lanes import LANE_ACTIVE_S, LaneSlot, NodeLane
from agent.node.metrics import NodeMetrics
from agent.node.sessions import SessionState
from agent.wire.ids import SessionId


class ActiveLane:
    """A lane whose sessions answer `activity` at once; `stats` would wait for their step in flight.
    Its batch log holds `batches` until taken."""

    def __init__(self, idle_s: float, busy: bool, batches: list[LaneBatch] | None = None) -> None:
        self.idle_s, self.busy, self.asked = idle_s, busy, 0
        self.batches = batches or []

    def take_batches(self) -> tuple[list[LaneBatch], int]:
        out, self.batches = self.batches, []
        return out, 0

    def activity(self, lane_id: int) -> tuple[float, bool]:
        self.asked += 1
        return self.idle_s, self.busy

    def stats(self, lane_id: int) -> object:
        raise AssertionError("the loop asked a lane session's stats, which wait for its step in flight")


def _node_lane(lane: ActiveLane, sessions: int = 2) -> NodeLane:
    nl = NodeLane(NodeMetrics(dict), {"tokens_in": 0, "tokens_out": 0}, hops=None)  # type: ignore[arg-type]
    nl._lane = lane  # type: ignore[assignment]
    for i in range(sessions):
        s = SessionState(sid=SessionId(bytes([i]) * 16), shard_key=("m", 0, 30), backend=None, capacity=64)  # type: ignore[arg-type]
        s.lane = LaneSlot(lane, i, nl)  # type: ignore[arg-type]
        nl._laned[s.key] = s
    return nl


def test_a_lane_session_with_a_step_in_flight_is_decoding_and_its_stats_are_not_asked() -> None:
    lane = ActiveLane(idle_s=60.0, busy=True)
    assert _node_lane(lane).decoding() and lane.asked == 1


def test_a_lane_session_that_stepped_lately_is_decoding_and_one_that_sat_there_is_not() -> None:
    assert _node_lane(ActiveLane(idle_s=LANE_ACTIVE_S / 2, busy=False)).decoding()
    sitting = ActiveLane(idle_s=LANE_ACTIVE_S + 1, busy=False)
    assert not _node_lane(sitting).decoding() and sitting.asked == 2  # every session asked


def test_a_lane_with_nobody_on_it_is_not_decoding() -> None:
    assert not _node_lane(ActiveLane(idle_s=0.0, busy=True), sessions=0).decoding()


def _done_at(*t_done: float) -> list[LaneBatch]:
    return [LaneBatch(t, wait_s=0.0, compute_s=0.005, steps=4, positions=4, sampled=4) for t in t_done]


def test_the_lanes_gap_between_passes_comes_from_its_batch_log_and_leaves_pauses_out() -> None:
    """The pacer's first wait for the lane's step (before it has measured the decoders' period) is a few
    of these gaps: slow decoders are still held, and a prompt beside decoders that just stopped is not
    held long (docs/lane.md)."""
    lane = ActiveLane(idle_s=0.0, busy=True, batches=_done_at(10.0, 10.03, 10.06, 10.09))
    nl = _node_lane(lane)
    assert nl.pass_gap_s is None and nl.decoding()  # asked before a chunk: the log is read
    assert nl.pass_gap_s == pytest.approx(0.03)
    lane.batches = _done_at(40.0, 40.2)  # a pause of 30 s between answers, then passes 0.2 s apart
    nl.take_batches()
    assert nl.pass_gap_s == pytest.approx(0.7 * 0.03 + 0.3 * 0.2)
