"""The node session table: budget admission, idle-LRU eviction and TTL expiry."""

from __future__ import annotations

import pytest

from agent.backends.base import AdmissionError
from agent.node.sessions import SessionState, SessionTable
from agent.wire.ids import SessionId


class FakeBackend:
    """Stands in for a backend at the accounting seam: a fixed number of bytes per session, and
    checkpoint bytes per session that it gives back on demand (as libggswarm's handles do)."""

    kv_in_node_budget = False  # counted by the table, like the torch and llama.cpp backends

    def __init__(self) -> None:
        self.bytes: dict[SessionId, int] = {}
        self.checkpoints: dict[SessionId, int] = {}

    def kv_bytes(self, sid: SessionId | None = None) -> int:
        if sid is None:
            return sum(self.bytes.values()) + sum(self.checkpoints.values())
        return self.bytes.get(sid, 0) + self.checkpoints.get(sid, 0)

    def close_session(self, sid: SessionId) -> None:
        self.bytes.pop(sid, None)
        self.checkpoints.pop(sid, None)

    def reclaimable_bytes(self) -> int:
        return sum(self.checkpoints.values())

    def reclaim(self, want: int) -> int:
        freed = 0
        for sid in list(self.checkpoints):
            if freed >= want:
                break
            freed += self.checkpoints.pop(sid)
        return freed


SHARD = ("m", 0, 1)


def key(name: bytes) -> tuple[SessionId, tuple[str, int, int]]:
    return (SessionId(name * 16), SHARD)


def add(
    table: SessionTable, be: FakeBackend, name: bytes, nbytes: int, shard: tuple[str, int, int] = SHARD
) -> SessionState:
    sid = SessionId(name * 16)
    st = SessionState(sid=sid, shard_key=shard, backend=be, capacity=10)  # type: ignore[arg-type]
    table.admit(st, nbytes)
    be.bytes[sid] = nbytes
    table.add(st)
    return st


def test_admission_evicts_the_least_recently_used_idle_session() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100)
    add(table, be, b"a", 40)
    add(table, be, b"b", 40)
    table.get(key(b"a"))  # a is now more recent than b
    add(table, be, b"c", 40)
    assert key(b"b") not in table and key(b"a") in table
    assert table.evictions == 1 and table.used_bytes() == 80 and table.remaining_bytes() == 20


def test_busy_sessions_are_never_evicted_and_the_request_is_refused() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100)
    a = add(table, be, b"a", 60)
    a.busy = True
    with pytest.raises(AdmissionError, match="budget"):
        add(table, be, b"b", 60)
    assert key(b"a") in table


def test_idle_sessions_expire_after_the_ttl() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100, ttl_s=10)
    st = add(table, be, b"a", 10)
    assert table.expire(now=st.last_used + 5) == 0
    assert table.expire(now=st.last_used + 11) == 1
    assert len(table) == 0 and be.kv_bytes() == 0


def test_one_session_id_on_two_shards_of_a_node_is_two_sessions() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100)
    sid = SessionId(b"s" * 16)
    for shard in (("m", 0, 15), ("m", 15, 30)):
        table.add(SessionState(sid=sid, shard_key=shard, backend=be, capacity=10))  # type: ignore[arg-type]
    assert len(table) == 2
    table.close((sid, ("m", 0, 15)))
    assert (sid, ("m", 15, 30)) in table and len(table) == 1


def test_a_request_that_cannot_fit_even_after_evicting_everything_evicts_nobody() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100)
    add(table, be, b"a", 40)
    with pytest.raises(AdmissionError, match="budget"):
        add(table, be, b"b", 120)
    assert key(b"a") in table and table.evictions == 0


def test_admission_never_evicts_the_same_session_on_the_node_s_other_shard() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100)
    add(table, be, b"a", 50, shard=("m", 0, 15))
    with pytest.raises(AdmissionError, match="budget"):
        add(table, be, b"a", 60, shard=("m", 15, 30))  # its first half is idle, but it is the same route
    assert (SessionId(b"a" * 16), ("m", 0, 15)) in table and table.evictions == 0


