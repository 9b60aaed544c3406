"""The decode lane: a route's decode steps relayed by libggswarm's own threads give the tokens of direct
calls, and every frame that is not the session's (wrong key, replayed, oversized, unknown) changes nothing."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from agent.backends.lane import NativeLane, NextHop
from agent.backends.libggswarm import NativeModel, sampling_struct
from agent.wire.lane import (
    FRAME_HEAD,
    KIND_IDS,
    DirectLaneClient,
    Head,
    LaneClient,
    LaneError,
    LaneHop,
    pack_head,
    seal_request,
)

from .routes import close_sessions, lane_refusal, native_forward, native_greedy, open_sessions

SPLITS = ((0, 10), (10, 20), (20, 30))
PROMPT = [1, 504, 3458, 282, 4237, 314, 2]
N_NEW = 12


@dataclass
class Route:
    """Three windows, each with its own lane, and one session of a route admitted to them."""

    hops: list[NativeModel]
    lanes: list[NativeLane]
    sids: list[int]
    ids: list[int]  # lane ids, in hop order
    keys: list[bytes]

    def admit(self, first_step: int = 1, sampling=None, history=None, direct: bool = False) -> None:  # noqa: ANN001
        for i in reversed(range(3)):
            nxt = None
            if i < 2:
                nxt = NextHop("127.0.0.1", self.lanes[i + 1].port, self.ids[i + 1], self.keys[i + 1])
            last = i == 2
            self.lanes[i].add(
                self.hops[i],
                self.sids[i],
                self.ids[i],
                self.keys[i],
                nxt,
                sampling=sampling if last else None,
                history=history if last else None,
                first_step=first_step,
                direct=direct,
            )

    def client(self, first_step: int = 1) -> LaneClient:
        return LaneClient("127.0.0.1", self.lanes[0].port, self.ids[0], self.keys[0], first_step)

    def direct_client(self) -> DirectLaneClient:
        return DirectLaneClient(
            [
                LaneHop("127.0.0.1", lane.port, i, k)
                for lane, i, k in zip(self.lanes, self.ids, self.keys, strict=True)
            ]
        )

    def direct_client_without_last(self) -> DirectLaneClient:
        """Subscribed to hops 0 and 1 only (hop 2 no longer knows the session)."""
        return DirectLaneClient(
            [
                LaneHop("127.0.0.1", lane.port, i, k)
                for lane, i, k in zip(self.lanes[:2], self.ids, self.keys, strict=False)
            ],
            first_step=100,  # the first client's subscription and steps spent the numbers below
        )

    def lengths(self) -> list[int]:
        return [h.session_len(s) for h, s in zip(self.hops, self.sids, strict=True)]


@pytest.fixture(scope="module")
def hops(native_lib: None, model_path: str) -> Iterator[list[NativeModel]]:
    models = [NativeModel(model_path, a, b, n_threads=2) for a, b in SPLITS]
    yield models
    for m in models:
        m.close()


@pytest.fixture
def route(hops: list[NativeModel]) -> Iterator[Route]:
    lanes = [NativeLane() for _ in hops]
    sids = open_sessions(hops)
    r = Route(
        hops,
        lanes,
        sids,
        [int.from_bytes(os.urandom(8), "little") for _ in hops],
        [os.urandom(32) for _ in hops],
    )
    yield r
    for lane in lanes:
        lane.close()
    close_sessions(hops, sids)


def _prefill(r: Route) -> int:
    """The prompt through direct calls (prompts stay off the lane); the first generated token."""
    return int(native_forward(r.hops, r.sids, 0, PROMPT, logits=False)["token"])


def _decode(client: LaneClient | DirectLaneClient, got: list[int]) -> None:
    """N_NEW - 1 decode steps over the lane after `got`'s first token, each answer checked; closes it."""
    for _ in range(N_NEW - 1):
        pos = len(PROMPT) + len(got) - 1
        ans = client.run(pos, np.asarray([got[-1]]))
        assert ans.session_len == pos + 1
        assert len(ans.timings) == 3 and all(c > 0 and h >= c for c, h in ans.timings)
        got.append(ans.token)
    client.close()


def test_a_route_decoded_over_lanes_gives_the_tokens_of_direct_calls(
    route: Route, hops: list[NativeModel]
) -> None:
    want = native_greedy(hops, PROMPT, N_NEW + 4)
    got = [_prefill(route)]
    route.admit()
    client = route.client()
    _decode(client, got)
    assert route.lengths() == [len(PROMPT) + N_NEW - 1] * 3
    # off the lane again, the session goes on by direct calls where the lane left it
    stats = [lane.remove(i) for lane, i in zip(route.lanes, route.ids, strict=True)]
    assert [s.steps for s in stats] == [N_NEW - 1] * 3
    # each lone step is logged on each hop as a batch of one; the last hop sampled its token
    for hop, lane in enumerate(route.lanes):
        batches, dropped = lane.take_batches()
        assert [(b.steps, b.positions, b.sampled) for b in batches] == [(1, 1, int(hop == 2))] * (N_NEW - 1)
        assert dropped == 0 and all(b.compute_s > 0 for b in batches)
    assert list(stats[2].appended) == got[:-1]  # the last window's history: each step's input id
    while len(got) < N_NEW + 4:
        got.append(
            int(native_forward(hops, route.sids, len(PROMPT) + len(got) - 1, [got[-1]], False)["token"])
        )
    assert got == want


