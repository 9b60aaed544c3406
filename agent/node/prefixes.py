"""Prefix snapshots on a hop: its state at a shared prefix, content-addressed, restored by new sessions.

A system prompt, a few-shot block or a shared document opens many sessions of many users. The route
client names such a prefix by `agent.wire.prefix.prefix_digest` of its token ids; after prefilling it,
`Op.PREFIX_SAVE` asks each hop to keep its state at exactly that length, and a later session of anyone
starting with the same ids asks `Op.PREFIX_LOAD` first and prefills only the rest (docs/protocol.md,
"Prefix snapshots").

What keeps it safe (docs/security.md): an entry's key is (model sha256, layer range, length, digest),
from the shard the route token grants and the frame, so entries never cross models or ranges; a save
stores the session's state only when the session holds exactly the prefix's length, so no position
after it (a user's own continuation) is ever kept; the last hop, which holds the ids, checks the digest
against them and keeps them for the repetition penalty of sessions restored from it; an entry is never
overwritten (the first honest save stands); the store is bounded in bytes (GGSWARM_PREFIX_CACHE_MB,
default a quarter of the node's KV budget) and evicts the least recently used entry first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.backends.base import AdmissionError, BackendError
from agent.defaults import env_int
from agent.node.errors import DataPlaneError
from agent.node.sessions import SessionState, SessionTable
from agent.node.shard import Shard
from agent.wire.frames import Kind, Op, Request, Response, encode_response
from agent.wire.prefix import DIGEST_BYTES, prefix_digest

log = logging.getLogger("agent.node.prefixes")
PREFIX_CACHE_ENV = "GGSWARM_PREFIX_CACHE_MB"  # 0 turns prefix snapshots off on this node
BUDGET_SHARE = 0.25  # of the node's KV budget, unless the operator sets the size

PrefixKey = tuple[str, int, int, int, bytes]  # model sha256, layer start, layer end, length, digest


def cache_bytes_from_env(kv_budget_bytes: int) -> int:
    """The store's size: GGSWARM_PREFIX_CACHE_MB (0..1,048,576), else BUDGET_SHARE of the KV budget."""
    mb = env_int(PREFIX_CACHE_ENV, 0, 1 << 20)
    return int(kv_budget_bytes * BUDGET_SHARE) if mb is None else mb << 20


@dataclass
class PrefixEntry:
    """One hop's state at a prefix, and the prefix's ids where this hop is the route's last."""

    data: bytes
    history: list[int] = field(default_factory=list)
    saved_at: float = field(default_factory=time.monotonic)
    hits: int = 0


