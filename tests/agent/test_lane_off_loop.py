"""A hop never waits for a lane session's step in flight on its event loop (in relay mode that step
waits for the later hops, up to the lane's downstream timeout when one hangs): NodeLane.decoding(), asked
before every chunk of a prompt, reads the sessions' activity (libggswarm v18), not their stats, which
held the loop 14-29 ms a chunk."""

from __future__ import annotations

from agent.node.lanes import LANE_ACTIVE_S, LaneSlot, NodeLane
from agent.node.metrics import NodeMetrics
from agent.node.sessions import SessionState
from agent.wire.ids import SessionId


class ActiveLane:
    """A lane whose sessions answer `activity` at once; `stats` would wait for their step in flight."""

    def __init__(self, idle_s: float, busy: bool) -> None:
        self.idle_s, self.busy, self.asked = idle_s, busy, 0

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