def test_a_route_with_a_repetition_penalty_samples_as_direct_calls_do(
    route: Route, hops: list[NativeModel]
) -> None:
    samp = sampling_struct(temperature=0.8, top_k=40, repeat_penalty=1.3, repeat_last_n=16, seed=7)
    sids = open_sessions(hops)
    try:  # the direct reference: the last window gets the history its penalty reads
        hist = list(PROMPT)
        x = native_forward(hops[:2], sids[:2], 0, PROMPT, logits=False)["hidden"]
        want = [int(hops[2].forward(sids[2], 0, hidden=x, sampling=samp, history=np.asarray(hist))["token"])]
        for _ in range(N_NEW - 1):
            pos = len(PROMPT) + len(want) - 1
            hist.append(want[-1])
            x = native_forward(hops[:2], sids[:2], pos, [want[-1]], logits=False)["hidden"]
            want.append(
                int(hops[2].forward(sids[2], pos, hidden=x, sampling=samp, history=np.asarray(hist))["token"])
            )
    finally:
        close_sessions(hops, sids)
    x = native_forward(route.hops[:2], route.sids[:2], 0, PROMPT, logits=False)["hidden"]
    got = [
        int(hops[2].forward(route.sids[2], 0, hidden=x, sampling=samp, history=np.asarray(PROMPT))["token"])
    ]
    route.admit(sampling=samp, history=PROMPT)
    client = route.client()
    for _ in range(N_NEW - 1):
        got.append(client.run(len(PROMPT) + len(got) - 1, np.asarray([got[-1]])).token)
    client.close()
    assert got == want


def _raw(r: Route) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", r.lanes[0].port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def test_a_frame_sealed_with_another_key_is_refused_and_changes_nothing(route: Route) -> None:
    tok = _prefill(route)
    route.admit()
    before = route.lengths()
    with _raw(route) as s:
        s.sendall(seal_request(os.urandom(32), route.ids[0], 1, before[0], np.asarray([tok])))
        assert "does not open" in lane_refusal(s)
    frame = bytearray(seal_request(route.keys[0], route.ids[0], 1, before[0], np.asarray([tok])))
    frame[-1] ^= 1  # one flipped payload bit
    with _raw(route) as s:
        s.sendall(bytes(frame))
        assert "does not open" in lane_refusal(s)
    assert route.lengths() == before
    frame[-1] ^= 1
    frame[24] ^= 1  # the position, which the tag covers
    with _raw(route) as s:
        s.sendall(bytes(frame))
        assert "does not open" in lane_refusal(s)
    assert route.lengths() == before
    # the session itself is untouched: its own key still runs step 1
    client = route.client()
    assert client.run(before[0], np.asarray([tok])).session_len == before[0] + 1
    client.close()


def test_a_replayed_step_is_refused_and_runs_once(route: Route) -> None:
    tok = _prefill(route)
    route.admit()
    pos = route.lengths()[0]
    frame = seal_request(route.keys[0], route.ids[0], 1, pos, np.asarray([tok]))
    with _raw(route) as s:
        s.sendall(frame)
        s.recv(4096)
    assert route.lengths() == [pos + 1] * 3
    with _raw(route) as s:
        s.sendall(frame)
        assert "stale or replayed" in lane_refusal(s)
    assert route.lengths() == [pos + 1] * 3


@pytest.mark.parametrize(
    ("n_tokens", "payload_len", "why"),
    [(1, 1 << 31, "payload size"), (65, 65 * 4, "bad position count"), (0, 0, "bad position count")],
)
def test_a_frame_whose_sizes_do_not_fit_is_refused_before_its_payload_is_read(
    route: Route, n_tokens: int, payload_len: int, why: str
) -> None:
    _prefill(route)
    route.admit()
    head = pack_head(Head(KIND_IDS, route.ids[0], 1, len(PROMPT), n_tokens, payload_len)) + bytes(16)
    with _raw(route) as s:
        s.sendall(head)  # no payload follows: the refusal comes from the header alone
        assert why in lane_refusal(s)
    assert route.lengths() == [len(PROMPT)] * 3