def test_a_vetoed_session_is_neither_evicted_nor_expired() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100, ttl_s=10)
    a = add(table, be, b"a", 60)
    with pytest.raises(AdmissionError, match="budget"):
        table.admit(SessionState(SessionId(b"b" * 16), SHARD, be, 10), 60, evictable=lambda s: False)  # type: ignore[arg-type]
    assert table.expire(now=a.last_used + 11, evictable=lambda s: False) == 0
    assert key(b"a") in table


def test_admission_takes_back_checkpoints_before_it_evicts_a_session() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100)
    add(table, be, b"a", 40)
    be.checkpoints[SessionId(b"a" * 16)] = 30  # a cache of free room, not the session's state
    add(table, be, b"b", 40)  # 40 + 30 + 40 > 100: it fits only without a's checkpoints
    assert key(b"a") in table and key(b"b") in table
    assert table.evictions == 0 and table.checkpoints_reclaimed == 30
    assert be.reclaimable_bytes() == 0 and table.used_bytes() == 80


def test_checkpoints_that_would_not_make_room_are_kept_and_the_request_refused() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100)
    a = add(table, be, b"a", 40)
    be.checkpoints[a.sid] = 30
    a.busy = True  # cannot be evicted: only its checkpoints could go, and 30 free + 30 are not 70
    with pytest.raises(AdmissionError, match="budget"):
        add(table, be, b"b", 70)
    assert be.checkpoints[a.sid] == 30 and table.checkpoints_reclaimed == 0


def test_checkpoints_of_a_computing_shard_are_left_alone() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100)
    add(table, be, b"a", 40)
    be.checkpoints[SessionId(b"a" * 16)] = 30
    st = SessionState(sid=SessionId(b"b" * 16), shard_key=SHARD, backend=be, capacity=10)  # type: ignore[arg-type]
    with pytest.raises(AdmissionError, match="budget"):
        table.admit(st, 40, evictable=lambda s: False)  # every shard busy: no checkpoint, no session
    assert be.reclaimable_bytes() == 30


class Seat:
    """A session's seat on the node's lane, where its decode steps bypass the table: how long ago it
    last stepped there and whether a step runs now, as the lane answers (without waiting)."""

    def __init__(self, idle_s: float, busy: bool = False) -> None:
        self.idle_s, self.busy = idle_s, busy

    def activity(self) -> tuple[float, bool]:
        return self.idle_s, self.busy

    def take_off(self, s: SessionState) -> None:
        s.lane = None


def test_admission_evicts_an_idle_session_before_one_that_decodes_on_the_lane() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100)
    laned = add(table, be, b"a", 40)  # joined the lane first, untouched by the table since
    laned.last_used -= 100
    laned.lane = Seat(idle_s=0.01)  # but it stepped there 10 ms ago: between two steps of an answer
    idle = add(table, be, b"b", 40)
    idle.last_used -= 50
    add(table, be, b"c", 40)
    assert key(b"a") in table and key(b"b") not in table and table.evictions == 1


def test_a_session_whose_lane_step_runs_is_never_evicted_or_expired() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100, ttl_s=10)
    running = add(table, be, b"a", 60)
    running.last_used -= 1000
    running.lane = Seat(idle_s=1000.0, busy=True)
    with pytest.raises(AdmissionError, match="budget"):
        add(table, be, b"b", 60)
    assert table.expire(now=running.last_used + 2000) == 0
    assert key(b"a") in table and table.evictions == 0


def test_a_lane_session_idle_there_too_expires_and_leaves_the_lane() -> None:
    be, table = FakeBackend(), SessionTable(budget_bytes=100, ttl_s=10)
    stepping, sitting = add(table, be, b"a", 10), add(table, be, b"b", 10)
    for s, idle_s in ((stepping, 5.0), (sitting, 60.0)):
        s.last_used -= 100  # the table's own use: long ago
        s.lane = Seat(idle_s)
    assert table.expire() == 1  # lane steps count as use: 5 s ago is within the TTL, 60 s is not
    assert key(b"a") in table and key(b"b") not in table and sitting.lane is None
