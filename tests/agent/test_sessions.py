"""The node session table: budget admission, idle-LRU eviction and TTL expiry."""

from __future__ import annotations

import pytest

from agent.backends.base import AdmissionError
from agent.node.sessions import SessionState, SessionTable
from agent.wire.ids import SessionId


class FakeBackend:
    """Stands in for a backend at the accounting seam: a fixed number of bytes per session."""

    kv_in_node_budget = False  # counted by the table, like the torch and llama.cpp backends

    def __init__(self) -> None:
        self.bytes: dict[SessionId, int] = {}

    def kv_bytes(self, sid: SessionId | None = None) -> int:
        return self.bytes.get(sid, 0) if sid is not None else sum(self.bytes.values())

    def close_session(self, sid: SessionId) -> None:
        self.bytes.pop(sid, None)


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