def test_an_unknown_lane_session_and_a_foreign_protocol_are_refused(route: Route) -> None:
    with _raw(route) as s:
        s.sendall(seal_request(os.urandom(32), 12345, 1, 0, np.asarray([1])))
        assert "unknown lane session" in lane_refusal(s)
    with _raw(route) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(FRAME_HEAD))
        assert "not a lane frame" in lane_refusal(s)


def test_a_failure_at_a_later_hop_leaves_every_hop_at_its_previous_length(route: Route) -> None:
    tok = _prefill(route)
    route.admit()
    route.lanes[2].remove(route.ids[2])  # the last hop no longer knows the session
    client = route.client()
    with pytest.raises(LaneError) as e:
        client.run(len(PROMPT), np.asarray([tok]))
    client.close()
    assert e.value.hop == 2 and "unknown lane session" in str(e.value)
    assert route.lengths() == [len(PROMPT)] * 3  # hops 1 and 2 took their step back


def test_a_position_that_does_not_follow_fails_at_the_first_hop(route: Route) -> None:
    tok = _prefill(route)
    route.admit()
    client = route.client()
    with pytest.raises(LaneError) as e:
        client.run(len(PROMPT) + 3, np.asarray([tok]))
    assert e.value.hop == 0 and e.value.status < 0 and not e.value.refused
    # the connection and the session go on: the right position runs next
    assert client.run(len(PROMPT), np.asarray([tok])).session_len == len(PROMPT) + 1
    client.close()


def test_direct_calls_on_another_session_of_the_same_windows_stay_exact_while_the_lane_runs(
    route: Route, hops: list[NativeModel]
) -> None:
    want = native_greedy(hops, PROMPT, N_NEW)
    got = [_prefill(route)]
    route.admit()
    other: list[int] = []
    errors: list[BaseException] = []

    def direct() -> None:  # the caller's thread on the same handles, as a node's Python path does
        try:
            other.extend(native_greedy(hops, PROMPT, N_NEW))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=direct)
    t.start()
    client = route.client()
    for _ in range(N_NEW - 1):
        got.append(client.run(len(PROMPT) + len(got) - 1, np.asarray([got[-1]])).token)
    client.close()
    t.join(timeout=120)
    assert not errors and got == want and other == want


def test_closing_a_lane_with_an_idle_connection_returns(hops: list[NativeModel]) -> None:
    lane = NativeLane()
    s = socket.create_connection(("127.0.0.1", lane.port), timeout=5)
    done = threading.Event()
    threading.Thread(target=lambda: (lane.close(), done.set()), daemon=True).start()
    assert done.wait(10)
    try:
        got = s.recv(16)
    except ConnectionResetError:  # closed before the lane accepted it: the listener's close resets it
        got = b""
    assert got == b""  # the lane shut its side (and sent nothing)
    s.close()


def test_a_lane_refuses_a_bad_address_and_a_window_without_its_next_hop(hops: list[NativeModel]) -> None:
    from agent.backends.libggswarm import NativeError

    with pytest.raises(NativeError, match="numeric IPv4"):
        NativeLane("localhost")
    lane = NativeLane()
    sid = hops[0].open_session(64)
    try:
        with pytest.raises(NativeError, match="next hop"):
            lane.add(hops[0], sid, 1, os.urandom(32), None)
        with pytest.raises(ValueError, match="32 bytes"):
            lane.add(hops[2], sid, 1, b"short", None)
    finally:
        hops[0].close_session(sid)
        lane.close()


def test_in_direct_mode_the_last_hop_answers_the_client_with_every_hops_timing(
    route: Route, hops: list[NativeModel]
) -> None:
    want = native_greedy(hops, PROMPT, N_NEW)
    got = [_prefill(route)]
    route.admit(direct=True)
    client = route.direct_client()
    _decode(client, got)
    assert got == want
    assert route.lengths() == [len(PROMPT) + N_NEW - 1] * 3


def test_in_direct_mode_a_later_hops_refusal_or_failure_reaches_the_client(route: Route) -> None:
    tok = _prefill(route)
    route.admit(direct=True)
    client = route.direct_client()
    # hop 2 fails the step itself (its session is one position short): it tells the client directly
    route.hops[2].truncate(route.sids[2], len(PROMPT) - 1)
    with pytest.raises(LaneError) as e:
        client.run(len(PROMPT), np.asarray([tok]))
    assert e.value.hop == 0 and e.value.status < 0  # hop 0 of the error's sender, hop 2's own failure
    client.close()
    # hop 2 forgets the session: hop 1 reports the refusal it gets, on hop 1's subscription
    route.lanes[2].remove(route.ids[2])
    client = route.direct_client_without_last()
    with pytest.raises(LaneError, match="refused"):
        client.run(len(PROMPT) + 1, np.asarray([tok]))
    client.close()
