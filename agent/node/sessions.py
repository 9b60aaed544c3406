"""Per-node session table: the node's one KV budget, admission, idle-LRU eviction, TTL expiry, step state."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from agent import defaults
from agent.backends.base import AdmissionError, Backend, StepInput
from agent.wire.frames import ChainHop
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams

if TYPE_CHECKING:
    from agent.backends.libggswarm import NativeBudget


class LaneSeat(Protocol):
    """A session's place on the node's decode lane, as the table uses it (lanes.py's LaneSlot): the
    table closes, evicts and expires sessions, so it must take them off and know how recently they
    stepped there (`activity`: idle seconds and whether a step runs now, answered without waiting)."""

    def take_off(self, s: SessionState) -> None: ...

    def activity(self) -> tuple[float, bool]: ...


@dataclass
class Verification:
    """A session's latest verification step: where it began and its inputs, kept so that a cut back
    into it is exact even where the state is recurrent (the rows after the checkpoint run again)."""

    pos: int
    end: int  # the position after its last row
    step: StepInput
    checkpoint: bool = False  # the hop took a checkpoint at `pos` for it (dropped once it is settled)


@dataclass
class SessionState:
    """One session as this node sees it: which shard holds its KV, and what was last applied."""

    sid: SessionId
    shard_key: ShardKey
    backend: Backend
    capacity: int
    last_step: int = 0
    last_digest: bytes = b""
    last_output: bytes = b""  # this hop's response for `last_step` if small (replayed on retry)
    retry_pos: int = -1  # where `last_step` began: a retry whose answer was not kept recomputes from here
    retry_history: int = 0  # len(history) before `last_step`
    history: list[int] = field(default_factory=list)  # input ids, kept on the last shard for penalties
    sampling: SamplingParams | None = None  # sent once per change, not with every decode frame
    chain: list[ChainHop] | None = None  # next hops (chain mode), sent once per route, not per step
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    lane: LaneSeat | None = None  # its decode steps run on the node's native lane (agent/node/lanes.py)
    # its latest speculative verification step (agent/node/verify.py), while a cut back into it is open
    verify: Verification | None = None
    # the last shard's MTP drafts after each of its steps (asked at OPEN; 0 where the backend has no head)
    mtp_draft: int = 0

    @property
    def key(self) -> SessionKey:
        return (self.sid, self.shard_key)


ShardKey = tuple[str, int, int]  # (model sha256, layer_start, layer_end)
# A route may pass twice through one node (two ranges on it), so a session is keyed by id *and* shard.
SessionKey = tuple[SessionId, ShardKey]


class SessionTable:
    """Owns every session on the node and the node's one KV byte budget.

    Native shards keep their KV inside libggswarm, which charges it to one budget object shared by all
    of them (native_budget()); the table reads that budget rather than estimating. Other backends'
    sessions are added up here, against the same total.
    """

    def __init__(self, budget_bytes: int, ttl_s: float = defaults.SESSION_TTL_S) -> None:
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._sessions: OrderedDict[SessionKey, SessionState] = OrderedDict()
        self._native: NativeBudget | None = None
        self.evictions = 0
        self.checkpoints_reclaimed = 0  # bytes of checkpoints taken back to admit work
        self.expirations = 0

    def native_budget(self) -> NativeBudget:
        """The node budget inside libggswarm, for every native shard of the node (made with the first)."""
        if self._native is None:
            from agent.backends.libggswarm import NativeBudget

            self._native = NativeBudget(self.budget_bytes)
        return self._native

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, sid: object) -> bool:
        return sid in self._sessions

    def get(self, key: SessionKey) -> SessionState | None:
        s = self._sessions.get(key)
        if s is not None:
            s.last_used = time.monotonic()
            self._sessions.move_to_end(key)
        return s

    def add(self, state: SessionState) -> None:
        self._sessions[state.key] = state

    def close(self, key: SessionKey) -> bool:
        s = self._sessions.pop(key, None)
        if s is None:
            return False
        if s.lane is not None:  # off the lane first: its threads must not run a step of a closed session
            s.lane.take_off(s)
        s.backend.close_session(s.sid)
        return True

    def used_bytes(self) -> int:
        """KV bytes held on the node: libggswarm's count for native shards, plus the other backends'."""
        native = self._native.used if self._native is not None else 0
        return native + sum(
            s.backend.kv_bytes(s.sid) for s in self._sessions.values() if not s.backend.kv_in_node_budget
        )

    def retry_bytes(self) -> int:
        """Bytes of stored answers kept for retries (each at most dataplane.RETRY_CACHE_MAX)."""
        return sum(len(s.last_output) for s in self._sessions.values())

    def remaining_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_bytes())

    def free_bytes(self) -> int:
        """What admission may still grant: the budget less KV and the stored retry answers."""
        return max(0, self.budget_bytes - self.used_bytes() - self.retry_bytes())

    def admit(
        self,
        state: SessionState,
        extra_bytes: int,
        evictable: Callable[[SessionState], bool] = lambda s: True,
    ) -> None:
        """Make room for `extra_bytes` more KV for `state`: first from the checkpoints of idle shards'
        sessions (a cache of free room, docs/native.md "Checkpoints"), then by evicting idle sessions least
        recently used first; else refuse with AdmissionError. `evictable` may veto a victim or a shard
        to take checkpoints from (its shard is computing).
        """
        if extra_bytes <= 0 or self.free_bytes() >= extra_bytes:
            return
        # checkpoints only borrow free room, so they go first (a lost one costs a re-prefill on a later
        # edit, never an answer): those of shards that are idle now, one backend per shard
        caches = {id(v.backend): v.backend for v in self._sessions.values() if evictable(v)}
        # never the session's own other shards: evicting half of a route to admit its other half
        # would only break the route; least recently used first, lane steps counted as use
        on_lane = self._lane_use()
        victims = [
            k
            for k, v in sorted(self._sessions.items(), key=lambda kv: kv[1].last_used)
            if v.sid != state.sid and not v.busy and k not in on_lane and evictable(v)
        ]
        if (
            self.free_bytes() + sum(b.reclaimable_bytes() for b in caches.values()) + self._freeable(victims)
            < extra_bytes
        ):  # (victims' bytes include their checkpoints: an upper bound)
            raise AdmissionError(self._refusal(extra_bytes))  # nothing would make room: lose nothing
        for b in caches.values():
            if self.free_bytes() >= extra_bytes:
                return
            self.checkpoints_reclaimed += b.reclaim(extra_bytes - self.free_bytes())
        if self.free_bytes() >= extra_bytes:
            return
        if self.free_bytes() + self._freeable(victims) < extra_bytes:
            # Even evicting every idle session would not make room: refuse, and evict nobody for nothing.
            raise AdmissionError(self._refusal(extra_bytes))
        for key in victims:
            if self.free_bytes() >= extra_bytes:
                break
            self.close(key)
            self.evictions += 1
        if self.free_bytes() < extra_bytes:
            raise AdmissionError(self._refusal(extra_bytes))

    def _freeable(self, keys: list[SessionKey]) -> int:
        """What closing these sessions would give back: their KV (checkpoints included) and stored answers."""
        return sum(
            self._sessions[k].backend.kv_bytes(self._sessions[k].sid) + len(self._sessions[k].last_output)
            for k in keys
        )

    def _refusal(self, extra_bytes: int) -> str:
        return (
            f"KV budget exhausted: {extra_bytes} more bytes needed, "
            f"{self.used_bytes()} of the node's {self.budget_bytes} bytes in use"
        )

    def expire(
        self, now: float | None = None, evictable: Callable[[SessionState], bool] = lambda s: True
    ) -> int:
        """Close the idle sessions unused for longer than the TTL (and not vetoed by `evictable`)."""
        now = time.monotonic() if now is None else now
        on_lane = self._lane_use()
        dead = [
            key
            for key, s in self._sessions.items()
            if not s.busy and key not in on_lane and now - s.last_used > self.ttl_s and evictable(s)
        ]
        for key in dead:
            self.close(key)
        self.expirations += len(dead)
        return len(dead)

    def _lane_use(self) -> set[SessionKey]:
        """Bring the last use of the sessions on the lane up to their lane steps, which bypass this
        table (a session decoding there looked idle since it joined: admission evicted it first, cutting
        a running answer); returns those with a step running now, which nothing may close."""
        now, running = time.monotonic(), set()
        for key, s in self._sessions.items():
            if s.lane is not None:
                idle_s, busy = s.lane.activity()
                if busy:
                    running.add(key)
                s.last_used = max(s.last_used, now if busy else now - idle_s)
        return running

    def for_shard(self, shard_key: ShardKey) -> list[SessionKey]:
        return [key for key, s in self._sessions.items() if s.shard_key == shard_key]
