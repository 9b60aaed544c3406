"""Per-node session table: KV budget admission, idle-LRU eviction, TTL expiry, step idempotency state."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from agent.backends.base import AdmissionError, Backend
from agent.wire.frames import ChainHop
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams


@dataclass
class SessionState:
    """One session as this node sees it: which shard holds its KV, and what was last applied."""

    sid: SessionId
    shard_key: ShardKey
    backend: Backend
    max_tokens: int
    last_step: int = 0
    last_digest: bytes = b""
    last_output: bytes = b""  # this hop's encoded response for `last_step` (replayed on retry)
    history: list[int] = field(default_factory=list)  # input ids, kept on the last shard for penalties
    sampling: SamplingParams | None = None  # sent once per change, not with every decode frame
    chain: list[ChainHop] | None = None  # next hops (chain mode), sent once per route, not per step
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> SessionKey:
        return (self.sid, self.shard_key)


ShardKey = tuple[str, int, int]  # (model sha256, layer_start, layer_end)
# A route may pass twice through one node (two ranges on it), so a session is keyed by id *and* shard.
SessionKey = tuple[SessionId, ShardKey]


class SessionTable:
    """Owns every session on the node and the node-wide KV byte budget."""

    def __init__(self, budget_bytes: int, ttl_s: float = 1800.0) -> None:
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._sessions: OrderedDict[SessionKey, SessionState] = OrderedDict()
        self.evictions = 0
        self.expirations = 0

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
        s.backend.close_session(s.sid)
        return True

    def used_bytes(self) -> int:
        return sum(s.backend.kv_bytes(s.sid) for s in self._sessions.values())

    def admit(self, state: SessionState, extra_bytes: int) -> None:
        """Make room for `extra_bytes` more KV for `state`, evicting idle LRU sessions; else refuse."""
        if extra_bytes <= 0:
            return
        used = self.used_bytes()
        if used + extra_bytes <= self.budget_bytes:
            return
        evictable = [(k, v) for k, v in self._sessions.items() if k != state.key and not v.busy]
        if used - sum(v.backend.kv_bytes(v.sid) for _, v in evictable) + extra_bytes > self.budget_bytes:
            # Even evicting every idle session would not make room: refuse, and evict nobody for nothing.
            raise AdmissionError(
                f"KV budget exhausted: {used + extra_bytes} bytes needed, budget {self.budget_bytes}"
            )
        for key in list(self._sessions):
            if used + extra_bytes <= self.budget_bytes:
                break
            victim = self._sessions[key]
            if key == state.key or victim.busy:
                continue
            used -= victim.backend.kv_bytes(victim.sid)
            self.close(key)
            self.evictions += 1
        if used + extra_bytes > self.budget_bytes:
            raise AdmissionError(
                f"KV budget exhausted: {used + extra_bytes} bytes needed, budget {self.budget_bytes}"
            )

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        dead = [key for key, s in self._sessions.items() if not s.busy and now - s.last_used > self.ttl_s]
        for key in dead:
            self.close(key)
        self.expirations += len(dead)
        return len(dead)

    def for_shard(self, shard_key: ShardKey) -> list[SessionKey]:
        return [key for key, s in self._sessions.items() if s.shard_key == shard_key]
