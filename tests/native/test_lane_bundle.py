"""Lane bundles: several sessions' decode steps in one lane frame run as one batch on every hop and give
each session the tokens it gets alone; a bundle that fails any check is refused whole and spends no step;
an owner can wait for the lane's next step to pass, or hold it while its own work runs first."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from agent.backends.lane import NativeLane, NextHop
from agent.backends.libggswarm import NativeModel
from agent.wire.lane import (
    FRAME_HEAD,
    KIND_BUNDLE,
    BundleMember,
    Head,
    LaneAnswer,
    LaneError,
    pack_head,
    run_bundle,
    seal_bundle,
)

from .routes import close_sessions, lane_refusal, native_forward, native_greedy, open_sessions

SPLITS = ((0, 10), (10, 20), (20, 30))
PROMPTS = (
    [1, 504, 3458, 282, 4237, 314, 2],
    [1, 9690, 28, 1201, 253, 1],
    [1, 504, 3458, 282, 4237, 314, 2, 378, 2051, 30, 9, 442],
    [1, 4237],
)
N_NEW = 10


@dataclass
class Session:
    """One session of the shared route: its window sessions, lane ids and keys in hop order."""

    sids: list[int]
    ids: list[int]
    keys: list[bytes]
    prompt: list[int]
    tokens: list[int]
    step: int = 1

    def member(self) -> BundleMember:
        pos = len(self.prompt) + len(self.tokens) - 1
        m = BundleMember(self.keys[0], self.ids[0], self.step, pos, np.asarray([self.tokens[-1]]))
        self.step += 1
        return m


@dataclass
class Route:
    hops: list[NativeModel]
    lanes: list[NativeLane]
    sessions: list[Session]

    def lengths(self, i: int) -> list[int]:
        return [h.session_len(s) for h, s in zip(self.hops, self.sessions[i].sids, strict=True)]

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.lanes[0].port), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s


@pytest.fixture(scope="module")
def hops(native_lib: None, model_path: str) -> Iterator[list[NativeModel]]:
    models = [NativeModel(model_path, a, b, n_threads=2) for a, b in SPLITS]
    yield models
    for m in models:
        m.close()


@pytest.fixture(scope="module")
def alone(hops: list[NativeModel]) -> list[list[int]]:
    return [native_greedy(hops, p, N_NEW) for p in PROMPTS]


@pytest.fixture
def route(hops: list[NativeModel]) -> Iterator[Route]:
    """Every prompt prefilled by direct calls, each session admitted to the three lanes."""
    lanes = [NativeLane() for _ in hops]
    sessions = []
    for prompt in PROMPTS:
        sids = open_sessions(hops)
        tok = int(native_forward(hops, sids, 0, prompt, logits=False)["token"])
        s = Session(
            sids,
            [int.from_bytes(os.urandom(8), "little") for _ in hops],
            [os.urandom(32) for _ in hops],
            prompt,
            [tok],
        )
        for i in reversed(range(3)):
            nxt = NextHop("127.0.0.1", lanes[i + 1].port, s.ids[i + 1], s.keys[i + 1]) if i < 2 else None
            lanes[i].add(hops[i], sids[i], s.ids[i], s.keys[i], nxt)
        sessions.append(s)
    yield Route(hops, lanes, sessions)
    for lane in lanes:
        lane.close()
    for s in sessions:
        close_sessions(hops, s.sids)


def _step(r: Route, conn: socket.socket, which: list[int]) -> list[LaneAnswer | LaneError]:
    members = [r.sessions[i].member() for i in which]
    out = run_bundle(conn, members)
    for i, o in zip(which, out, strict=True):
        if isinstance(o, LaneAnswer):
            r.sessions[i].tokens.append(o.token)
    return out


def test_sessions_bundled_through_three_lanes_get_the_tokens_each_gets_alone(
    route: Route, alone: list[list[int]]
) -> None:
    t_start = time.monotonic()
    with route.connect() as conn:
        for t in range(N_NEW - 1):
            # sessions join and leave the bundle: all four, then three, and one steps alone at times
            which = [0, 1, 2, 3] if t % 3 != 2 else [0, 2, 3]
            out = _step(route, conn, which)
            for i, o in zip(which, out, strict=True):
                assert isinstance(o, LaneAnswer), o
                assert o.session_len == len(route.sessions[i].prompt) + len(route.sessions[i].tokens) - 1
                assert len(o.timings) == 3 and all(c > 0 and h >= c for c, h in o.timings)
            if t % 3 == 2:
                _step(route, conn, [1])
    for i, s in enumerate(route.sessions):
        assert s.tokens == alone[i], f"session {i}"
    # the lanes counted each session's steps, and the last window's history holds each step's input
    stats = [route.lanes[2].remove(s.ids[2]) for s in route.sessions]
    assert [st.steps for st in stats] == [N_NEW - 1] * 4
    assert [list(st.appended) for st in stats] == [s.tokens[:-1] for s in route.sessions]
    # each hop logged every bundle it computed, as one batch of its members' steps, for the telemetry
    sizes = [n for t in range(N_NEW - 1) for n in ([4] if t % 3 != 2 else [3, 1])]
    t_end = time.monotonic()
    for hop, lane in enumerate(route.lanes):
        batches, dropped = lane.take_batches()
        assert [b.steps for b in batches] == sizes and dropped == 0, hop
        assert [b.positions for b in batches] == sizes  # one position per decode step
        assert [b.sampled for b in batches] == (sizes if hop == 2 else [0] * len(sizes))
        assert all(t_start <= b.t_done <= t_end for b in batches)  # on time.monotonic()'s clock
        assert all(b.compute_s > 0 and b.wait_s >= 0 for b in batches)
        assert lane.take_batches() == ([], 0)  # taken once


def _bundle_head(count: int, payload_len: int, lane_id: int = 0) -> bytes:
    return pack_head(Head(KIND_BUNDLE, lane_id, 0, 0, count, payload_len)) + bytes(16)


def test_a_bundle_with_a_stranger_a_twin_or_a_wrong_key_is_refused_whole_and_spends_no_step(
    route: Route, alone: list[list[int]]
) -> None:
    before = [route.lengths(i) for i in range(4)]
    s0, s1 = route.sessions[0], route.sessions[1]
    good = [s0.member(), s1.member()]
    stranger = BundleMember(os.urandom(32), 12345, 1, 0, np.asarray([1]))
    forged = BundleMember(os.urandom(32), s1.ids[0], good[1].step, good[1].pos_start, good[1].ids)
    for members, why in (
        ([good[0], stranger], "unknown lane session"),
        ([good[0], good[0]], "twice in one bundle"),
        ([good[0], forged], "does not open"),
    ):
        with route.connect() as conn:
            conn.sendall(seal_bundle(members))
            assert why in lane_refusal(conn)
    assert [route.lengths(i) for i in range(4)] == before
    # nothing was spent: the very same sealed steps run now, and stay exact
    with route.connect() as conn:
        out = run_bundle(conn, good)
    assert [o.token for o in out if isinstance(o, LaneAnswer)] == [alone[0][1], alone[1][1]]


@pytest.mark.parametrize(
    ("count", "payload_len", "why"),
    [
        (0, 0, "bad bundle head"),
        (33, 33 * FRAME_HEAD, "bad bundle head"),
        (2, 10, "shorter than its members"),
    ],
)
def test_a_bundle_whose_head_does_not_fit_is_refused_before_its_members_are_read(
    route: Route, count: int, payload_len: int, why: str
) -> None:
    with route.connect() as conn:
        conn.sendall(_bundle_head(count, payload_len))
        assert why in lane_refusal(conn)


def test_a_bundle_member_that_fails_at_a_later_hop_is_taken_back_and_the_others_run(
    route: Route, alone: list[list[int]]
) -> None:
    s0, s1 = route.sessions[0], route.sessions[1]
    route.lanes[2].remove(s1.ids[2])  # the last hop no longer knows session 1: it refuses the bundle
    with route.connect() as conn:
        out = _step(route, conn, [0, 1])
    assert all(isinstance(o, LaneError) and o.hop == 2 for o in out)
    assert route.lengths(0) == [len(s0.prompt)] * 3 and route.lengths(1) == [len(s1.prompt)] * 3
    # the first two hops computed the bundle (and took it back); the last refused it unread
    assert [[b.steps for b in lane.take_batches()[0]] for lane in route.lanes] == [[2], [2], []]
    # session 0 goes on exact, alone in its bundles now; a position that does not follow fails alone
    s2 = route.sessions[2]
    with route.connect() as conn:
        s2_pos = len(s2.prompt)
        bad = BundleMember(s2.keys[0], s2.ids[0], s2.step, s2_pos + 5, np.asarray([s2.tokens[-1]]))
        s2.step += 1
        out = run_bundle(conn, [s0.member(), bad])
        assert isinstance(out[0], LaneAnswer) and out[0].token == alone[0][1]
        assert isinstance(out[1], LaneError) and out[1].hop == 0 and not out[1].refused
        assert route.lengths(2) == [s2_pos] * 3
    # a member that failed is not counted among the batch's steps
    assert [[b.steps for b in lane.take_batches()[0]] for lane in route.lanes] == [[1], [1], [1]]


def test_waiting_for_the_lanes_next_step_returns_when_one_passes_and_at_once_when_it_is_quiet(
    route: Route,
) -> None:
    lane0 = route.lanes[0]
    t0 = time.monotonic()
    assert not lane0.wait_step(5.0)  # no step ever ran: nothing to wait for
    assert time.monotonic() - t0 < 1.0
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(lane0.wait_step(5.0)))
    with route.connect() as conn:
        _step(route, conn, [0, 1])  # the lane is active now
        waiter.start()
        for _ in range(N_NEW - 2):  # steps until the waiter has seen one pass (bounded)
            if not waiter.is_alive():
                break
            _step(route, conn, [0, 1])
    waiter.join(10)
    assert got == [True]
    t0 = time.monotonic()
    assert not lane0.wait_step(0.05)  # quiet again: no step comes
    assert time.monotonic() - t0 < 1.0


def test_an_owner_holds_the_lanes_next_step_for_its_own_work_and_releases_it(route: Route) -> None:
    lane0 = route.lanes[0]
    t0 = time.monotonic()
    assert not lane0.gate(0.001)  # nothing stepped within the last millisecond: quiet, nothing held
    assert time.monotonic() - t0 < 1.0
    held: list[bool] = []
    done: list[float] = []

    with route.connect() as conn:
        _step(route, conn, [2, 3])  # the lane is active now
        owner = threading.Thread(target=lambda: held.append(lane0.gate(5.0)))
        owner.start()

        def stepping() -> None:
            for _ in range(N_NEW - 3):  # until one step arrives while the owner waits (bounded)
                if held:
                    return
                out = _step(route, conn, [2, 3])
                assert all(isinstance(o, LaneAnswer) for o in out), out
                done.append(time.monotonic())

        stepper = threading.Thread(target=stepping)
        stepper.start()
        owner.join(10)
        assert held == [True]
        # the arriving step waits for the owner: none completes while it holds it (bounded wait)
        n_held = len(done)
        stepper.join(0.3)
        assert stepper.is_alive() and len(done) == n_held
        t_release = time.monotonic()
        lane0.gate_release()
        stepper.join(30)
        assert not stepper.is_alive() and len(done) == n_held + 1 and done[-1] >= t_release
    # the held steps ran after all: every hop kept one length, and the batch log counts the wait
    assert len(set(route.lengths(2))) == 1 and len(set(route.lengths(3))) == 1
    assert max(b.wait_s for b in lane0.take_batches()[0]) >= 0.25


def test_an_owner_that_asks_again_right_after_a_release_waits_for_the_next_step(route: Route) -> None:
    """A prompt's chunk holds the lane's step for longer than its next wait's timeout; asked at once
    after the release, the gate must wait for the next step, not answer "quiet" because the last step
    that finished did so before the hold (then every later chunk ran unpaced, sized for a quiet lane)."""
    lane0 = route.lanes[0]
    stop = threading.Event()
    held: list[bool] = []

    def stepping() -> None:
        for _ in range(40):  # bounded: the owner needs two arrivals
            if stop.is_set():
                return
            _step(route, conn, [1])

    with route.connect() as conn:
        _step(route, conn, [1])  # the lane is active now
        owner = threading.Thread(target=lambda: held.append(lane0.gate(5.0)))
        owner.start()
        stepper = threading.Thread(target=stepping)
        stepper.start()
        owner.join(10)
        assert held == [True]
        time.sleep(0.6)  # the owner's own work (a chunk) while it holds the step: longer than 0.5 s
        lane0.gate_release()
        t0 = time.monotonic()
        again = lane0.gate(0.5)
        waited = time.monotonic() - t0
        if again:
            lane0.gate_release()
        stop.set()
        stepper.join(30)
        assert not stepper.is_alive()
    # held the next step, or (a loaded box whose three hops took longer) waited for it: never "quiet"
    assert again or waited >= 0.45, (
        f"asked right after its release, the gate found the lane quiet ({waited:.3f} s)"
    )


def test_a_sessions_activity_is_read_at_once_while_its_step_is_held(route: Route) -> None:
    """ggswarm_lane_activity (v18) answers while the session's step holds its lock (here held by the
    gate; in relay mode the step waits for the later hops), where ggswarm_lane_stats_get would wait."""
    lane0, lane_id = route.lanes[0], route.sessions[0].ids[0]
    held: list[bool] = []
    with route.connect() as conn:
        _step(route, conn, [0])
        idle_before, busy_before = lane0.activity(lane_id)
        assert not busy_before and 0 <= idle_before < 30
        owner = threading.Thread(target=lambda: held.append(lane0.gate(5.0)))
        owner.start()
        stepper = threading.Thread(target=lambda: [_step(route, conn, [0]) for _ in range(3)])
        stepper.start()
        owner.join(10)
        assert held == [True]
        t0 = time.monotonic()
        idle, busy = lane0.activity(lane_id)  # the held step is session 0's: it holds the session
        asked_s = time.monotonic() - t0
        lane0.gate_release()
        stepper.join(30)
        assert not stepper.is_alive()
    assert busy and asked_s < 0.1, (busy, asked_s)
    idle_after, busy_after = lane0.activity(lane_id)
    assert not busy_after and idle_after < idle_before + 30


def test_an_owner_that_never_releases_holds_the_lanes_step_for_a_bounded_time(route: Route) -> None:
    lane0 = route.lanes[0]
    held: list[bool] = []
    with route.connect() as conn:
        _step(route, conn, [2])
        owner = threading.Thread(target=lambda: held.append(lane0.gate(5.0)))
        owner.start()
        t0 = time.monotonic()
        while owner.is_alive() and time.monotonic() - t0 < 10:
            out = _step(route, conn, [2])  # the held one returns after GGSWARM_LANE_GATE_MAX_MS
            assert isinstance(out[0], LaneAnswer)
        owner.join(1)
    assert held == [True] and time.monotonic() - t0 < 5.0