class PrefixStore:
    """Entries by key, least recently used first, within `budget_bytes` in all."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self._entries: OrderedDict[PrefixKey, PrefixEntry] = OrderedDict()
        self.used_bytes = 0
        self.counters = {"prefix_hits": 0, "prefix_misses": 0, "prefix_saves": 0, "prefix_evictions": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: PrefixKey) -> bool:
        return key in self._entries

    def get(self, key: PrefixKey) -> PrefixEntry | None:
        e = self._entries.get(key)
        if e is None:
            self.counters["prefix_misses"] += 1
            return None
        self._entries.move_to_end(key)
        e.hits += 1
        self.counters["prefix_hits"] += 1
        return e

    def put(self, key: PrefixKey, entry: PrefixEntry) -> bool:
        """Keep `entry` unless the key is held already (never overwritten) or it alone exceeds the
        budget; older entries go first to make room."""
        size = _size(entry)
        if key in self._entries or size > self.budget_bytes:
            return False
        while self.used_bytes + size > self.budget_bytes and self._entries:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= _size(old)
            self.counters["prefix_evictions"] += 1
        self._entries[key] = entry
        self.used_bytes += size
        self.counters["prefix_saves"] += 1
        return True

    def drop_range(self, model_sha256: str, layer_start: int, layer_end: int) -> None:
        """Forget the entries of a window being unloaded (its snapshots fit no other handle)."""
        for k in [k for k in self._entries if k[:3] == (model_sha256, layer_start, layer_end)]:
            self.used_bytes -= _size(self._entries.pop(k))

    def stats(self) -> dict[str, int]:
        return {
            "prefix_entries": len(self._entries),
            "prefix_bytes": self.used_bytes,
            "prefix_budget_bytes": self.budget_bytes,
            **self.counters,
        }


def _size(e: PrefixEntry) -> int:
    return len(e.data) + 4 * len(e.history)


class PrefixOps:
    """Op.PREFIX_SAVE and Op.PREFIX_LOAD on the data plane's shards and session table."""

    def __init__(
        self,
        store: PrefixStore,
        sessions: SessionTable,
        evictable: Callable[[SessionState, Shard], bool],
    ) -> None:
        self.store, self.sessions, self._evictable = store, sessions, evictable

    async def handle(self, req: Request, shard: Shard, s: SessionState) -> bytes:
        """Op.PREFIX_SAVE or Op.PREFIX_LOAD of session `s` on `shard` (its route token was checked)."""
        if self.store.budget_bytes <= 0:
            raise DataPlaneError(
                409, "prefix_off", f"prefix snapshots are off on this node ({PREFIX_CACHE_ENV}=0)"
            )
        if req.kind != Kind.DIGEST:
            raise DataPlaneError(400, "bad_frame", f"a prefix frame carries a {DIGEST_BYTES}-byte digest")
        n = req.pos_start
        if not 0 < n <= s.capacity:
            raise DataPlaneError(400, "bad_position", f"prefix length {n} outside 1..{s.capacity}")
        key: PrefixKey = (
            shard.spec.manifest.sha256,
            shard.spec.layer_start,
            shard.spec.layer_end,
            n,
            bytes(req.payload),
        )
        if req.op == Op.PREFIX_SAVE:
            return await self._save(req, shard, s, key)
        return await self._load(req, shard, s, key)

    async def _save(self, req: Request, shard: Shard, s: SessionState, key: PrefixKey) -> bytes:
        n = key[3]
        async with shard.lock:
            held = s.backend.session_len(s.sid)
            if held != n:
                # only the prefix itself is ever kept: never a session that has gone past it
                raise DataPlaneError(409, "bad_position", f"the session holds {held} positions, not {n}")
            history: list[int] = []
            if shard.spec.is_last:
                if len(s.history) != n or prefix_digest(s.history) != key[4]:
                    raise DataPlaneError(
                        409, "prefix_mismatch", "the digest is not that of the session's ids"
                    )
                history = list(s.history)
            if key not in self.store:
                try:
                    # a copy of the window's KV rows (megabytes): off the event loop; the lock keeps
                    # every step of the shard out meanwhile
                    data = await asyncio.to_thread(s.backend.snapshot, s.sid)
                except BackendError as e:
                    raise DataPlaneError(409, "no_snapshot", str(e)) from None
                self.store.put(key, PrefixEntry(data, history))
        return encode_response(Response(step=req.step, kind=Kind.NONE, session_len=n))

    async def _load(self, req: Request, shard: Shard, s: SessionState, key: PrefixKey) -> bytes:
        n = key[3]
        async with shard.lock:
            if s.backend.session_len(s.sid) != 0:
                raise DataPlaneError(409, "bad_position", "a prefix is restored into an empty session only")
            entry = self.store.get(key)
            if entry is None:
                return encode_response(Response(step=req.step, kind=Kind.NONE, session_len=0))  # a miss
            try:
                self.sessions.admit(
                    s, s.backend.kv_growth_bytes(s.sid, n), lambda v: self._evictable(v, shard)
                )
                await asyncio.to_thread(s.backend.restore, s.sid, entry.data)
            except AdmissionError as e:
                raise DataPlaneError(503, "kv_budget", str(e)) from None
            except BackendError as e:
                raise DataPlaneError(409, "restore", str(e)) from None
            held = s.backend.session_len(s.sid)
            if held != n:  # a snapshot of another length under this key: never used again
                s.backend.truncate_to(s.sid, 0)
                raise DataPlaneError(409, "restore", f"the snapshot holds {held} positions, not {n}")
            s.history[:] = entry.history
            s.last_step = max(s.last_step, req.step)
            s.last_digest, s.last_output = b"", b""
        return encode_response(Response(step=req.step, kind=Kind.NONE, session_len=n))
